"""`rloo evaluate`: one policy (the untrained base, SFT, or a trained policy) on the held-out problems.

Greedy, and sampled at T = 1 as `evaluate.samples_per_prompt` draws per problem; each completion graded
by the verifier and the solution checker, each draw scored by the reward model (the proxy) and, where
RLOO trains on reward functions or a reward server, by the training reward's parts, with its KL to SFT
(the reference). Writes the policy's records and figures (rloo.eval.records); the report compares the
policies from them (rloo_workflow/stages/report.py). The decoding noise of a problem depends only on (seed, its
offset, the stream), so a policy's evaluation does not depend on which others are evaluated, or when.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from rloo.console import console
from rloo.data.gsm8k import read_split
from rloo.errors import InputError
from rloo.eval import records
from rloo.eval.evaluation import evaluate_spec, evaluate_with_records
from rloo.model import checkpoint, models
from rloo.reward.rewards import HttpReward, RewardModelReward, build_plugin
from rloo.runtime import setup
from rloo.settings import Config

log = logging.getLogger("rloo.evaluate")


def refuse_nonfinite(folder: str | Path, model: torch.nn.Module) -> None:
    """A diverged model (a NaN or an infinity among its weights) is refused before anything is sampled: checked
    on the model as loaded, not by reading its files a second time (at 7 B, 14 GB per policy)."""
    if bad := checkpoint.nonfinite(model.state_dict()):
        raise InputError(f"{folder}: weight {bad} is not finite (a diverged run?): not evaluated")


def run(cfg: dict, data_dir: str | Path, sft_dir: str | Path, name: str, policy_dir: str | Path,
        out_records: str | Path, reward_model_dir: str | Path | None = None) -> dict:
    """Evaluate policy `name` (its folder `policy_dir`) against SFT (`sft_dir`: the tokenizer and the KL
    reference), the reward model of `reward_model_dir` its proxy; write its records to `out_records` and
    its figures beside them. Returns the figures."""
    sections = Config.of(cfg)
    setup(sections.threads, sections.seed)
    mc, ec = sections.model, sections.evaluate
    policy = models.load_causal_lm(policy_dir, **models.load_options(mc))
    refuse_nonfinite(policy_dir, policy)
    reference = models.load_causal_lm(sft_dir, **models.load_options(mc))
    refuse_nonfinite(sft_dir, reference)
    rows = read_split(Path(data_dir), "test")[: ec.examples]
    tok = models.load_tokenizer(sft_dir, mc.trust_remote_code)
    proxy = None
    if reward_model_dir:  # what the learned reward model thinks of these completions
        scorer = models.load_reward_model(reward_model_dir, **models.load_options(mc))
        refuse_nonfinite(reward_model_dir, scorer)
        proxy = RewardModelReward(scorer, models.load_tokenizer(reward_model_dir, mc.trust_remote_code),
                                  batch_size=ec.batch_size, max_length=mc.max_length, prompt_cfg=sections.prompt,
                                  inference_dtype=mc.inference_dtype)
    # The user's reward functions or reward server that RLOO trains on, reported for every policy too.
    plugin = build_plugin(cfg)
    spec = evaluate_spec(sections)
    # the progress bars name the policy as the pipeline does (`mine`), not its folder's last part
    report, problems, _ = evaluate_with_records(policy, tok, rows, spec, reference=reference, proxy=proxy, label=name,
                                                training_reward=plugin)
    if isinstance(plugin, HttpReward):  # its retries were console lines as they came; their count here
        console(f"evaluate: {plugin.client.summary()}", log)
    log.info("%s: %s", name, report)
    # what the report needs to say which figures are independent of the training reward
    summary = {"policy": name, "examples": len(rows), "proxy": proxy is not None,
               "reward_parts": list(plugin.weights) if plugin is not None else None, "figures": report}
    records.write(out_records, problems, summary)
    return report
