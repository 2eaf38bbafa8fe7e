"""What the rules declare of each job beyond its inputs and outputs (rloo_workflow.pipeline), declared once: the
options of its command (`rloo <verb> OPTIONS`), its log and benchmark files, the local files its config names as
inputs. The options of one job come from its inputs and outputs by name (rloo_workflow.pipeline: `job_inputs`, `outputs`), its config file (--job-config)
and its estimator, variant and policy. The chain rules (workflow/rules/*.smk) hand them to their command
through an args file (`@FILE`, rloo_workflow.config.job_args_file), so that what a job runs is declared here
and not in a rule's format string: one place for the rules and for what else builds a job's command (issue 70:
dvc.yaml from the project's own declaration)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from rloo.model.base import gguf_file
from rloo.settings import Config
from rloo_workflow.config import with_overrides
from rloo_workflow.pipeline import Variant, work_dir


def chain_options(stage: str, cfg: Mapping, inputs: Mapping[str, str], outputs: Mapping[str, str], job_config: str,
                  estimator: str | None = None, variant: Variant | None = None, policy: str | None = None) -> list[str]:
    """The options of `stage`'s job (a stage of rloo_workflow.pipeline.CHAIN) on the config `cfg` (the
    pipeline's, before its variant's keys), its `inputs` and `outputs` ({name: path}) and its `job_config` file."""
    head = ["--job-config", job_config, *(["--variant", variant.label] if variant else [])]
    data = os.path.dirname(inputs["train"] if "train" in inputs else inputs.get("test", ""))
    work = ["--work", work_dir(stage, cfg, estimator, variant), "--work-guard"]
    if stage == "prepare":
        return [*head, "--out", os.path.dirname(outputs["manifest"])]
    if stage == "base":  # the training texts only where the embedded model is built from them
        return [*head, *(["--data", data] if "train" in inputs else []), "--out", outputs["model"]]
    if stage == "sft":
        return [*head, "--data", data, "--base", inputs["base"], "--out", outputs["model"], *work]
    if stage in ("reward", "rloo"):
        reward_model = ["--reward-model", inputs["reward_model"]] if "reward_model" in inputs else []
        return [*head, "--data", data, "--policy", inputs["policy"], *reward_model, "--out", outputs["model"], *work]
    if stage == "evaluate":
        return [*head, "--data", data, "--policy", f"{policy}={inputs['policy']}", "--sft", inputs["sft"],
                "--reward-model", inputs["reward_model"], "--out", outputs["records"]]
    if stage == "judge":
        named = estimator or Config.of(cfg).rloo.estimator
        return [*head, "--policy", f"{named}={inputs['policy']}", "--sft", inputs["sft"], "--out", outputs["result"]]
    if stage == "report":
        # the trained policy's name in the results: its estimator (a sweep may set rloo.estimator)
        named = estimator or Config.of(with_overrides(dict(cfg), variant.overrides) if variant else cfg).rloo.estimator
        judged = ["--judged", inputs["judged"]] if "judged" in inputs else []
        return [*head, "--policy", f"{named}={inputs['policy']}", "--sft", inputs["sft"], "--base", inputs["base"],
                "--training", inputs["training"], "--data", os.path.dirname(inputs["manifest"]), *judged,
                "--out", outputs["result"], "--plots", os.path.dirname(outputs["policies"])]
    raise KeyError(f"{stage} is not a stage of the chain")


def aggregate_options(stage: str, cfg: Mapping, outputs: Mapping[str, str], job_config: str,
                      results: Mapping[str, str] | None = None, records: Mapping[str, str] | None = None,
                      sweep: str | None = None) -> list[str]:
    """The options of a job outside the chain (toy, seeds, sweep, comparison) on the config `cfg`: `results`
    ({label: results file}: a seed's, a sweep point's, an estimator's) and, for the comparison, each estimator's
    evaluation `records` and its RLOO run's wall-clock figures (beside its checkpoints, in no output)."""
    head = ["--job-config", job_config, *(["--name", sweep] if stage == "sweep" else [])]
    tabled = [o for label, path in (results or {}).items()
              for o in ("--result", f"{label}={path}", *(("--records", f"{label}={records[label]}")
                                                         if records and label in records else ()))]
    timings = [o for e in (results or {}) for o in ("--timings", f"{e}={work_dir('rloo', cfg, e)}/timings.json")
               ] if stage == "comparison" else []
    return [*head, *tabled, *timings, "--out", outputs["result"], "--plot", outputs["plot"]]


def job_logs(stage: str, cfg: Mapping, estimator: str | None = None, policy: str | None = None,
             folder: str | None = None, sweep: str | None = None) -> dict[str, str]:
    """A job's log and benchmark files (and, for the jobs that may serve an LLM judge, the judge's log), below
    `paths.logs` (a variant's below its `folder`): named after the stage and the wildcard that tells its jobs apart."""
    logs = Config.of(cfg).paths.logs
    name = {"rloo": f"rloo_{estimator}", "judge": f"judge_{estimator}", "report": f"report_{estimator}",
            "evaluate": f"evaluate_{policy}", "sweep": f"sweep_{sweep}"}.get(stage, stage)
    sub = f"{folder}/" if folder else ""
    out = {"log": f"{logs}/{sub}{name}.log", "benchmark": f"{logs}/benchmarks/{sub}{name}.tsv"}
    return {**out, "judge_log": f"{logs}/{sub}{name}.judge.log"} if stage in ("judge", "comparison") else out


def local_inputs(stage: str, cfg: Mapping) -> dict[str, list[str]]:
    """A job's inputs beyond the outputs of the jobs above it: the local files and folders its config names (JSONL
    data, a model or tokenizer to start from, the GGUF file, a served judge's weights), so that replacing one
    reruns it; hub ids and nulls are no files."""
    s = Config.of(cfg)

    def local(*values: str | None) -> list[str]:
        return [v for v in values if v and os.path.exists(v)]

    serve = s.evaluate.llm_judge.serve if s.evaluate.judge == "llm" else None
    judge = {"judge": local(serve.model) if serve else []}
    return {"prepare": {"files": local(s.data.train_file, s.data.test_file) if s.data.source == "jsonl" else []},
            "base": {"start": local(s.model.name_or_path, s.model.tokenizer)
                     + ([str(gguf_file(s.model.gguf))] if s.model.gguf else [])},
            "reward": {"start": local(s.reward.init)}, "judge": judge, "comparison": judge}.get(stage, {})
