"""What the other modules of rloo_workflow.dvc share: the file names, the error, and dvc.yaml as written
(stages expanded, their deps and outs)."""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import yaml

from rloo_workflow.pipeline import VARIANT_FOLDERS, variant_fields

DVC_YAML = "dvc.yaml"
PARAMS = "params.yaml"
LOCK = "dvc.lock"
ENV_ENABLED = "RLOO_DVC"
# Snakemake's mtime carrier inside directory outputs (also in .dvcignore: not part of an output).
MARKER = ".snakemake_timestamp"
ITEM = "${item}"
# A foreach over a mapping (an item that reads more params than its rule's template: compile._foreach)
# names the wildcard's value `${key}` and its extra params `${item.p0}`, `${item.p1}`, ...
KEY = "${key}"
PARAM_SLOT = "p"


class DvcError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"rloo dvc: {msg}", file=sys.stderr, flush=True)


def configfile_parser() -> argparse.ArgumentParser:
    """The `--configfile` option of the tools that build the Snakemake DAG (`rloo dvc`, `rloo why-rerun`)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--configfile", nargs="+", default=[], metavar="FILE",
                        help="config files, as given to `snakemake --configfile`")
    return parser


def project_root(prog: str) -> Path | None:
    """The working directory where it holds the workflow (the Snakefile); else None, said in one line."""
    root = Path.cwd()
    if (root / "Snakefile").is_file():
        return root
    print(f"{prog}: run from the project root (no Snakefile in {root})", file=sys.stderr)
    return None


def venv_executable(name: str) -> str | None:
    """`name` next to this Python (the project's venv), else on PATH."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else shutil.which(name)


# The variant rules (workflow/rules/variants.smk: `<stage>_variant`) have the wildcard `variant`, the
# variant's folder (seeds/seed1, sweeps/beta/p8066cca7), which no DVC stage name can hold (`/`), and a
# seed's folder is not a value that `${item}` stands for in a command (`--set seed=1`). So their jobs
# are named after the variant's kind and fields (rloo_workflow.pipeline.variant_fields): `<stage>_seed` with
# wildcard `seed`, `<stage>_sweep` with `sweep` and `point`, then the rule's other wildcards (an
# evaluation's `policy`); a seed's jobs an item each of a foreach stage (`rloo_seed@1`), a sweep point's,
# and a job of several wildcards, a stage of its own (`rloo_sweep-beta-p8066cca7`, `evaluate_seed-1-sft`).
VARIANT_WILDCARD = "variant"
VARIANT_SUFFIX = "_variant"


def dvc_rule(rule: str, wildcards: dict[str, str]) -> tuple[str, dict[str, str]]:
    """The rule name and wildcards a job's DVC stage is named after: a variant rule's job as its kind's
    (`rloo_variant`, {variant: seeds/seed1} -> `rloo_seed`, {seed: 1}); any other job as it is."""
    if VARIANT_WILDCARD not in wildcards:
        return rule, wildcards
    kind, fields = variant_fields(wildcards[VARIANT_WILDCARD])
    return f"{rule.removesuffix(VARIANT_SUFFIX)}_{kind}", {**fields, **{k: v for k, v in wildcards.items()
                                                                        if k != VARIANT_WILDCARD}}


def variant_job(rule: str, value: str, others: tuple[str, ...] = ()) -> tuple[str, dict[str, str]] | None:
    """The inverse of `dvc_rule` for a variant stage: the workflow's rule and wildcards of DVC rule `rule`
    (`<stage>_seed`, `<stage>_sweep`) and value (`1`, `beta-p8066cca7`, `1-sft`: the fields, then the
    rule's `others` wildcards, joined by `-`); None for another rule."""
    if (workflow_rule := variant_rule(rule)) is None:
        return None
    kind = rule.rpartition("_")[2]
    names = re.findall(r"\{(\w+)\}", VARIANT_FOLDERS[kind])
    values = value.split("-", len(names) + len(others) - 1)
    fields = dict(zip(names, values[: len(names)], strict=True))
    return workflow_rule, {VARIANT_WILDCARD: VARIANT_FOLDERS[kind].format(**fields),
                           **dict(zip(others, values[len(names):], strict=True))}


def variant_rule(rule: str) -> str | None:
    """The workflow's rule of DVC rule `rule` where it is a variant's (`rloo_seed` is `rloo_variant`), else None."""
    stage, _, kind = rule.rpartition("_")
    return f"{stage}{VARIANT_SUFFIX}" if stage and kind in VARIANT_FOLDERS else None


def stage_name(rule: str, wildcards: dict[str, str]) -> str:
    """The DVC stage of a Snakemake job: the rule, `rule@value` for a rule with a wildcard (a variant
    rule's job: see `dvc_rule`)."""
    rule, wildcards = dvc_rule(rule, wildcards)
    if not wildcards:
        return rule
    if per_job(wildcards):
        # its own stage, not a foreach's: DVC reads `@` as foreach's, and takes no `/` in a name. The
        # values in the order of the rule's output path (none holds a `-`, nor does a rule name).
        return f"{rule}-{'-'.join(wildcards.values())}"
    return f"{rule}@{next(iter(wildcards.values()))}"


# A sweep's jobs differ in more than the wildcard's value (each sweep has its own grid, each point its
# own keys), so the rules of a `sweep` wildcard, and of several, get a DVC stage per job instead of a
# foreach stage: `sweep-<name>`, `rloo_sweep-<name>-<point>`.
PER_JOB_WILDCARDS = frozenset({"sweep", "policy"})


def per_job(wildcards: dict[str, str]) -> bool:
    """Whether a job of these wildcards is a DVC stage of its own rather than an item of a foreach stage."""
    return len(wildcards) > 1 or bool(PER_JOB_WILDCARDS & set(wildcards))


def covers(out: str, path: str) -> bool:
    return path == out or path.startswith(out.rstrip("/") + "/")


def substitute(obj: Any, old: str, new: str) -> Any:
    """`obj` (strings, lists, dicts) with every `old` in its strings replaced by `new`."""
    if isinstance(obj, str):
        return obj.replace(old, new)
    if isinstance(obj, list):
        return [substitute(x, old, new) for x in obj]
    if isinstance(obj, dict):
        return {k: substitute(v, old, new) for k, v in obj.items()}
    return obj


def load_pipeline(root: Path) -> dict:
    path = Path(root) / DVC_YAML
    if not path.is_file():
        return {}
    return yaml.safe_load(path.read_text()) or {}


def expand_stages(pipeline: dict) -> dict[str, dict]:
    """{stage name: {deps, outs, ...}} with `foreach` stages expanded (`rule@value`)."""
    out: dict[str, dict] = {}
    for name, body in (pipeline.get("stages") or {}).items():
        if isinstance(body.get("foreach"), dict):
            for value, item in body["foreach"].items():
                do = substitute(body["do"], KEY, str(value))
                for slot, key in item.items():
                    do = substitute(do, f"${{item.{slot}}}", key)
                # the filler slots repeat a key (an entry may be a {params file: keys} mapping: unhashable)
                do["params"] = [p for i, p in enumerate(do["params"]) if p not in do["params"][:i]]
                out[f"{name}@{value}"] = do
        elif "foreach" in body:
            for value in body["foreach"]:
                out[f"{name}@{value}"] = substitute(body["do"], ITEM, str(value))
        else:
            out[name] = body
    return out


def stage_outs(body: dict) -> list[str]:
    outs = []
    for kind in ("outs", "metrics", "plots"):
        for entry in body.get(kind) or []:
            outs.append(next(iter(entry)) if isinstance(entry, dict) else str(entry))
    return outs


def stage_deps(body: dict) -> list[str]:
    return [str(d) for d in body.get("deps") or []]
