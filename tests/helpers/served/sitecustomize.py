"""Imported by every Python process the tests start (tests/conftest.py puts this folder on PYTHONPATH):
an `rloo ARGS` or `python -m rloo_workflow.cli ARGS` command becomes a client of the test run's stage server
(tests/helpers/stage_server.py), which runs it in a process forked from an interpreter that has imported
torch, transformers and MLflow already. Where no server listens, or it declines, the command runs here
as it would have. Nothing of the package takes part: this is how the tests run it, not how it runs.
"""

import os
import sys


def _command() -> list[str] | None:
    """The arguments of an `rloo` command, from the interpreter's own command line; None for anything
    else (a `python -m torch.distributed.run ... -m rloo_workflow.cli` agent is not one: its workers are)."""
    argv = sys.orig_argv[1:]
    while argv and argv[0].startswith("-") and argv[0] not in ("-m", "-c"):
        argv = argv[2:] if argv[0] in ("-X", "-W") else argv[1:]  # the interpreter's own options
    if argv[:2] == ["-m", "rloo_workflow.cli"]:
        return argv[2:]
    if argv and os.path.basename(argv[0]) == "rloo":
        return argv[1:]
    return None


if os.environ.get("RLOO_STAGE_SERVER") and (_args := _command()) is not None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from stage_server import delegate

    _argv, sys.argv = sys.argv, ["rloo", *_args]
    _code = delegate("rloo_workflow.cli", _args)
    sys.path.pop(0)
    sys.argv = _argv
    if _code is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_code)  # site's import machinery would turn SystemExit into a fatal error
