"""`rloo <stage>`: parse arguments, load and validate the config, call the stage's `run`."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import stat
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rloo import extras
from rloo.console import configure_logging, set_scrubber
from rloo.errors import MissingInputError, UserError
from rloo.io import failed_write_line
from rloo.model import launcher
from rloo.settings import Config
from rloo_workflow import launch, pipeline, tracking
from rloo_workflow.config import (
    ConfigError,
    changed_keys,
    declares_extends,
    deep_merge,
    load_config,
    parse_set,
    read_job_config,
    resolved_base,
)
from rloo_workflow.job_log import run_logged
from rloo_workflow.tracking.redact import redact_text

if TYPE_CHECKING:
    from rloo.identity import Identity

DEFAULT_CONFIG = "config/config.yaml"
# The stages that train data-parallel under torchrun or srun (rloo/model/distributed.py).
DATA_PARALLEL = tuple(s.verb for s in pipeline.STAGES.values() if s.data_parallel)
# Old verbs kept working: {alias: its command}.
ALIASES = {"compare": "comparison"}


def _config(args: argparse.Namespace) -> dict:
    overrides: dict = read_job_config(args.job_config) if args.job_config else {}
    if args.set:
        overrides = deep_merge(overrides, parse_set(args.set))
    paths = args.config
    if not paths and not args.job_config and Path(DEFAULT_CONFIG).is_file():
        paths = [DEFAULT_CONFIG]
    if args.job_config and not paths:
        # A Snakemake job: its keys (--job-config) over the pipeline's resolved config, where the main
        # process exported one; else over the schema's defaults.
        overrides = deep_merge(resolved_base(), overrides)
    cfg = load_config(paths or None, overrides)
    if paths:
        _warn_without_extends(paths, overrides, cfg)
    return cfg


def _warn_without_extends(paths: list[str], overrides: dict, cfg: dict) -> None:
    """`rloo -c overlay.yaml` reads the file on the schema's defaults, while `snakemake --configfile`
    lays it over config/config.yaml: say so loudly when that changes a value."""
    if not Path(DEFAULT_CONFIG).is_file() or any(Path(p).resolve() == Path(DEFAULT_CONFIG).resolve() for p in paths):
        return
    if any(declares_extends(p) for p in paths):
        return
    on_default = load_config([DEFAULT_CONFIG, *paths], overrides)
    differ = changed_keys(cfg, on_default)
    if differ:
        shown = ", ".join(differ[:6]) + (f" and {len(differ) - 6} more" if len(differ) > 6 else "")
        print(f"rloo: warning: {' + '.join(map(str, paths))} is read on the schema's defaults, not on "
              f"{DEFAULT_CONFIG} (as snakemake --configfile would); {len(differ)} keys differ: {shown}. Add "
              f"`extends: config.yaml` to the file, or pass -c {DEFAULT_CONFIG} first.", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    """`rloo`'s command line: one sub-command per stage (pipeline.BY_VERB), plus the tools."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", "-c", action="append", default=[],
                        help="YAML config, repeatable: later files overlay earlier ones, as Snakemake's "
                             "--configfile does (default: config/config.yaml if present, else the schema's defaults)")
    common.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one key, e.g. --set rloo.k=8 (repeatable)",
    )
    common.add_argument("--job-config", default=None, metavar="FILE",
                        help="the keys a Snakemake job reads, as a JSON file named by its content (set by the "
                             "rules: .rloo/config/<stage>-<digest>.json), over the run's resolved config")
    common.add_argument("--log", default=None, metavar="FILE",
                        help="append everything the stage prints to FILE; a failure shows the terminal the "
                             "log's last lines and its path (set by the rules)")
    common.add_argument("--debug", action="store_true", help="show the traceback of an input error")
    common.add_argument("--variant", default=None, metavar="LABEL",
                        help="the job is a seed or a sweep point of the chain: its MLflow run is named "
                             "<stage>[LABEL] (e.g. rloo[seed=1]); set by the Snakemake rules")

    # `rloo <verb> @FILE`: options read from FILE, one a line (the Snakemake rules' args files:
    # rloo_workflow.config.job_args_file)
    parser = argparse.ArgumentParser(prog="rloo", description=__doc__, fromfile_prefix_chars="@")
    sub = parser.add_subparsers(dest="stage", required=True)

    p = sub.add_parser("prepare", parents=[common], help="write GSM8K-format train/test splits + manifest")
    p.add_argument("--out", default=None, help="output folder (default: paths.data)")

    nproc = argparse.ArgumentParser(add_help=False)
    nproc.add_argument("--nproc", type=int, default=None, metavar="N",
                       help="train with N processes per machine (re-run under torchrun, or under srun inside a "
                            "Slurm allocation; needs distributed.strategy ddp or fsdp; default: "
                            "distributed.nproc_per_node)")

    guard = argparse.ArgumentParser(add_help=False)
    guard.add_argument("--work-guard", action="store_true",
                       help="empty --work first unless its checkpoints are this very job's (the same resume "
                            "identity: rloo.identity); set by the Snakemake rules, where a rerun for a change starts "
                            "fresh; without it another job's checkpoints are refused in one line")

    p = sub.add_parser("base", parents=[common],
                       help="the starting model as one local folder (hub id, folder, GGUF file or the embedded model)")
    p.add_argument("--data", default=None, help="data folder (the embedded tokenizer learns its texts)")
    p.add_argument("--out", default=None, help="default: paths.models/base")

    p = sub.add_parser("sft", parents=[common, nproc, guard], help="supervised fine-tuning of the reference policy")
    p.add_argument("--data", default=None)
    p.add_argument("--base", default=None, help="the starting model's folder (default: paths.models/base)")
    p.add_argument("--out", default=None)
    p.add_argument(
        "--work", default=None, help="checkpoints (default: results/work/sft)"
    )

    p = sub.add_parser("train", parents=[common, nproc, guard], help="RLOO on the SFT policy (the `rloo` stage)")
    p.add_argument("--data", default=None)
    p.add_argument("--policy", default=None, help="SFT policy folder (default: paths.models/sft)")
    p.add_argument("--reward-model", default=None, help="reward model folder (reward.source: model)")
    p.add_argument("--out", default=None, help="default: paths.models/rloo_<estimator>")
    p.add_argument("--work", default=None, help="checkpoints (default: results/work/rloo_<estimator>)")

    p = sub.add_parser("reward", parents=[common, nproc, guard], help="train the Bradley-Terry reward model")
    p.add_argument("--data", default=None)
    p.add_argument("--policy", default=None, help="SFT policy folder (default: paths.models/sft)")
    p.add_argument("--out", default=None, help="default: paths.models/reward")
    p.add_argument("--work", default=None, help="checkpoints (default: results/work/reward)")

    p = sub.add_parser("evaluate", parents=[common],
                       help="evaluate one policy on the held-out problems: its records and figures")
    p.add_argument("--data", default=None)
    p.add_argument("--policy", default=None, metavar="NAME=FOLDER",
                   help="the policy: base, sft or an estimator, and its folder (default: the config's estimator "
                        "and its RLOO output)")
    p.add_argument("--sft", default=None, help="the SFT policy: tokenizer and KL reference (default: paths.models/sft)")
    p.add_argument("--reward-model", default=None, help="reward model for the proxy score")
    p.add_argument("--out", default=None, help="its records (default: paths.results/eval/<policy>.jsonl; its "
                                                "figures beside them, .json)")

    p = sub.add_parser("judge", parents=[common], help="an LLM judge's verdicts: trained policies against SFT")
    p.add_argument("--policy", action="append", default=[], metavar="NAME=RECORDS",
                   help="a trained policy's evaluation records (repeatable; default: the config's estimator's)")
    p.add_argument("--sft", default=None, metavar="RECORDS", help="SFT's evaluation records (default: paths.results/eval/sft.jsonl)")
    p.add_argument("--out", default=None, help="default: paths.results/gsm8k_<policy>/judged.json")
    p.add_argument("--judge-log", default=None,
                   help="the served judge's output (evaluate.llm_judge.serve; default: <paths.logs>/judge_<policy>.judge.log)")

    p = sub.add_parser("report", parents=[common],
                       help="base -> SFT -> RL from the evaluations' records (no model): the results JSON and plots")
    p.add_argument("--policy", default=None, metavar="NAME=RECORDS",
                   help="the trained policy's evaluation records (default: the config's estimator's)")
    p.add_argument("--sft", default=None, metavar="RECORDS", help="default: paths.results/eval/sft.jsonl")
    p.add_argument("--base", default=None, metavar="RECORDS", help="default: paths.results/eval/base.jsonl")
    p.add_argument("--training", default=None, metavar="FOLDER",
                   help="the trained policy's folder, for its metrics.json (default: its RLOO output)")
    p.add_argument("--data", default=None, help="the data folder, for its manifest (default: paths.data)")
    p.add_argument("--judged", default=None, metavar="FILE", help="an LLM judge's verdicts (`rloo judge`), "
                                                                   "where evaluate.judge is llm")
    p.add_argument("--out", default=None, help="default: paths.results/gsm8k_<policy>.json")
    p.add_argument("--plots", default=None, help="folder for PNG plots (default: next to --out)")

    p = sub.add_parser("toy", parents=[common], help="the article's toy variance experiment")
    p.add_argument("--out", default=None, help="default: paths.results/toy_variance.json")
    p.add_argument("--plot", default=None, help="default: paths.results/toy_variance.png")

    p = sub.add_parser("comparison", aliases=list(ALIASES), parents=[common],
                       help="compare the evaluation results of several estimators (`compare`: its old name)")
    p.add_argument("--result", action="append", default=[], required=True, metavar="NAME=FILE",
                   help="an evaluation result (results/gsm8k_<estimator>.json) named by its estimator (repeatable)")
    p.add_argument("--timings", action="append", default=[], metavar="NAME=FILE",
                   help="an RLOO run's wall-clock figures (default: <paths.results>/work/rloo_<NAME>/timings.json)")
    p.add_argument("--records", action="append", default=[], metavar="NAME=FILE",
                   help="an estimator's evaluation records, judged against RLOO's (default: "
                        "<paths.results>/eval/<NAME>.jsonl)")
    p.add_argument("--out", default=None, help="default: paths.results/comparison.json")
    p.add_argument("--plot", default=None, help="default: paths.results/comparison.png")
    p.add_argument("--judge-log", default=None,
                   help="the served judge's output (default: <paths.logs>/comparison.judge.log)")

    p = sub.add_parser("seeds", parents=[common], help="aggregate the per-seed results of the `seeds` target")
    p.add_argument("--result", action="append", default=[], required=True, metavar="SEED=FILE",
                   help="one seed's evaluation result (repeatable)")
    p.add_argument("--out", default=None, help="default: paths.results/seeds/gsm8k_<rloo.estimator>.json")
    p.add_argument("--plot", default=None, help="default: paths.results/seeds/gsm8k_<rloo.estimator>.png")

    p = sub.add_parser("sweep", parents=[common], help="table the points of a sweep (sweeps.<name>), best by validation")
    p.add_argument("--name", required=True, help="the sweep (a key of `sweeps`)")
    p.add_argument("--result", action="append", default=[], required=True, metavar="POINT=FILE",
                   help="one point's evaluation result, by its point id (repeatable)")
    p.add_argument("--out", default=None, help="default: paths.results/sweeps/<name>.json")
    p.add_argument("--plot", default=None, help="default: paths.results/sweeps/<name>.png")

    sub.add_parser("validate-config", parents=[common], help="validate a config and print it resolved")
    p = sub.add_parser("schema", help="print the config's JSON schema, made from the typed settings (rloo/settings/)")
    p.add_argument("--write", action="store_true", help="write it to rloo_workflow/schemas/config.schema.json instead")
    p = sub.add_parser("plan", parents=[common], help="predict each GPU stage's peak memory per device; exit 2 "
                                                      "if one does not fit")
    p.add_argument("--gpu-memory-gb", type=float, default=None, metavar="N",
                   help="memory of one GPU in GB (default: plan.gpu_memory_gb; null there: print the plan only)")
    sub.add_parser("dvc", add_help=False, help="DVC: dvc.yaml from the Snakemake DAG, commit, pull (rloo dvc -h)")
    sub.add_parser("why-rerun", add_help=False,
                   help="which stages Snakemake would rerun and why: the code (file, function), config keys "
                        "or inputs that changed (rloo why-rerun -h)")
    p = sub.add_parser("summary", help="print what a finished stage reports (an rloo metrics.json or a results JSON)")
    p.add_argument("files", nargs="+")

    return parser


