"""Data-parallel training (rloo/model/distributed.py): DDP and FSDP2 under torchrun, gloo on the CPU.

Fast: what makes the processes' union equal one process's step, checked without a process group (a
slice of a batch samples what the whole batch samples; the split of a step; the launcher's refusals).
Slow (`rloo train --nproc 2`, `rloo sft --nproc 2`, `rloo reward --nproc 2` on the micro config): 2
processes give the weights of 1 process after 3 steps on the same prompts (the reward model: on the
same pairs, sampled half by each process), write one output and one MLflow child run, and a run
killed with SIGKILL then rerun ends where an uninterrupted one does, bit for bit; under FSDP the
best snapshot is the policy written. With LoRA (FSDP and DDP) and gradient checkpointing (FSDP), 2
processes train as one does, and an FSDP LoRA run resumes from its adapter-only checkpoint bit for bit.
"""

import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import without_stage_server

from rloo.data.gsm8k import format_prompt
from rloo.errors import InputError
from rloo.io import read_jsonl
from rloo.model import checkpoint, distributed, models
from rloo.rollout import generate
from rloo.runtime import step_generator
from rloo_workflow import cli
from rloo_workflow.config import load_config

ROOT = Path(__file__).resolve().parents[2]
MICRO = str(ROOT / "config" / "micro.yaml")
# Two processes against one: sampling is exact per row (the same noise), so the processes see the same
# tokens; what differs is float rounding (other batch shapes in every matrix product), which AdamW
# (~lr * g / |g| at first) carries into the weights. Measured after 3 steps: RLOO max |dw| 6e-8 (its
# lr 1e-5..3e-5 in warm-up), SFT 2.7e-6 (lr 3e-3), and |dw| / |w - w0| below 1e-5 for both. Broken on
# purpose (tests run once with the break): no loss scale under token normalisation, RLOO 5e-5 and
# 0.07, SFT 5e-3 and 0.03; each rank drawing its own noise 1e-4 and 1.3; twice the scale 1e-5 and 0.1
# (and the logged gradient norm doubles).
ATOL = {"rloo": 1e-6, "sft": 2e-5, "reward": 2e-5}
RTOL_UPDATE = 1e-4  # |w_2 - w_1| / |w_1 - w_0|: the difference against how far the steps moved
RTOL_METRICS = 1e-4


# -- fast: no process group ---------------------------------------------------------------------------
@pytest.mark.parametrize("lean", [True, False])
def test_a_slice_of_a_batch_samples_what_the_whole_batch_samples(micro_run, lean):
    """`noise_rows`: a process sampling rows lo..hi of a step draws the noise of the whole batch and
    reads its rows', so together the processes sample exactly what one process samples."""
    tok, model = models.load_tokenizer(micro_run["sft"]), models.load_causal_lm(micro_run["sft"])
    rows = [r for _, r in read_jsonl(micro_run["data"] / "train.jsonl")][:4]
    prompts = [tok(format_prompt(r["question"], micro_run["cfg"]["prompt"]["template"]))["input_ids"]
               for r in rows for _ in range(2)]
    kw = {"max_new_tokens": 16, "eos_id": tok.eos_token_id, "pad_id": tok.pad_token_id, "lean": lean}
    whole = generate(model, prompts, generator=step_generator(0, 3), **kw)

    def same(part, lo: int) -> bool:
        n = part.lengths
        return torch.equal(n, whole.lengths[lo : lo + len(n)]) and all(
            torch.equal(part.completions[i, : n[i]], whole.completions[lo + i, : n[i]]) for i in range(len(n)))

    for lo, hi in ((0, 4), (4, 8), (2, 6), (6, 8)):
        assert same(generate(model, prompts[lo:hi], generator=step_generator(0, 3), noise_rows=(lo, 8), **kw), lo)
    # Without it the slice draws other noise: the check above is not vacuous.
    assert not same(generate(model, prompts[4:8], generator=step_generator(0, 3), **kw), 4)


