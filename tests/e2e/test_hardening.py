"""Hardening: no secret in any file or command line, config values that mean what they say, bad input
files and a dead judge as one line and exit 2, Ctrl-C as a checkpoint and exit 130, mistyped targets."""

from __future__ import annotations

import http.server
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from workflow_helpers import CONFIGFILES, make_copy, snakemake

from rloo.data import synthetic
from rloo.model import checkpoint
from rloo_workflow.config import ConfigError, load_config, parse_set

ROOT = Path(__file__).resolve().parents[2]
MICRO = str(ROOT / "config" / "micro.yaml")
SECRET = "S3cr3t-pw-7f2a9c"


def _rloo(*args: str, cwd: Path, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rloo_workflow.cli", *args], cwd=cwd, env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def _last_line(res: subprocess.CompletedProcess) -> str:
    return res.stderr.strip().splitlines()[-1]


def _files_holding(root: Path, secret: str) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- secrets ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("key", "url"), [
    ("evaluate.llm_judge.base_url", f"http://user:{SECRET}@judge.example/v1"),
    ("evaluate.llm_judge.base_url", f"https://judge.example/v1?api_key={SECRET}"),
    ("tracking.tracking_uri", f"https://rloo:{SECRET}@mlflow.example"),
    ("reward.http.url", f"http://scorer:{SECRET}@scorer.example/score"),
    ("reward.http.url", f"https://scorer.example/score?token={SECRET}"),
    # a user part without a password: how a token is often passed (the second probe's, issue 61)
    ("reward.http.url", f"http://{SECRET}@127.0.0.1:18100/score"),
    ("evaluate.llm_judge.base_url", f"http://{SECRET}@judge.example/v1"),
    ("tracking.tracking_uri", f"https://{SECRET}@mlflow.example"),
    # short names of secrets, as a word of the parameter's name; long ones within it; the fragment too
    ("reward.http.url", f"http://127.0.0.1:18100/score?sig={SECRET}"),
    ("reward.http.url", f"https://scorer.example/score?model=m&apiSig={SECRET}"),
    ("reward.http.url", f"https://scorer.example/api/score?code={SECRET}"),
    ("reward.http.url", f"https://scorer.example/score?pwd={SECRET}"),
    ("reward.http.url", f"https://scorer.example/score?auth={SECRET}"),
    ("reward.http.url", f"https://scorer.example/score?access_token={SECRET}"),
    ("evaluate.llm_judge.base_url", f"https://judge.example/v1?X-Amz-Signature={SECRET}"),
    ("evaluate.llm_judge.base_url", f"https://judge.example/v1#access_token={SECRET}"),
])
def test_credentials_in_a_url_are_refused_without_repeating_them(key, url):
    with pytest.raises(ConfigError) as info:
        load_config(None, parse_set([f"{key}={url}"]))
    message = str(info.value)
    assert key in message and SECRET not in message
    assert {"evaluate": "evaluate.llm_judge.api_key_env", "tracking": "MLFLOW_TRACKING_PASSWORD",
            "reward": "reward.http.api_key_env"}[key.split(".")[0]] in message
    # A URL without credentials is fine, whose parameters' names only contain a short one's letters too.
    assert load_config(None, parse_set([f"{key}=https://judge.example:8000/v1"]))
    assert load_config(None, parse_set([f"{key}=https://judge.example:8000/v1?design=a&zipcode=1&passage=2&codec=3"]))


