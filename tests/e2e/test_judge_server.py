"""The judge served inside the judge job (rloo_workflow.judge_server), without vLLM: a real tiny HTTP server
(tests/helpers/fake_judge_server.py) started through the same code path (`evaluate.llm_judge.serve.command`).

Every test checks that no process of the server's group is left: after success, after an error inside
the block, after SIGTERM to the stage process, after a start that failed or timed out, and after a
server that ignores SIGTERM. The same lifecycle with a real `vllm serve` is in tests/e2e/test_vllm.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fault_helpers import silent_server
from workflow_helpers import pythonpath

from rloo.settings import ServeConfig
from rloo_workflow.config import ConfigError, load_config
from rloo_workflow.judge_server import JudgeServerError, command_for, free_port, judge_devices, serve
from rloo_workflow.stages import comparison

ROOT = Path(__file__).resolve().parents[2]
FAKE = ROOT / "tests" / "helpers" / "fake_judge_server.py"


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes whose process group is `pgid`."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def pids_in_log(path: Path) -> dict[str, int]:
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"(server|child) pid (\d+)", path.read_text())}


def wait_for(predicate, timeout: float = 60.0) -> None:
    t0 = time.time()
    while not predicate():
        assert time.time() - t0 < timeout, "timed out"
        time.sleep(0.1)


def fake(port: int, *flags: str) -> list[str]:
    return [sys.executable, str(FAKE), str(port), *flags]


def test_the_server_is_stopped_after_the_block_and_after_an_error_in_it(tmp_path):
    port = free_port()
    with serve(fake(port, "--child"), tmp_path / "ok.log", what="fake", port=port) as server:
        pids = pids_in_log(tmp_path / "ok.log")
        assert server.base_url == f"http://127.0.0.1:{port}/v1" and pids["server"] == server.pid
        assert set(group_members(server.pid)) >= {pids["server"], pids["child"]}  # the group holds both
    assert group_members(server.pid) == []

    port = free_port()
    with pytest.raises(RuntimeError, match="inside the block"), \
            serve(fake(port, "--child"), tmp_path / "err.log", what="fake", port=port) as server:
        assert len(group_members(server.pid)) == 2
        raise RuntimeError("inside the block")
    assert group_members(server.pid) == []


def test_a_server_that_ignores_sigterm_is_killed_after_the_grace(tmp_path):
    port = free_port()
    with serve(fake(port, "--child", "--ignore-sigterm"), tmp_path / "s.log", what="fake", port=port,
               stop_grace_s=1.0) as server:
        t0 = time.time()
    assert group_members(server.pid) == []  # SIGKILL after the grace: the child too
    assert 1.0 <= time.time() - t0 < 5


def test_a_server_that_exits_while_starting_is_one_line_naming_model_code_and_log(tmp_path, caplog):
    log_path = tmp_path / "judge.log"
    cmd = [sys.executable, "-c", "import sys; print('no such model folder: /nope'); sys.exit(3)"]
    with pytest.raises(JudgeServerError) as e, serve(cmd, log_path, what="/nope", port=free_port()):
        pytest.fail("the block must not run")
    msg = str(e.value)
    assert "\n" not in msg and "/nope" in msg and "exited with code 3" in msg and str(log_path) in msg
    assert "no such model folder: /nope" in caplog.text  # the log's last lines, logged before the error


def test_a_server_that_never_answers_times_out_and_is_stopped(tmp_path):
    port = free_port()
    cmd = [sys.executable, "-c", "import os, time; print('server pid', os.getpid(), flush=True); time.sleep(600)"]
    t0 = time.time()
    with pytest.raises(JudgeServerError, match=r"did not answer .*/health within 1 s .*startup_timeout_s"), \
            serve(cmd, tmp_path / "t.log", what="slow", port=port, startup_timeout_s=1.0):
        pytest.fail("the block must not run")
    assert time.time() - t0 < 10
    assert group_members(pids_in_log(tmp_path / "t.log")["server"]) == []


def test_command_and_devices_follow_the_config():
    s = ServeConfig(model="Qwen/Qwen2.5-7B-Instruct", args=("--max-model-len", "4096"), gpus=2,
                    startup_timeout_s=900, stop_grace_s=30, command=None)
    cmd = command_for(s, "judge", 8123)
    assert cmd[cmd.index("--served-model-name") + 1] == "judge" and cmd[cmd.index("--port") + 1] == "8123"
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2" and "Qwen/Qwen2.5-7B-Instruct" in cmd
    assert "--tensor-parallel-size" not in command_for(dataclasses.replace(s, gpus=1), "judge", 1)
    custom = command_for(dataclasses.replace(s, command=("srv", "{model}", "--port={port}", "{host}", "{name}")), "judge", 9)
    assert custom == ["srv", "Qwen/Qwen2.5-7B-Instruct", "--port=9", "127.0.0.1", "judge"]
    # the policies take the job's first GPU, the judge its last serve.gpus
    assert judge_devices(2, ["4", "5", "7"]) == "5,7" and judge_devices(0, ["3"]) == "3"
    assert judge_devices(1, []) is None  # no GPU: vLLM's CPU build
    with pytest.raises(JudgeServerError, match=r"serve\.gpus=2 .* sees 2 \(0,1\)"):
        judge_devices(2, ["0", "1"])
    assert judge_devices(2, ["0", "1"], reserved=0) == "0,1"  # the comparison job: no policy of its own


@pytest.mark.parametrize(("serve_cfg", "message"), [
    ({"model": "m", "gpus": 2, "args": ["-tp", "4"]}, r"--tensor-parallel-size 4 but serve\.gpus is 2"),
    ({"model": "m", "gpus": 1, "args": ["--tensor-parallel-size=2"]}, r"--tensor-parallel-size 2 but serve\.gpus is 1"),
    ({"args": []}, r"evaluate\.llm_judge\.serve.*'model' is a required property"),
    ({"model": "m", "args": ["--api-key", "k", "--port=80"]}, r"serve\.args': --api-key, --port are set by the judge job"),
])
def test_bad_serve_config_names_the_key(serve_cfg, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, {"evaluate": {"judge": "llm", "llm_judge": {"serve": serve_cfg}}})
    with pytest.raises(ConfigError, match=r"reward\.source: judge"):
        load_config(None, {"reward": {"source": "judge"}, "evaluate": {"judge": "llm", "llm_judge": {"serve": {"model": "m"}}}})


# -- the judge stage, as Snakemake runs it ---------------------------------------------------------
@pytest.fixture(scope="module")
def records(micro_run, tmp_path_factory) -> Path:
    """The micro SFT policy's evaluation records (4 problems, one draw each): the judge job's input."""
    from rloo_workflow.stages import evaluate

    cfg = load_config(ROOT / "config" / "micro.yaml", {"tracking": {"enabled": False},
                                                       "evaluate": {"examples": 4, "samples_per_prompt": 1}})
    out = tmp_path_factory.mktemp("judge_records") / "sft.jsonl"
    evaluate.run(cfg, micro_run["data"], micro_run["sft"], "sft", micro_run["sft"], out)
    return out


def _judge(records, tmp_path, *fake_flags: str, timeout_s: float = 60) -> tuple[list[str], Path]:
    """`rloo judge` of the micro SFT policy's records against themselves, the fake server as the served judge."""
    judge_log = tmp_path / "logs" / "judge_rloo.judge.log"
    command = json.dumps([sys.executable, str(FAKE), "{port}", "--child", *fake_flags])
    argv = [sys.executable, "-m", "rloo_workflow.cli", "judge", "--config", str(ROOT / "config" / "micro.yaml"),
            "--set", "tracking.enabled=false", "--set", "evaluate.judge=llm",
            "--set", "evaluate.llm_judge.serve.model=fake-judge", "--set", f"evaluate.llm_judge.serve.command={command}",
            "--set", f"evaluate.llm_judge.serve.startup_timeout_s={timeout_s}",
            "--policy", f"rloo={records}", "--sft", str(records), "--out", str(tmp_path / "judged.json"),
            "--judge-log", str(judge_log)]
    return argv, judge_log


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": pythonpath(ROOT), "HF_HUB_OFFLINE": "1"}