def entry() -> int:
    """The `rloo` command (console script, `python -m rloo_workflow.cli`)."""
    return main(sys.argv[1:])


def main(argv: list[str] | None = None) -> int:
    # Every log record and console line of this process passes through the secret redaction, so that the
    # value of a variable an `*_env` key names (validation registers them) reaches no log or terminal.
    set_scrubber(redact_text)
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["dvc"], ["why-rerun"]):  # tools with a parser of their own
        return COMMANDS[argv[0]](argv[1:])
    args = parser.parse_args(argv)
    args.stage = ALIASES.get(args.stage, args.stage)  # an alias runs, logs and fingerprints as its command
    if args.stage in ("summary", "schema"):  # tools that read no config
        return COMMANDS[args.stage](args)
    return run_logged(getattr(args, "log", None), f"rloo {args.stage}", lambda: _main(args, argv))


def _main(args: argparse.Namespace, argv: list[str]) -> int:
    """A command that reads the config, its launch in several processes, and its errors as one line."""
    try:
        cfg = _config(args)
    except ConfigError as e:
        print(redact_text(f"rloo: {e}"), file=sys.stderr)
        return 2
    if "SLURM_STEP_ID" in os.environ:  # a task of an srun step: its ranks become torchrun's variables
        launcher.adopt_slurm_env()
    try:
        if (stage := pipeline.BY_VERB.get(args.stage)) is not None:
            # a missing optional package: one line, before anything runs or is written (the work folder too)
            extras.require(Config.of(cfg), stage.name)
        if launcher.launched_world() == 1:  # once per job, before it starts its processes
            _guard_work(args, cfg)
        if args.stage in DATA_PARALLEL and launcher.launched_world() == 1:
            d = Config.of(cfg).distributed
            n = args.nproc if args.nproc is not None else d.nproc_per_node
            if n * d.nodes > 1:
                # Not yet under a launcher: become srun (inside a Slurm allocation) or torchrun, starting
                # the run's processes, each running this command.
                if problem := launch.launch_problem(cfg, n):
                    print(f"rloo {args.stage}: error: {problem}", file=sys.stderr)
                    return 2
                launch.relaunch(cfg, n, argv)
        return _run(args, cfg)
    except UserError as e:
        # Bad input: one line a person can act on. The traceback helps only a developer: it goes where
        # stderr is a log file (a Snakemake job's log), or to the terminal with --debug.
        if args.debug or (_stderr_is_a_file() and not isinstance(e, extras.MissingExtraError)):
            _print_traceback()
        print(redact_text(f"rloo {args.stage}: error: {e}"), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"rloo {args.stage}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        # A write that failed outside rloo.io's atomic blocks (which raise a UserError, above): one line
        # naming the file (else the stage's output) and the space left there; anything else keeps its
        # traceback (a bug).
        def output() -> str:
            outputs = pipeline.cli_outputs(args, cfg)
            return outputs.get("model") or next(iter(outputs.values()), ".")

        line = failed_write_line(e, output)
        if line is None:
            raise
        if args.debug or _stderr_is_a_file():
            _print_traceback()
        print(redact_text(f"rloo {args.stage}: error: {line}"), file=sys.stderr)
        return 2


def _print_traceback() -> None:
    """The exception being handled, its traceback with secrets redacted (a message may quote a server's
    reply that holds the key it was sent)."""
    print(redact_text(traceback.format_exc()), end="", file=sys.stderr)


def _stderr_is_a_file() -> bool:
    try:
        return stat.S_ISREG(os.fstat(sys.stderr.fileno()).st_mode)
    except (OSError, ValueError):
        return False


def _run(args: argparse.Namespace, cfg: dict) -> int:
    """A command that reads the config: a tool prints, a stage runs in its MLflow run (a child of the
    pipeline's run under Snakemake: rloo_workflow/tracking/)."""
    command = COMMANDS[args.stage]
    if pipeline.BY_VERB.get(args.stage) is None:  # validate-config, plan
        return command(args, cfg)
    if launcher.launched_world() > 1 and args.stage not in DATA_PARALLEL:
        raise UserError(f"{launcher.launched_world()} processes were launched; rloo {args.stage} runs in one "
                        f"(only {' and '.join(DATA_PARALLEL)} train data-parallel)")
    stage = pipeline.BY_VERB[args.stage]
    configure_logging()  # every stage's progress in its log, those that load no model (judge, report) too
    # Data-parallel, rank 0 logs: the other ranks have no run (tracking.log_metrics logs nothing there).
    tracked = launcher.launched_rank() == 0
    with (tracking.stage_run(cfg, **tracking.cli_context(args, cfg), identity=_tagged_identity(args, cfg))
          if tracked else contextlib.nullcontext()):
        data, sft = _data_and_sft(args, cfg)
        _inputs_exist(args, cfg, data, sft)
        out = pipeline.cli_outputs(args, cfg)
        command(args, cfg, _Job(data=data, sft=sft, out=out, work=_work(args, cfg)))
        if tracked and stage.name in _RECORDED:  # what made it, for a job started by hand on it
            pipeline.cli_identity(args, cfg).write(out[_RECORDED[stage.name]])
    if tracked and (summary := SUMMARY.get(stage.name)):
        # what the stage reports (`rloo summary`), on the terminal: its standard output
        from rloo.eval import report

        report.main([str(summary(out))])
    return 0


# The file `rloo summary` reads of a stage that reports one when it ends, from its outputs (cli_outputs).
SUMMARY: dict[str, Callable[[dict[str, str]], Path | str]] = {
    "prepare": lambda out: Path(out["data"]) / "manifest.json",
    "rloo": lambda out: Path(out["model"]) / "metrics.json",
    "report": lambda out: out["result"],
}


def _tagged_identity(args: argparse.Namespace, cfg: dict) -> Identity | None:
    """The job's identity for its MLflow run's tags (pipeline.cli_identity), where it is tracked and a stage
    of the chain; None otherwise, or where its code does not parse (the stage says so when it runs)."""
    if not tracking.enabled(cfg) or pipeline.BY_VERB[args.stage].name not in pipeline.CHAIN:
        return None
    try:
        return pipeline.cli_identity(args, cfg)
    except (OSError, ValueError, SyntaxError):
        return None


def _data_and_sft(args: argparse.Namespace, cfg: dict) -> tuple[str, str]:
    """The data folder (--data, else paths.data) and SFT's model folder a stage reads."""
    data = args.data if getattr(args, "data", None) else pipeline.folders(cfg)["data"]
    return data, pipeline.outputs("sft", cfg)["model"]


def _work(args: argparse.Namespace, cfg: dict) -> str | None:
    """A resumable stage's work folder (checkpoints): --work, else the pipeline's; None for the others."""
    stage = pipeline.BY_VERB[args.stage]
    return getattr(args, "work", None) or (pipeline.work_dir(stage.name, cfg) if stage.work else None)


def _guard_work(args: argparse.Namespace, cfg: dict) -> None:
    """A resumable stage's work folder made this job's (rloo.identity.claim_work): its checkpoints kept where
    they are of the same resume identity; another job's are cleared with --work-guard (the rules' jobs, and
    so DVC's stages: a rerun is a new job) and refused with one line otherwise. Run by the command itself,
    before it starts its processes, so that the rules' commands stay one short line."""
    stage = pipeline.BY_VERB.get(args.stage)
    if stage is None or not stage.work:
        return
    from rloo.identity import claim_work

    work, guarded = _work(args, cfg), getattr(args, "work_guard", False)
    said = claim_work(work, pipeline.cli_identity(args, cfg), clear=guarded)
    if guarded:  # a rule's job: its stderr is the job's log, which says what became of the folder
        print(f"workdir {work}: {said}", file=sys.stderr)


# The output a stage records the identity of its job in (rloo.identity.IDENTITY_FILE): each folder a later
# stage reads, so that a job started by hand counts the identity of what it reads.
_RECORDED = {"prepare": "data", "base": "model", "sft": "model", "reward": "model", "rloo": "model"}


@dataclass(frozen=True)
class _Job:
    """A stage's inputs and outputs: its options, else the pipeline's declared paths."""

    data: str
    sft: str
    out: dict[str, str]
    work: str | None


# Inputs a command reads only where its option names one (without it, the stage goes on without them).
_GIVEN_ONLY = {"evaluate": ("reward_model",), "report": ("judged", "training", "manifest")}


def _inputs_exist(args: argparse.Namespace, cfg: dict, data: str, sft: str) -> None:
    """Every local folder the stage reads (pipeline.input_graph, the rules' inputs) exists, or one line
    names it, where it came from (the option of the input's name, else the config) and the stage that
    writes it (rather than transformers reading a missing folder as a hub id)."""
    needs = _needs(args, cfg, data, sft, data_files=False)
    # the earliest stage first: the one to run first
    for path, (source, writer) in sorted(needs.items(), key=lambda need: pipeline.CHAIN.index(need[1][1])):
        # A hub id given on the command line (namespace/name) is transformers' to resolve.
        hub_id = source.startswith("--") and writer != "prepare" and re.fullmatch(r"[\w.-]+/[\w.-]+", str(path))
        if not Path(path).exists() and not hub_id:
            raise MissingInputError(f"{path} ({source}) does not exist: the {writer} stage writes it "
                                    f"(rloo {pipeline.STAGES[writer].verb}, or snakemake runs it)")


def _needs(args: argparse.Namespace, cfg: dict, data: str, sft: str, data_files: bool = True) -> dict[str, tuple[str, str]]:
    """{path: (where it came from, the stage that writes it)} of every local input the stage reads
    (pipeline.input_graph, the rules' inputs): the data folder, or (`data_files`) its files the stage reads."""
    stage = pipeline.BY_VERB[args.stage].name
    if stage not in pipeline.CHAIN:
        return {}
    policy = pipeline.evaluated_policy(args, cfg) if stage == "evaluate" else None
    needs: dict[str, tuple[str, str]] = {}
    for key, ref in pipeline.input_graph(stage, cfg, policy=policy and policy[0]).items():
        given = getattr(args, key, None)
        if key in _GIVEN_ONLY.get(stage, ()) and not given:
            continue
        if ref.stage == "prepare":  # the data folder's files: --data, else paths.data
            source = ("--data" if getattr(args, "data", None) else "paths.data", "prepare")
            if data_files:  # a file, not the folder: a variant's data lies below it (pipeline.folders)
                needs[str(Path(data) / Path(pipeline.outputs("prepare", cfg)[ref.output]).name)] = source
            else:
                needs.setdefault(data, source)
        elif ref.stage == "evaluate":  # the records of --policy, --sft and --base, else the declared ones
            needs.update({path: (f"the {name} evaluation", "evaluate") for name, path in _evaluations(args, cfg).items()})
        elif policy and key == "policy":  # evaluate: its --policy NAME=FOLDER, else the estimator's output
            needs[policy[1]] = (f"the {policy[0]} policy", ref.stage)
        elif given:
            needs[given] = (f"--{key.replace('_', '-')}", ref.stage)
        else:
            path = sft if ref.stage == "sft" else pipeline.outputs(ref.stage, cfg, ref.estimator, policy=ref.policy)[ref.output]
            needs[path] = (_why_read(stage, key, ref.stage, cfg), ref.stage)
    return needs


def _why_read(stage: str, key: str, writer: str, cfg: dict) -> str:
    """Where an input the options do not name comes from: the setting that makes the RLOO stage read the
    reward model, else the upstream stage's declared output."""
    if stage == "rloo" and key == "reward_model":
        source = Config.of(cfg).reward.source
        return "reward.source=model" if source == "model" else "rloo.ppo.critic_init=reward_model"
    return f"the {writer} output"


def _evaluations(args: argparse.Namespace, cfg: dict) -> dict[str, str]:
    """{policy: its evaluation's records} that `rloo report` or `rloo judge` reads: its options, else the
    declared outputs (the base model's for the report only)."""
    def records(policy: str) -> str:
        return pipeline.outputs("evaluate", cfg, policy=policy)["records"]

    trained = [p.split("=", 1) for p in (args.policy if isinstance(args.policy, list) else [args.policy]) if p]
    estimator = Config.of(cfg).rloo.estimator
    out = {name: path for name, path in trained} or {estimator: records(estimator)}
    out["sft"] = args.sft or records("sft")
    if args.stage == "report":
        out["base"] = args.base or records("base")
    return out


# One handler per `rloo` sub-command. Each imports its module when it runs (`rloo summary` or
# `rloo prepare` need not import torch), and each stage's code fingerprint (rloo_workflow/code_fingerprint.py)
# counts its own handler, not the others'.


def _prepare(args: argparse.Namespace, cfg: dict, job: _Job) -> None:
    from rloo_workflow.stages import prepare

    prepare.run(cfg, job.out["data"])


def _base(args: argparse.Namespace, cfg: dict, job: _Job) -> None:
    from rloo_workflow.stages import base

    base.run(cfg, job.data, job.out["model"])


def _data_parallel(run: Callable[[], None]) -> None:
    """A stage that may train in a process group: the group is closed however the stage ends."""
    from rloo.model import distributed

    try:
        run()
    finally:
        distributed.shutdown()


def _sft(args: argparse.Namespace, cfg: dict, job: _Job) -> None:
    from rloo_workflow.stages import sft

    base = args.base or pipeline.outputs("base", cfg)["model"]
    _data_parallel(lambda: sft.run(cfg, job.data, base, job.out["model"], job.work))


def _rloo(args: argparse.Namespace, cfg: dict, job: _Job) -> None:
    from rloo_workflow.stages import rloo

    reads = pipeline.reads_reward_model(cfg)
    reward_model = args.reward_model or (pipeline.outputs("reward", cfg)["model"] if reads else None)
    _data_parallel(lambda: rloo.run(cfg, job.data, args.policy or job.sft, job.out["model"], job.work, reward_model))


def _reward(args: argparse.Namespace, cfg: dict, job: _Job) -> None:
    from rloo_workflow.stages import reward

    _data_parallel(lambda: reward.run(cfg, job.data, args.policy or job.sft, job.out["model"], job.work))


def _evaluate(args: argparse.Namespace, cfg: dict, job: _Job) -> None:
    from rloo_workflow.stages import evaluate

    name, folder = pipeline.evaluated_policy(args, cfg)
    evaluate.run(cfg, job.data, args.sft or job.sft, name, folder, job.out["records"], args.reward_model)


def _judge(args: argparse.Namespace, cfg: dict, job: _Job) -> None:
    from rloo.eval.records import read
    from rloo_workflow.stages import judge

    evaluations = {name: read(name, path) for name, path in _evaluations(args, cfg).items()}
    sft = evaluations.pop("sft")
    log = args.judge_log or Path(Config.of(cfg).paths.logs) / f"judge_{next(iter(evaluations))}.judge.log"
    judge.run(cfg, evaluations, sft, job.out["result"], log)


def _report(args: argparse.Namespace, cfg: dict, job: _Job) -> None:
    from rloo.eval.records import read
    from rloo_workflow import sweep_table
    from rloo_workflow.stages import report

    name, _ = pipeline.evaluated_policy(args, cfg)
    evaluations = {policy: read(policy, path) for policy, path in _evaluations(args, cfg).items()}
    training = args.training or pipeline.outputs("rloo", cfg, name)["model"]
    result = report.run(cfg, evaluations, name, training, Path(job.data) / "manifest.json", job.out["result"],
                        job.out["plots"], args.judged)
    sweep_table.point_finished(cfg, job.out["result"], result)  # a sweep point's line in the sweep's log


def _toy(args: argparse.Namespace, cfg: dict, job: _Job) -> None:
    from rloo_workflow.stages import toy

    toy.run(job.out["result"], job.out["plot"], seed=Config.of(cfg).seed)


def _comparison(args: argparse.Namespace, cfg: dict, job: _Job) -> None:
    from rloo_workflow.stages import comparison

    results = dict(r.split("=", 1) for r in args.result)
    timings = {name: f"{pipeline.work_dir('rloo', cfg, name)}/timings.json" for name in results}
    timings.update(dict(t.split("=", 1) for t in args.timings))
    record_files = {name: pipeline.outputs("evaluate", cfg, policy=name)["records"] for name in results}
    record_files.update(dict(r.split("=", 1) for r in args.records))
    comparison.run(results, job.out["result"], job.out["plot"], timings, cfg, args.judge_log, record_files)


def _seeds(args: argparse.Namespace, cfg: dict, job: _Job) -> None:
    from rloo_workflow.stages import seeds

    seeds.run(dict(r.split("=", 1) for r in args.result), Config.of(cfg).rloo.estimator, job.out["result"],
              job.out["plot"])


def _sweep(args: argparse.Namespace, cfg: dict, job: _Job) -> None:
    from rloo_workflow.stages import sweep

    sweep.run(cfg, args.name, dict(r.split("=", 1) for r in args.result), Config.of(cfg).rloo.estimator,
              job.out["result"], job.out["plot"])


def _validate_config(args: argparse.Namespace, cfg: dict) -> int:
    print(json.dumps(cfg, indent=2))
    # A warning, not a refusal: a cluster's jobs may run in another environment than this machine's.
    for gap in extras.missing(Config.of(cfg)):
        print(f"rloo validate-config: warning: {gap.line()}; the {' and '.join(gap.stages)} jobs will stop "
              "at their start where it is missing", file=sys.stderr)
    return 0


def _plan(args: argparse.Namespace, cfg: dict) -> int:
    """`rloo plan`: the table of rloo_workflow.memory_plan; exit 2 with one line when a stage does not fit."""
    from rloo.settings import Config
    from rloo_workflow import memory_plan

    sections = Config.from_config(cfg)
    gpu_gb = args.gpu_memory_gb or sections.plan.gpu_memory_gb
    shape, source = memory_plan.model_shape(sections.model)
    plans = memory_plan.plan(sections, shape, gpu_gb)
    print(f"policy {shape.parameters() / 1e9:.2f}B parameters (shape from {source}); GB per GPU"
          + (f", {memory_plan.usable_gb(gpu_gb):.1f} usable of {gpu_gb:g} (margin: 1 GB + 10 %)" if gpu_gb else
             " (no GPU size: plan.gpu_memory_gb or --gpu-memory-gb; vLLM's share left out)"))
    print(memory_plan.table(plans, gpu_gb))
    if gpu_gb and (problem := memory_plan.problem(plans, gpu_gb)):
        print(f"rloo plan: {problem}", file=sys.stderr)
        return 2
    return 0


def _dvc(argv: list[str]) -> int:
    from rloo_workflow.dvc import cli

    return cli.main(argv)


def _summary(args: argparse.Namespace) -> int:
    from rloo.eval import report

    return report.main(args.files)


def _schema(args: argparse.Namespace) -> int:
    from rloo_workflow.config.schema import SCHEMA_PATH, render_schema

    if args.write:
        SCHEMA_PATH.write_text(render_schema())
        print(f"wrote {SCHEMA_PATH}", file=sys.stderr)
    else:
        print(render_schema(), end="")
    return 0


def _why_rerun(argv: list[str]) -> int:
    from rloo_workflow import why_rerun

    return why_rerun.main(argv)


COMMANDS: dict[str, Callable[..., int | None]] = {
    "prepare": _prepare, "base": _base, "sft": _sft, "train": _rloo, "reward": _reward, "evaluate": _evaluate,
    "judge": _judge, "report": _report,
    "toy": _toy, "comparison": _comparison, "seeds": _seeds, "sweep": _sweep,
    "validate-config": _validate_config, "plan": _plan, "dvc": _dvc, "summary": _summary, "why-rerun": _why_rerun,
    "schema": _schema,
}


if __name__ == "__main__":
    sys.exit(entry())
