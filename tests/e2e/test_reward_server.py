"""`reward.source: http` (rloo/reward/remote.py) against a real reward server process
(tests/helpers/reward_server.py), which scores with the same reward functions a `reward.source:
function` config names: the same rewards through either; retries, a failing request within its share, a
reply that breaks the protocol, a bearer key from the environment; and a server killed mid-run under
Snakemake, which stops the rloo job in one line with its last checkpoint intact, so that the rerun resumes
from it, and leaves the key in no file."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml
from conftest import copy_tree
from fault_helpers import silent_server
from workflow_helpers import CONFIGFILES, SERVED_SNAKEMAKE, env_for, job_counts, snakemake

from rloo.model import checkpoint
from rloo.reward.remote import RewardServerError
from rloo.reward.rewards import FunctionReward, HttpReward, build_reward
from rloo_workflow.config import load_config

ROOT = Path(__file__).resolve().parents[2]
SERVER = ROOT / "tests" / "helpers" / "reward_server.py"
SECRET = "SECRET-xyz"  # issue 71: no key's shape, in a variable whose name (no api_key, no token) is no secret's

FUNCTIONS = textwrap.dedent('''
    from rloo.reward.verifier import gold_answer

    def marker(completions, **kwargs):
        return [1.0 if "####" in c else 0.0 for c in completions]

    def answer_digits(completions, answer, **kwargs):
        """A column of the record: how many of the answer's digits the completion writes, or None."""
        return [None if c.startswith("?") else sum(d in c for d in gold_answer(a)) / 3 for c, a in zip(completions, answer)]
