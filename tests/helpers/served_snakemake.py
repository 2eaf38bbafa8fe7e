"""`snakemake ARGS` as the tests run it: in a process forked by the stage server (tests/helpers/stage_server.py,
tests/conftest.py) where there is one, which has imported Snakemake and its plugins already; else here.
Either way it is `snakemake.cli.main`, the function the `snakemake` command calls.

    python tests/helpers/served_snakemake.py ARGS...
"""

from __future__ import annotations

import sys
from pathlib import Path

from stage_server import delegate

if __name__ == "__main__":
    sys.argv[0] = str(Path(sys.executable).parent / "snakemake")  # as the command's own argv[0]
    code = delegate("snakemake.cli", sys.argv[1:])
    if code is None:
        from snakemake.cli import main

        main(sys.argv[1:])  # exits
    sys.exit(code)