@pytest.mark.slow
def test_the_judge_job_judges_with_the_served_model_and_stops_it(micro_run, records, tmp_path):
    from rloo.eval.records import read
    from rloo_workflow.stages import report

    argv, judge_log = _judge(records, tmp_path)
    res = subprocess.run(argv, capture_output=True, text=True, env=_env(), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    # the job's log says which server it started (the vLLM tests find its process group by this line)
    assert re.search(r"judge server for fake-judge started \(pid \d+", res.stderr), res.stderr[-3000:]
    judged = json.loads((tmp_path / "judged.json").read_text())
    # the report takes the judge's verdicts as they are
    cfg = load_config(ROOT / "config" / "micro.yaml", {"evaluate": {"judge": "llm"}})
    evaluations = {name: read(name, records) for name in ("base", "sft", "rloo")}
    result = report.run(cfg, evaluations, "rloo", micro_run["sft"], micro_run["data"] / "manifest.json",
                        tmp_path / "gsm8k_rloo.json", judged=tmp_path / "judged.json")
    assert (result["judge"], result["win_rate"]) == (judged["judge"], judged["win_rates"]["rloo"])
    # the fake judge answers "A" in both orders: every pair a tie, no call failed
    assert result["win_rate"]["value"] == 0.5 and result["win_rate"]["ties"] == 4
    assert result["judge"]["served"] == {"model": "fake-judge", "args": [], "gpus": 1}
    assert result["judge"]["failed_calls"] == 0 and "base_url" not in result["judge"]
    # beside the verifier on the same 4 pairs: a tie agrees only where the verifier ties too
    agree = result["win_rate"]["agreement_with_verifier"]
    assert agree["all_pairs_judged"] == 4 and agree["judged"] == agree["decided_pairs"], agree
    assert agree["agree"] == 0 and agree["all_pairs_agree"] == 4 - agree["decided_pairs"], agree
    pids = pids_in_log(judge_log)
    assert group_members(pids["server"]) == [] and not Path(f"/proc/{pids['child']}").exists()

    # The comparison stage judges estimators against RLOO with the same served judge (its own server).
    cfg = load_config(ROOT / "config" / "micro.yaml", {"evaluate": {"judge": "llm", "llm_judge": {"serve": {
        "model": "fake-judge", "command": [sys.executable, str(FAKE), "{port}"]}}}})
    out = tmp_path / "gsm8k_rloo.json"
    table = comparison.run({"rloo": out, "grpo": out}, tmp_path / "comparison.json", tmp_path / "comparison.png", cfg=cfg,
                        judge_log=tmp_path / "comparison.judge.log", record_files={"rloo": records, "grpo": records})
    assert table["estimators"]["grpo"]["win_rate_vs_rloo"]["ties"] == 4
    assert table["judge_vs_baseline"]["failed_calls"] == 0
    assert group_members(pids_in_log(tmp_path / "comparison.judge.log")["server"]) == []


@pytest.mark.slow
def test_sigterm_to_the_judge_stage_stops_the_served_judge(records, tmp_path):
    seen = tmp_path / "seen"
    argv, judge_log = _judge(records, tmp_path, "--delay", "2", "--seen", str(seen))
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        wait_for(seen.exists, timeout=240)  # the stage is judging: inside the served block
        pids = pids_in_log(judge_log)
        assert len(group_members(pids["server"])) == 2
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err[-3000:]
    assert "SIGTERM received: stopping the judge server" in err
    assert group_members(pids["server"]) == [] and not Path(f"/proc/{pids['child']}").exists()
    assert not (tmp_path / "judged.json").exists()


@pytest.mark.slow
def test_a_judge_that_cannot_start_fails_the_stage_with_one_line(records, tmp_path):
    argv, judge_log = _judge(records, tmp_path, "--no-such-flag")
    res = subprocess.run(argv, capture_output=True, text=True, env=_env(), timeout=300)
    assert res.returncode == 2
    last = res.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"rloo judge: error: the judge server for fake-judge exited with code 2 after \d+ s, "
                        rf"before answering /health; its log: {re.escape(str(judge_log))}", last), res.stderr[-2000:]
    assert "unrecognized arguments: --no-such-flag" in res.stderr  # the server's own words, from its log
    assert not (tmp_path / "judged.json").exists()


