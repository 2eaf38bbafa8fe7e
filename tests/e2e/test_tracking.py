"""MLflow tracking: one parent run per pipeline invocation, one child run per stage (issue 7).

Fast unit tests (redaction, metric filtering, a standalone stage run, DVC-compatible md5), then the
micro pipeline end to end:
- through Snakemake in an isolated copy of the project, into the default store (sqlite:///mlflow.db
  in the working directory), after checking that a dry run creates no store and no run;
- through the `rloo` CLI stages under a parent run, against a real `mlflow server` on 127.0.0.1 (HTTP);
- the MLflow UI on the Snakemake run's store, in headless Chromium (needs scripts/ui-test-deps.sh;
  skipped with the reason when Chromium or playwright-core is missing, a failure when RLOO_UI=1).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from tracking_helpers import BIN, SECRET_CFG, SECRET_ENV, pipeline_env

from rloo_workflow import tracking
from rloo_workflow.config import load_config

ROOT = Path(__file__).resolve().parents[2]
MICRO = ROOT / "config" / "micro.yaml"
# the default target, micro: an evaluation run per policy, and the report
EVALUATIONS = ["evaluate_base", "evaluate_sft", "evaluate_rloo"]
SNAKEMAKE_STAGES = {"prepare", "base", "sft", "reward", "rloo", *EVALUATIONS, "report", "toy"}
CLI_STAGES = ["prepare", "base", "sft", "reward", "rloo", *EVALUATIONS, "report"]


# --------------------------------------------------------------------------------------------------
# helpers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_SERVERS: dict[str, subprocess.Popen] = {}  # url: the server process (a test may kill it)


@contextlib.contextmanager
def _mlflow_server(cwd: Path, backend: str, *extra: str, verb: str = "server"):
    """`mlflow server|ui` on 127.0.0.1 with one worker; yields its URL once /health answers."""
    port = _free_port()
    logf = open(cwd / f"mlflow-{verb}-{port}.log", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [str(BIN / "mlflow"), verb, "--backend-store-uri", backend, "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1", *extra],
        # MLflow 3's server also starts a job runner and its pool of huey worker processes (for jobs these
        # tests never submit); on two cores their start-up competes with the stages under test
        cwd=cwd, stdout=logf, stderr=subprocess.STDOUT, env=pipeline_env(MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false"),
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while True:
            assert proc.poll() is None, f"mlflow {verb} exited: {Path(logf.name).read_text()[-3000:]}"
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    break
            assert time.time() < deadline, f"mlflow {verb} did not answer: {Path(logf.name).read_text()[-3000:]}"
            time.sleep(0.5)
        _SERVERS[url] = proc
        yield url
    finally:
        _SERVERS.pop(url, None)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        logf.close()


def _artifacts(client, run_id: str, path: str | None = None) -> list[str]:
    out = []
    for f in client.list_artifacts(run_id, path):
        out += _artifacts(client, run_id, f.path) if f.is_dir else [f.path]
    return out


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes(), usedforsecurity=False).hexdigest()


def check_pipeline(client, experiment: str, workdir: Path, stages: set[str], *, git_commit: str | None = None,
                   config_name: str = "micro") -> dict[str, object]:
    """The audit a person does in the UI, with MlflowClient: see the module docstring. Returns the runs."""
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no experiment {experiment!r}"
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert [r.info.run_name for r in parents] == ["pipeline"], "exactly one top-level (pipeline) run"
    parent = parents[0]
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["rloo.kind"] == "pipeline"
    assert parent.data.params["rloo.k"] == "2" and parent.data.params["sft.steps"] == "12"
    children = {r.info.run_name: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    assert len(children) == len(runs) - 1, "every other run is a child of the pipeline run"
    assert set(children) == stages, f"one child run per stage: {sorted(children)}"

    records = tracking.recorded_runs(workdir / "results" / "runs")
    assert records["pipeline"]["run_id"] == parent.info.run_id
    assert records["pipeline"]["status"] == "FINISHED"
    for name, run in children.items():
        assert run.info.status == "FINISHED", name
        rec = records[name]
        assert (rec["run_id"], rec["parent_run_id"], rec["status"]) == (run.info.run_id, parent.info.run_id, "FINISHED")
        tags = run.data.tags
        assert tags["rloo.stage"] == name and tags["host"] == socket.gethostname()
        assert len(tags["config_hash"]) == 16
        if git_commit:
            assert tags["git_commit"] == git_commit and tags["mlflow.source.git.commit"] == git_commit
        assert any(k.startswith("dvc.md5.") for k in tags), f"{name}: no output md5"
        assert "tracking.tracking_uri" not in run.data.params
        arts = _artifacts(client, run.info.run_id)
        assert f"logs/{name}.log" in arts and "provenance/config.json" in arts, (name, arts)
        assert not [a for a in arts if a.endswith((".safetensors", ".bin", ".pt"))], f"weights logged: {arts}"

    def history(run_name: str, key: str) -> list[tuple[int, float]]:
        return sorted((m.step, m.value) for m in client.get_metric_history(children[run_name].info.run_id, key))

    # prepare: the data section; its manifest
    p = children["prepare"]
    assert p.data.params["data.synthetic.n_train"] == "256"
    assert "outputs/gsm8k/manifest.json" in _artifacts(client, p.info.run_id)
    # sft: per-step loss, weights' md5 (not the weights)
    s = children["sft"]
    assert s.data.params["sft.steps"] == "12" and s.data.params["model.tiny.hidden_size"] == "64"
    assert len(history("sft", "sft/loss")) >= 3
    assert {"outputs/sft/metrics.json", "outputs/sft/history.json", "plots/curves.png"} <= set(
        _artifacts(client, s.info.run_id))
    weights = workdir / "results" / "models" / "sft" / "model.safetensors"
    assert s.data.tags["md5.results/models/sft/model.safetensors"] == _md5(weights)
    assert s.data.tags["dvc.md5.results/models/sft"] == tracking.dvc_md5(weights.parent)[0]
    # reward: per-step loss
    assert children["reward"].data.params["reward.steps"] == "6"
    assert len(history("reward", "reward/loss")) >= 2
    # rloo: every step of the diagnostics
    r = children["rloo"]
    assert r.data.params["rloo.k"] == "2" and r.data.params["rloo.steps"] == "4"
    for key in ("train/reward_mean", "train/kl", "train/zero_adv_frac", "train/entropy", "time/step_s"):
        h = history("rloo", key)
        assert [step for step, _ in h] == [0, 1, 2, 3], (key, h)
        assert all(math.isfinite(v) for _, v in h)
    assert "step" not in r.data.metrics
    assert {"outputs/rloo_rloo/metrics.json", "outputs/rloo_rloo/steps.jsonl", "plots/curves.png",
            "logs/rloo.log"} <= set(_artifacts(client, r.info.run_id))
    log_text = Path(client.download_artifacts(r.info.run_id, "logs/rloo.log", str(workdir / "dl"))).read_text()
    assert "rloo done" in log_text
    # each evaluation: its policy's figures as metrics, its records and figures as outputs
    for name in EVALUATIONS:
        ev = children[name]
        policy = name.removeprefix("evaluate_")
        assert ev.data.params["evaluate.examples"] == "16" and "evaluate/accuracy_sampled" in ev.data.metrics
        assert {f"outputs/{policy}.jsonl", f"outputs/{policy}.json"} <= set(_artifacts(client, ev.info.run_id))
    # the report: results as metrics, the results JSON and its plots
    e = children["report"]
    assert e.data.params["evaluate.examples"] == "16"
    assert e.data.params["evaluate.llm_judge.api_key_env"] == "OPENAI_API_KEY"  # a name, not a secret
    assert "evaluate/rloo/accuracy" in e.data.metrics and "evaluate/win_rate/rloo/value" in e.data.metrics
    # the gain over SFT with its 95 % interval and p-value (rloo.eval.gains), one trained policy
    assert {"gain/sampled", "gain/sampled_ci95_lo", "gain/sampled_ci95_hi", "gain/sampled_p_value",
            "gain/greedy", "gain/greedy_p_value"} <= set(e.data.metrics)
    assert e.data.metrics["gain/sampled_ci95_lo"] <= e.data.metrics["gain/sampled"] <= e.data.metrics["gain/sampled_ci95_hi"]
    assert {"outputs/gsm8k_rloo.json", "outputs/gsm8k_rloo/policies.png",
            "outputs/gsm8k_rloo/proxy_vs_judge.png"} <= set(_artifacts(client, e.info.run_id))

    # Hygiene: no planted secret in any param, tag or text artifact of any run.
    dl = workdir / "dl-all"
    for run in runs:
        for blob in (json.dumps(run.data.params), json.dumps(run.data.tags)):
            assert SECRET_ENV not in blob and SECRET_CFG not in blob, run.info.run_name
        local = Path(client.download_artifacts(run.info.run_id, "", str(dl / run.info.run_id)))
        for f in local.rglob("*"):
            if f.is_file() and f.suffix in {".json", ".jsonl", ".log", ".txt"}:
                text = f.read_text(errors="replace")
                assert SECRET_ENV not in text and SECRET_CFG not in text, f
    return {"parent": parent, "children": children}


# --------------------------------------------------------------------------------------------------
# unit tests


def test_log_metrics_is_a_noop_without_a_run():
    assert tracking.active_run_id() is None
    tracking.log_metrics({"train/kl": 1.0, "step": 3}, 3)  # nothing to log to, nothing raised


@pytest.mark.parametrize(
    ("key", "secret"),
    [("api_key", True), ("OPENAI_API_KEY", True), ("hf_token", True), ("password", True), ("HF_TOKEN", True),
     ("client_secret", True), ("max_new_tokens", False), ("eval_max_new_tokens", False), ("tokenizer", False),
     ("author", False), ("k", False)],
)
def test_secret_keys(key, secret):
    assert tracking.is_secret_key(key) is secret


def test_redaction(monkeypatch):
    monkeypatch.setenv("MY_SERVICE_TOKEN", "s3cr3t-value-xyz")
    cfg = {
        "evaluate": {"llm_judge": {"api_key_env": "OPENAI_API_KEY", "api_key": "abc123", "base_url":
                                   "http://user:pw123@host:8000/v1"}},
        "model": {"max_new_tokens": 96, "tokenizer": "gpt2", "hub_token": "hf_" + "a" * 30},
        "name": "run sk-" + "b" * 30,
        "note": "uses s3cr3t-value-xyz",
    }
    params = tracking.config_params(cfg)
    assert params["evaluate.llm_judge.api_key_env"] == "OPENAI_API_KEY"
    assert params["evaluate.llm_judge.api_key"] == tracking.REDACTED
    assert params["evaluate.llm_judge.base_url"] == f"http://user:{tracking.REDACTED}@host:8000/v1"
    assert params["model.max_new_tokens"] == "96" and params["model.tokenizer"] == "gpt2"
    assert params["model.hub_token"] == tracking.REDACTED
    assert params["name"] == f"run {tracking.REDACTED}"
    assert params["note"] == f"uses {tracking.REDACTED}"
    text = tracking.redact_text(
        "Authorization: Bearer abcdefghijklmnopqrstuvwxyz\nexport OPENAI_API_KEY=sk-live-123456789012345678\n"
        "api_key_env=OPENAI_API_KEY ghp_" + "c" * 36 + " AKIA" + "D" * 16 + " step 3 loss 0.5"
    )
    for leaked in ("abcdefghijklmnop", "sk-live", "ghp_", "AKIA"):
        assert leaked not in text
    assert "api_key_env=OPENAI_API_KEY" in text and "step 3 loss 0.5" in text


def test_dvc_md5_matches_dvc(tmp_path):
    data = tmp_path / "d"
    (data / "sub").mkdir(parents=True)
    (data / "a.txt").write_text("hello\n")
    (data / "sub" / "b.bin").write_bytes(bytes(range(256)) * 10 + b"\r\n")
    dvc = BIN / "dvc"
    if not dvc.exists():
        pytest.skip("dvc not installed")
    subprocess.run([str(dvc), "init", "--no-scm", "-q"], cwd=tmp_path, check=True)
    subprocess.run([str(dvc), "add", "-q", "d"], cwd=tmp_path, check=True)
    import yaml

    recorded = yaml.safe_load((tmp_path / "d.dvc").read_text())["outs"][0]["md5"]
    assert tracking.dvc_md5(data)[0] == recorded
    assert tracking.dvc_md5(data / "a.txt")[0] == hashlib.md5(b"hello\n").hexdigest()


def test_cli_context_names_and_keys(tmp_path):
    import argparse

    cfg = load_config(MICRO)
    job_config = tmp_path / "evaluate-0123.json"  # the rules' --job-config (rloo_workflow.config.job_config_file)
    job_config.write_text('{"seed":0,"evaluate":{"examples":16},"reward":{"source":"model"}}')
    args = argparse.Namespace(stage="evaluate", out="results/eval/grpo.jsonl", policy="grpo=m/rloo_grpo",
                              job_config=str(job_config), set=["threads=1", 'tracking={"enabled": true}', "name=micro"])
    ctx = tracking.cli_context(args, cfg, "evaluate")
    assert ctx["stage"] == "evaluate_grpo"
    assert ctx["outputs"] == ["results/eval/grpo.jsonl", "results/eval/grpo.json"]  # records, figures
    report = argparse.Namespace(stage="report", out="results/gsm8k_grpo.json", plots=None, policy="grpo=m/rloo_grpo",
                                job_config=None, set=[])
    assert tracking.cli_context(report, cfg, "report") == {"stage": "report_grpo",
                                                          "outputs": ["results/gsm8k_grpo.json", "results/gsm8k_grpo"]}
    assert ctx["keys"] == ["evaluate.examples", "name", "reward.source", "seed", "threads", "tracking.enabled"]
    params = tracking.config_params(cfg, ctx["keys"])
    assert set(params) == {"evaluate.examples", "name", "reward.source", "seed", "threads"}  # tracking: no param
    args = argparse.Namespace(stage="train", out=None, job_config=None, set=[])
    assert tracking.cli_context(args, cfg, "rloo") == {"stage": "rloo", "outputs": ["results/models/rloo_rloo"]}


def test_tracking_disabled_creates_nothing(tmp_path, monkeypatch):
    db = tmp_path / "off.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")
    with tracking.stage_run(load_config(MICRO, {"tracking": {"enabled": False}}), "sft") as run:
        assert run is None
    monkeypatch.setenv(tracking.ENV_ENABLED, "0")
    with tracking.stage_run(load_config(MICRO), "sft") as run:
        assert run is None
    assert not db.exists()


def test_standalone_stage_run(tmp_path, monkeypatch):
    """No parent: a top-level run with params, filtered metrics, artifacts, md5 tags, redacted log."""
    from mlflow import MlflowClient

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///store/mlflow.db")  # relative: made absolute
    monkeypatch.setenv("HF_TOKEN", "hf_" + "Z" * 30)
    cfg = load_config(MICRO, {"tracking": {"experiment": "unit"}})
    out = tmp_path / "results" / "models" / "sft"
    out.mkdir(parents=True)
    (out / "metrics.json").write_text(json.dumps({"accuracy": 0.5, "api_key": "hunter2hunter2"}))
    (out / "model.safetensors").write_bytes(b"\0weights" * 100)
    (out / "tokenizer.json").write_text("{}")
    log = tmp_path / "sft.log"
    log.write_text(f"loading with token {'hf_' + 'Z' * 30}\n")
    with tracking.stage_run(cfg, "sft", outputs=[out], log_file=log) as run:
        assert tracking.active_run_id() == run.run_id
        tracking.log_metrics({"step": 0, "sft/loss": 2.0, "note": "x", "bad": math.nan, "flag": True, "n": None}, 0)
        tracking.log_metrics({"step": 2, "sft/loss": 1.0}, 2)
    assert tracking.active_run_id() is None
    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    client = MlflowClient(uri)
    got = client.get_run(run.run_id)
    assert got.info.run_name == "sft" and got.info.status == "FINISHED"
    assert "mlflow.parentRunId" not in got.data.tags
    assert client.get_experiment(got.info.experiment_id).name == "unit"
    assert [(m.step, m.value) for m in client.get_metric_history(run.run_id, "sft/loss")] == [(0, 2.0), (2, 1.0)]
    assert set(got.data.metrics) == {"sft/loss", "flag"}
    assert got.data.params["sft.steps"] == "12" and "rloo.k" not in got.data.params  # the stage's keys only
    assert got.data.tags["md5.results/models/sft/model.safetensors"] == _md5(out / "model.safetensors")
    arts = _artifacts(client, run.run_id)
    assert {"outputs/sft/metrics.json", "logs/sft.log", "plots/curves.png", "provenance/outputs.json"} <= set(arts)
    assert not any(a.endswith((".safetensors", "tokenizer.json")) for a in arts)
    dl = Path(client.download_artifacts(run.run_id, "", str(tmp_path / "dl")))
    assert "hf_ZZZZ" not in (dl / "logs" / "sft.log").read_text()
    assert json.loads((dl / "outputs" / "sft" / "metrics.json").read_text())["api_key"] == tracking.REDACTED
    rec = json.loads((tmp_path / "results" / "runs" / "sft.json").read_text())
    assert rec["run_id"] == run.run_id and rec["parent_run_id"] is None and rec["status"] == "FINISHED"
    assert rec["tracking_uri"] == uri


def test_output_outside_the_working_directory_is_tagged(tmp_path, monkeypatch):
    """A stage writing outside the cwd (`rloo train --out /elsewhere`) still gets its md5 tags."""
    from mlflow import MlflowClient

    work, out = tmp_path / "repo", tmp_path / "elsewhere" / "policy"
    work.mkdir()
    out.mkdir(parents=True)
    (out / "model.safetensors").write_bytes(b"\0weights" * 10)
    monkeypatch.chdir(work)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db")
    with tracking.stage_run(load_config(MICRO), "rloo", outputs=[out]) as run:
        pass
    tags = MlflowClient(f"sqlite:///{work / 'mlflow.db'}").get_run(run.run_id).data.tags
    key = "outside/" + out.resolve().as_posix().lstrip("/")
    assert tags[f"dvc.md5.{key}"] == tracking.dvc_md5(out)[0]
    assert tags[f"md5.{key}/model.safetensors"] == _md5(out / "model.safetensors")


@pytest.mark.slow
def test_a_stage_run_names_its_identity_and_the_reward_file_that_made_it(tmp_path, monkeypatch):
    """Issue 70: two RLOO runs that differ only in the body of the user's reward file had the same
    config_hash and git_commit, and git_dirty=false with that file untracked. Their runs' identities
    differ now, as do the file's digests (`rloo.code.<file>`), while the library's files' are the same;
    git_dirty is true while git does not track the file, and a comment in it changes nothing."""
    from mlflow import MlflowClient

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db")
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.org", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.org", "GIT_CONFIG_GLOBAL": os.devnull}

    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True, env={**os.environ, **env})

    (tmp_path / ".gitignore").write_text("mlflow.db\nmlruns/\nresults/\n")
    git("init", "-q")
    git("add", ".gitignore")
    git("commit", "-qm", "project")
    bonus = tmp_path / "bonus.py"
    good = "def bonus(completions, **kwargs):\n    return [1.0 for _ in completions]\n"
    bonus.write_text(good)
    cfg = load_config(MICRO, {"reward": {"source": "function", "functions": [{"name": "bonus", "fn": "bonus.py:bonus"}]}})
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")

    def tags(body: str) -> dict[str, str]:
        bonus.write_text(body)
        with tracking.stage_run(cfg, "rloo") as run:
            pass
        return client.get_run(run.run_id).data.tags

    a = tags(good)
    b = tags(good.replace("1.0", "1 / 0"))  # a body that raises
    assert a["config_hash"] == b["config_hash"] and a["git_commit"] == b["git_commit"]
    assert a["rloo.identity"] != b["rloo.identity"] and a["rloo.identity.code"] != b["rloo.identity.code"]
    assert a["rloo.code.bonus.py"] != b["rloo.code.bonus.py"]
    assert json.loads(a["rloo.user_files"]) == ["bonus.py"]
    library = {k: v for k, v in a.items() if k.startswith("rloo.code.rloo/")}
    assert "rloo.code.rloo/algo/estimators.py" in library and library == {k: v for k, v in b.items() if k in library}
    assert a["git_dirty"] == b["git_dirty"] == "true"  # no tracked file changed: the reward file is untracked
    git("add", "bonus.py")
    git("commit", "-qm", "the reward")
    c = tags(good + "# a comment\n")  # the commit holds the file; a comment is no change of what it computes
    assert c["git_dirty"] == "true"  # ... but the file on disk differs from the commit
    git("commit", "-qam", "the comment")
    d = tags(good + "# a comment\n")
    assert d["git_dirty"] == "false" and d["rloo.identity"] == c["rloo.identity"] == a["rloo.identity"]


def test_failed_stage_run_is_marked_failed(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    with pytest.raises(RuntimeError, match="boom"), tracking.stage_run(load_config(MICRO), "reward") as run:
        raise RuntimeError("boom")
    assert MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_run(run.run_id).info.status == "FAILED"
    assert json.loads((tmp_path / "results" / "runs" / "reward.json").read_text())["status"] == "FAILED"


_CONCURRENT_STAGE = """
import sys
from rloo_workflow import tracking
from rloo_workflow.config import load_config
cfg = load_config(sys.argv[1], {"paths": {"results": sys.argv[3]}})
with tracking.stage_run(cfg, sys.argv[2]) as run:
    assert run is not None
    for step in range(20):
        tracking.log_metrics({"train/kl": step / 10}, step)
