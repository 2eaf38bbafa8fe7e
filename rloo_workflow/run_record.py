"""What the last `snakemake` run of the project was given: its config files, its `--config` values and its
targets (.rloo/last-run.json, written when a run starts its jobs: workflow/rules/tracking.smk).

`rloo why-rerun` and `rloo dvc`, given no `--configfile`, build the DAG the last run built, not the one
of config/config.yaml alone (a bare `snakemake -n`), which would call every stage of a run made with an
overlay changed. "The last run" is the one that started its jobs last: two runs at once each write the
file as they start (atomically), so it names the later one.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rloo.io import atomic_path, write_json_atomic

LAST_RUN = ".rloo/last-run.json"
# The last run's `--config` values as one more config file, the last (Snakemake lays --config over them all).
LAST_RUN_CONFIG = ".rloo/last-run.config.yaml"


@dataclass(frozen=True)
class RunArgs:
    """The DAG a tool builds: Snakemake's `--configfile` files (the last run's `--config` values among
    them, as a file) and targets (none: the default target); `source` says where they came from."""

    configfiles: list[str] = field(default_factory=list)
    targets: list[str] = field(default_factory=list)
    source: str | None = None
    # the same as Snakemake's options, as the user gave them (`--configfile ...`, `--config k=v ...`)
    options: list[str] = field(default_factory=list)


def _relative(path: str | os.PathLike, root: Path) -> str:
    p = Path(path).resolve()
    return str(p.relative_to(root.resolve())) if p.is_relative_to(root.resolve()) else str(p)


def record(root: Path, configfiles: Iterable[str | os.PathLike], config: Mapping[str, Any],
           targets: Iterable[str]) -> None:
    """Write what a run was given (its main process, as it starts its jobs)."""
    values = json.loads(json.dumps(dict(config), default=str))
    if values:
        with atomic_path(Path(root) / LAST_RUN_CONFIG) as tmp:
            tmp.write_text(yaml.safe_dump(values, sort_keys=True))
    write_json_atomic(Path(root) / LAST_RUN, {
        "configfiles": [_relative(f, Path(root)) for f in configfiles],
        "config": values,
        "targets": sorted(str(t) for t in targets),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    })


def run_args(root: Path, configfiles: list[str]) -> RunArgs:
    """The DAG's arguments: `configfiles` where given; else the last run's, where one was recorded; else
    Snakemake's defaults (config/config.yaml, the default target)."""
    if configfiles:
        return RunArgs(configfiles=list(configfiles), options=["--configfile", *configfiles])
    path = Path(root) / LAST_RUN
    try:
        last = json.loads(path.read_text())
    except (OSError, ValueError):
        return RunArgs()
    files = [f for f in last.get("configfiles", []) if Path(root, f).is_file()]
    values = last.get("config") or {}
    options = [*(["--configfile", *files] if files else []),
               *(["--config", *(f"{k}={json.dumps(v)}" for k, v in values.items())] if values else [])]
    shown = " ".join([*last.get("targets", []), *options])
    if values and Path(root, LAST_RUN_CONFIG).is_file():
        files.append(LAST_RUN_CONFIG)
    return RunArgs(configfiles=files, targets=list(last.get("targets", [])), options=options,
                   source=f"the last run's configuration ({last.get('started', '?')}: {shown or 'no arguments'}; "
                          f"--configfile to give another)")
