"""`rloo evaluate`: the base model, the SFT policy and each trained policy on held-out prompts, judged independently.

Per policy: verifier accuracy (greedy and sampled at T = 1, strict and flexible), the reward model's
mean score (the proxy the policy was trained on), sequence KL to the reference, mean length, and the
solution checker's figures (rloo.reward.solution_check), pass@k and maj@k over the sampled draws
(rloo.eval.at_k). Then, for each trained policy against SFT: its gain
with a 95 % interval and p-value (rloo.eval.gains), and the win rate by a pairwise judge, in both
presentation orders; and the gain of SFT and of each trained policy over the untrained base model.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import jsonschema
import numpy as np
import yaml
from safetensors.torch import load_file

from rloo.config import config_hash
from rloo.data.gsm8k import read_split
from rloo.data.manifest import read_manifest
from rloo.errors import InputError
from rloo.eval.at_k import maj_at_k, pass_at_k
from rloo.eval.evaluation import evaluate_policy, spec_for, write_completions
from rloo.eval.gains import correctness, gain, win_rate_ci95
from rloo.eval.reward_figures import reward_figures
from rloo.eval.stats import wilson_interval
from rloo.io import sha256_file, write_json_atomic
from rloo.model import checkpoint, models
from rloo.pipeline import stage_config
from rloo.reward.functions import VERIFIER_FN
from rloo.reward.judge_server import open_judge
from rloo.reward.judges import VerifierJudge, agreement, win_rate
from rloo.reward.rewards import HttpReward, RewardModelReward, build_plugin
from rloo.reward.solution_check import ANSWER_FIGURES, WORK_FIGURES
from rloo.reward.solution_check import summarize as check_solutions
from rloo.runtime import console, setup
from rloo.settings import Config

log = logging.getLogger("rloo.evaluate")


def policy_report(
    cfg: dict, policy_dir: Path, reference, tok, rows: list[dict], reward, training_reward=None
) -> tuple[dict, dict[str, list[str]]]:
    """Metrics of one policy (evaluation.evaluate_policy: sampled accuracy is the mean over
    `evaluate.samples_per_prompt` draws, since one draw moves by about two points from one sampling
    seed to the next on 500 problems), and its completions by decoding mode for the pairwise judge."""
    sections = Config.from_config(cfg)
    ec, mc = sections.evaluate, sections.model
    policy = models.load_causal_lm(policy_dir, **models.load_options(mc))
    spec = spec_for(cfg, "evaluate", ec.max_new_tokens, ec.samples_per_prompt, stream=21)
    proxy = None
    if reward is not None:  # what the learned reward model thinks of these completions
        proxy = RewardModelReward(reward[0], reward[1], batch_size=ec.batch_size, max_length=mc.max_length,
                                  prompt_cfg=cfg["prompt"], inference_dtype=mc.inference_dtype)
    report, texts = evaluate_policy(policy, tok, rows, spec, reference=reference, proxy=proxy, label=policy_dir.name,
                                    training_reward=training_reward)
    report.pop("examples")  # one figure for the whole result
    if training_reward is not None:
        report["training_reward"] = reward_figures(report.pop("training_reward_parts"), training_reward.weights)
    return report, texts


def run(cfg: dict, data_dir: str | Path, sft_dir: str | Path, policies: dict[str, str], out_json: str | Path,
        reward_model_dir: str | Path | None = None, plot_dir: str | Path | None = None,
        judge_log: str | Path | None = None, base_dir: str | Path | None = None) -> dict:
    """Evaluate SFT and `policies` ({name: folder}), and the untrained `base_dir` where given; write the
    results JSON (and, into `plot_dir`, the plots and every policy's completions). A served judge (evaluate.llm_judge.serve) is started first,
    so that one that cannot start fails the stage before the policies are sampled, and is stopped on
    every way out; its output goes to `judge_log` (default: judge_log_path)."""
    setup(cfg["threads"], cfg["seed"])
    with open_judge(cfg, judge_log or judge_log_path(cfg, out_json)) as judge:
        return _evaluate(cfg, judge, data_dir, sft_dir, policies, out_json, reward_model_dir, plot_dir, base_dir)


def nonfinite_weights(folder: Path) -> str | None:
    """The first tensor of a model folder's safetensors files holding a NaN or an infinity, or None."""
    for path in sorted(folder.glob("*.safetensors")):
        if bad := checkpoint.nonfinite(load_file(str(path))):
            return f"{bad} ({path.name})"
    return None


def judge_log_path(cfg: dict, out_json: str | Path) -> Path:
    """<paths.logs>/evaluate_<result name>.judge.log: beside the stage's own log."""
    return Path(cfg["paths"]["logs"]) / f"evaluate_{Path(out_json).stem.removeprefix('gsm8k_')}.judge.log"


def _evaluate(cfg: dict, judge, data_dir, sft_dir, policies: dict[str, str], out_json, reward_model_dir,
              plot_dir, base_dir=None) -> dict:
    sections = Config.from_config(cfg)
    mc, ec = sections.model, sections.evaluate
    data_dir = Path(data_dir)
    # A diverged model (NaN or infinite weights) is refused before anything is sampled.
    for folder in [sft_dir, *policies.values(), *(f for f in (reward_model_dir, base_dir) if f)]:
        if bad := nonfinite_weights(Path(folder)):
            raise InputError(f"{folder}: weight {bad} is not finite (a diverged run?): not evaluated")
    rows = read_split(data_dir, "test")[: ec.examples]
    tok = models.load_tokenizer(sft_dir, mc.trust_remote_code)
    reference = models.load_causal_lm(sft_dir, **models.load_options(mc))
    reward = None
    if reward_model_dir:
        reward = (models.load_reward_model(reward_model_dir, **models.load_options(mc)),
                  models.load_tokenizer(reward_model_dir, mc.trust_remote_code))
    # The user's reward functions or reward server that RLOO trains on, reported for every policy too.
    plugin = build_plugin(cfg)
    reports, texts = {}, {}
    for name, folder in {"sft": str(sft_dir), **policies}.items():
        reports[name], texts[name] = policy_report(cfg, Path(folder), reference, tok, rows, reward, plugin)
        log.info("%s: %s", name, reports[name])
    # The untrained start last, so that adding it leaves every other policy's draws as they were.
    evaluated = dict(reports)
    if base_dir is not None:
        evaluated["base"], texts["base"] = policy_report(cfg, Path(base_dir), reference, tok, rows, reward, plugin)
        log.info("base: %s", evaluated["base"])
    questions, golds = [r["question"] for r in rows], [r["answer"] for r in rows]
    mode = ec.win_rate_decoding
    judged = {name: win_rate(judge, questions, golds, texts[name][mode], texts["sft"][mode]) for name in policies}
    wins = {name: w.as_dict() for name, w in judged.items()}
    for name, detail in wins.items():
        detail["ci95"] = win_rate_ci95(detail)
        if judge.name != VerifierJudge.name:  # how far to trust a judge: its verdicts beside the verifier's
            ref = win_rate(VerifierJudge(), questions, golds, texts[name][mode], texts["sft"][mode])
            agree = agreement(judged[name].scores, ref.scores)
            interval = wilson_interval(agree["agree"], agree["judged"])
            detail["agreement_with_verifier"] = {**agree, "ci95": list(interval) if interval else None}
    # An LLM judge that failed more often than allowed stops the stage here, before any output is written.
    calls = judge.check()
    if isinstance(plugin, HttpReward):  # its retries were console lines as they came; their count here
        console(f"evaluate: {plugin.client.summary()}", log)
    # Every policy on the same problems: each one's gain over SFT with its uncertainty, per problem
    # paired; the resampling is seeded by the run's seed, so the result is a function of the inputs.
    correct = {name: correctness(t, golds) for name, t in texts.items()}
    gains = {name: gain(correct[name], correct["sft"], cfg["seed"]) for name in policies}
    for name, t in texts.items():
        evaluated[name]["solution_check"] = check_solutions(t["draws"], t["greedy"], golds)
        # the same draws read two more ways: any of them right, and their majority answer right
        evaluated[name]["pass_at_k"] = pass_at_k(correct[name]["sampled"])
        evaluated[name]["maj_at_k"] = maj_at_k(t["draws"], golds)
    training = {name: _read_json(Path(folder) / "metrics.json") for name, folder in policies.items()}
    for name, metrics in training.items():
        if metrics:  # the checkpoint the stage wrote, and the alarms that fired while training it
            reports[name]["selected_step"] = metrics.get("selected_step")
            reports[name]["alarms"] = {k: v for k, v in (metrics.get("alarms") or {}).items() if v is not None}
    sources = set().union(*(trained_on(m) for m in training.values() if m))
    manifest = data_dir / "manifest.json"
    result = {
        "primary": "accuracy_sampled",
        "policies": reports,
        "win_rate": wins[next(iter(policies))] if len(policies) == 1 else wins,
        "win_rates": wins,
        "gains": gains,
        "judge": {**getattr(judge, "description", {"type": judge.name}), "decoding": mode, **calls},
        "judges": judge_independence(judge.name, sources, reward is not None,
                                     list(plugin.weights) if plugin is not None else None),
        "examples": len(rows),
        # What this stage read of the config (pipeline.STAGES): tracking settings are not part of it.
        "config_hash": config_hash(stage_config(cfg, "evaluate")),
        "seed": cfg["seed"],
        "data_manifest_sha256": sha256_file(manifest) if manifest.exists() else None,
        # test problems whose question is also a training problem's (prepare refuses them unless
        # data.allow_train_test_overlap): a held-out accuracy is only as held out as this is zero
        "train_test_overlap": read_manifest(data_dir).get("train_test_overlap"),
        # and those sharing a run of n normalised words with a test problem ({words, count, mode}; data.on_ngram_overlap)
        "train_test_ngram_overlap": read_manifest(data_dir).get("train_test_ngram_overlap"),
        "training": training,
    }
    if base_dir is not None:  # base -> SFT -> RL: what each step of post-training added
        result["base"] = {"policy": evaluated["base"],
                          "gains": {name: gain(correct[name], correct["base"], cfg["seed"]) for name in reports}}
    if plot_dir is not None:
        from rloo.eval.plots import plot_policies, plot_proxy_vs_judge

        write_completions(Path(plot_dir) / "completions.jsonl", rows, texts)

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

