"""A micro SFT run as the tests start it: a fresh `rloo` process against one forked by the test suite's
stage server (tests/helpers/stage_server.py, which has imported torch, transformers and MLflow already;
a command is its client through tests/helpers/served/sitecustomize.py, on its PYTHONPATH).

Prepare and base run once; then each round runs `rloo sft` on config/micro.yaml (tracking off) once
fresh and once served, in alternating order, with the round's own seed. CPU is user + system: for a
fresh run its rusage; for a served run the client's rusage plus what the server reports for the forked
process. The two runs of a round must write the same weights (`same_bytes`).

    python bench/stage_server.py --json docs/figures/stage_server.json
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HELPERS = ROOT / "tests" / "helpers"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HELPERS))

import stage_server  # noqa: E402

from bench.record import write  # noqa: E402

MICRO = str(ROOT / "config" / "micro.yaml")
RLOO = [sys.executable, "-m", "rloo_workflow.cli"]


def _env(sock: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != stage_server.ENV_VAR}
    env.update(HF_HUB_OFFLINE="1", RLOO_TRACKING="0")
    if sock:
        env[stage_server.ENV_VAR] = sock
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HELPERS / "served"), env.get("PYTHONPATH")) if p)
    return env


def timed_sft(work: Path, seed: int, sock: str | None) -> dict:
    """One `rloo sft` run: CPU and wall seconds, and the SHA-256 of the weights it wrote."""
    out = work / f"sft_{seed}_{'served' if sock else 'fresh'}"
    cmd = [*RLOO, "sft", "-c", MICRO, "--set", "tracking.enabled=false", "--set", f"seed={seed}",
           "--data", str(work / "data"), "--base", str(work / "base"), "--out", str(out), "--work", str(out) + ".work"]
    served0 = stage_server.cpu_seconds(sock) if sock else 0.0
    before, start = os.times(), time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, env=_env(sock), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall, after = time.perf_counter() - start, os.times()
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    if sock:
        cpu += stage_server.cpu_seconds(sock) - served0
    return {"cpu_s": cpu, "wall_s": wall, "sha256": hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, help="write the figures here (docs/figures/stage_server.json)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="rloo-bench-stage-server-") as tmp:
        work = Path(tmp)
        subprocess.run([*RLOO, "prepare", "-c", MICRO, "--out", str(work / "data")], cwd=ROOT, env=_env(None),
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        subprocess.run([*RLOO, "base", "-c", MICRO, "--data", str(work / "data"), "--out", str(work / "base")], cwd=ROOT,
                       env=_env(None), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        sock = str(work / "server.sock")
        server = subprocess.Popen([sys.executable, "-u", str(HELPERS / "stage_server.py"), sock], cwd=ROOT, env=_env(None),
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            stage_server.wait_listening(sock, 300, server)
            runs: dict[str, list[dict]] = {"fresh": [], "served": []}
            for seed in range(args.rounds):
                order = ("fresh", "served") if seed % 2 == 0 else ("served", "fresh")
                for mode in order:
                    runs[mode].append(timed_sft(work, seed, sock if mode == "served" else None))
        finally:
            server.terminate()
            server.wait(timeout=60)
    rows = {mode: {"cpu_s": round(statistics.median(r["cpu_s"] for r in rs), 2),
                   "wall_s": round(statistics.median(r["wall_s"] for r in rs), 2), "rounds": len(rs)}
            for mode, rs in runs.items()}
    same = all(f["sha256"] == s["sha256"] for f, s in zip(runs["fresh"], runs["served"], strict=True))
    print(f"{'micro rloo sft':16s} {'CPU s':>7s} {'wall s':>7s}")
    for mode, r in rows.items():
        print(f"{mode:16s} {r['cpu_s']:7.2f} {r['wall_s']:7.2f}")
    print(f"same weights fresh and served, every round: {same}")
    if args.json:
        write(args.json, {"sft_micro": rows, "same_bytes": same,
                          "note": "median of the rounds, one seed per round, the two modes in alternating order"})
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