@pytest.mark.slow
def test_a_token_in_a_config_file_is_refused_before_anything_is_written(tmp_path):
    """The second probe's forms (a token as the URL's user part, a `sig` parameter) given in a config file,
    to Snakemake and to a stage, MLflow tracking on: refused at validation, before any file is written,
    so the token is nowhere in the work tree (.snakemake/, data/, results/, logs/, mlruns/, mlflow.db)."""
    token = "TOKEN789-9d3e51"
    copy = make_copy(tmp_path / "wf")
    secret = tmp_path / "secret.yaml"  # the user's own file, outside the work tree
    secret.write_text(f"tracking: {{enabled: true}}\nreward: {{source: http, http: {{url: 'http://{token}@127.0.0.1:18100/score'}}}}\n"
                      f"evaluate: {{llm_judge: {{base_url: 'http://127.0.0.1:8000/v1?sig={token}'}}}}\n")
    res = snakemake(copy, "--cores", "1", "--configfile", "config/micro.yaml", str(secret), check=False)
    out = res.stdout + res.stderr
    assert res.returncode != 0 and token not in out, out[-3000:]
    assert "key 'reward.http.url'" in out and "a user part" in out and "reward.http.api_key_env" in out, out[-3000:]
    assert "key 'evaluate.llm_judge.base_url'" in out and "(sig)" in out and "api_key_env (now OPENAI_API_KEY)" in out
    stage = _rloo("prepare", "-c", str(ROOT / "config" / "config.yaml"), "-c", MICRO, "-c", str(secret), cwd=copy)
    assert stage.returncode == 2 and token not in stage.stdout + stage.stderr, stage.stderr[-2000:]
    assert "key 'reward.http.url'" in _last_line(stage) or "key 'reward.http.url'" in stage.stderr
    assert not _files_holding(copy, token)
    assert not (copy / "data").exists() and not (copy / "results").exists() and not (copy / "mlflow.db").exists()


@pytest.fixture(scope="module")
def workflow(tmp_path_factory) -> Path:
    return make_copy(tmp_path_factory.mktemp("hardening") / "wf")


@pytest.mark.slow
def test_a_credential_given_to_snakemake_stops_it_and_reaches_no_file(workflow):
    # the judge's URL and a reward server's, in one run: each refused, each named; and a key pasted where
    # the name of its variable belongs (issue 71), refused without being repeated
    pasted = "sk-SECRET5abc"
    res = snakemake(workflow, "--cores", "1", *CONFIGFILES, "--config",
                    f"evaluate={{llm_judge: {{base_url: 'http://judge:{SECRET}@judge.example/v1', "
                    f"api_key_env: '{pasted}'}}}}",
                    f"reward={{source: http, http: {{url: 'http://scorer:{SECRET}@scorer.example/score'}}}}", check=False)
    out = res.stdout + res.stderr
    for key in ("evaluate.llm_judge.base_url", "reward.http.url"):
        assert res.returncode != 0 and f"key '{key}'" in out and f"{key.rsplit('.', 1)[0]}.api_key_env" in out, out[-3000:]
    assert "key 'evaluate.llm_judge.api_key_env': must name an environment variable" in out, out[-3000:]
    assert SECRET not in out and pasted not in out
    for secret in (SECRET, pasted):
        assert not _files_holding(workflow, secret)  # .snakemake/ (logs, metadata), data/, results/, logs/


