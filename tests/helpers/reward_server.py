"""A real reward server for the tests of `reward.source: http` (rloo/reward/remote.py): it scores with
reward functions in TRL's form, the same ones a `reward.source: function` config names.

    python tests/helpers/reward_server.py PORT FILE.py:FUNCTION=WEIGHT ... [--key-env VAR] [--seen FILE]
        [--fail-first N [--fail-body TEXT] [--echo-key]] [--hang-after N --hung FILE] [--reply JSON] [--delay S]

POST (any path) takes {"prompts", "completions", "rows"} and answers {"rewards": [...]}: per completion
the weighted sum of the functions' rewards over those that gave a number (math.fsum, in the order
given), null where none did. Each function gets `prompts`, `completions` and every column of `rows`.
GET /health answers 200. `--key-env`: only requests with `Bearer $VAR` are answered (else 401);
`--seen`: a line per scoring request; `--fail-first N`: the first N requests get a 500 (`--fail-body`: its
body; `--echo-key`: the Authorization header it got after it, as a server that says which key it saw does); `--hang-after
N`: requests after the N-th write FILE and never answer (the test then kills the server); `--reply`:
that JSON body instead of the rewards; `--delay S`: every scoring request is answered after S seconds.
"""

from __future__ import annotations

import argparse
import http.server
import importlib.util
import json
import math
import os
import time
from pathlib import Path


def load(spec: str):
    target, weight = spec.rsplit("=", 1)
    path, name = target.rsplit(":", 1)
    module_spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return getattr(module, name), float(weight)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("port", type=int)
    ap.add_argument("functions", nargs="+")
    ap.add_argument("--key-env", default=None)
    ap.add_argument("--seen", default=None)
    ap.add_argument("--fail-first", type=int, default=0)
    ap.add_argument("--fail-body", default='{"error": "failing on purpose"}')
    ap.add_argument("--echo-key", action="store_true")
    ap.add_argument("--hang-after", type=int, default=None)
    ap.add_argument("--hung", default=None)
    ap.add_argument("--reply", default=None)
    ap.add_argument("--delay", type=float, default=0.0)
    args = ap.parse_args()
    functions = [load(s) for s in args.functions]
    key = os.environ.get(args.key_env) if args.key_env else None
    count = {"requests": 0}

    def score(body: dict) -> list[float | None]:
        rows = body["rows"]
        columns = {k: [r.get(k) for r in rows] for k in dict.fromkeys(k for r in rows for k in r)}
        kwargs = {**columns, "prompts": body["prompts"], "completions": body["completions"]}
        values = [f(**kwargs) for f, _ in functions]
        out = []
        for i in range(len(body["completions"])):
            terms = [w * v[i] for (_, w), v in zip(functions, values, strict=True) if v[i] is not None]
            out.append(math.fsum(terms) if terms else None)
        return out

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self._send(200 if self.path == "/health" else 404, b"{}")

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            count["requests"] += 1
            if args.seen:
                with open(args.seen, "a") as f:
                    f.write(f"{len(body['completions'])}\n")
            if key and self.headers.get("Authorization") != f"Bearer {key}":
                self._send(401, b'{"error": "bad key"}')
                return
            if count["requests"] <= args.fail_first:
                seen = f" (got Authorization: {self.headers.get('Authorization')})" if args.echo_key else ""
                self._send(500, (args.fail_body + seen).encode())
                return
            if args.hang_after is not None and count["requests"] > args.hang_after:
                Path(args.hung).write_text(str(os.getpid()))
                time.sleep(3600)
            time.sleep(args.delay)
            reply = args.reply.encode() if args.reply else json.dumps({"rewards": score(body)}).encode()
            self._send(200, reply)

        def _send(self, code: int, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    print(f"server pid {os.getpid()}", flush=True)
    http.server.ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
