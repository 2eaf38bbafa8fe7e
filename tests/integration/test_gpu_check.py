"""scripts/gpu_check.sh's verdicts (rloo_workflow.gpu_check): the memory against the plan within ±20 %, the
results regraded from their completions, the served judge; a check not run is never a pass.

No GPU here: the memory inputs are the CPU dry run's recorded file (tests/data/gpu_check/memory_cpu.json,
its command inside) and CUDA files constructed from it (its planned figure, a measured peak at a chosen
ratio); the results are a real micro evaluate run's files."""

import json
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from rloo.errors import InputError
from rloo_workflow import gpu_check

ROOT = Path(__file__).resolve().parents[2]
RECORDED = ROOT / "tests" / "data" / "gpu_check" / "memory_cpu.json"


def _memory(tmp_path: Path, ratio: float, device: str = "cuda:0") -> Path:
    m = json.loads(RECORDED.read_text())
    m.update(device=device, peak_mb=m["planned_update_mb"] * ratio)
    path = tmp_path / f"memory_{ratio}.json"
    path.write_text(json.dumps(m))
    return path


@pytest.mark.parametrize(("ratio", "status"), [
    (1.0, "passed"), (1.19, "passed"), (0.81, "passed"), (1.21, "failed"), (0.79, "failed"), (2.0, "failed")])
def test_memory_within_20_percent_of_the_plan(tmp_path, ratio, status):
    path = _memory(tmp_path, ratio)
    v = gpu_check.memory_verdict(json.loads(path.read_text()), path)
    assert v.status == status, v.line()
    assert f"{100 * (ratio - 1):+.1f} %" in v.detail


def test_a_cpu_peak_is_reported_not_compared():
    v = gpu_check.memory_verdict(json.loads(RECORDED.read_text()), RECORDED)
    assert v.status == "not run" and "peak RSS" in v.detail
    assert "measured peak 4.82 GB, planned 5.59 GB" in v.detail  # the recorded figures, shown


@pytest.mark.parametrize(("key", "value"), [("peak_mb", None), ("planned_update_mb", float("nan")), ("device", 3)])
def test_a_malformed_memory_file_names_the_file_and_key(tmp_path, key, value):
    path = _memory(tmp_path, 1.0)
    m = json.loads(path.read_text())
    m[key] = value
    with pytest.raises(InputError, match=rf"{re.escape(str(path))}: `{key}`"):
        gpu_check.memory_verdict(m, path)


@pytest.fixture(scope="module")
def evaluated(micro_run, tmp_path_factory) -> dict:
    """A real micro evaluation (the SFT policy as the trained one too): its results and its policies' records."""
    from rloo.eval.records import read
    from rloo_workflow.stages import evaluate, report

    out = tmp_path_factory.mktemp("gpu_check_eval")
    for name in ("base", "sft", "rloo"):
        folder = micro_run["base_model"] if name == "base" else micro_run["sft"]
        evaluate.run(micro_run["cfg"], micro_run["data"], micro_run["sft"], name, folder, out / "eval" / f"{name}.jsonl")
    evaluations = {name: read(name, out / "eval" / f"{name}.jsonl") for name in ("base", "sft", "rloo")}
    report.run(micro_run["cfg"], evaluations, "rloo", micro_run["sft"], micro_run["data"] / "manifest.json",
               out / "eval.json")
    return {"results": out / "eval.json", "records": out / "eval"}


def _copy(evaluated: dict, tmp_path: Path) -> dict:
    shutil.copytree(evaluated["records"], tmp_path / "eval")
    return {"results": Path(shutil.copy(evaluated["results"], tmp_path / "results.json")), "records": tmp_path / "eval"}


def test_results_regraded_from_their_records(evaluated, tmp_path):
    f = _copy(evaluated, tmp_path)
    assert gpu_check.results_verdict(f["results"], f["records"]).status == "passed"
    # a figure the records do not bear out
    r = json.loads(f["results"].read_text())
    r["policies"]["rloo"]["accuracy_sampled"] = 0.5
    f["results"].write_text(json.dumps(r))
    v = gpu_check.results_verdict(f["results"], f["records"])
    assert v.status == "failed" and "rloo.accuracy_sampled is 0.5" in v.detail