class _Judge(http.server.BaseHTTPRequestHandler):
    """An OpenAI-compatible chat endpoint that always prefers answer A and records the keys it got."""

    seen: list = []  # noqa: RUF012 - read by the test

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        type(self).seen.append(self.headers.get("Authorization"))
        body = json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": "judge",
                           "choices": [{"index": 0, "finish_reason": "stop",
                                        "message": {"role": "assistant", "content": "A"}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def judge_url():
    pytest.importorskip("openai")
    _Judge.seen = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def records(micro_run, tmp_path_factory) -> Path:
    """The micro SFT policy's evaluation records (6 problems): what the judge job reads."""
    from rloo_workflow.stages import evaluate

    cfg = load_config(MICRO, {"tracking": {"enabled": False}, "evaluate": {"examples": 6}})
    out = tmp_path_factory.mktemp("hardening_records") / "sft.jsonl"
    evaluate.run(cfg, micro_run["data"], micro_run["sft"], "sft", micro_run["sft"], out)
    return out


def _judge_args(records: Path, out: Path, *sets: str) -> list[str]:
    """`rloo judge` of the micro SFT policy's records against themselves, by the LLM judge."""
    args = ["judge", "-c", MICRO, "--set", "evaluate.judge=llm",
            "--set", "evaluate.llm_judge.api_key_env=RLOO_TEST_JUDGE_KEY",
            "--policy", f"rloo={records}", "--sft", str(records), "--out", str(out)]
    for s in sets:
        args += ["--set", s]
    return args


def _cmdlines_holding(secret: str) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if secret.encode() in cmdline.read_bytes():
                found.append(str(cmdline))
        except OSError:
            pass  # the process ended meanwhile
    return found


@pytest.mark.slow
def test_the_judge_key_reaches_the_judge_and_no_file_or_command_line(records, tmp_path, judge_url):
    """Tracking on (a real MLflow store in tmp_path): every file the stage writes is searched."""
    env = {**os.environ, "RLOO_TEST_JUDGE_KEY": SECRET, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    cmd = [sys.executable, "-m", "rloo_workflow.cli",
           *_judge_args(records, tmp_path / "results.json", f"evaluate.llm_judge.base_url={judge_url}")]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    on_command_lines = []
    while proc.poll() is None:
        on_command_lines += _cmdlines_holding(SECRET)
        time.sleep(0.05)
    out, err = proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    assert _Judge.seen and set(_Judge.seen) == {f"Bearer {SECRET}"}  # the judge got the key...
    assert not on_command_lines  # ...no command line held it...
    assert SECRET not in out + err
    assert (tmp_path / "mlflow.db").exists()
    assert not _files_holding(tmp_path, SECRET)  # ...nor any file: results, plots, the MLflow store
    judge = json.loads((tmp_path / "results.json").read_text())["judge"]
    assert judge["calls"] == len(_Judge.seen) and judge["failed_calls"] == 0


# -- a judge that does not answer --------------------------------------------------------------------


@pytest.mark.slow
def test_an_unreachable_judge_fails_the_stage_in_one_line(records, tmp_path):
    pytest.importorskip("openai")
    closed = f"http://127.0.0.1:{_free_port()}/v1"
    sets = [f"evaluate.llm_judge.base_url={closed}", "evaluate.llm_judge.max_retries=0", "tracking.enabled=false"]
    res = _rloo(*_judge_args(records, tmp_path / "results.json", *sets), cwd=tmp_path)
    assert res.returncode == 2, res.stderr[-3000:]
    last = _last_line(res)
    assert last.startswith("rloo judge: error:") and closed in last and "evaluate.judge: verifier" in last
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "results.json").exists()  # no win rate of nothing
    # When failures are allowed, the stage finishes and the results say how many calls failed.
    res = _rloo(*_judge_args(records, tmp_path / "results.json", *sets, "evaluate.llm_judge.max_failed_share=1"),
                cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["judge"]["failed_share"] == 1.0 and result["judge"]["calls"] == result["judge"]["failed_calls"] > 0
    assert result["win_rates"]["rloo"]["invalid"] == 6


# -- config values ------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["nan", ".nan", "inf", "-.inf", "1e999"])
def test_non_finite_numbers_are_refused(value, tmp_path):
    with pytest.raises(ConfigError, match=r"key 'rloo\.beta': must be a finite number"):
        load_config(None, parse_set([f"rloo.beta={value}"]))
    f = tmp_path / "c.yaml"
    f.write_text(f"rloo:\n  beta: {value}\n")
    with pytest.raises(ConfigError, match=r"rloo\.beta"):
        load_config(f)


def test_numbers_written_as_strings_are_numbers(tmp_path):
    """YAML 1.1 reads 5e-5 as a string; Snakemake's --config passes nested values as strings."""
    f = tmp_path / "c.yaml"
    f.write_text("rloo:\n  lr: 5e-5\n  k: '8'\ntracking:\n  enabled: 'false'\n")
    cfg = load_config(f)
    assert cfg["rloo"]["lr"] == 5e-5 and cfg["rloo"]["k"] == 8 and cfg["tracking"]["enabled"] is False
    cfg = load_config(None, {"rloo": {"beta": "0.1", "steps": "12"}})
    assert cfg["rloo"]["beta"] == 0.1 and cfg["rloo"]["steps"] == 12
    with pytest.raises(ConfigError, match=r"rloo\.beta"):
        load_config(None, {"rloo": {"beta": "a lot"}})
    with pytest.raises(ConfigError, match=r"rloo\.k"):
        load_config(None, {"rloo": {"k": "4.5"}})


@pytest.mark.slow
def test_snakemake_config_values_are_typed_and_checked_before_any_job(workflow):
    res = snakemake(workflow, "-n", "--cores", "1", *CONFIGFILES, "--config", "rloo={beta: 0.1, lr: 5e-5}")
    assert "rloo" in res.stdout
    res = snakemake(workflow, "-n", "--cores", "1", *CONFIGFILES, "--config", "rloo={k: 1}", check=False)
    assert res.returncode != 0 and "key 'rloo.k'" in res.stdout + res.stderr
    # sizes that no run could hold, refused by the same validation before any job (a CPU run: the host
    # memory of this machine; a batch larger than the data; a completion longer than the context)
    for setting, key in (("rloo={k: 100000}", "rloo.k"), ("sft={batch_size: 100000000}", "sft.batch_size"),
                         ("rloo={max_new_tokens: 1000000000}", "rloo.max_new_tokens")):
        res = snakemake(workflow, "-n", "--cores", "1", *CONFIGFILES, "--config", setting, "model={device: cpu}",
                        check=False)
        out = res.stdout + res.stderr
        assert res.returncode != 0 and f"key '{key}'" in out and "Job stats" not in out, out[-3000:]
    # a key given with --config that breaks a rule of another key is the one named, with that other key
    for size, other in (("100000000", "reward.micro_batch_tokens=32768"), ("16", "sft.eval_max_new_tokens=24")):
        res = snakemake(workflow, "-n", "--cores", "1", *CONFIGFILES, "--config",
                        f"model={{device: cpu, max_length: {size}}}", check=False)
        out = res.stdout + res.stderr
        assert res.returncode != 0 and "key 'model.max_length': " in out and other in out, out[-3000:]


def test_an_overlay_read_alone_says_what_it_misses():
    res = _rloo("validate-config", "-c", MICRO, cwd=ROOT)
    assert res.returncode == 0 and "warning" in res.stderr and "reward.source" in res.stderr
    # An overlay that names the file it extends is read on top of it, with no warning.
    res = _rloo("validate-config", "-c", str(ROOT / "config" / "reward_model.yaml"), cwd=ROOT)
    cfg, base = json.loads(res.stdout), load_config(ROOT / "config" / "config.yaml")
    assert "warning" not in res.stderr
    assert cfg["model"] == base["model"] and cfg["reward"]["source"] == "model"


@pytest.mark.slow
def test_a_mistyped_target_names_the_estimators(workflow):
    res = snakemake(workflow, "results/gsm8k_rlooo.json", "-n", "--cores", "1", *CONFIGFILES, check=False)
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "no estimator named 'rlooo'" in out and "grpo, grpo_std" in out


# -- bad input files ------------------------------------------------------------------------------------


def _records(n: int, seed: int = 3) -> list[str]:
    train, _, _ = synthetic.generate(n, 1, seed=seed)
    return [json.dumps({"question": r["question"], "answer": r["answer"]}) for r in train]


def _prepare_jsonl(tmp_path: Path, train: bytes, *sets: str) -> subprocess.CompletedProcess:
    (tmp_path / "train.jsonl").write_bytes(train)
    (tmp_path / "test.jsonl").write_text("\n".join(_records(8, seed=4)) + "\n")
    return _rloo("prepare", "-c", MICRO, "--set", "data.source=jsonl", "--set", f"data.train_file={tmp_path}/train.jsonl",
                 "--set", f"data.test_file={tmp_path}/test.jsonl", "--set", "tracking.enabled=false",
                 *[x for s in sets for x in ("--set", s)], "--out", str(tmp_path / "data"), cwd=tmp_path)


@pytest.mark.parametrize(("content", "expected"), [
    (b"", "train.jsonl: no usable GSM8K records: the file holds no records"),
    ("\n".join(_records(30)).encode() + b"\n{\"question\": \"caf\xe9?\", \"answer\": \"#### 1\"}\n",
     "train.jsonl:31: not UTF-8 text (byte 0xe9 at column 18)"),
    ("\n".join(_records(30)).encode() + b'\n{"question": "Half of 3?", "answer": "3/2\\n#### 3/2"}\n',
     "train.jsonl:31: answer has no parseable final '#### N'"),
])
def test_a_bad_data_file_is_one_line_and_exit_2(tmp_path, content, expected):
    res = _prepare_jsonl(tmp_path, content)
    assert res.returncode == 2
    assert _last_line(res).startswith("rloo prepare: error:") and expected in _last_line(res), res.stderr[-2000:]
    assert "Traceback" not in res.stderr and not (tmp_path / "data").exists()
    debug = _rloo("prepare", "--debug", "-c", MICRO, "--set", "data.source=jsonl", "--set",
                  f"data.train_file={tmp_path}/train.jsonl", "--set", f"data.test_file={tmp_path}/test.jsonl",
                  "--set", "tracking.enabled=false", "--out", str(tmp_path / "data"), cwd=tmp_path)
    assert debug.returncode == 2 and "Traceback" in debug.stderr


def test_skipped_records_are_counted_and_shown(tmp_path):
    good = "\n".join(_records(30)).encode()
    res = _prepare_jsonl(tmp_path, good + b"\n\xff\xfe\n" + good[:20] + b"\n", "data.on_bad_record=skip")
    assert res.returncode == 0, res.stderr[-2000:]
    manifest = json.loads((tmp_path / "data" / "manifest.json").read_text())
    assert manifest["skipped"]["train"] == 2
    summary = _rloo("summary", str(tmp_path / "data" / "manifest.json"), cwd=tmp_path)
    assert "!! prepare: skipped 2 bad records" in summary.stderr and "not UTF-8" in summary.stderr


def _with_oversized(at: tuple[int, ...], chars: int = 5_000_000) -> bytes:
    """30 good records with a record of `chars` characters (a 5 MB line) at each 1-based line of `at`."""
    lines = _records(30)
    for n in sorted(at):
        lines.insert(n - 1, json.dumps({"question": "Why? " * (chars // 5), "answer": "1 + 1 = 2\n#### 2"}))
    return ("\n".join(lines) + "\n").encode()


def test_an_oversized_record_is_refused_at_prepare_naming_its_line(tmp_path):
    res = _prepare_jsonl(tmp_path, _with_oversized((4, 20)))
    assert res.returncode == 2, res.stderr[-2000:]
    line = _last_line(res)
    assert line.startswith("rloo prepare: error: ") and "train.jsonl:4: a record of 5,000,0" in line, line
    assert "over data.max_record_chars=20,000; 2 records of the split are over it" in line and "on_oversized" in line
    assert "Traceback" not in res.stderr and not (tmp_path / "data").exists()
    # a bound of the user's own: a 30,000-character record passes at 40,000, not at the default
    assert _prepare_jsonl(tmp_path, _with_oversized((4,), 30_000), "data.max_record_chars=40000").returncode == 0


def test_oversized_records_dropped_are_counted_in_the_log_manifest_and_summary(tmp_path):
    res = _prepare_jsonl(tmp_path, _with_oversized((4, 20)), "data.on_oversized=drop")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "!!! train: dropped 2 records over data.max_record_chars=20000 (data.on_oversized=drop)" in res.stderr
    manifest = json.loads((tmp_path / "data" / "manifest.json").read_text())
    assert manifest["oversized"] == {"train": 2, "test": 0}
    assert manifest["counts"]["train"] + manifest["counts"]["val"] == 30  # the 30 good ones, none dropped
    held = [len(line) for name in ("train", "val") for line in (tmp_path / "data" / f"{name}.jsonl").read_text().splitlines()]
    assert max(held) < 20_000
    summary = _rloo("summary", str(tmp_path / "data" / "manifest.json"), cwd=tmp_path)
    assert "!! prepare: dropped 2 records over data.max_record_chars (data.on_oversized: drop; train 2)" in summary.stderr


@pytest.mark.slow
def test_sft_stops_when_the_context_would_drop_the_data(micro_run, tmp_path):
    res = _rloo("sft", "-c", MICRO, "--set", "model.max_length=40", "--set", "tracking.enabled=false",
                "--data", str(micro_run["data"]), "--base", str(micro_run["base_model"]), "--out", str(tmp_path / "sft"),
                "--work", str(tmp_path / "work"), cwd=tmp_path)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "longer than model.max_length=40" in _last_line(res) and "sft.max_dropped_share" in _last_line(res)


# -- an optional package missing ---------------------------------------------------------------------


def _without_vllm() -> None:
    from rloo import extras

    if extras.installed("vllm"):
        pytest.skip("vLLM is installed here (.venv-vllm): the missing package is the case under test")


def test_a_backend_whose_package_is_missing_stops_the_rloo_job_at_its_start_in_one_line(micro_run, tmp_path):
    """Issue 71: `rollout.backend: vllm` without vLLM was a ModuleNotFoundError after the model loaded. The
    rloo job as Snakemake runs it (its log a file): one line naming the extra, no traceback, even in the
    log, and nothing written."""
    _without_vllm()
    log, out, work = tmp_path / "logs" / "rloo_rloo.log", tmp_path / "rloo", tmp_path / "work"
    res = _rloo("train", "-c", MICRO, "--set", "rollout.backend=vllm", "--set", "tracking.enabled=false",
                "--data", str(micro_run["data"]), "--policy", str(micro_run["sft"]), "--out", str(out),
                "--work", str(work), "--log", str(log), cwd=tmp_path)
    assert res.returncode == 2, res.stderr[-3000:]
    text = log.read_text()
    lines = [line for line in text.splitlines() if not line.startswith("rloo: warning: ")]  # -c micro.yaml alone
    assert len(lines) == 1 and lines[0].startswith("rloo train: error: rollout.backend: vllm needs the 'vllm' "
                                                   "package"), text
    assert "pip install 'rloo[vllm]'" in lines[0] and "Traceback" not in text + res.stderr
    assert res.stderr.strip().endswith(lines[0]), res.stderr  # the terminal gets it from the log's end
    assert not out.exists() and not work.exists()


def test_validate_config_warns_of_a_package_this_machine_lacks(capsys):
    """A warning, not a refusal: a cluster's jobs may have the package the submitting machine lacks."""
    from rloo_workflow import cli

    _without_vllm()
    assert cli.main(["validate-config", "-c", MICRO, "--set", "rollout.backend=vllm"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["rollout"]["backend"] == "vllm"
    warnings = [line for line in err.splitlines() if line.startswith("rloo validate-config: warning: ")]
    assert len(warnings) == 1 and "'vllm'" in warnings[0] and "pip install 'rloo[vllm]'" in warnings[0], err
    assert cli.main(["validate-config", "-c", MICRO]) == 0
    assert "validate-config: warning" not in capsys.readouterr().err  # the hf backend needs nothing more


def test_a_missing_config_file_stops_before_anything_is_written_naming_the_file(tmp_path):
    """Issue 71: `rloo` says it in one line, before any work; so does Snakemake, before any job and before
    its own records. Snakemake 9.27.1 opens each --configfile outside the `try` that says so in one line
    (docs/upstream/snakemake-configfile-not-found.patch), before it reads the Snakefile: the profiles' logger
    plugin (snakemake_logger_plugin_rloo), which Snakemake imports before, gives the file to that `try`,
    and prints Snakemake's WorkflowError on one line (docs/failure-modes.md)."""
    copy = make_copy(tmp_path / "wf")
    for verb in ("validate-config", "prepare"):
        res = _rloo(verb, "-c", "config/micro.yaml", "-c", "config/nope.yaml", cwd=copy)
        assert res.returncode == 2 and res.stderr.strip() == "rloo: config/nope.yaml: config file not found", res.stderr
    res = snakemake(copy, "--cores", "1", *CONFIGFILES, "config/nope.yaml", check=False)
    out = (res.stdout + res.stderr).strip()
    lines = out.splitlines()
    assert res.returncode != 0 and "config/nope.yaml" in lines[-1] and "not found" in lines[-1], out[-3000:]
    # that one line, no traceback: above it at most Snakemake's notice of the profile it read first
    assert lines[:-1] == [] or (len(lines) == 2 and "profiles/default" in lines[0]), out[-3000:]
    assert not any((copy / name).exists() for name in (".snakemake", "data", "results", "logs", ".rloo")), out[-3000:]
    # the quick start's command checks its config files itself, in one line, before it installs anything
    res = subprocess.run(["bash", str(ROOT / "scripts" / "pipeline.sh"), "--configfile", "config/micro.yaml",
                          "config/nope.yaml", "--dry-run"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and not res.stdout, res.stdout[-2000:]
    assert res.stderr.strip() == "pipeline.sh: error: config file config/nope.yaml: no such file", res.stderr


# -- Ctrl-C ------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_ctrl_c_checkpoints_exits_130_and_ends_the_mlflow_run(micro_run, micro_reward, tmp_path):
    import mlflow

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cmd = [sys.executable, "-m", "rloo_workflow.cli", "train", "-c", MICRO, "--set", "reward.source=model",
           "--reward-model", str(micro_reward), "--set", "rloo.steps=400", "--set", "rloo.checkpoint_every=3",
           "--data", str(micro_run["data"]), "--policy", str(micro_run["sft"]),
           "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env={**os.environ, "MLFLOW_TRACKING_URI": uri},
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while (first := checkpoint.latest(tmp_path / "work" / "checkpoints")) is None:
        assert proc.poll() is None and time.time() < deadline, "no checkpoint appeared"
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "SIGINT received" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
    step = int(checkpoint.latest(tmp_path / "work" / "checkpoints").name.split("_")[1])
    assert int(first.name.split("_")[1]) <= step < 400
    client = mlflow.MlflowClient(uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    assert [r.info.status for r in client.search_runs(experiments)] == ["KILLED"]
    # The rerun resumes, and its run holds the whole metric history (the steps before the interrupt too).
    cmd[cmd.index("rloo.steps=400")] = f"rloo.steps={step + 2}"
    done = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, "MLFLOW_TRACKING_URI": uri}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = next(r for r in client.search_runs(experiments) if r.info.status == "FINISHED")
    assert resumed.data.tags["rloo.resumed_from_step"] == str(step)
    history = client.get_metric_history(resumed.info.run_id, "train/zero_adv_frac")
    assert sorted(m.step for m in history) == list(range(step + 2))


# -- the terminal under Snakemake ---------------------------------------------------------------------


@pytest.mark.slow
def test_a_stage_logging_to_a_file_reports_progress_in_the_terminal(micro_run, tmp_path):
    """A Snakemake job's stderr is its log file and its stdout the terminal: both get the plain progress
    lines (rloo/progress.py), at most one every progress_every_s, and neither a progress bar's redraws."""
    import pty

    master, slave = pty.openpty()
    with open(tmp_path / "sft.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rloo_workflow.cli", "sft", "-c", MICRO, "--set", "tracking.enabled=false",
             "--set", "sft.steps=12", "--set", "progress_every_s=0.05", "--data", str(micro_run["data"]), "--base", str(micro_run["base_model"]),
             "--out", str(tmp_path / "sft"),
             "--work", str(tmp_path / "work")], cwd=tmp_path, stdout=slave, stderr=log)
        os.close(slave)
        out = b""
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
        proc.wait(timeout=300)
    os.close(master)
    assert proc.returncode == 0, (tmp_path / "sft.log").read_text()[-2000:]
    terminal = out.decode().replace("\r\n", "\n")
    assert re.search(r"^sft: step 12/12 \(100%\) · loss [\d.]+ · .* · took \d+ s$", terminal, re.M), terminal
    log = (tmp_path / "sft.log").read_text()
    assert "\r" not in terminal and "\r" not in log
    assert "INFO rloo.progress: sft: step 12/12 (100%)" in log, log[-3000:]


def test_the_mlflow_experiment_opens_on_its_training_runs(tmp_path):
    """MLflow 3's UI shows an experiment without a kind as a GenAI app (traces); ours is model training."""
    import mlflow

    from rloo_workflow import tracking

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    experiment = mlflow.MlflowClient(uri).get_experiment(tracking.ensure_experiment(uri, "rloo-test"))
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