def test_a_step_splits_into_contiguous_shares_that_cover_it(monkeypatch):
    monkeypatch.setattr(distributed, "enabled", lambda: True)
    monkeypatch.setattr(distributed, "world", lambda: 3)
    for n in (3, 4, 16, 17):
        shares = []
        for r in range(3):
            monkeypatch.setattr(distributed, "rank", lambda r=r: r)
            shares.append(distributed.shard(n))
        assert shares[0][0] == 0 and shares[-1][1] == n
        assert all(a[1] == b[0] for a, b in itertools.pairwise(shares))
        assert max(h - lo for lo, h in shares) - min(h - lo for lo, h in shares) <= 1
    with pytest.raises(InputError, match="cannot be split"):
        distributed.shard(2)


def test_single_process_helpers_are_the_identity(micro_cfg):
    assert distributed.init(micro_cfg) == 1 and not distributed.enabled()
    assert distributed.shard(5) == (0, 5) and distributed.loss_scale(7.0) == 1.0
    m = {"a": 1.5, "b": "x"}
    assert distributed.mean_over_ranks(m) is m and distributed.fingerprint("abc") == "abc"
    t = torch.arange(3)
    assert distributed.gather_rows(t)[0] is t and distributed.on_main(lambda: 4) == 4


def test_several_processes_need_a_strategy(micro_cfg, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(InputError, match=r"distributed\.strategy is none"):
        distributed.init(micro_cfg)
    monkeypatch.delenv("WORLD_SIZE")
    assert cli.main(["train", "-c", MICRO, "--nproc", "2"]) == 2
    assert "needs distributed.strategy ddp or fsdp" in capsys.readouterr().err
    assert cli.main(["sft", "-c", MICRO, "--nproc", "2", "--set", "distributed.strategy=ddp",
                     "--set", "distributed.nodes=2"]) == 2
    assert "one torchrun per node" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")  # a stage that runs in one process refuses a launcher's several
    assert cli.main(["evaluate", "-c", MICRO, "--set", "distributed.strategy=ddp"]) == 2
    assert "rloo evaluate runs in one" in capsys.readouterr().err
    monkeypatch.delenv("WORLD_SIZE")
    cfg = load_config(MICRO, {"distributed": {"strategy": "fsdp"}})
    assert cfg["distributed"] == {"strategy": "fsdp", "nproc_per_node": 1, "nodes": 1}


# -- slow: torchrun, 2 processes ---------------------------------------------------------------------
def _rloo_cmd(micro_run, reward_dir, tmp: Path, *sets: str, steps: int = 3, nproc: int | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "rloo_workflow.cli", "train", "-c", MICRO, "--set", "reward.source=model",
           "--reward-model", str(reward_dir), "--set", f"rloo.steps={steps}", "--set", "tracking.enabled=false",
           "--data", str(micro_run["data"]), "--policy", str(micro_run["sft"]),
           "--out", str(tmp / "out"), "--work", str(tmp / "work")]
    for s in sets:
        cmd += ["--set", s]
    return cmd + (["--nproc", str(nproc)] if nproc else [])


def _run_here(cmd: list[str]) -> None:
    """A one-process reference run: the same command line through `rloo_workflow.cli.main` in this process
    (no interpreter start-up to pay; the command is the same, so are its outputs)."""
    assert cmd[:3] == [sys.executable, "-m", "rloo_workflow.cli"] and "--nproc" not in cmd, cmd
    assert cli.main(cmd[3:]) == 0, f"rloo {cmd[3]} failed (its log is in the captured stderr)"


def _run(cmd: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return models.load_causal_lm(folder).state_dict()


def _diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _norm(tensors) -> float:
    return sum(float((t**2).sum()) for t in tensors) ** 0.5


def _close(got: dict, want: dict, start: dict, atol: float) -> None:
    """`got` within `atol` of `want` everywhere, and their difference small against the update."""
    diff = _diff(got, want)
    rel = _norm(got[k] - want[k] for k in want) / _norm(want[k] - start[k] for k in want)
    assert diff <= atol and rel <= RTOL_UPDATE, f"weights differ by {diff:.3g} (> {atol:g}?), {rel:.3g} of the update"


def _steps(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "steps.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def single_rloo(micro_run, micro_reward, tmp_path_factory):
    """One process's 3 RLOO steps, per loss normalisation: {norm: (weights, steps.jsonl records)}."""
    runs = {}
    for norm in ("sequence", "token"):
        tmp = tmp_path_factory.mktemp(f"single_{norm}")
        _run_here(_rloo_cmd(micro_run, micro_reward, tmp, f"rloo.loss_norm={norm}"))
        runs[norm] = (_weights(tmp / "out"), _steps(tmp / "out"))
    sft = _weights(micro_run["sft"])
    # The steps must have moved the weights, else equal weights would test nothing.
    assert min(_diff(w, sft) for w, _ in runs.values()) > 1e-5
    return runs


@pytest.mark.slow
def test_one_process_under_torchrun_trains_fsdp_in_a_group_of_one(micro_run, micro_reward, single_rloo, tmp_path):
    """torchrun --nproc-per-node 1 with strategy fsdp shards over a world of one (the code path a one-GPU
    check runs: scripts/gpu_check.sh) and trains what the single-process path trains."""
    cmd = _rloo_cmd(micro_run, micro_reward, tmp_path, "distributed.strategy=fsdp")
    i = cmd.index("-m")
    cmd = [*cmd[:i], "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", *cmd[i:]]
    done = _run(cmd)
    assert "distributed: fsdp on 1 processes (gloo)" in done.stderr, done.stderr[-3000:]
    weights, _ = single_rloo["sequence"]
    _close(_weights(tmp_path / "out"), weights, _weights(micro_run["sft"]), ATOL["rloo"])


@pytest.mark.slow
@pytest.mark.parametrize("norm", ["sequence", "token"])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_train_rloo_as_one(micro_run, micro_reward, single_rloo, tmp_path, strategy, norm):
    """2 ranks x 2 prompts per step give the update of 1 rank x 4 prompts, the same prompts; with
    tracking on (a SQLite store in tmp, under a parent run), one output and one MLflow child run."""
    from rloo_workflow.tracking import store

    store_dir = tmp_path / "mlflow"
    store_dir.mkdir()
    uri = f"sqlite:///{store_dir}/mlflow.db"
    client = store.mlflow_client(uri)
    parent = client.create_run(store.ensure_experiment(uri, "rloo"), run_name="pipeline").info.run_id
    env = {"MLFLOW_TRACKING_URI": uri, "RLOO_MLFLOW_PARENT_RUN_ID": parent, "RLOO_MLFLOW_RUNS_DIR": str(tmp_path / "runs")}
    _run(_rloo_cmd(micro_run, micro_reward, tmp_path, f"rloo.loss_norm={norm}", f"distributed.strategy={strategy}",
                   "tracking.enabled=true", nproc=2), env)

    weights, steps = single_rloo[norm]
    _close(_weights(tmp_path / "out"), weights, _weights(micro_run["sft"]), ATOL["rloo"])
    got = _steps(tmp_path / "out")
    assert [s["step"] for s in got] == [0, 1, 2]
    for key in ("train/grad_norm", "train/loss", "train/reward_mean", "train/kl", "train/response_length",
                "train/entropy", "train/adv_std", "eval/accuracy_sampled"):
        for a, b in zip(got, steps, strict=True):
            if key in b:
                # The KL sums ~24 token log-ratios of ~1e-5 each: a small difference of large log-probs.
                tol = 1e-5 if key == "train/kl" else 1e-6
                assert a[key] == pytest.approx(b[key], rel=RTOL_METRICS, abs=tol), (key, a["step"])

    # One writer: one output folder, no second rank's temporary folders, one timings file, one run.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow", "out", "runs", "work"]
    assert sorted(p.name for p in (tmp_path / "work").iterdir()) == ["checkpoints", "identity.json", "timings.json"]
    runs = client.search_runs([client.get_run(parent).info.experiment_id])
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent]
    assert [(r.info.run_name, r.info.status) for r in children] == [("rloo", "FINISHED")]
    assert len(runs) == 2  # the parent and its one child
    assert len(client.get_metric_history(children[0].info.run_id, "train/reward_mean")) == 3
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["rloo.json"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_in_micro_batches_train_rloo_as_one_in_one_pass(micro_run, micro_reward, single_rloo, tmp_path,
                                                                      strategy):
    """rloo.micro_batch_tokens small enough for 2-3 micro-batches per rank (their counts made equal, a
    group's samples split among them, gradients synchronised on the last): the update of one process
    that takes the step in one pass."""
    _run(_rloo_cmd(micro_run, micro_reward, tmp_path, "rloo.loss_norm=token", f"distributed.strategy={strategy}",
                   "rloo.micro_batch_tokens=160", nproc=2))
    weights, steps = single_rloo["token"]
    _close(_weights(tmp_path / "out"), weights, _weights(micro_run["sft"]), ATOL["rloo"])
    for a, b in zip(_steps(tmp_path / "out"), steps, strict=True):
        for key in ("train/grad_norm", "train/loss", "train/entropy"):
            assert a[key] == pytest.approx(b[key], rel=RTOL_METRICS, abs=1e-6), (key, a["step"])


def _sft_cmd(micro_run, tmp: Path, *sets: str, nproc: int | None = None) -> list[str]:
    # The same starting model for every run: the micro chain's base folder (the embedded tiny model). Three
    # steps learn next to nothing (LoRA: 5.71 nats of ln 320 = 5.77): the learned-nothing check is not the
    # point here (tests/e2e/test_divergence.py), the processes are.
    cmd = [sys.executable, "-m", "rloo_workflow.cli", "sft", "-c", MICRO, "--set", "sft.steps=3", "--set", "sft.log_every=1",
           "--set", "sft.min_loss_drop_nats=0",
           "--set", "tracking.enabled=false", "--data", str(micro_run["data"]), "--base", str(micro_run["base_model"]),
           "--out", str(tmp / "out"), "--work", str(tmp / "work")]
    for s in sets:
        cmd += ["--set", s]
    return cmd + (["--nproc", str(nproc)] if nproc else [])


@pytest.fixture(scope="module")
def single_sft(micro_run, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("single_sft")
    _run_here(_sft_cmd(micro_run, tmp))
    return _weights(tmp / "out"), json.loads((tmp / "out" / "history.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_train_sft_as_one(micro_run, single_sft, tmp_path, strategy):
    """SFT: each rank takes half of every step's 16 examples; its token-mean loss is weighted by its
    share of the step's answer tokens (the halves hold different numbers of tokens)."""
    _run(_sft_cmd(micro_run, tmp_path, f"distributed.strategy={strategy}", nproc=2))
    weights, history = single_sft
    _close(_weights(tmp_path / "out"), weights, _weights(micro_run["base_model"]), ATOL["sft"])
    got = json.loads((tmp_path / "out" / "history.json").read_text())
    assert [h["step"] for h in got] == [0, 1, 2]
    for a, b in zip(got, history, strict=True):
        assert a["sft/loss"] == pytest.approx(b["sft/loss"], rel=RTOL_METRICS)
        assert a["sft/grad_norm"] == pytest.approx(b["sft/grad_norm"], rel=RTOL_METRICS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "work"]


def _reward_cmd(micro_run, tmp: Path, *sets: str, steps: int = 3, nproc: int | None = None) -> list[str]:
    # 7 pairs a step: shares of 4 and 3, so the loss scale (8/7, 6/7) matters
    cmd = [sys.executable, "-m", "rloo_workflow.cli", "reward", "-c", MICRO, "--set", f"reward.steps={steps}",
           "--set", "reward.batch_size=7",
           "--set", "tracking.enabled=false", "--data", str(micro_run["data"]), "--policy", str(micro_run["sft"]),
           "--out", str(tmp / "out"), "--work", str(tmp / "work")]
    for s in sets:
        cmd += ["--set", s]
    return cmd + (["--nproc", str(nproc)] if nproc else [])


def _reward_weights(folder: Path) -> dict[str, torch.Tensor]:
    return models.load_reward_model(folder).state_dict()


@pytest.fixture(scope="module")
def single_reward(micro_run, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("single_reward")
    _run_here(_reward_cmd(micro_run, tmp))
    return (_reward_weights(tmp / "out"), json.loads((tmp / "out" / "history.json").read_text()),
            json.loads((tmp / "out" / "metrics.json").read_text()))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_train_the_reward_model_as_one(micro_run, single_reward, tmp_path, strategy):
    """The reward model: each rank samples half of every batch's prompts (the noise of the whole batch),
    the samples are gathered so both pair exactly what one process pairs, then each rank scores half of
    every step's 7 pairs (4 and 3) through DDP / FSDP (an AutoModelForSequenceClassification sharded per decoder
    layer); one output, one MLflow child run."""
    from rloo_workflow.tracking import store

    (tmp_path / "mlflow").mkdir()
    uri = f"sqlite:///{tmp_path}/mlflow/mlflow.db"
    client = store.mlflow_client(uri)
    parent = client.create_run(store.ensure_experiment(uri, "rloo"), run_name="pipeline").info.run_id
    env = {"MLFLOW_TRACKING_URI": uri, "RLOO_MLFLOW_PARENT_RUN_ID": parent, "RLOO_MLFLOW_RUNS_DIR": str(tmp_path / "runs")}
    _run(_reward_cmd(micro_run, tmp_path, f"distributed.strategy={strategy}", "tracking.enabled=true",
                     "reward.checkpoint_every=2", nproc=2), env)
    weights, history, metrics = single_reward
    start = models.load_reward_model(micro_run["sft"], trained=False).state_dict()  # the head is seeded: the same start
    got = _reward_weights(tmp_path / "out")
    assert _diff(weights, start) > 1e-4  # the steps moved the weights
    print(f"reward {strategy}: max |dw| {_diff(got, weights):.3g}")
    _close(got, weights, start, ATOL["reward"])
    mine = json.loads((tmp_path / "out" / "metrics.json").read_text())
    for key in ("pairs", "train_pairs", "val_pairs", "samples", "sample_accuracy"):
        assert mine[key] == metrics[key], key  # the same pairs
    for key in ("val_accuracy", "train_accuracy"):
        assert mine[key] == pytest.approx(metrics[key], abs=1e-9), key
    got_history = json.loads((tmp_path / "out" / "history.json").read_text())
    assert [h["step"] for h in got_history] == [h["step"] for h in history]
    for a, b in zip(got_history, history, strict=True):
        assert a["reward/loss"] == pytest.approx(b["reward/loss"], rel=RTOL_METRICS)
        assert a["reward/train_accuracy"] == b["reward/train_accuracy"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow", "out", "runs", "work"]
    assert sorted(p.name for p in (tmp_path / "work").iterdir()) == ["checkpoints", "identity.json", "timings.json"]
    runs = client.search_runs([client.get_run(parent).info.experiment_id])
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent]
    assert [(r.info.run_name, r.info.status) for r in children] == [("reward", "FINISHED")] and len(runs) == 2


@pytest.mark.slow
def test_two_processes_in_micro_batches_train_sft_and_the_reward_model_as_one(micro_run, single_sft, single_reward,
                                                                              tmp_path):
    """FSDP with sft.micro_batch_tokens and reward.micro_batch_tokens splitting each rank's share into
    several micro-batches: the weights of one process that takes every step in one pass. The reward
    budget of 1 token puts every pair alone: 4 micro-batches on one rank, 3 on the other, which runs
    a weight-0 stand-in so that both make as many FSDP passes."""
    _run(_sft_cmd(micro_run, tmp_path / "sft", "distributed.strategy=fsdp", "sft.micro_batch_tokens=300", nproc=2))
    _close(_weights(tmp_path / "sft" / "out"), single_sft[0], _weights(micro_run["base_model"]), ATOL["sft"])
    _run(_reward_cmd(micro_run, tmp_path / "reward", "distributed.strategy=fsdp", "reward.micro_batch_tokens=1",
                     nproc=2))
    start = models.load_reward_model(micro_run["sft"], trained=False).state_dict()
    _close(_reward_weights(tmp_path / "reward" / "out"), single_reward[0], start, ATOL["reward"])


@pytest.mark.slow
def test_a_two_process_reward_model_resumes_from_its_checkpoint(micro_run, tmp_path):
    """FSDP: the reward model's checkpoints (gathered by rank 0) are loaded back into the shards, the
    optimizer state with them: a rerun from the newest checkpoint (step 6 of 8) ends bit for bit where
    the uninterrupted run ended."""
    cmd = _reward_cmd(micro_run, tmp_path, "distributed.strategy=fsdp", "reward.checkpoint_every=2", steps=8, nproc=2)
    _run(cmd)
    whole = _reward_weights(tmp_path / "out")
    shutil.rmtree(tmp_path / "out")  # as if the job died after its last checkpoint
    assert checkpoint.latest(tmp_path / "work" / "checkpoints").name == "step_00000006"
    _run(cmd)
    assert json.loads((tmp_path / "work" / "timings.json").read_text())["resumed_from_step"] == 6
    resumed = _reward_weights(tmp_path / "out")
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun starts its workers in sessions of their own)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        for c in children:
            found += [c, *_descendants(c)]
    return found


@pytest.mark.slow
def test_kill_9_of_a_two_process_run_then_rerun_gives_the_same_weights(micro_run, micro_reward, tmp_path_factory):
    """SIGKILL to every process of an FSDP run (the launcher and both ranks, as a node failure or a
    Slurm kill does) after a checkpoint; the rerun resumes and ends bit for bit where an uninterrupted
    2-process run ends."""
    sets = ("distributed.strategy=fsdp", "rloo.checkpoint_every=2")
    whole = tmp_path_factory.mktemp("fsdp_whole")
    _run(_rloo_cmd(micro_run, micro_reward, whole, *sets, steps=8, nproc=2))
    uninterrupted = _weights(whole / "out")

    cut = tmp_path_factory.mktemp("fsdp_cut")
    cmd = _rloo_cmd(micro_run, micro_reward, cut, *sets, steps=8, nproc=2)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=without_stage_server())
    deadline = time.time() + 300
    while checkpoint.latest(cut / "work" / "checkpoints") is None:
        assert proc.poll() is None, "train exited before its first checkpoint"
        assert time.time() < deadline, "no checkpoint appeared"
        time.sleep(0.05)
    # Killed as soon as the first checkpoint (step 2 of 8) is on disk: a random wait measured against the
    # whole run's time (torchrun's start included) could land after rank 0 wrote the output.
    assert proc.poll() is None, "the run finished before the kill: nothing was tested"
    victims = [proc.pid, *_descendants(proc.pid)]
    assert len(victims) >= 3, victims  # torchrun and its two ranks
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    assert not (cut / "out").exists()
    step = int(checkpoint.latest(cut / "work" / "checkpoints").name.split("_")[1])
    assert 0 < step < 8

    _run(cmd)
    assert json.loads((cut / "work" / "timings.json").read_text())["resumed_from_step"] >= step
    resumed = _weights(cut / "out")
    assert all(torch.equal(uninterrupted[k], resumed[k]) for k in uninterrupted)


@pytest.mark.slow
def test_two_processes_select_the_best_snapshot(micro_run, micro_reward, tmp_path):
    """`rloo.select: best` under FSDP: the snapshots are gathered and written by rank 0, and the one
    selected is loaded back into the shards before the output is written. The micro policy solves
    nothing, so every evaluation ties at 0 and the best is the starting policy itself."""
    _run(_rloo_cmd(micro_run, micro_reward, tmp_path, "distributed.strategy=fsdp", "rloo.select=best",
                   "rloo.eval_every=1", steps=2, nproc=2))
    assert json.loads((tmp_path / "out" / "metrics.json").read_text())["selected_step"] == 0
    out, sft = _weights(tmp_path / "out"), _weights(micro_run["sft"])
    assert all(torch.equal(out[k], sft[k]) for k in sft)
    assert checkpoint.read_snapshot(tmp_path / "work" / "best")["step"] == 0


# -- LoRA and gradient checkpointing under FSDP (docs/scaling.md) ----------------------------------
LORA = "model.lora.enabled=true"
GC = "model.gradient_checkpointing=true"


@pytest.fixture(scope="module")
def single_lora(micro_run, micro_reward, tmp_path_factory):
    """One process's 3 RLOO steps with LoRA: the merged weights."""
    tmp = tmp_path_factory.mktemp("single_lora")
    _run_here(_rloo_cmd(micro_run, micro_reward, tmp, LORA))
    return _weights(tmp / "out")


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "option"), [("fsdp", "lora"), ("fsdp", "gradient_checkpointing"), ("ddp", "lora")])
def test_two_processes_train_lora_and_checkpointed_rloo_as_one(micro_run, micro_reward, single_rloo, single_lora,
                                                               tmp_path, strategy, option):
    """FSDP over a peft model (frozen base shards, trainable adapters; the merged weights gathered on rank
    0), FSDP with checkpointed layers (their recompute under the shards), DDP with LoRA (only the adapters
    in its gradient buckets): the single process's weights after 3 steps (LoRA: the single LoRA run's;
    checkpointing: the plain run's)."""
    done = _run(_rloo_cmd(micro_run, micro_reward, tmp_path, LORA if option == "lora" else GC,
                          f"distributed.strategy={strategy}", nproc=2))
    if option == "gradient_checkpointing":
        assert "gradient checkpointing: 2 decoder layers" in done.stderr
    want = single_lora if option == "lora" else single_rloo["sequence"][0]
    _close(_weights(tmp_path / "out"), want, _weights(micro_run["sft"]), ATOL["rloo"])


@pytest.mark.slow
def test_two_fsdp_processes_train_sft_with_lora_and_checkpointing_as_one(micro_run, tmp_path_factory):
    single, double = tmp_path_factory.mktemp("sft_lora_1"), tmp_path_factory.mktemp("sft_lora_2")
    _run_here(_sft_cmd(micro_run, single, LORA, GC))
    _run(_sft_cmd(micro_run, double, LORA, GC, "distributed.strategy=fsdp", nproc=2))
    _close(_weights(double / "out"), _weights(single / "out"), _weights(micro_run["base_model"]), ATOL["sft"])


@pytest.mark.slow
def test_an_fsdp_lora_run_resumes_from_its_adapter_checkpoint_bit_for_bit(micro_run, micro_reward, tmp_path):
    """FSDP + LoRA: the checkpoint holds the gathered adapters alone; a rerun of the same 4 steps from the
    step-2 checkpoint (each rank taking its shards of them back) writes the first run's weights, bit for bit."""
    cmd = _rloo_cmd(micro_run, micro_reward, tmp_path, LORA, "distributed.strategy=fsdp", "rloo.checkpoint_every=2",
                    "rloo.lr=1.0e-3", steps=4, nproc=2)
    _run(cmd)
    first = _weights(tmp_path / "out")
    assert _diff(first, _weights(micro_run["sft"])) > 1e-4  # the adapters moved the merged weights
    saved = checkpoint.latest(tmp_path / "work" / "checkpoints")
    from safetensors.torch import load_file

    assert saved.name == "step_00000002" and all(".lora_" in k for k in load_file(str(saved / "model.safetensors")))
    shutil.rmtree(tmp_path / "out")
    assert "resumed from" in _run(cmd).stderr
    resumed = _weights(tmp_path / "out")
    assert all(torch.equal(first[k], resumed[k]) for k in first)
