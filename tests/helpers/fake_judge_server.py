"""A real (tiny) OpenAI-compatible judge server for the tests of rloo_workflow.judge_server without vLLM.

    python tests/helpers/fake_judge_server.py PORT [--child] [--ignore-sigterm] [--delay S] [--seen FILE] [--reply TEXT]

GET /health answers 200, POST /v1/chat/completions answers "A" (so every pair is a tie: a non-null win
rate) when the request carries `Bearer $VLLM_API_KEY`, else 401. `--child` starts a second process in
the same process group (as vLLM starts its engine core), printing both pids; `--ignore-sigterm` makes
both ignore SIGTERM (only SIGKILL stops them); `--delay` waits before each answer; `--seen` gets a line
per chat request; `--reply` answers that text instead of "A".
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import signal
import subprocess
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("port", type=int)
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--ignore-sigterm", action="store_true")
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--seen", default=None)
    ap.add_argument("--reply", default="A")
    args = ap.parse_args()
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.child:
        code = "import signal, time\n" + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if args.ignore_sigterm else "")
        child = subprocess.Popen([sys.executable, "-c", code + "time.sleep(600)"])
        print(f"child pid {child.pid}", flush=True)
    print(f"server pid {os.getpid()}", flush=True)
    key = os.environ.get("VLLM_API_KEY")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self._send(200 if self.path == "/health" else 404, b"{}")

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if args.seen:
                with open(args.seen, "a") as f:
                    f.write("chat\n")
            time.sleep(args.delay)
            if key and self.headers.get("Authorization") != f"Bearer {key}":
                self._send(401, b'{"error": {"message": "bad key"}}')
                return
            self._send(200, json.dumps({
                "id": "x", "object": "chat.completion", "created": 0, "model": "judge",
                "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": args.reply}}],
            }).encode())

        def _send(self, code: int, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    http.server.ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