"""


@pytest.mark.slow
def test_concurrent_first_use_of_a_new_sqlite_store(tmp_path):
    """Four stages start at once on a store that does not exist yet: one database, one experiment."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'new' / 'mlflow.db'}"
    procs = [subprocess.Popen([sys.executable, "-c", _CONCURRENT_STAGE, str(MICRO), f"stage{i}", str(tmp_path / "r")],
                              env=pipeline_env(MLFLOW_TRACKING_URI=uri), stderr=subprocess.PIPE, text=True)
             for i in range(4)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        assert "MLflow: could not" not in err, err[-3000:]
    client = MlflowClient(uri)
    [exp] = [e for e in client.search_experiments() if e.name == "rloo"]
    runs = client.search_runs([exp.experiment_id])
    assert sorted(r.info.run_name for r in runs) == [f"stage{i}" for i in range(4)]
    for r in runs:
        assert r.info.status == "FINISHED"
        assert len(client.get_metric_history(r.info.run_id, "train/kl")) == 20


# --------------------------------------------------------------------------------------------------
# the micro pipeline, end to end


@pytest.mark.slow
def test_snakemake_pipeline_logs_parent_and_stage_runs(tracked_workflow, tmp_path):
    from mlflow import MlflowClient

    wf = tracked_workflow["wf"]
    assert (wf / "mlflow.db").is_file(), "the default store is sqlite:///mlflow.db in the working directory"
    assert "rloo: MLflow pipeline run" in tracked_workflow["output"]
    client = MlflowClient(tracked_workflow["uri"])
    runs = check_pipeline(client, "rloo", wf, SNAKEMAKE_STAGES, git_commit=tracked_workflow["commit"])
    parent = runs["parent"]
    assert parent.data.tags["config_name"] == f"micro-{tracking.REDACTED}"
    parent_arts = _artifacts(client, parent.info.run_id)
    assert "provenance/stage_runs.json" in parent_arts
    assert any(a.startswith("logs/") and a.endswith(".log") for a in parent_arts), "the snakemake log"
    # Under Snakemake a stage's params are exactly the keys its rule passes (common.smk STAGE_KEYS).
    assert "rloo.k" not in runs["children"]["sft"].data.params
    toy = runs["children"]["toy"].data.params
    assert "seed" in toy and not [k for k in toy if k.startswith(("rloo.", "sft.", "model.", "tracking."))]
    # Lineage: each stage's run names the runs of the stages before it (the results file does not).
    kids = runs["children"]
    assert kids["report"].data.tags["rloo.upstream.sft"] == kids["sft"].info.run_id
    assert kids["report"].data.tags["rloo.upstream.rloo"] == kids["rloo"].info.run_id
    assert kids["report"].data.tags["rloo.upstream.evaluate_base"] == kids["evaluate_base"].info.run_id
    assert kids["sft"].data.tags["rloo.upstream.base"] == kids["base"].info.run_id
    sft_upstream = {t for t in kids["sft"].data.tags if t.startswith("rloo.upstream.")}
    assert sft_upstream == {"rloo.upstream.prepare", "rloo.upstream.base"}, sft_upstream
    # ...but each stage sees, and records, the user's whole resolved config (RLOO_RESOLVED_CONFIG): the
    # micro values of sections it does not read, not the schema's defaults.
    for name in ("toy", "report", "evaluate_sft", "sft"):
        run_id = runs["children"][name].info.run_id
        seen = json.loads(Path(client.download_artifacts(run_id, "provenance/config.json", str(tmp_path / "dl-cfg" / name))).read_text())
        assert (seen["sft"]["steps"], seen["rloo"]["k"], seen["evaluate"]["examples"]) == (12, 2, 16), name


@pytest.mark.slow
def test_cli_stages_against_mlflow_server(tmp_path, monkeypatch):
    """The same audit over HTTP: a real `mlflow server`, the stages run by hand under a parent run."""
    from mlflow import MlflowClient

    server_dir = tmp_path / "server"
    server_dir.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    with _mlflow_server(server_dir, f"sqlite:///{server_dir / 'server.db'}",
                        "--artifacts-destination", str(server_dir / "artifacts")) as url:
        cfg = load_config(MICRO)
        monkeypatch.chdir(work)
        monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
        for var in (tracking.ENV_PARENT, tracking.ENV_RUNS_DIR, tracking.ENV_ENABLED):
            monkeypatch.delenv(var, raising=False)  # start_pipeline sets them; restored after the test
        parent = tracking.start_pipeline(cfg, results_dir=work / "results", argv=["test", f"--token={SECRET_CFG}"])
        assert parent and os.environ[tracking.ENV_PARENT] == parent
        env = pipeline_env(MLFLOW_TRACKING_URI=url, **{tracking.ENV_PARENT: parent,
                                                 tracking.ENV_RUNS_DIR: os.environ[tracking.ENV_RUNS_DIR]})
        t0 = time.time()
        commands = [[verb] for verb in ("prepare", "base", "sft", "reward", "train")]
        commands += [["evaluate", "--policy", f"{p}=results/models/{p}"] for p in ("base", "sft")]
        commands += [["evaluate"], ["report"]]  # the config's estimator's policy, by default
        for i, command in enumerate(commands):
            with open(work / f"{i}.log", "w") as log:  # like Snakemake's `> {log} 2>&1`
                res = subprocess.run([str(BIN / "rloo"), *command, "-c", str(MICRO)], cwd=work, env=env,
                                     stdout=log, stderr=subprocess.STDOUT, timeout=600)
            assert res.returncode == 0, (work / f"{i}.log").read_text()[-3000:]
        tracking.end_pipeline("FINISHED")
        print(f"micro pipeline via the CLI against mlflow server: {time.time() - t0:.1f} s")
        client = MlflowClient(url)
        runs = check_pipeline(client, "rloo", work, set(CLI_STAGES))
        for run in [runs["parent"], *runs["children"].values()]:
            assert client.get_run(run.info.run_id).info.artifact_uri.startswith("mlflow-artifacts:")
        assert SECRET_CFG not in runs["parent"].data.tags["snakemake.command"]
        # Run by hand, a stage logs its own config keys: the sft run has no RLOO parameters.
        assert "rloo.k" not in runs["children"]["sft"].data.params
    assert list((server_dir / "artifacts").rglob("rloo.log")), "artifacts went through the server"


def _ui_problem() -> str | None:
    chromium = os.environ.get("CHROMIUM", "/usr/bin/chromium")
    if not Path(chromium).exists() and not shutil.which("chromium"):
        return f"Chromium not found at {chromium}"
    if shutil.which("node") is None:
        return "node not found"
    if not (ROOT / "tests" / "ui" / "node_modules" / "playwright-core").is_dir():
        return "playwright-core not installed in tests/ui"
    return None


@pytest.mark.slow
def test_mlflow_ui_lists_pipeline_and_stage_runs(tracked_workflow, tmp_path):
    """`mlflow ui` on the pipeline's store, opened in headless Chromium: the runs are listed."""
    problem = _ui_problem()
    if problem:
        if os.environ.get("RLOO_UI") == "1":
            pytest.fail(f"RLOO_UI=1 but {problem}; run scripts/ui-test-deps.sh")
        pytest.skip(f"{problem}: run `bash scripts/ui-test-deps.sh` (as root: apt chromium, npm playwright-core)")
    from mlflow import MlflowClient

    wf = tracked_workflow["wf"]
    experiment_id = MlflowClient(tracked_workflow["uri"]).get_experiment_by_name("rloo").experiment_id
    shots = Path(os.environ.get("RLOO_UI_SCREENSHOT_DIR") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    runs_png, rloo_png = shots / "mlflow-ui-runs.png", shots / "mlflow-ui-rloo-metrics.png"
    with _mlflow_server(wf, tracked_workflow["uri"], verb="ui") as url:
        res = subprocess.run(
            ["node", str(ROOT / "tests" / "ui" / "mlflow_ui_check.mjs"), "--url", url, "--experiment", experiment_id,
             "--parent", "pipeline", "--children", ",".join(sorted(SNAKEMAKE_STAGES)), "--screenshot", str(runs_png),
             "--run", "rloo", "--metrics", "train/reward_mean,train/kl,train/zero_adv_frac",
             "--run-screenshot", str(rloo_png)],
            cwd=ROOT / "tests" / "ui", capture_output=True, text=True, timeout=300,
        )
    assert res.returncode == 0, f"UI check failed (screenshot {runs_png}):\n{res.stdout}\n{res.stderr[-4000:]}"
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert set(report["found"]) == SNAKEMAKE_STAGES and not report["missing"]
    assert report["run"]["parent_listed"] and len(report["run"]["metrics_shown"]) == 3
    for png in (runs_png, rloo_png):
        assert png.is_file() and png.stat().st_size > 10_000, png
    print(f"MLflow UI screenshots: {runs_png}, {rloo_png}")


@pytest.mark.slow
def test_a_tracking_server_killed_mid_stage_costs_seconds_not_minutes(micro_run, micro_reward, tmp_path):
    """The server dies while `rloo train` runs: one warning, the stage stops waiting on it, finishes in
    a small factor of its untracked time, and its outputs and local metrics are complete."""
    steps = 30

    def cmd(tag: str) -> list[str]:
        return [str(BIN / "rloo"), "train", "-c", str(MICRO), "--set", f"rloo.steps={steps}",
                "--set", "rloo.checkpoint_every=2", "--set", "rloo.eval_every=0", "--set", "reward.source=model",
                "--reward-model", str(micro_reward), "--data", str(micro_run["data"]), "--policy", str(micro_run["sft"]),
                "--out", str(tmp_path / tag / "out"), "--work", str(tmp_path / tag / "work")]

    t0 = time.monotonic()
    res = subprocess.run([*cmd("untracked"), "--set", "tracking.enabled=false"], env=pipeline_env(), capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    untracked = time.monotonic() - t0

    server_dir = tmp_path / "server"
    server_dir.mkdir()
    with _mlflow_server(server_dir, f"sqlite:///{server_dir / 'server.db'}",
                        "--artifacts-destination", str(server_dir / "artifacts")) as url:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd("tracked"), env=pipeline_env(MLFLOW_TRACKING_URI=url), stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 300
        while not list((tmp_path / "tracked" / "work" / "checkpoints").glob("step_*/checkpoint.json")):
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint before the kill"
            time.sleep(0.05)
        os.killpg(_SERVERS[url].pid, signal.SIGKILL)  # mid-stage: the server is gone
        _, err = proc.communicate(timeout=600)
        tracked = time.monotonic() - t0
    assert proc.returncode == 0, err[-3000:]
    print(f"untracked {untracked:.1f} s; tracked, server killed mid-stage {tracked:.1f} s")
    assert tracked < 2 * untracked + 30, (tracked, untracked, err[-3000:])
    assert err.count("MLflow: could not") == 1, err[-3000:]  # one warning, not one a step
    assert "metric values (the tracking store did not come back)" in err
    for tag in ("untracked", "tracked"):
        lines = (tmp_path / tag / "out" / "steps.jsonl").read_text().splitlines()
        assert [json.loads(x)["step"] for x in lines] == list(range(steps)), tag
    assert (tmp_path / "tracked" / "out" / "model.safetensors").is_file()


@pytest.mark.slow
def test_a_frozen_tracking_server_costs_a_stage_seconds(micro_run, tmp_path):
    """An `mlflow server` stopped by SIGSTOP (it accepts connections and never replies), before `rloo
    train` starts and in the middle of it: each costs the stage under 15 s, one bounded call (the
    first call's 5 s; mid-stage two tries of 5 s) and no resend at the end, where it cost about a
    minute (two retries of 20 s, and the resend); the stage's record says what MLflow lacks."""
    steps = 12

    def run(tag: str, url: str | None, freeze_mid: int | None = None) -> tuple[float, str]:
        folder = tmp_path / tag
        folder.mkdir()
        cmd = [str(BIN / "rloo"), "train", "-c", str(MICRO), "--set", f"rloo.steps={steps}",
               "--set", "rloo.checkpoint_every=2", "--set", "rloo.eval_every=0", "--set", "reward.source=verifier",
               "--data", str(micro_run["data"]), "--policy", str(micro_run["sft"]),
               "--out", str(folder / "out"), "--work", str(folder / "work")]
        env = pipeline_env(MLFLOW_TRACKING_URI=url) if url else pipeline_env(RLOO_TRACKING="0")
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=folder, env=env, stderr=subprocess.PIPE, text=True)
        if freeze_mid is not None:  # once the run has its first checkpoint: the server stops mid-stage
            deadline = time.monotonic() + 300
            while not list((folder / "work" / "checkpoints").glob("step_*/checkpoint.json")):
                assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint before the freeze"
                time.sleep(0.05)
            os.killpg(freeze_mid, signal.SIGSTOP)
        _, err = proc.communicate(timeout=600)
        seconds = time.monotonic() - t0
        assert proc.returncode == 0, err[-3000:]
        lines = (folder / "out" / "steps.jsonl").read_text().splitlines()
        assert [json.loads(x)["step"] for x in lines] == list(range(steps)), tag
        return seconds, err

    untracked, _ = run("untracked", None)
    server_dir = tmp_path / "server"
    server_dir.mkdir()
    with _mlflow_server(server_dir, f"sqlite:///{server_dir / 'server.db'}",
                        "--artifacts-destination", str(server_dir / "artifacts")) as url:
        group = _SERVERS[url].pid
        live, _ = run("live", url)
        os.killpg(group, signal.SIGSTOP)
        try:
            before, err_before = run("frozen_before", url)
        finally:
            os.killpg(group, signal.SIGCONT)
        try:
            mid, err_mid = run("frozen_mid", url, freeze_mid=group)
        finally:
            os.killpg(group, signal.SIGCONT)
    print(f"untracked {untracked:.1f} s, tracked {live:.1f} s; server frozen before the stage {before:.1f} s, "
          f"mid-stage {mid:.1f} s")
    # against the faster of the two runs: the first run of a test pays for the disk cache
    fastest = min(untracked, live)
    assert "could not start a run for stage rloo" in err_before and "no reply within 5 s" in err_before, err_before[-3000:]
    assert before - fastest < 15, (before, untracked, live)
    assert err_mid.count("MLflow: could not") == 1 and "not sent again: it did not reply in time" in err_mid, err_mid[-3000:]
    assert "gave no reply in time, and was not asked again" in err_mid
    # mid-stage, the run did all a tracked run does before the freeze (its run, tags, parameters, the first
    # steps' metrics): what the freeze costs is its time over the live run's, like for like
    assert mid - live < 15, (mid, untracked, live, err_mid[-3000:])
    record = json.loads((tmp_path / "frozen_mid" / "results" / "runs" / "rloo.json").read_text())
    assert record["status"] == "FINISHED" and record["metrics_missing"] > 0, record
    assert record["tracking_store"] == "the tracking store gave no reply in time, and was not asked again"
