"""A stage's code fingerprint: what the code it runs computes (rloo/code_fingerprint.py's walk and digests).

A stage runs its own module (`rloo_workflow.stages.<stage>`, all of it), the CLI's dispatch
(rloo_workflow/cli.py from `entry` and `main`, without the other commands' handlers), and every definition
of the library and the workflow those reach. Snakemake reruns a job on its identity (rloo.identity, the
chain rules' `identity` param, whose parts count it) or its `code` param (the rules outside the chain:
workflow/rules/common.smk), DVC a stage on its key in FINGERPRINTS_FILE (rloo_workflow/dvc/compile.py),
and `rloo why-rerun` names what changed from the manifest kept by its digest (MANIFESTS_DIR). A training
stage's checkpoint counts it too, through the same identity; rloo.api's runs count the library's part
(rloo.code_fingerprint.training_fingerprint).
"""

from __future__ import annotations

import ast
import contextlib
import json
from functools import cache
from pathlib import Path

from rloo import code_fingerprint as library
from rloo.code_fingerprint import ROOT, Fingerprint, Key
from rloo.identity import Identity
from rloo.stages import BY_VERB, STAGES

WORKFLOW = "rloo_workflow"  # where the CLI and the stage modules live
# Where the workflow keeps what it derives from the code: the fingerprints DVC reads as params, and each
# manifest by its digest (what `rloo why-rerun` compares a recorded fingerprint with).
STATE_DIR = ".rloo"
FINGERPRINTS_FILE = f"{STATE_DIR}/fingerprints.yaml"
MANIFESTS_DIR = f"{STATE_DIR}/code"
IDENTITIES_DIR = f"{STATE_DIR}/identity"  # each job identity's parts, by its rerun digest (`rloo why-rerun`)


class Codebase(library.Codebase):
    """The packages below `root`, with the workflow's stages and commands as the roots of a walk."""

    def command_handlers(self) -> dict[str, str]:
        """Each `rloo` sub-command's handler in rloo_workflow/cli.py, by verb (its `COMMANDS` table, read as source)."""
        for stmt in self.parse(f"{WORKFLOW}.cli").defs.get("COMMANDS", []):
            value = stmt.value
            if isinstance(value, ast.Dict):
                return {k.value: v.id for k, v in zip(value.keys, value.values, strict=True)
                        if isinstance(k, ast.Constant) and isinstance(v, ast.Name)}
        raise ValueError(f"{self.root}/{WORKFLOW}/cli.py: no COMMANDS table of the sub-commands' handlers")

    def stage_keys(self, stage: str) -> list[Key]:
        """The definitions `stage` runs: its module (rloo_workflow.stages.<stage>), and the CLI less the other
        commands' handlers. `stage` is a pipeline stage, its command `rloo <its verb>`, or a command that is
        no stage (`summary`)."""
        handlers = self.command_handlers()
        verb = stage_verb(stage)
        if verb not in handlers:
            raise ValueError(f"rloo {verb}: no such command (rloo_workflow/cli.py COMMANDS: {', '.join(handlers)})")
        cli, module = f"{WORKFLOW}.cli", f"{WORKFLOW}.stages.{stage}"
        roots = [*(self.whole(module) if self.is_module(module) else []),
                 (cli, "entry"), (cli, "main"), (cli, handlers[verb])]
        return sorted(self.reachable(roots, [(cli, h) for h in handlers.values() if h != handlers[verb]]))

    def fingerprint(self, stage: str, extra_files: tuple[Path, ...] = (), extra_roots: tuple[Key, ...] = ()) -> Fingerprint:
        """The fingerprint of `stage` (`stage_keys`), with the user's files and the package's functions the
        config names (`fingerprint_of`)."""
        return self.kept(["stage", stage, extra_roots], extra_files,
                         lambda: self.fingerprint_of(stage, self.stage_keys(stage), extra_files, extra_roots))


