"""Many `snakemake` dry runs in one process, for a test that asks for dozens of plans of one workflow under
different configs (tests/e2e/test_every_key.py). Each run is `snakemake.cli.main`, the function the
`snakemake` command calls, on its own arguments, so each builds its own workflow, DAG and records; what the
runs share is the process: its imports and the code fingerprints of the rules' params
(rloo_workflow/code_fingerprint.py caches them per process). One process per plan cost about 4 CPU-seconds
each, mostly those fingerprints; here a plan after the first takes a fraction of a second. The code must
not change between the runs (the first run's fingerprints would stand): vary configs only.

    python tests/helpers/snakemake_plans.py RUNS.json

RUNS.json: a list of argument lists. Prints a JSON list: per run, its exit code and its output.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path


def main(runs_file: str) -> None:
    from snakemake.cli import main as snakemake

    results = []
    for args in json.loads(Path(runs_file).read_text()):
        buf = io.StringIO()
        code: object = 0
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            try:
                snakemake(args)
            except SystemExit as e:  # the command's way to end, every time
                code = e.code
        results.append({"code": code, "output": buf.getvalue()})
    print(json.dumps(results))


if __name__ == "__main__":
    sys.argv[0] = str(Path(sys.executable).parent / "snakemake")
    main(sys.argv[1])
