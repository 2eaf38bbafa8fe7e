"""Keep a stage's work folder (checkpoints) only if it belongs to the same job: same parameters, same
code, same inputs. `rloo sft`, `rloo reward` and `rloo train` run it before they start, given
`--work-guard` (rloo_workflow/cli.py), as the Snakemake rules, and so DVC's stages, give it.

Training stages resume from the newest checkpoint under their work folder. That is right after an
interruption (preemption, a time limit, a killed run), and wrong when the stage runs again because a
parameter, an upstream output or the code changed: the old checkpoints would be resumed as if nothing
had happened. `guard` writes a stamp of the job (what the stage reads of the config, its code
fingerprint (rloo_workflow/code_fingerprint.py), and path, size and mtime of every file of every input)
to WORK_DIR/job.stamp, and empties WORK_DIR when the stamp differs from the one already there. Comparing
mtimes errs on the safe side: a touched input costs a fresh start, never a wrong resume.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

STAMP = "job.stamp"


def _files(path: Path):
    if path.is_dir():
        for root, dirs, files in os.walk(path):
            dirs.sort()
            for name in sorted(files):
                yield Path(root) / name
    elif path.exists():
        yield path


def job_stamp(params: str, code: str, inputs: list[str]) -> str:
    entries = []
    for item in inputs:
        for f in _files(Path(item)):
            st = f.stat()
            entries.append([str(f), st.st_size, st.st_mtime_ns])
    blob = json.dumps({"params": params, "code": code, "inputs": entries}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def guard(work_dir: str | Path, params: str, code: str, inputs: list[str]) -> bool:
    """Prepare `work_dir` for the job; return True if its previous content was kept (a resume)."""
    work = Path(work_dir)
    stamp = job_stamp(params, code, inputs)
    stamp_file = work / STAMP
    kept = False
    if work.exists():
        previous = stamp_file.read_text().strip() if stamp_file.exists() else None
        if previous == stamp:
            kept = True
        else:
            shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    stamp_file.write_text(stamp + "\n")
    return kept
