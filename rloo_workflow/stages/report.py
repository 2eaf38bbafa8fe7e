"""`rloo report`: base -> SFT -> RL for one trained policy, from the evaluations' records alone (no model).

Reads the records and figures of the untrained base model, of SFT and of the trained policy
(`rloo evaluate`: rloo.eval.records), the trained policy's training metrics, and, where an LLM judges,
its verdicts (`rloo judge`). Writes the results JSON: each policy's figures, with its accuracies' intervals,
pass@k, maj@k and the solution checker's figures read from its records; each step's gain over the one before (the trained
policy and SFT over the base, the trained policy over SFT), with a 95 % paired interval and a p-value
(rloo.eval.gains); the win rate against SFT by the pairwise judge (the verifier's, computed here); and,
for each figure, whether its judge is independent of the training reward. Then its plots.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import jsonschema
import yaml

from rloo.data.manifest import read_manifest
from rloo.errors import InputError
from rloo.eval import records
from rloo.eval.at_k import completion_figures
from rloo.eval.gains import add_tool_figures, correctness, gain, judged_win_rate
from rloo.io import sha256_file, write_json_atomic
from rloo.reward.functions import VERIFIER_FN
from rloo.reward.judges import VerifierJudge
from rloo.reward.solution_check import ANSWER_FIGURES, WORK_FIGURES
from rloo.settings import Config
from rloo_workflow.config import config_hash
from rloo_workflow.pipeline import stage_config

log = logging.getLogger("rloo.report")

RESULTS_SCHEMA = Path(__file__).parents[1] / "schemas" / "results.schema.yaml"


def run(cfg: dict, evaluations: dict[str, records.PolicyRecords], policy: str, training_dir: str | Path,
        manifest: str | Path, out_json: str | Path, plot_dir: str | Path | None = None,
        judged: str | Path | None = None) -> dict:
    """The results of trained policy `policy` against SFT and the base model: `evaluations` holds the three
    ({"base", "sft", policy}: rloo.eval.records.read), `training_dir` the trained policy's folder (its
    metrics.json), `manifest` the data's; `judged`: an LLM judge's verdicts (`rloo judge`), where the
    judge is not the verifier. Writes `out_json`, and the plots into `plot_dir`."""
    sections = Config.of(cfg)
    mode = sections.evaluate.win_rate_decoding
    base, sft, trained = evaluations["base"], evaluations["sft"], evaluations[policy]
    questions, golds = sft.questions, sft.golds
    for ev in (base, trained):  # paired figures: the same problems, in the same order
        if ev.questions != questions:
            raise InputError(f"the {ev.name} evaluation holds other problems than SFT's: evaluate both on the same data")
    texts = {name: ev.texts() for name, ev in evaluations.items()}
    correct = {name: correctness(t, golds) for name, t in texts.items()}
    figures = _figures(evaluations, texts, correct, golds, sections.seed)
    metrics = _read_json(Path(training_dir) / "metrics.json")
    if metrics:  # the checkpoint the stage wrote, and the alarms that fired while training it
        figures[policy]["selected_step"] = metrics.get("selected_step")
        figures[policy]["alarms"] = {k: v for k, v in (metrics.get("alarms") or {}).items() if v is not None}
    judge, win = _win_rate(mode, texts, questions, golds, policy, judged)
    seed = sections.seed
    facts = read_manifest(Path(manifest).parent)
    reports = {"sft": figures["sft"], policy: figures[policy]}
    summary = trained.summary
    result = {
        "primary": "accuracy_sampled",
        "policies": reports,
        "win_rate": win,
        "win_rates": {policy: win},
        # Every policy on the same problems: each one's gain with its uncertainty, per problem paired; the
        # resampling is seeded by the run's seed, so the result is a function of the inputs.
        "gains": {policy: gain(correct[policy], correct["sft"], seed)},
        "judge": judge,
        "judges": judge_independence(judge["type"], trained_on(metrics) if metrics else set(), summary.get("proxy", False),
                                     summary.get("reward_parts")),
        "examples": len(questions),
        # What the evaluations read of the config (pipeline.STAGES): tracking settings are not part of it.
        "config_hash": config_hash(stage_config(cfg, "evaluate")),
        "seed": seed,
        "data_manifest_sha256": sha256_file(manifest) if Path(manifest).exists() else None,
        # test problems whose question is also a training problem's (prepare refuses them unless
        # data.allow_train_test_overlap): a held-out accuracy is only as held out as this is zero
        "train_test_overlap": facts.get("train_test_overlap"),
        # and those sharing a run of n normalised words with a test problem ({words, count, mode}; data.on_ngram_overlap)
        "train_test_ngram_overlap": facts.get("train_test_ngram_overlap"),
        "training": {policy: metrics},
        # base -> SFT -> RL: what each step of post-training added
        "base": {"policy": figures["base"],
                 "gains": {name: gain(correct[name], correct["base"], seed) for name in reports}},
    }
    if plot_dir is not None:
        result["plots"] = _plots(Path(plot_dir), reports, policy, metrics)
    jsonschema.validate(result, yaml.safe_load(RESULTS_SCHEMA.read_text()))
    write_json_atomic(out_json, result)
    return result


def _figures(evaluations: dict[str, records.PolicyRecords], texts: dict[str, dict], correct: dict[str, dict],
             golds: list[str], seed: int) -> dict[str, dict]:
    """Each policy's figures: its evaluation's, and what its records add (rloo.eval.at_k.completion_figures:
    the accuracies' intervals, the solution checker's figures, pass@k and maj@k; where it was evaluated
    without the tools too, the same of that pass and the tool's paired gain: rloo.eval.gains.add_tool_figures)."""
    out = {}
    for name, ev in evaluations.items():
        out[name] = {**ev.summary["figures"], **completion_figures(texts[name], correct[name], golds)}
        add_tool_figures(out[name], texts[name], correct[name], golds, seed)
    return out


def _plots(plot_dir: Path, reports: dict[str, dict], policy: str, metrics: dict | None) -> dict:
    """The policies' figures, and the trained policy's proxy reward against the judge while it trained."""
    from rloo.eval.plots import plot_policies, plot_proxy_vs_judge

    return {
        "policies": plot_policies(reports, plot_dir / "policies.png"),
        "proxy_vs_judge": plot_proxy_vs_judge({policy: (metrics or {}).get("evals", [])},
                                              plot_dir / "proxy_vs_judge.png"),
    }


def _win_rate(mode: str, texts: dict[str, dict], questions: list[str], golds: list[str], policy: str,
              judged: str | Path | None) -> tuple[dict, dict]:
    """(the judge's record, the trained policy's win rate against SFT): an LLM judge's from its verdicts
    (`rloo judge`), the verifier's computed here (it needs no model)."""
    if judged is not None:
        verdicts = json.loads(Path(judged).read_text())
        return verdicts["judge"], verdicts["win_rates"][policy]
    win = judged_win_rate(VerifierJudge(), questions, golds, texts[policy][mode], texts["sft"][mode])
    return {"type": VerifierJudge.name, "decoding": mode}, win


# Training rewards that are a user's code: what they read of a completion is not known here.
OPAQUE_REWARDS = ("function", "http")


def trained_on(metrics: dict) -> set[str]:
    """The rewards a policy was trained on, from its metrics.json, in judge_independence's names: its
    `reward_source`, with reward functions as `verifier` where one is rloo's verifier (and `function`
    for the others)."""
    source = metrics.get("reward_source")
    if source != "function":
        return {source} - {None}
    return {"verifier" if f["fn"] == VERIFIER_FN else "function" for f in (metrics.get("reward_functions") or {}).values()}


def judge_independence(pairwise: str, training_rewards: set[str], proxy: bool,
                       reward_parts: list[str] | None = None) -> dict:
    """Each figure's judge, and whether it is independent of the reward the policies were trained on:
    true, false, or null (unknown) when no policy's training metrics name its reward, or when a reward
    function or server of the user's (which may read anything) trained it and the figure's own judge
    was not among its parts.

    Accuracy is graded by the verifier against the gold answers; the pairwise win rate by `pairwise`
    (verifier or llm); the proxy is the trained reward model's opinion, and that model learnt from
    verifier-labelled pairs; the solution checker's work figures read the annotations alone, its answer
    figures the verifier's final-answer check; `training_reward` (with `reward_parts`, the functions or
    server evaluated) is the training reward itself.
    """
    def independent(*sources: str) -> bool | None:
        if not training_rewards:  # missing metrics are not evidence of independence
            return None
        if any(s in training_rewards for s in sources):
            return False
        return None if any(s in training_rewards for s in OPAQUE_REWARDS) else True

    out = {
        "accuracy": {"graded_by": "verifier", "independent_of_training_reward": independent("verifier")},
        "win_rate": {"graded_by": pairwise, "independent_of_training_reward": independent(
            "verifier" if pairwise == "verifier" else "judge")},
        # The work is read by the checker alone, which no training reward is; every figure that reads
        # the final answer is the verifier's check, whatever else it adds.
        "solution_check_work": {"graded_by": "solution checker (every <<expr=value>> annotation; the answer not read)",
                                "figures": list(WORK_FIGURES), "independent_of_training_reward": independent()},
        "solution_check": {"graded_by": "verifier (strict final answer), with the solution checker's annotations",
                           "figures": list(ANSWER_FIGURES), "independent_of_training_reward": independent("verifier")},
    }
    if proxy:
        out["proxy_reward"] = {"graded_by": "reward model (trained on verifier-labelled pairs)",
                               "independent_of_training_reward": independent("model", "verifier")}
    if reward_parts is not None:
        out["training_reward"] = {"graded_by": f"the training reward ({', '.join(reward_parts)})",
                                  "independent_of_training_reward": False}
    return out


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None
