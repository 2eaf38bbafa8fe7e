"""`rloo <stage>`: parse arguments, load and validate the config, call the stage's `run`."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import stat
import sys
import traceback
from pathlib import Path

from rloo import tracking
from rloo.config import ConfigError, changed_keys, declares_base, deep_merge, load_config, parse_set
from rloo.errors import UserError

# The stage names used by Snakemake, DVC and MLflow; the RLOO stage's CLI verb is `train`.
STAGE_NAMES = {"train": "rloo"}
DEFAULT_CONFIG = "config/config.yaml"


def _config(args: argparse.Namespace) -> dict:
    overrides: dict = {}
    if args.config_json:
        try:
            overrides = json.loads(args.config_json)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--config-json: not valid JSON ({e.msg})") from None
    if args.set:
        overrides = deep_merge(overrides, parse_set(args.set))
    paths = args.config
    if not paths and not args.config_json and Path(DEFAULT_CONFIG).is_file():
        paths = [DEFAULT_CONFIG]
    cfg = load_config(paths or None, overrides)
    if paths:
        _warn_without_base(paths, overrides, cfg)
    return cfg


def _warn_without_base(paths: list[str], overrides: dict, cfg: dict) -> None:
    """`rloo -c overlay.yaml` reads the file on the schema's defaults, while `snakemake --configfile`
    lays it over config/config.yaml: say so loudly when that changes a value."""
    if not Path(DEFAULT_CONFIG).is_file() or any(Path(p).resolve() == Path(DEFAULT_CONFIG).resolve() for p in paths):
        return
    if any(declares_base(p) for p in paths):
        return
    on_default = load_config([DEFAULT_CONFIG, *paths], overrides)
    differ = changed_keys(cfg, on_default)
    if differ:
        shown = ", ".join(differ[:6]) + (f" and {len(differ) - 6} more" if len(differ) > 6 else "")
        print(f"rloo: warning: {' + '.join(map(str, paths))} is read on the schema's defaults, not on "
              f"{DEFAULT_CONFIG} (as snakemake --configfile would); {len(differ)} keys differ: {shown}. Add "
              f"`base: config.yaml` to the file, or pass -c {DEFAULT_CONFIG} first.", file=sys.stderr)


def _paths(cfg: dict) -> dict:
    p = cfg["paths"]
    return {
        "data": p["data"],
        "sft": f"{p['models']}/sft",
        "reward": f"{p['models']}/reward",
        "work": f"{p['results']}/work",
    }


def main(argv: list[str] | None = None) -> int:
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
    common.add_argument(
        "--config-json", default=None, help="overrides as one JSON object (used by Snakemake)"
    )
    common.add_argument("--debug", action="store_true", help="show the traceback of an input error")

    parser = argparse.ArgumentParser(prog="rloo", description=__doc__)
    sub = parser.add_subparsers(dest="stage", required=True)

    p = sub.add_parser("prepare", parents=[common], help="write GSM8K-format train/test splits + manifest")
    p.add_argument("--out", default=None, help="output folder (default: paths.data)")

    p = sub.add_parser("sft", parents=[common], help="supervised fine-tuning of the reference policy")
    p.add_argument("--data", default=None)
    p.add_argument("--out", default=None)
    p.add_argument(
        "--work", default=None, help="checkpoints and the initial model (default: results/work/sft)"
    )

    p = sub.add_parser("train", parents=[common], help="RLOO on the SFT policy (the `rloo` stage)")
    p.add_argument("--data", default=None)
    p.add_argument("--policy", default=None, help="SFT policy folder (default: paths.models/sft)")
    p.add_argument("--reward-model", default=None, help="reward model folder (reward.source: model)")
    p.add_argument("--out", default=None, help="default: paths.models/rloo_<estimator>")
    p.add_argument("--work", default=None, help="checkpoints (default: results/work/rloo_<estimator>)")

    p = sub.add_parser("reward", parents=[common], help="train the Bradley-Terry reward model")
    p.add_argument("--data", default=None)
    p.add_argument("--policy", default=None, help="SFT policy folder (default: paths.models/sft)")
    p.add_argument("--out", default=None, help="default: paths.models/reward")

    p = sub.add_parser("evaluate", parents=[common], help="evaluate SFT and trained policies; write results JSON")
    p.add_argument("--data", default=None)
    p.add_argument("--sft", default=None)
    p.add_argument("--policy", action="append", default=[], metavar="NAME=FOLDER",
                   help="a trained policy to evaluate against SFT (repeatable)")
    p.add_argument("--reward-model", default=None, help="reward model for the proxy score")
    p.add_argument("--out", default="results/gsm8k_rloo.json")
    p.add_argument("--plots", default=None, help="folder for PNG plots (default: next to --out)")

    p = sub.add_parser("toy", parents=[common], help="the article's toy variance experiment")
    p.add_argument("--out", default="results/toy_variance.json")
    p.add_argument("--plot", default="results/toy_variance.png")

    p = sub.add_parser("compare", parents=[common], help="compare the evaluation results of several estimators")
    p.add_argument("--result", action="append", default=[], required=True, metavar="NAME=FILE",
                   help="an evaluation result (results/gsm8k_<estimator>.json) named by its estimator (repeatable)")
    p.add_argument("--out", default="results/comparison.json")
    p.add_argument("--plot", default="results/comparison.png")

    sub.add_parser("validate-config", parents=[common], help="validate a config and print it resolved")
    sub.add_parser("dvc", add_help=False, help="DVC: dvc.yaml from the Snakemake DAG, commit, pull (rloo dvc -h)")
    p = sub.add_parser("summary", help="print what a finished stage reports (an rloo metrics.json or a results JSON)")
    p.add_argument("files", nargs="+")

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["dvc"]:
        # Imported by name, like the stages: rloo.provenance does not count it as a stage's code.
        return importlib.import_module("rloo.dvc").main(argv[1:])
    args = parser.parse_args(argv)
    if args.stage == "summary":  # imported by name: no stage counts it as its code
        return importlib.import_module("rloo.report").main(args.files)
    try:
        cfg = _config(args)
    except ConfigError as e:
        print(f"rloo: {e}", file=sys.stderr)
        return 2
    try:
        return _run_stage(args, cfg)
    except UserError as e:
        # Bad input: one line a person can act on. The traceback helps only a developer: it goes where
        # stderr is a log file (a Snakemake job's log), or to the terminal with --debug.
        if args.debug or _stderr_is_a_file():
            traceback.print_exc()
        print(f"rloo {args.stage}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"rloo {args.stage}: interrupted", file=sys.stderr)
        return 130


def _stderr_is_a_file() -> bool:
    try:
        return stat.S_ISREG(os.fstat(sys.stderr.fileno()).st_mode)
    except (OSError, ValueError):
        return False


def _run_stage(args: argparse.Namespace, cfg: dict) -> int:
    paths = _paths(cfg)

    if args.stage == "validate-config":
        print(json.dumps(cfg, indent=2))
        return 0
    # Stages are imported by name: `rloo.provenance` then counts only the one that runs as its code.
    stage = importlib.import_module(f"rloo.stages.{args.stage}")
    name = STAGE_NAMES.get(args.stage, args.stage)
    if args.stage == "train":
        name = f"rloo_{cfg['rloo']['estimator']}" if cfg["rloo"]["estimator"] != "rloo" else "rloo"
    # One MLflow run per stage (a child of the pipeline's run under Snakemake): rloo/tracking.py.
    with tracking.stage_run(cfg, **tracking.cli_context(args, cfg, name)):
        _dispatch(stage, args, cfg, paths)
    return 0


def _dispatch(stage, args: argparse.Namespace, cfg: dict, paths: dict) -> None:
    if args.stage == "prepare":
        stage.run(cfg, args.out or paths["data"])
    elif args.stage == "sft":
        stage.run(cfg, args.data or paths["data"], args.out or paths["sft"], args.work or f"{paths['work']}/sft")
    elif args.stage == "train":
        name = f"rloo_{cfg['rloo']['estimator']}"
        stage.run(
            cfg, args.data or paths["data"], args.policy or paths["sft"],
            args.out or f"{cfg['paths']['models']}/{name}", args.work or f"{paths['work']}/{name}",
            args.reward_model or (paths["reward"] if cfg["reward"]["source"] == "model" else None),
        )
    elif args.stage == "reward":
        stage.run(cfg, args.data or paths["data"], args.policy or paths["sft"], args.out or paths["reward"])
    elif args.stage == "evaluate":
        policies = dict(p.split("=", 1) for p in args.policy) if args.policy else {
            "rloo": f"{cfg['paths']['models']}/rloo_{cfg['rloo']['estimator']}"}
        out = Path(args.out)
        stage.run(cfg, args.data or paths["data"], args.sft or paths["sft"], policies, out,
                  args.reward_model, args.plots or out.with_suffix(""))
    elif args.stage == "toy":
        stage.run(args.out, args.plot, seed=cfg["seed"])
    elif args.stage == "compare":
        stage.run(dict(r.split("=", 1) for r in args.result), args.out, args.plot)


if __name__ == "__main__":
    sys.exit(main())
