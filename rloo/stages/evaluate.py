"""`rloo evaluate`: the SFT policy and each trained policy on held-out prompts, judged independently.

Per policy: verifier accuracy (greedy and sampled at T = 1, strict and flexible), the reward model's
mean score (the proxy the policy was trained on), sequence KL to the reference, mean length. Then the
win rate of each trained policy against SFT by a pairwise judge, in both presentation orders.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import jsonschema
import numpy as np
import torch
import yaml

from rloo import models, tracking
from rloo.batching import completion_logprobs, join, model_device
from rloo.config import config_hash
from rloo.data.gsm8k import format_prompt
from rloo.evaluation import accuracy
from rloo.io import read_jsonl, sha256_file, write_json_atomic
from rloo.judges import build_judge, win_rate
from rloo.losses import sequence_kl
from rloo.rewards import score_texts
from rloo.rollout import generate
from rloo.runtime import Progress, autocast, setup, step_generator

log = logging.getLogger("rloo.evaluate")


@torch.no_grad()
def decode(cfg: dict, policy, reference, tok, ids: list[list[int]], greedy: bool, draws: int = 1,
           label: str = "policy") -> list[dict]:
    """Completions of `ids`: greedy (one), or `draws` independent samples per prompt at T = 1, with
    their lengths and, for samples, their sequence KL to the reference. One dict per draw.

    The draws of a prompt are decoded together (its rows side by side: the prompt is prefilled once
    and its keys are shared), `evaluate.batch_size` rows at a time.
    """
    e, m = cfg["evaluate"], cfg["model"]
    device = model_device(policy)
    draws = 1 if greedy else draws
    out = [{"texts": [], "lengths": [], "kl": []} for _ in range(draws)]
    per_call = max(1, e["batch_size"] // draws)
    what = "greedy" if greedy else f"{draws} draws"
    for s in Progress(range(0, len(ids), per_call), desc=f"evaluate: {label}, {what}", unit="batch"):
        rows = [p for p in ids[s : s + per_call] for _ in range(draws)]
        with autocast(m["autocast"], device):
            ro = generate(policy, rows, max_new_tokens=e["max_new_tokens"], eos_id=tok.eos_token_id,
                          pad_id=tok.pad_token_id, greedy=greedy, generator=step_generator(cfg["seed"], s, stream=21))
            kl = None
            if not greedy:  # KL(π‖π_ref) is estimated on the policy's own T = 1 samples only
                batch = join(ro.prompt_ids, ro.prompt_mask, ro.completions, ro.completion_mask)
                kl = sequence_kl(completion_logprobs(policy, batch), completion_logprobs(reference, batch),
                                 batch.completion_mask).tolist()
        texts, lengths = ro.texts(tok), ro.lengths.tolist()
        for j, d in enumerate(out):
            d["texts"] += texts[j::draws]
            d["lengths"] += lengths[j::draws]
            d["kl"] += kl[j::draws] if kl is not None else []
    return out


@torch.no_grad()
def policy_report(
    cfg: dict, policy_dir: Path, reference, tok, rows: list[dict], reward
) -> tuple[dict, dict[str, list[str]]]:
    """Metrics of one policy, and its completions by decoding mode (for the pairwise judge).

    Sampled accuracy is the mean over `evaluate.samples_per_prompt` independent draws per problem: one
    draw moves by about two points from one sampling seed to the next on 500 problems.
    """
    e, m = cfg["evaluate"], cfg["model"]
    policy = models.load_causal_lm(policy_dir, **models.load_options(m))
    prompts = [format_prompt(r["question"], cfg["prompt"]["template"]) for r in rows]
    golds = [r["answer"] for r in rows]
    ids = [tok(p)["input_ids"] for p in prompts]
    greedy = decode(cfg, policy, reference, tok, ids, greedy=True, label=policy_dir.name)[0]
    draws = decode(cfg, policy, reference, tok, ids, greedy=False, draws=e["samples_per_prompt"], label=policy_dir.name)
    per_draw = [accuracy(d["texts"], golds, "strict") for d in draws]
    report = {
        "accuracy": accuracy(greedy["texts"], golds, "strict"),
        "accuracy_flexible": accuracy(greedy["texts"], golds, "flexible"),
        "accuracy_sampled": float(np.mean(per_draw)),
        "accuracy_sampled_flexible": float(np.mean([accuracy(d["texts"], golds, "flexible") for d in draws])),
        "accuracy_sampled_draws": per_draw,
        # KL(π‖π_ref) estimated on the policy's own T = 1 samples (the k1 estimator is unbiased there).
        "kl": float(np.mean([x for d in draws for x in d["kl"]])),
        "mean_length": float(np.mean([x for d in draws for x in d["lengths"]])),
        "proxy_reward": None,
    }
    if reward is not None:  # what the learned reward model thinks of these completions
        texts = [p + t for d in draws for p, t in zip(prompts, d["texts"], strict=True)]
        scores = score_texts(reward[0], reward[1], texts, e["batch_size"], m["max_length"])
        ok = torch.isfinite(scores)
        report["proxy_reward"] = float(scores[ok].mean()) if ok.any() else None
    # The pairwise judge compares the first draw (an LLM judge is paid per comparison).
    return report, {"greedy": greedy["texts"], "sampled": draws[0]["texts"]}


def run(cfg: dict, data_dir: str | Path, sft_dir: str | Path, policies: dict[str, str], out_json: str | Path,
        reward_model_dir: str | Path | None = None, plot_dir: str | Path | None = None) -> dict:
    """Evaluate SFT and `policies` ({name: folder}); write the results JSON (and plots)."""
    setup(cfg["threads"], cfg["seed"])
    m, e = cfg["model"], cfg["evaluate"]
    data_dir = Path(data_dir)
    rows = [r for _, r in read_jsonl(data_dir / "test.jsonl")][: e["examples"]]
    tok = models.load_tokenizer(sft_dir, m["trust_remote_code"])
    reference = models.load_causal_lm(sft_dir, **models.load_options(m))
    reward = None
    if reward_model_dir:
        reward = (models.load_reward_model(reward_model_dir, **models.load_options(m)),
                  models.load_tokenizer(reward_model_dir, m["trust_remote_code"]))
    reports, texts = {}, {}
    for name, folder in {"sft": str(sft_dir), **policies}.items():
        reports[name], texts[name] = policy_report(cfg, Path(folder), reference, tok, rows, reward)
        log.info("%s: %s", name, reports[name])
    judge = build_judge(cfg)
    questions, golds = [r["question"] for r in rows], [r["answer"] for r in rows]
    mode = e["win_rate_decoding"]
    wins = {name: win_rate(judge, questions, golds, texts[name][mode], texts["sft"][mode]).as_dict()
            for name in policies}
    # An LLM judge that failed more often than allowed stops the stage here, before any output is written.
    calls = judge.check()
    training = {name: _read_json(Path(folder) / "metrics.json") for name, folder in policies.items()}
    for name, metrics in training.items():
        if metrics:  # the checkpoint the stage wrote, and the alarms that fired while training it
            reports[name]["selected_step"] = metrics.get("selected_step")
            reports[name]["alarms"] = {k: v for k, v in (metrics.get("alarms") or {}).items() if v is not None}
    sources = {(m or {}).get("reward_source") for m in training.values()} - {None}
    manifest = data_dir / "manifest.json"
    result = {
        "primary": "accuracy_sampled",
        "policies": reports,
        "win_rate": wins[next(iter(policies))] if len(policies) == 1 else wins,
        "win_rates": wins,
        "judge": {**getattr(judge, "description", {"type": judge.name}), "decoding": mode, **calls},
        "judges": judge_independence(judge.name, sources, reward is not None),
        "examples": len(rows),
        "config_hash": config_hash(cfg),
        "seed": cfg["seed"],
        "data_manifest_sha256": sha256_file(manifest) if manifest.exists() else None,
        "training": training,
        # The MLflow runs of the stages that made these results (empty when tracking is off).
        "run_ids": {stage: rec.get("run_id") for stage, rec in tracking.recorded_runs().items()},
    }
    if plot_dir is not None:
        from rloo.plots import plot_policies, plot_proxy_vs_judge

        result["plots"] = {
            "policies": plot_policies(reports, Path(plot_dir) / "policies.png"),
            "proxy_vs_judge": plot_proxy_vs_judge(
                {n: (m or {}).get("evals", []) for n, m in training.items()}, Path(plot_dir) / "proxy_vs_judge.png"
            ),
        }
    # NaN is not JSON: a win rate with no valid verdict is written as null.
    for wr in [result["win_rate"], *result["win_rates"].values()]:
        if isinstance(wr.get("value"), float) and np.isnan(wr["value"]):
            wr["value"] = None
    jsonschema.validate(result, yaml.safe_load((Path(__file__).parents[1] / "schemas" / "results.schema.yaml").read_text()))
    write_json_atomic(out_json, result)
    return result


def judge_independence(pairwise: str, training_rewards: set[str], proxy: bool) -> dict:
    """Each figure's judge, and whether it is independent of the reward the policies were trained on.

    Accuracy is graded by the verifier against the gold answers; the pairwise win rate by `pairwise`
    (verifier or llm); the proxy is the trained reward model's opinion.
    """
    def independent(source: str) -> bool:
        return not training_rewards or source not in training_rewards

    out = {
        "accuracy": {"graded_by": "verifier", "independent_of_training_reward": independent("verifier")},
        "win_rate": {"graded_by": pairwise, "independent_of_training_reward": independent(
            "verifier" if pairwise == "verifier" else "judge")},
    }
    if proxy:
        out["proxy_reward"] = {"graded_by": "reward model", "independent_of_training_reward": independent("model")}
    return out


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None