def stage_verb(stage: str) -> str:
    """The `rloo` command that runs `stage` (its verb differs where `rloo <stage>` reads badly: `rloo train`
    runs the rloo stage); a name that is no stage is a command itself."""
    if stage in STAGES:
        return STAGES[stage].verb
    if stage in BY_VERB:  # without its module the walk would miss the stage's own code
        raise ValueError(f"{stage}: a command, not a stage: `rloo {stage}` runs the stage {BY_VERB[stage].name}")
    return stage


@cache
def installed() -> Codebase:
    """The packages this process runs (rloo/ and rloo_workflow/, the folder above this file's)."""
    return Codebase(ROOT)


@cache
def _stage_fingerprint(stage: str, extra_files: tuple[Path, ...], extra_roots: tuple[Key, ...]) -> Fingerprint:
    return installed().fingerprint(stage, extra_files, extra_roots)


def stage_fingerprint(stage: str, cfg: dict | None = None, cached: bool = True) -> Fingerprint:
    """`stage`'s fingerprint; with a config whose reward functions the stage runs (rloo and
    evaluate) or whose tools it runs (sft, rloo and evaluate), their code too, by name: the user's files,
    and the package's functions a spec names. Not `cached`: the user's files as they are now (a process
    that outlives an edit of them)."""
    files: tuple[Path, ...] = ()
    roots: tuple[Key, ...] = ()
    if cfg is not None and stage in ("rloo", "evaluate"):
        from rloo.reward.functions import package_functions, user_files
        from rloo.settings import Config

        config = Config.of(cfg)
        files, roots = tuple(user_files(config)), tuple(package_functions(config))
    if cfg is not None and stage in ("sft", "rloo", "evaluate"):  # the stages that run the enabled tools
        from rloo import tools
        from rloo.settings import Config

        config = Config.of(cfg)
        files += tuple(f for f in tools.user_files(config) if f not in files)
        roots += tuple(r for r in tools.package_functions(config) if r not in roots)
    return (_stage_fingerprint if cached else installed().fingerprint)(stage, files, roots)


def stage_code_param(stage: str, cfg: dict | None = None, root: Path | None = None) -> str:
    """The `code` param of `stage`'s Snakemake jobs, its manifest kept under `root` (default: the
    working directory, the workflow's) for `rloo why-rerun`; a folder that cannot be written keeps none."""
    fp = stage_fingerprint(stage, cfg)
    save_manifest(Path.cwd() if root is None else root, fp)
    return fp.param


def script_files(path: Path) -> list[str]:
    """The package files a script outside the package runs (scripts/figures.py's stale check)."""
    return installed().script_files(path)


def save_manifest(root: Path, fp: Fingerprint) -> None:
    """`fp`'s manifest under MANIFESTS_DIR by its digest (written once; `rloo why-rerun` reads it back); a
    folder that cannot be written keeps none."""
    _save(Path(root) / MANIFESTS_DIR / f"{fp.digest}.json", {"stage": fp.stage, "manifest": fp.manifest})


def save_identity(root: Path, identity: Identity) -> None:
    """A job identity's parts under IDENTITIES_DIR by its rerun digest (`load_identity`)."""
    _save(Path(root) / IDENTITIES_DIR / f"{identity.rerun}.json", identity.parts)


def load_identity(root: Path, rerun: str) -> dict | None:
    """The parts of the job identity `rerun` (`save_identity`), else None."""
    try:
        return json.loads((Path(root) / IDENTITIES_DIR / f"{rerun}.json").read_text())
    except (OSError, ValueError):
        return None


def _save(path: Path, obj: object) -> None:
    if not path.is_file():
        from rloo.io import write_json_atomic

        with contextlib.suppress(OSError):
            write_json_atomic(path, obj)


def load_manifest(root: Path, digest: str) -> dict[str, dict[str, str]] | None:
    path = Path(root) / MANIFESTS_DIR / f"{digest}.json"
    try:
        return json.loads(path.read_text())["manifest"]
    except (OSError, ValueError, KeyError):
        return None