def test_a_judge_whose_replies_never_parse_fails_like_one_that_is_down(tmp_path):
    """A judge that answers every call with no verdict in it is counted against
    evaluate.llm_judge.max_failed_share with the failed calls, not passed with a null win rate."""
    from rloo.reward.judges import JudgeUnavailable, LLMJudge, win_rate

    port = free_port()
    with serve(fake(port, "--reply", "I cannot decide."), tmp_path / "j.log", what="fake", port=port) as server:
        judge = LLMJudge(server.base_url, "judge", "NO_SUCH_KEY_ENV", 10.0, 0, max_failed_share=0.01,
                         api_key="EMPTY")
        wr = win_rate(judge, ["q1", "q2"], ["1", "2"], ["#### 1", "#### 3"], ["#### 2", "#### 2"])
        assert wr.invalid == 2 and judge.calls == 4 and judge.failed == 0 and judge.unparsed == 4
        with pytest.raises(JudgeUnavailable, match=r"0 of 4 LLM-judge calls .* failed and 4 answered without a verdict"):
            judge.check()
    # the same server answering a verdict passes, and records that none went unparsed
    port = free_port()
    with serve(fake(port), tmp_path / "k.log", what="fake", port=port) as server:
        judge = LLMJudge(server.base_url, "judge", "NO_SUCH_KEY_ENV", 10.0, 0, max_failed_share=0.01,
                         api_key="EMPTY")
        win_rate(judge, ["q1"], ["1"], ["#### 1"], ["#### 2"])
        assert judge.check() == {"calls": 2, "failed_calls": 0, "failed_share": 0.0, "unparsed_replies": 0,
                                 "retries": 0}


