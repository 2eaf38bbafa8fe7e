"""A command for tests/e2e/test_stage_server.py to send to a stage server (stage_server.delegate
runs `module.main(args)`): it reports the process it finds itself in, exits, raises, burns CPU
or waits for a signal, as told.

    python tests/helpers/served_probe.py SOCKET ACTION [ARG]   a client: delegate, else run here
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(args: list[str]) -> int:
    action = args[0]
    if action == "info":
        preloaded = "torch" in sys.modules  # before this command imported anything
        import tempfile

        import rloo

        threads = {}
        if preloaded:
            import threadpoolctl
            import torch

            threads = {"torch": torch.get_num_threads(),
                       "blas": [p["num_threads"] for p in threadpoolctl.threadpool_info() if p["user_api"] == "blas"]}
        print(json.dumps({"threads": threads, "tempdir": tempfile.gettempdir(),
                          "inductor_cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR"), "pid": os.getpid(),
                          "ppid": os.getppid(), "pgid": os.getpgid(0), "cwd": os.getcwd(),
                          "argv": sys.argv, "probe_env": os.environ.get("PROBE_VALUE"), "preloaded": preloaded,
                          "rloo_file": rloo.__file__, "stdin": sys.stdin.read()}))
        return 0
    if action == "exit":
        print("exiting", file=sys.stderr)
        return int(args[1])
    if action == "raise":
        raise RuntimeError("the probe raised")
    if action == "burn":
        end = time.process_time() + float(args[1])
        while time.process_time() < end:
            pass
        return 0
    if action == "wait":
        print(os.getpid(), flush=True)
        time.sleep(600)
        return 0
    raise SystemExit(f"unknown action {action}")


if __name__ == "__main__":
    os.environ["RLOO_STAGE_SERVER"] = sys.argv[1]
    from stage_server import delegate

    code = delegate("served_probe", sys.argv[2:])
    sys.exit(main(sys.argv[2:]) if code is None else code)
