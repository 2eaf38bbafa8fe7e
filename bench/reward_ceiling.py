"""How well can a reward model initialised from the SFT policy rank the reward stage's held-out pairs?

    python bench/reward_ceiling.py --policy results/models/sft --data data/gsm8k \
        [--reward-model results/models/reward] [--prompts 2000]

Builds the preference pairs exactly as `rloo reward` does (k samples per prompt from the SFT policy,
verifier labels, the reference as an extra chosen answer, validation held out by prompt), then prints
the pairwise accuracy on the held-out pairs of scorers that use only what the SFT policy knows:
its summed and mean log-likelihood of the completion, the lowest log-probability it gives any token of
an intermediate result (`<<a*b=c>>`), and how often the completion's result tokens leave its greedy
choice (fewer = better; a tie counts 0.5). If these sit near 0.6, the rejected answers are the
policy's confident mistakes, and a reward model built on the same network has nothing to learn
them from. With --reward-model, the trained Bradley-Terry model's accuracy on the same pairs.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.record import write  # noqa: E402
from rloo.data.prompting import PromptFormat  # noqa: E402
from rloo.io import read_jsonl  # noqa: E402
from rloo.model import models  # noqa: E402
from rloo.reward.preferences import Pair, split_by_prompt  # noqa: E402
from rloo.runtime import setup  # noqa: E402
from rloo.settings import ModelConfig  # noqa: E402
from rloo.train.reward import pairwise_accuracy, sample_pairs  # noqa: E402
from rloo_workflow.config import load_config  # noqa: E402

_RESULT = re.compile(r"=\s*(-?\d+)\s*>>")


@torch.no_grad()
def likelihood_features(model, tok, prompt: str, completion: str) -> dict[str, float]:
    """Per-completion scores from the policy's own next-token distribution (higher = more plausible)."""
    p = tok(prompt)["input_ids"]
    enc = tok(completion + tok.eos_token, return_offsets_mapping=True)
    c, offsets = enc["input_ids"], enc["offset_mapping"]
    logits = model(input_ids=torch.tensor([p + c])).logits[0, len(p) - 1 : -1].float()
    token_lp = torch.log_softmax(logits, -1)[torch.arange(len(c)), torch.tensor(c)]
    spans = [m.span(1) for m in _RESULT.finditer(completion)]
    result_tokens = [i for i, (s, e) in enumerate(offsets) if any(s < b and e > a for a, b in spans)]
    off_greedy = logits.argmax(-1) != torch.tensor(c)
    return {
        "sum_logprob": float(token_lp.sum()),
        "mean_logprob": float(token_lp.mean()),
        "min_result_logprob": float(token_lp[result_tokens].min()) if result_tokens else 0.0,
        "result_tokens_on_greedy": -float(off_greedy[result_tokens].sum()) if result_tokens else 0.0,
    }


def ranking_accuracy(model, tok, pairs: list[Pair]) -> dict[str, float]:
    wins: dict[str, float] = {}
    for p in pairs:
        a = likelihood_features(model, tok, p.prompt, p.chosen)
        b = likelihood_features(model, tok, p.prompt, p.rejected)
        for k in a:
            wins[k] = wins.get(k, 0.0) + (1.0 if a[k] > b[k] else 0.5 if a[k] == b[k] else 0.0)
    return {k: v / len(pairs) for k, v in wins.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", "-c", default=str(ROOT / "config" / "config.yaml"))
    ap.add_argument("--policy", default=str(ROOT / "results" / "models" / "sft"))
    ap.add_argument("--data", default=str(ROOT / "data" / "gsm8k"))
    ap.add_argument("--reward-model", default=None)
    ap.add_argument("--prompts", type=int, default=None, help="training prompts to sample (default: reward.prompts)")
    ap.add_argument("--json", default=None, help="also write the figures here (docs/figures/reward_ceiling.json)")
    args = ap.parse_args()
    cfg = load_config(args.config, {"reward": {"prompts": args.prompts}} if args.prompts else None)
    setup(cfg["threads"], cfg["seed"])
    train = [r for _, r in read_jsonl(Path(args.data) / "train.jsonl")]
    pairs, info = sample_pairs(cfg, Path(args.policy), train)
    _, val = split_by_prompt(pairs, cfg["reward"]["val_fraction"], cfg["seed"])
    print(f"pairs {len(pairs)}, held-out {len(val)} on {len({p.prompt_id for p in val})} prompts; "
          f"{info['samples']} samples, {info['sample_accuracy']:.3f} correct")
    mc = ModelConfig.from_config(cfg["model"])
    tok = models.load_tokenizer(args.policy, mc.trust_remote_code)
    policy = models.load_causal_lm(args.policy, **models.load_options(mc))
    scores = {f"policy {name}": acc for name, acc in ranking_accuracy(policy, tok, val).items()}
    if args.reward_model:
        rm = models.load_reward_model(args.reward_model, **models.load_options(mc))
        fmt = PromptFormat(tok, cfg["prompt"])
        scores["reward model"] = pairwise_accuracy(rm, fmt, val, mc.max_length, mc.autocast)
    for name, acc in scores.items():
        print(f"held-out pairwise accuracy, {name:<31} {acc:.3f}")
    if args.json:
        out = {"pairs": len(pairs), "held_out_pairs": len(val), "held_out_prompts": len({p.prompt_id for p in val}),
               "samples": info["samples"], "sample_accuracy": info["sample_accuracy"],
               "reward_prompts": cfg["reward"]["prompts"], "held_out_pairwise_accuracy": scores}
        write(args.json, out, indent=2)


if __name__ == "__main__":
    main()