def _default_judge(base_url: str):
    """The LLM judge of the schema's defaults (timeout_s 60, max_retries 3, max_failed_share 0.01) at `base_url`."""
    from rloo.reward.judges import build_judge

    return build_judge(load_config(None, {"evaluate": {"judge": "llm", "llm_judge": {"base_url": base_url}}}))


@pytest.mark.slow
def test_a_judge_and_a_reward_server_that_accept_and_never_reply_each_fail_within_three_minutes_at_default_settings():
    """A real socket that accepts every connection and never answers (a hung server), one as the LLM judge
    and one as the reward server, at the schema's defaults. The judge: the stage's judging stops with one line
    after the first call's two tries (about 2 x 60 s), where it used to wait 60 s x 4 tries for each of the
    first 8 calls (32 minutes). The reward client: the first request's two tries, about 2 x 60 s, then one
    line; it used to take three tries and the waits between them (3:01). The two wait at once, each in a
    thread of its own against a socket of its own (two three-minute tests held a worker each: CI's time)."""
    import threading

    from test_reward_server import _http, _timed_failure

    from rloo.reward.judges import JudgeUnavailable, win_rate

    outcome: dict = {}
    with silent_server() as (port, held), silent_server() as (reward_port, reward_held):
        url = f"http://127.0.0.1:{port}/v1"
        judge = _default_judge(url)

        def judging() -> None:
            t0 = time.monotonic()
            try:
                win_rate(judge, ["q"] * 8, ["1"] * 8, ["#### 1"] * 8, ["#### 2"] * 8)
            except JudgeUnavailable as e:
                outcome["error"] = str(e)
            outcome["seconds"] = time.monotonic() - t0

        worker = threading.Thread(target=judging, daemon=True)
        deadline = time.monotonic() + 180
        worker.start()
        reward_url = f"http://127.0.0.1:{reward_port}/score"
        reward_error, reward_seconds = _timed_failure(_http(reward_url), 180)  # meanwhile, in its own thread
        worker.join(timeout=max(0.0, deadline - time.monotonic()))
        connections, reward_connections = len(held), len(reward_held)
    assert not worker.is_alive(), "the judge was still waiting after 3 minutes"
    print(f"a judge that never replies: failed after {outcome['seconds']:.0f} s")
    print(f"a reward server that never replies: failed after {reward_seconds:.0f} s")
    assert outcome["error"] == (f"the LLM judge at {url} gave no reply within evaluate.llm_judge.timeout_s=60 s to its "
                                "first call (2 tries): is it up and serving 'judge'? For a judge that is only slow "
                                "raise timeout_s; or set evaluate.judge: verifier")
    assert 110 < outcome["seconds"] < 180 and connections == 2 and judge.calls == 1
    assert reward_error == (f"the reward server at {reward_url} did not answer its first request (no reply within "
                            "reward.http.timeout_s=60 s, 2 tries): is it up? For a server that is only slow raise "
                            "reward.http.timeout_s; the run stops (its last checkpoint is kept; rerun once the server "
                            "answers)")
    assert 110 < reward_seconds < 180 and reward_connections == 2


@pytest.mark.slow
def test_a_slow_judge_that_answers_is_not_failed(tmp_path):
    """A judge that takes 11 s (longer than the connect timeout) to answer each call, at the default
    settings: every call counts, none fails."""
    from rloo.reward.judges import LLMJudge, win_rate

    port = free_port()
    with serve(fake(port, "--delay", "11"), tmp_path / "j.log", what="fake", port=port) as server:
        judge = _default_judge(server.base_url)
        assert judge.CONNECT_TIMEOUT_S < 11 and isinstance(judge, LLMJudge)
        wr = win_rate(judge, ["q1"], ["1"], ["#### 1"], ["#### 2"])
        assert judge.check() == {"calls": 2, "failed_calls": 0, "failed_share": 0.0, "unparsed_replies": 0,
                                 "retries": 0}
        assert wr.invalid == 0 and wr.ties == 1
