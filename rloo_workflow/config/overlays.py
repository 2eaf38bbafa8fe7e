"""Reading a config: YAML files overlaid in order (an overlay may name the file it `extends`), `--set` assignments,
and the resolved config a Snakemake run hands its jobs."""

from __future__ import annotations

import copy
import hashlib
import json
import os
from pathlib import Path

import yaml

from rloo_workflow.config.checks import EXTENDS_KEYS, validate
from rloo_workflow.config.schema import ConfigError


def deep_merge(base: dict, override: dict) -> dict:
    """`base` with `override` laid over it, mappings merged key by key (copies: neither is changed)."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def parse_set(assignments: list[str]) -> dict:
    """Turn ["rloo.k=8", "sft.lr=1e-3"] into a nested dict; values are parsed as YAML."""
    out: dict = {}
    for item in assignments:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY.PATH=VALUE")
        dotted, raw = item.split("=", 1)
        node = out
        *parents, leaf = dotted.strip().split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = _scalar(raw)
    return out


def _scalar(raw: str):
    """A YAML scalar, except that "1e-4" is a number (YAML 1.1 wants "1.0e-4", users don't)."""
    value = yaml.safe_load(raw)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


# Where Snakemake's main process leaves the user's resolved config for its jobs (workflow/rules/tracking.smk).
RESOLVED_ENV = "RLOO_RESOLVED_CONFIG"


def export_resolved(cfg: dict, path: str | Path) -> Path:
    """Write the resolved `cfg` to `path` and name it in the environment the jobs inherit, so that
    each stage sees the user's whole config (provenance, config hash) while Snakemake reruns it on its
    own keys only (its --job-config)."""
    from rloo.io import write_json_atomic

    path = Path(path).resolve()
    write_json_atomic(path, cfg)
    os.environ[RESOLVED_ENV] = str(path)
    return path


# Where a Snakemake job's part of the config goes (`job_config_file`), below the project's state folder.
JOB_CONFIG_DIR = ".rloo/config"
# ... and its command's options (`job_args_file`)
JOB_ARGS_DIR = ".rloo/args"


def job_config_file(stage: str, part: dict, root: str | Path = ".") -> str:
    """The file holding what a job reads of the config (`part`), named by its content
    (<JOB_CONFIG_DIR>/<stage>-<digest>.json; written once): a rule's `cfg` param and its command's
    --job-config. A changed value is another file, so Snakemake reruns the job; and the command a
    terminal shows, at the job's start and when it fails, is one short path, not the config."""
    text = json.dumps(part, sort_keys=True, separators=(",", ":"))  # sorted: the same keys, the same file
    return _content_file(f"{JOB_CONFIG_DIR}/{stage}", text, ".json", root, ending="\n")


def job_args_file(stage: str, args: list[str], root: str | Path = ".") -> str:
    """The file holding a job's command-line options (one a line, as argparse reads `@FILE`), named by
    its content (<JOB_ARGS_DIR>/<stage>-<digest>; written once): a rule's `args` param, its
    command `rloo <verb> @FILE ...`. Snakemake prints a failed job's command twice; with its options in
    a file it stays one short line (issue 72). The file holds what the command line held, nothing else:
    the DVC stage's command is the same command with the file's options in place (rloo_workflow/dvc/shell.py)."""
    if any("\n" in a for a in args):
        raise ValueError(f"a job's option holds a line break: {args}")
    return _content_file(f"{JOB_ARGS_DIR}/{stage}", "".join(f"{a}\n" for a in args), "", root, ending="")


def _content_file(prefix: str, text: str, suffix: str, root: str | Path, ending: str) -> str:
    """<prefix>-<digest of text><suffix> below `root`, holding text + ending; written once (atomically:
    parallel jobs share it)."""
    from rloo.io import atomic_path

    name = f"{prefix}-{hashlib.sha256(text.encode()).hexdigest()[:16]}{suffix}"
    path = Path(root) / name
    if not path.is_file():
        with atomic_path(path) as tmp:
            tmp.write_text(text + ending)
    return name


def read_job_config(path: str | Path) -> dict:
    """A job's part of the config (`job_config_file`), or a ConfigError naming the file."""
    try:
        part = json.loads(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"--job-config {path}: cannot read it ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"--job-config {path}: not valid JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(part, dict):
        raise ConfigError(f"--job-config {path}: not a JSON object")
    return part


def resolved_base() -> dict:
    """The config exported by `export_resolved` for this job, or {} outside a Snakemake run."""
    path = os.environ.get(RESOLVED_ENV)
    if not path:
        return {}
    try:
        base = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} ({RESOLVED_ENV}): cannot read the pipeline's resolved config ({e})") from None
    return base if isinstance(base, dict) else {}


def load_config(
    path: str | Path | list[str | Path] | None = None,
    overrides: dict | None = None,
) -> dict:
    """Read a YAML file, or several merged in order (later ones overlay earlier ones), or start empty;
    merge overrides, validate and fill defaults."""
    paths = [] if path is None else [path] if isinstance(path, str | Path) else list(path)
    cfg: dict = {}
    for p in paths:
        cfg = deep_merge(cfg, _read_yaml(p))
    source = " + ".join(map(str, paths)) or "config"
    if overrides:
        cfg = deep_merge(cfg, overrides)
        source += " (with overrides)"
    return validate(cfg, source, overrides)


def _extends(path: str | Path, cfg: dict) -> tuple[str, object] | None:
    """(the key given, its value) of an overlay that names the config it extends, else None."""
    given = [k for k in EXTENDS_KEYS if k in cfg]
    if len(given) > 1:
        raise ConfigError(f"{path}: keys 'extends' and 'base' both name the config this file overlays; keep "
                          "'extends' ('base' is its old spelling)")
    return (given[0], cfg[given[0]]) if given else None


def _read_yaml(path: str | Path, seen: tuple[Path, ...] = ()) -> dict:
    """A config file; an overlay that names the file it `extends` (a path relative to itself) is read on top of it."""
    try:
        cfg = yaml.safe_load(Path(path).read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(cfg).__name__}")
    extends = _extends(path, cfg)
    if extends is None:
        return cfg
    key, parent = extends
    del cfg[key]
    if not isinstance(parent, str):
        raise ConfigError(f"{path}: key '{key}' must be a path to the config this file overlays")
    parent_path = (Path(path).parent / parent).resolve()
    if parent_path in seen:
        raise ConfigError(f"{path}: key '{key}': {parent} is already being read (a cycle of overlays)")
    return deep_merge(_read_yaml(parent_path, (*seen, parent_path)), cfg)


def config_extends(path: str | Path) -> Path | None:
    """The file a config overlays (its `extends:`, resolved against its own folder), or None."""
    try:
        cfg = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return None
    extends = _extends(path, cfg) if isinstance(cfg, dict) else None
    return (Path(path).parent / extends[1]).resolve() if extends and isinstance(extends[1], str) else None


def declares_extends(path: str | Path) -> bool:
    """Whether a config file names the config it overlays (`extends:`)."""
    try:
        cfg = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(cfg, dict) and any(k in cfg for k in EXTENDS_KEYS)