def test_results_check_reads_the_records(evaluated, tmp_path):
    """A greedy completion replaced by the gold solution: the stage's figure no longer matches it."""
    f = _copy(evaluated, tmp_path)
    path = f["records"] / "sft.jsonl"
    lines = path.read_text().splitlines()
    first = json.loads(lines[0])
    first["greedy"]["text"] = first["answer"]
    path.write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    v = gpu_check.results_verdict(f["results"], f["records"])
    assert v.status == "failed" and "sft.accuracy is" in v.detail, v.line()


def test_results_off_schema_fail(evaluated, tmp_path):
    f = _copy(evaluated, tmp_path)
    r = json.loads(f["results"].read_text())
    del r["policies"]["sft"]["accuracy_sampled"]
    f["results"].write_text(json.dumps(r))
    v = gpu_check.results_verdict(f["results"], f["records"])
    assert v.status == "failed" and "policies/sft" in v.detail and "accuracy_sampled" in v.detail


def _judged(tmp_path: Path, **judge) -> Path:
    path = tmp_path / "chain.json"
    path.write_text(json.dumps({"judge": {"type": "llm", **judge}, "win_rate": {"value": 0.5}}))
    return path


def test_served_judge(tmp_path):
    assert gpu_check.judge_verdict(None, "vLLM absent").status == "not run"
    assert gpu_check.judge_verdict(_judged(tmp_path, served=True, calls=24)).status == "passed"
    v = gpu_check.judge_verdict(_judged(tmp_path, served=False, calls=24))
    assert v.status == "failed" and "not served" in v.detail
    v = gpu_check.judge_verdict(_judged(tmp_path, served=True, calls=0))
    assert v.status == "failed" and "no judge calls" in v.detail
    path = tmp_path / "nowr.json"
    path.write_text(json.dumps({"judge": {"served": True, "calls": 24}, "win_rate": {"value": None}}))
    assert "no win rate" in gpu_check.judge_verdict(path).detail


def test_the_command_passes_only_when_every_check_ran_and_passed(evaluated, tmp_path, capsys):
    def _main(*args: str) -> SimpleNamespace:
        code = gpu_check.main(list(args))
        out = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)

    files = ["--results", str(evaluated["results"]), "--records", str(evaluated["records"])]
    judge = ["--judge", str(_judged(tmp_path, served=True, calls=24))]
    ok = _main("--memory", str(_memory(tmp_path, 1.1)), *files, *judge)
    assert ok.returncode == 0 and ok.stdout.splitlines()[-1].startswith("gpu check passed: "), ok.stdout + ok.stderr
    off = _main("--memory", str(_memory(tmp_path, 1.3)), *files, *judge)
    assert off.returncode == 1 and "memory: FAILED" in off.stdout and "gpu check FAILED: memory" in off.stdout
    # the served-judge chain skipped: incomplete, exit 1, and never the word passed in the verdict
    skipped = _main("--memory", str(_memory(tmp_path, 1.1)), *files, "--judge-not-run", "vLLM absent")
    assert skipped.returncode == 1 and "served judge: NOT RUN: vLLM absent" in skipped.stdout
    assert skipped.stdout.splitlines()[-1] == "gpu check INCOMPLETE; not run: served judge"
    # DEVICE=cpu: a dry run, which nothing failed, is not a pass either
    dry = _main("--memory", str(RECORDED), *files, "--judge-not-run", "no CUDA", "--dry-run")
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert dry.stdout.splitlines()[-1] == "gpu check dry run: no check failed; not run: memory, served judge"
    missing = _main("--memory", str(tmp_path / "absent.json"), *files, *judge)
    assert missing.returncode == 2 and "absent.json: no such file" in missing.stderr


def test_the_script_ends_on_the_verdicts():
    """gpu_check.sh prints no verdict of its own: its last command is rloo_workflow.gpu_check on the files its
    steps wrote, with the served-judge chain's results or the reason it was not run."""
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    assert subprocess.run(["bash", "-n", "-c", script]).returncode == 0
    assert not re.search(r"echo .*passed", script)
    last = script.rstrip().rsplit("\n$PY -m rloo_workflow.gpu_check", 1)[1]
    for arg in ('--memory "$W/memory.json"', '--results "$W/eval.json"', '--records "$W/eval"',
                '"${JUDGE[@]}"'):
        assert arg in last, arg
    assert '--json "$W/memory.json"' in script and 'JUDGE=(--judge "$C/results/gsm8k_rloo.json")' in script
    assert 'JUDGE=(--judge-not-run ' in script