''')

PROMPTS = ["Question: a\nAnswer:"] * 4
COMPLETIONS = [" 2 + 2 = 4\n#### 4", "? #### 15", " no marker 1", " #### 7"]
ROWS = [{"question": "a", "answer": f"#### {a}", "id": i} for i, a in enumerate((4, 15, 12, 7))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def functions_file(tmp_path) -> Path:
    path = tmp_path / "scorers.py"
    path.write_text(FUNCTIONS)
    return path


class Server:
    """The helper server on a port of its own, started and killed by the test."""

    def __init__(self, tmp_path: Path, functions_file: Path, *args: str, port: int | None = None,
                 env: dict | None = None) -> None:
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}/score"
        self.seen = tmp_path / f"seen_{self.port}_{time.monotonic_ns()}"
        self.proc = subprocess.Popen(
            [sys.executable, str(SERVER), str(self.port), f"{functions_file}:marker=0.25",
             f"{functions_file}:answer_digits=2.0", "--seen", str(self.seen), *args],
            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1).read()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"reward server did not start: {self.proc.communicate()}") from None
                time.sleep(0.05)

    @property
    def requests(self) -> int:
        return len(self.seen.read_text().splitlines()) if self.seen.exists() else 0

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.communicate()


@pytest.fixture
def servers():
    started: list[Server] = []
    yield started
    for s in started:
        s.kill()


def _http(url: str, **http) -> HttpReward:
    reward = build_reward(load_config(None, {"reward": {"source": "http", "http": {"url": url, **http}}}))
    assert isinstance(reward, HttpReward)
    return reward


def _score(reward) -> torch.Tensor:
    return reward.score(PROMPTS, COMPLETIONS, [r["answer"] for r in ROWS], [True] * 4, rows=ROWS)


def test_the_server_gives_the_rewards_the_functions_give(tmp_path, functions_file, servers):
    servers.append(server := Server(tmp_path, functions_file))
    as_functions = build_reward(load_config(None, {"data": {"source": "jsonl"}, "reward": {"source": "function", "functions": [
        {"name": "marker", "fn": f"{functions_file}:marker", "weight": 0.25},
        {"name": "digits", "fn": f"{functions_file}:answer_digits", "weight": 2.0}]}}))
    assert isinstance(as_functions, FunctionReward)
    local, remote = _score(as_functions), _score(_http(server.url))
    assert torch.equal(local, remote), (local, remote)
    # the record's columns reached the server's functions: "4", "7" and the 1 of "12" are written; a None
    # (the second) leaves the marker's reward alone
    assert local.tolist() == pytest.approx([0.25 + 2 / 3, 0.25, 2 / 3, 0.25 + 2 / 3]), local
    assert server.requests == 1


def test_a_failed_request_is_retried(tmp_path, functions_file, servers):
    servers.append(server := Server(tmp_path, functions_file, "--fail-first", "1"))
    assert not _score(_http(server.url, max_retries=1)).isnan().any()
    assert server.requests == 2  # the 500, then the answer


def test_a_request_that_still_fails_within_its_share_leaves_rewards_missing(tmp_path, functions_file, servers):
    servers.append(server := Server(tmp_path, functions_file, "--fail-first", "1"))
    reward = _http(server.url, max_retries=0, max_failed_share=1.0)
    assert _score(reward).isnan().all()  # missing rewards, kept out of the baselines
    assert not _score(reward).isnan().any()


def test_each_retry_is_a_console_line_and_counted(tmp_path, functions_file, servers, capfd):
    """Two HTTP 500s, then the answer, at the default settings (2 retries): each retry is one line on
    stdout, which reaches the terminal under Snakemake (a stage's stderr goes to its log), naming the
    server, what failed and the attempt; the client counts them for the stage's last lines."""
    servers.append(server := Server(tmp_path, functions_file, "--fail-first", "2"))
    reward = _http(server.url)
    assert not _score(reward).isnan().any() and server.requests == 3
    out = capfd.readouterr().out.splitlines()
    assert len(out) == 2, out
    for line, attempt, wait in zip(out, (1, 2), ("0.5", "1"), strict=True):
        assert line.startswith(f"reward server {server.url}: HTTP 500"), line
        assert line.endswith(f" on attempt {attempt} of 3; retrying in {wait} s"), line
    assert reward.client.retries.count == 2
    assert reward.client.summary() == f"reward server {server.url}: 1 requests, 2 retries, 0 failed after their retries"


def _timed_failure(reward: HttpReward, limit_s: float) -> tuple[str, float]:
    """The stop's message and when it came, the scoring run in a thread given `limit_s` seconds."""
    import threading

    outcome: dict = {}

    def scoring() -> None:
        t0 = time.monotonic()
        try:
            _score(reward)
        except RewardServerError as e:
            outcome["error"] = str(e)
        outcome["seconds"] = time.monotonic() - t0

    worker = threading.Thread(target=scoring, daemon=True)
    worker.start()
    worker.join(timeout=limit_s)
    assert not worker.is_alive(), f"the reward client was still waiting after {limit_s} s"
    return outcome.get("error", "no error"), outcome["seconds"]


# A server that accepts and never replies, at the default settings: in test_judge_server.py, waiting at
# once with the judge's own such test (each three-minute wait held an xdist worker of its own).


@pytest.mark.slow
def test_a_server_that_never_takes_the_connection_fails_in_seconds():
    """A listening socket whose queue is full (a process stopped with its backlog filled): the
    connection attempt itself hangs; connecting gets 10 s, so two tries end in about 20 s, not 2 x 60."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/score"
    fillers = []
    for _ in range(3):  # fill the accept queue: further connection attempts get no answer
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(listener.getsockname())
        fillers.append(s)
    time.sleep(0.2)
    try:
        error, seconds = _timed_failure(_http(url), 60)
    finally:
        for s in (*fillers, listener):
            s.close()
    assert error.startswith(f"the reward server at {url} did not answer its first request (no connection within "
                            "10 s, 2 tries): is it up?"), error
    assert 19 < seconds < 40, seconds


@pytest.mark.slow
def test_a_slow_server_that_answers_is_not_failed(tmp_path, functions_file, servers, capfd):
    """A server that takes 11 s (longer than the 10 s connect limit) to answer, at the default settings:
    scored, with no retry."""
    servers.append(server := Server(tmp_path, functions_file, "--delay", "11"))
    reward = _http(server.url)
    assert not _score(reward).isnan().any()
    assert reward.client.retries.count == 0 and server.requests == 1 and capfd.readouterr().out == ""


def test_a_run_shows_its_retries_on_the_terminal_and_counts_them(micro_run, tmp_path, functions_file, servers):
    """`rloo train` as a Snakemake rule runs it, stderr to its log file: the two retries and the count at
    the end reach stdout (the terminal); the count is a run fact in timings.json, not in the outputs."""
    servers.append(server := Server(tmp_path, functions_file, "--fail-first", "2"))
    work, out = tmp_path / "work", tmp_path / "rloo"
    cmd = [sys.executable, "-m", "rloo_workflow.cli", "train", "-c", str(ROOT / "config" / "micro.yaml"),
           "--set", "reward.source=http", "--set", f"reward.http.url={server.url}", "--set", "rloo.eval_every=0",
           "--set", "rloo.steps=2", "--set", "tracking.enabled=false",
           "--data", str(micro_run["data"]), "--policy", str(micro_run["sft"]), "--out", str(out), "--work", str(work)]
    with open(tmp_path / "rloo.log", "w") as log:
        res = subprocess.run(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=log, text=True, timeout=300)
    assert res.returncode == 0, (tmp_path / "rloo.log").read_text()[-3000:]
    lines = res.stdout.splitlines()
    assert [line.rsplit(" on attempt ", 1)[1] for line in lines[:2]] == ["1 of 3; retrying in 0.5 s",
                                                                         "2 of 3; retrying in 1 s"], lines
    assert lines[2] == f"rloo: reward server {server.url}: 2 requests, 2 retries, 0 failed after their retries"
    assert all(line.startswith("rloo: ") for line in lines[3:]), lines  # then the stage's own summary
    assert all(line in (tmp_path / "rloo.log").read_text() for line in lines)  # the log has them too
    facts = json.loads((work / "timings.json").read_text())
    assert (facts["reward_server_requests"], facts["reward_server_retries"], facts["reward_server_failed"]) == (2, 2, 0)
    assert "retries" not in (out / "metrics.json").read_text()


def _counted_tries(lines: list[str], error: str) -> tuple[list[tuple[int, int]], int]:
    """(attempt, of) of each retry line, and the tries the stop says it made."""
    attempts = [tuple(map(int, m.groups())) for line in lines if (m := re.search(r" on attempt (\d+) of (\d+);", line))]
    made = re.search(r"(\d+) tries\)", error)
    assert made, error
    return attempts, int(made.group(1))


def test_the_retry_lines_and_the_stop_count_the_requests_a_failing_server_saw(tmp_path, functions_file, servers,
                                                                              capfd):
    """A server that answers every request with HTTP 500, at the default 2 retries: 'attempt 1 of 3', '2
    of 3', then the stop 'after 3 tries', and the server saw 3 requests."""
    servers.append(server := Server(tmp_path, functions_file, "--fail-first", "100"))
    with pytest.raises(RewardServerError) as info:
        _score(_http(server.url))
    attempts, made = _counted_tries(capfd.readouterr().out.splitlines(), str(info.value))
    assert made == server.requests == 3 and attempts == [(1, made), (2, made)], (attempts, str(info.value))


def test_the_retry_lines_and_the_stop_count_the_tries_a_silent_server_saw(capfd):
    """A server that accepts and never replies (issue 71: 'attempt 1 of 3', then '2 tries'): the line
    counts against the two tries a first request gets, and the stop names as many as connections came."""
    with silent_server() as (port, held):
        url = f"http://127.0.0.1:{port}/score"
        with pytest.raises(RewardServerError) as info:
            _score(_http(url, timeout_s=0.5))
        seen = len(held)
    attempts, made = _counted_tries(capfd.readouterr().out.splitlines(), str(info.value))
    assert made == seen == 2 and attempts == [(1, made)], (attempts, str(info.value))


def test_a_dead_server_is_one_line(tmp_path):
    closed = f"http://127.0.0.1:{_free_port()}/score"
    with pytest.raises(RewardServerError) as info:
        _score(_http(closed, max_retries=1))
    message = str(info.value)
    assert message.startswith(f"the reward server at {closed} did not answer (ConnectionRefusedError") and "\n" not in message
    assert "1 of 1 requests failed, more than reward.http.max_failed_share=0: the run stops" in message


def test_an_http_error_is_one_line_with_the_url_the_status_and_the_first_line_of_the_body(tmp_path, functions_file,
                                                                                         servers):
    body = "\n  scorer crashed: KeyError 'answer'\nTraceback (most recent call last):\n  File \"scorer.py\", line 9\n"
    servers.append(server := Server(tmp_path, functions_file, "--fail-first", "5", "--fail-body", body))
    with pytest.raises(RewardServerError) as info:
        _score(_http(server.url, max_retries=1))
    message = str(info.value)
    assert message.startswith(f"the reward server at {server.url} did not answer (HTTP 500 Internal Server Error: "
                              "scorer crashed: KeyError 'answer', after 2 tries)") and "\n" not in message, message


@pytest.mark.parametrize(("reply", "expected"), [
    ('{"rewards": [1.0]}', "returned 1 rewards for 4 completions"),
    ('{"rewards": [1.0, "2", 3, 4]}', "returned '2' for completion 1: not a number"),
    ('{"score": [1, 2, 3, 4]}', "replied without 'rewards'"),
    ("not json", "replied with no JSON"),
])
def test_a_reply_that_breaks_the_protocol_is_one_line(tmp_path, functions_file, servers, reply, expected):
    servers.append(server := Server(tmp_path, functions_file, "--reply", reply))
    with pytest.raises(RewardServerError) as info:
        _score(_http(server.url))
    assert str(info.value).startswith(f"the reward server at {server.url} ") and expected in str(info.value)


def test_the_key_comes_from_the_environment(tmp_path, functions_file, servers, monkeypatch):
    servers.append(server := Server(tmp_path, functions_file, "--key-env", "RLOO_TEST_REWARD_KEY",
                                    env={"RLOO_TEST_REWARD_KEY": SECRET}))
    reward = _http(server.url, api_key_env="RLOO_TEST_REWARD_KEY", max_retries=0)
    with pytest.raises(RewardServerError, match=r"reward\.http\.api_key_env names RLOO_TEST_REWARD_KEY, which is not set"):
        _score(reward)
    monkeypatch.setenv("RLOO_TEST_REWARD_KEY", "wrong")
    with pytest.raises(RewardServerError, match=r"did not answer \(HTTP 401 Unauthorized"):
        _score(reward)
    monkeypatch.setenv("RLOO_TEST_REWARD_KEY", SECRET)
    assert not _score(reward).isnan().any()


@pytest.mark.slow
def test_a_server_killed_mid_run_stops_the_snakemake_job_in_one_line_the_rerun_resumes_and_no_file_holds_the_key(
        micro_workflow, tmp_path, functions_file, servers):
    """Issue 71 under Snakemake, on a copy of the session's finished micro chain with MLflow tracking on:
    only the jobs that read the key run (rloo, 4 steps with a checkpoint after 2, and its policy's
    evaluation, which reports the training reward). A key pasted where its variable's name belongs is
    refused when the Snakefile is read, not repeated. With the name of a variable that holds the key, the
    server hangs on the third step's request and is killed there: the rloo job stops in one line and keeps
    its checkpoint. The server back, the rerun resumes from step 2; its first reply fails quoting the key it
    got, which the retry line on the terminal and the log show redacted. `grep -r` then finds either key in no
    file of the copy: the run's folders (results/, logs/, .rloo/), the MLflow store and .snakemake/."""
    servers.append(server := Server(tmp_path, functions_file, "--hang-after", "2", "--hung", str(tmp_path / "hung"),
                                    "--key-env", "RLOO_TEST_REWARD_KEY", env={"RLOO_TEST_REWARD_KEY": SECRET}))
    copy = copy_tree(micro_workflow["copy"], tmp_path / "wf")
    (copy / "config" / "http.yaml").write_text(yaml.safe_dump({
        "reward": {"source": "http", "http": {"url": server.url, "api_key_env": "RLOO_TEST_REWARD_KEY"}},
        "rloo": {"eval_every": 0}, "tracking": {"enabled": True}}))
    targets = ["results/models/rloo_rloo", "results/eval/rloo.json"]
    args = [*targets, "--cores", "1", *CONFIGFILES, "config/http.yaml"]
    env = {"RLOO_TEST_REWARD_KEY": SECRET, "MLFLOW_TRACKING_URI": f"sqlite:///{copy}/mlflow.db"}

    pasted = "sk-SECRET5abc"
    res = snakemake(copy, *args, "-n", "--config", f"reward={{http: {{api_key_env: '{pasted}'}}}}", env=env, check=False)
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "key 'reward.http.api_key_env': must name an environment variable" in out, out[-3000:]
    assert pasted not in out and "Traceback" not in out, out[-3000:]

    run = subprocess.Popen([sys.executable, str(SERVED_SNAKEMAKE), *args], cwd=copy, env={**env_for(copy), **env},
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 600
    while not (tmp_path / "hung").exists():
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()[0][-4000:]
        time.sleep(0.05)
    server.kill()  # mid-request, after the checkpoint of step 2
    out, _ = run.communicate(timeout=600)
    assert run.returncode != 0 and job_counts(out) == {"rloo": 1, "evaluate": 1}, out[-4000:]
    stop = [line for line in out.splitlines() if line.startswith("rloo train: error: ")]
    assert len(stop) == 1 and stop[0].startswith(f"rloo train: error: the reward server at {server.url} did not "
                                                 "answer"), out[-4000:]
    assert "the run stops (its last checkpoint is kept" in stop[0] and "Traceback" not in out, out[-4000:]
    assert not (copy / "results" / "models" / "rloo_rloo").exists()  # no output from a run that did not finish
    work = copy / "results" / "work" / "rloo_rloo"
    assert [p.name for p in checkpoint.complete(work / "checkpoints")] == ["step_00000002"]

    # the server back on its port: the rerun resumes at step 2; the first request fails quoting the key
    servers.append(Server(tmp_path, functions_file, "--key-env", "RLOO_TEST_REWARD_KEY", "--fail-first", "1",
                          "--echo-key", port=server.port, env={"RLOO_TEST_REWARD_KEY": SECRET}))
    res = snakemake(copy, *args, env=env, timeout=900)
    out, log = res.stdout + res.stderr, (copy / "logs" / "rloo_rloo.log").read_text()
    assert json.loads((work / "timings.json").read_text())["resumed_from_step"] == 2, log[-3000:]
    quoted = "(got Authorization: Bearer [REDACTED]) on attempt 1 of 3"
    assert quoted in out and quoted in log and SECRET not in out, out[-4000:]
    steps = [json.loads(line) for line in (copy / "results/models/rloo_rloo/steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [0, 1, 2, 3] and all(math.isfinite(s["train/reward_mean"]) for s in steps)
    figures = json.loads((copy / "results/eval/rloo.json").read_text())
    assert figures["reward_parts"] == ["http"], figures  # the evaluation scored with the server too

    stores = [copy / name for name in ("results/runs", "logs", ".rloo", "mlflow.db", "mlruns", ".snakemake")]
    assert all(p.exists() for p in stores), [p for p in stores if not p.exists()]
    found = subprocess.run(["grep", "-rlF", "-e", SECRET, "-e", pasted, "."], cwd=copy, capture_output=True, text=True)
    assert found.returncode == 1 and not found.stdout, found.stdout + found.stderr  # 1: no file holds either
