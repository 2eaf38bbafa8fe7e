"""Bradley-Terry loss, pair construction, judges and the results file."""

import json
import math
import random
from pathlib import Path

import jsonschema
import pytest
import torch
import yaml

import rloo
from rloo.algo.losses import bradley_terry_loss
from rloo.reward.judges import VerifierJudge, agreement, combine, parse_verdict, win_rate
from rloo.reward.preferences import build_pairs, split_by_prompt
from rloo_workflow.stages.report import RESULTS_SCHEMA


def test_bradley_terry_loss_and_gradient_by_hand():
    chosen = torch.tensor([2.0, 0.0, -1.0], requires_grad=True)
    rejected = torch.tensor([0.0, 0.0, 1.0], requires_grad=True)
    loss = bradley_terry_loss(chosen, rejected)
    expected = -(math.log(1 / (1 + math.exp(-2))) + math.log(0.5) + math.log(1 / (1 + math.exp(2)))) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    loss.backward()
    # d/dc of -log σ(c - r) = -(1 - σ(c - r)) = -σ(r - c); averaged over 3 pairs.
    sig = torch.sigmoid(torch.tensor([-2.0, 0.0, 2.0]))
    torch.testing.assert_close(chosen.grad, -sig / 3)
    torch.testing.assert_close(rejected.grad, sig / 3)


def test_pairs_stay_within_a_prompt_and_never_pair_a_text_with_itself():
    rng = random.Random(0)
    pairs = build_pairs(7, "Q7", " ref #### 3", [" a #### 3", " b #### 4", " a #### 3", " ref #### 3"],
                        [True, False, True, True], max_pairs=10, rng=rng)
    assert {p.prompt_id for p in pairs} == {7}
    assert all(p.chosen != p.rejected for p in pairs)
    assert {(p.chosen, p.rejected) for p in pairs} == {(" ref #### 3", " b #### 4"), (" a #### 3", " b #### 4")}
    assert build_pairs(1, "Q", None, [" x", " y"], [True, True], 10, rng) == []


def test_split_holds_out_whole_prompts():
    rng = random.Random(0)
    pairs = [p for i in range(20) for p in build_pairs(i, f"Q{i}", "ref", ["w1", "w2"], [False, False], 4, rng)]
    tr, val = split_by_prompt(pairs, 0.25, seed=0)
    assert {p.prompt_id for p in tr}.isdisjoint({p.prompt_id for p in val})
    assert len({p.prompt_id for p in val}) == 5


@pytest.mark.parametrize(
    ("first", "swapped", "score"),
    [("A", "B", 1.0), ("B", "A", 0.0), ("A", "A", 0.5), ("tie", "B", 0.5), (None, "B", None), ("A", None, None)],
)
def test_both_orders_combine(first, swapped, score):
    assert combine(first, swapped) == score


class _BiasedJudge:
    """Always prefers whatever is shown first: a pure position bias."""

    name = "biased"

    def judge(self, question, gold, a, b):
        return "A"


class _Garbled:
    name = "garbled"

    def judge(self, question, gold, a, b):
        return parse_verdict("I cannot decide")


def test_win_rate_counts_position_bias_as_ties_and_invalid_separately():
    qs, golds = ["q1", "q2"], ["#### 1", "#### 2"]
    cand, base = ["#### 1", "#### 5"], ["#### 9", "#### 2"]
    wr = win_rate(VerifierJudge(), qs, golds, cand, base)
    assert (wr.wins, wr.losses, wr.ties, wr.invalid) == (1, 1, 0, 0) and wr.value == 0.5
    assert win_rate(_BiasedJudge(), qs, golds, cand, base).as_dict()["ties"] == 2
    bad = win_rate(_Garbled(), qs, golds, cand, base)
    assert bad.invalid == 2 and bad.losses == 0 and math.isnan(bad.value)


def test_agreement_with_the_verifier_counts_decided_pairs_and_keeps_invalid_apart():
    # four questions: the verifier decides the first three (candidate right, wrong, right), ties the last
    qs, golds = ["q1", "q2", "q3", "q4"], ["#### 1", "#### 2", "#### 3", "#### 4"]
    cand, base = ["#### 1", "#### 5", "#### 3", "#### 7"], ["#### 9", "#### 2", "#### 8", "#### 7"]
    ref = win_rate(VerifierJudge(), qs, golds, cand, base).scores
    assert ref == [1.0, 0.0, 1.0, 0.5]
    # a judge that agrees on q1, calls q2 a tie, leaves q3 invalid and ties q4 as the verifier does
    got = agreement([1.0, 0.5, None, 0.5], ref)
    assert got == {"decided_pairs": 3, "judged": 2, "agree": 1, "value": 0.5, "all_pairs_judged": 3, "all_pairs_agree": 2}
    assert agreement(ref, ref)["value"] == 1.0 and agreement([1 - s for s in ref], ref)["value"] == 0.0
    assert agreement([None] * 4, ref)["value"] is None  # nothing judged: unknown, not zero
    # `rloo summary` says it beside the win rate
    from rloo.eval.report import report_lines

    policy = {"accuracy": 0.5, "accuracy_sampled": 0.5, "kl": 0.0}
    wr = {"value": 0.5, "wins": 1, "losses": 1, "ties": 0, "invalid": 0, "ci95": [0.1, 0.9],
          "agreement_with_verifier": {**got, "ci95": [0.1, 0.9]}}
    lines = report_lines({"policies": {"sft": policy, "rloo": policy}, "win_rates": {"rloo": wr}})
    assert "report: rloo vs sft judge agrees with the verifier on 1 of the 2 pairs the verifier decides (0.500 [0.100, 0.900]; 1 left invalid)" in lines, lines


@pytest.mark.parametrize(("reply", "verdict"), [("A", "A"), (" b.", "B"), ("Tie", "tie"), ("neither", None), ("", None)])
def test_parse_verdict(reply, verdict):
    assert parse_verdict(reply) == verdict


def _evaluate(cfg, micro_run, rm, policies: dict[str, str], out: Path) -> dict:
    """Each of `policies` ({name: folder}) evaluated as its own job (rloo evaluate): their records, read back."""
    from rloo.eval import records
    from rloo_workflow.stages import evaluate

    for name, folder in policies.items():
        evaluate.run(cfg, micro_run["data"], micro_run["sft"], name, folder, out / f"{name}.jsonl", rm)
    return {name: records.read(name, out / f"{name}.jsonl") for name in policies}


def test_results_file_matches_its_schema(micro_run, tmp_path):
    from rloo.eval import report
    from rloo_workflow.stages import report as report_stage
    from rloo_workflow.stages import reward
    from rloo_workflow.stages import rloo as rloo_stage

    cfg = json.loads(json.dumps(micro_run["cfg"]))
    cfg["rloo"]["eval_every"] = 2
    rm = tmp_path / "reward"
    metrics = reward.run(cfg, micro_run["data"], micro_run["sft"], rm)
    assert metrics["train_pairs"] > 0 and 0.0 <= metrics["val_accuracy"] <= 1.0
    rloo_stage.run(cfg, micro_run["data"], micro_run["sft"], tmp_path / "rloo", tmp_path / "w", rm)
    out = tmp_path / "gsm8k_rloo.json"
    # each policy evaluated on its own (the base model last here, SFT first: the order is no matter)
    policies = {"sft": str(micro_run["sft"]), "rloo": str(tmp_path / "rloo"), "base": str(micro_run["base_model"])}
    evaluations = _evaluate(cfg, micro_run, rm, policies, tmp_path / "eval")
    result = report_stage.run(cfg, evaluations, "rloo", tmp_path / "rloo", micro_run["data"] / "manifest.json", out,
                              tmp_path / "plots")
    schema = yaml.safe_load(RESULTS_SCHEMA.read_text())
    jsonschema.validate(json.loads(out.read_text()), schema)
    assert set(result["policies"]) == {"sft", "rloo"}
    assert result["policies"]["sft"]["kl"] == 0.0
    for png in result["plots"].values():
        assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the reward model's opinion of every policy, the checkpoint written, who judged what
    assert all(isinstance(p["proxy_reward"], float) for p in result["policies"].values())
    assert result["policies"]["rloo"]["selected_step"] == 4  # micro: select last, 4 steps
    assert result["primary"] == "accuracy_sampled"
    # the data manifest's train/test overlap, in the results and the summary (prepare refuses any unless allowed)
    assert result["train_test_overlap"] == 0
    assert "report: no training problem occurs in the test split" in report.report_lines(result)
    assert "!! report: 3 training problems" in report.report_lines({**result, "train_test_overlap": 3})[0]
    # and the count of those sharing a run of 13 normalised words with a test problem (counted, not refused)
    from rloo.data.manifest import read_manifest

    ngram = read_manifest(micro_run["data"])["train_test_ngram_overlap"]
    assert result["train_test_ngram_overlap"] == ngram and ngram["words"] == 13 and ngram["mode"] == "count"
    assert (f"report: {ngram['count']} training problems share a run of 13 words with a test problem "
            "(data.on_ngram_overlap: count)") in report.report_lines(result)
    trained_on = cfg["reward"]["source"]  # micro.yaml alone: the reward model
    assert trained_on == "model"
    assert result["judges"]["proxy_reward"]["independent_of_training_reward"] is False
    assert result["judges"]["accuracy"]["independent_of_training_reward"] is True
    assert result["judges"]["win_rate"] == {"graded_by": "verifier", "independent_of_training_reward": True}
    assert result["judges"]["solution_check"]["independent_of_training_reward"] is True
    assert result["judges"]["solution_check_work"]["independent_of_training_reward"] is True
    # every solution-check figure is flagged by the part that grades it, the work or the answer
    flagged = [f for part in ("solution_check", "solution_check_work") for f in result["judges"][part]["figures"]]
    assert sorted(flagged) == sorted(set(result["policies"]["sft"]["solution_check"]) - {"completions", "reason"})
    # each trained policy against SFT on the same problems: gain, 95 % interval, p-value
    g, rl, sft = result["gains"]["rloo"], result["policies"]["rloo"], result["policies"]["sft"]
    assert g["sampled"]["gain"] == pytest.approx(rl["accuracy_sampled"] - sft["accuracy_sampled"])
    assert g["greedy"]["gain"] == pytest.approx(rl["accuracy"] - sft["accuracy"])
    for mode in ("sampled", "greedy"):
        lo, hi = g[mode]["ci95"]
        assert lo <= g[mode]["gain"] <= hi and 0 < g[mode]["p_value"] <= 1
    assert (g["n_problems"], g["draws"]) == (result["examples"], cfg["evaluate"]["samples_per_prompt"])
    assert g["bootstrap"]["seed"] == cfg["seed"] and g["bootstrap"]["resamples"] > 0
    wr = result["win_rate"]
    assert wr["ci95"][0] <= wr["value"] <= wr["ci95"][1]
    # ...a deterministic function of the records the evaluations wrote, every draw of every problem, each
    # completion's grade among them
    from rloo.eval.gains import correctness, gain
    from rloo.reward.verifier import is_correct

    golds = evaluations["sft"].golds
    per_problem = {name: correctness(ev.texts(), golds) for name, ev in evaluations.items()}
    assert gain(per_problem["rloo"], per_problem["sft"], cfg["seed"]) == g
    for ev in evaluations.values():
        for rec in ev.records:
            for c in [rec["greedy"], *rec["draws"]]:
                assert c["correct"] == is_correct(c["text"], rec["answer"]) and c["tokens"] > 0
            assert all(isinstance(d["kl"], float) and isinstance(d["proxy"], float) for d in rec["draws"])
    # pass@k and maj@k read the same draws: any right, the majority right, never below the mean
    from rloo.eval.at_k import maj_at_k, pass_at_k

    # the untrained start on the same problems: its row, and what SFT and RLOO each added to it
    assert set(result["base"]["gains"]) == {"sft", "rloo"}
    for name in ("sft", "rloo"):
        assert result["base"]["gains"][name] == gain(per_problem[name], per_problem["base"], cfg["seed"])
    result["policies"]["base"] = result["base"]["policy"]  # checked below like the others
    for name in ("sft", "rloo", "base"):
        p = result["policies"][name]
        assert p["pass_at_k"] == pass_at_k(per_problem[name]["sampled"])
        assert p["maj_at_k"] == maj_at_k(evaluations[name].texts()["draws"], golds)
        assert p["pass_at_k"]["k"] == p["maj_at_k"]["k"] == cfg["evaluate"]["samples_per_prompt"]
        assert p["pass_at_k"]["value"] >= p["accuracy_sampled"]
    # the solution checker beside accuracy: figures, or n/a with a reason where nothing is annotated
    for p in result["policies"].values():
        check = p["solution_check"]
        assert (check["work_right"] is None) == (check["work_checked_share"] == 0) == ("reason" in check)
        assert check["answer_right"] is not None
    lines = report.report_lines(result)
    assert any(x.startswith("report: RLOO − SFT = ") and "points (p " in x for x in lines), lines
    k = cfg["evaluate"]["samples_per_prompt"]
    assert any(x.startswith("report: rloo: pass@") and f", maj@{k} " in x for x in lines), lines
    assert any(x.startswith("report: base (untrained): accuracy sampled ") for x in lines), lines
    assert any(x.startswith("report: rloo: solution check: ") for x in lines), lines
    assert any(x.startswith("report: SFT − BASE = ") for x in lines), lines
    # a policy's evaluation is the same whichever others are evaluated, and in whatever order: RLOO's alone
    alone = _evaluate(cfg, micro_run, rm, {"rloo": str(tmp_path / "rloo")}, tmp_path / "alone")
    assert (tmp_path / "alone" / "rloo.jsonl").read_bytes() == (tmp_path / "eval" / "rloo.jsonl").read_bytes()
    assert alone["rloo"].summary == evaluations["rloo"].summary


def test_judge_independence_follows_the_training_reward():
    from rloo_workflow.stages.report import judge_independence

    on_verifier = judge_independence("verifier", {"verifier"}, proxy=True)
    assert not on_verifier["accuracy"]["independent_of_training_reward"]
    assert not on_verifier["win_rate"]["independent_of_training_reward"]
    # the reward model learnt from verifier-labelled pairs: not independent of a verifier-trained policy
    assert on_verifier["proxy_reward"]["independent_of_training_reward"] is False
    assert on_verifier["solution_check"]["independent_of_training_reward"] is False  # its answer check is the verifier's
    assert on_verifier["solution_check_work"]["independent_of_training_reward"] is True  # no reward reads the work
    assert "answer_right" in on_verifier["solution_check"]["figures"]
    assert "work_right" in on_verifier["solution_check_work"]["figures"]
    on_model = judge_independence("llm", {"model"}, proxy=False)
    assert on_model["accuracy"]["independent_of_training_reward"] and "proxy_reward" not in on_model
    assert on_model["win_rate"] == {"graded_by": "llm", "independent_of_training_reward": True}
    assert not judge_independence("llm", {"judge"}, proxy=False)["win_rate"]["independent_of_training_reward"]
    # no policy's metrics name its training reward: unknown, never independent by default
    unknown = judge_independence("verifier", set(), proxy=True)
    assert {k: v["independent_of_training_reward"] for k, v in unknown.items()} == dict.fromkeys(
        ("accuracy", "win_rate", "solution_check_work", "solution_check", "proxy_reward"), None)

    # reward functions: the verifier among them is the verifier; a user's function or server may read
    # anything, so a figure whose judge is not among them is of unknown independence
    from rloo_workflow.stages.report import trained_on

    functions = {"reward_source": "function", "reward_functions": {
        "correct": {"fn": "rloo.reward.verifier:reward"}, "format": {"fn": "mine.py:format_bonus"}}}
    assert trained_on(functions) == {"verifier", "function"} and trained_on({"reward_source": "model"}) == {"model"}
    both = judge_independence("verifier", trained_on(functions), proxy=False, reward_parts=["correct", "format"])
    assert both["accuracy"]["independent_of_training_reward"] is False
    assert both["solution_check_work"]["independent_of_training_reward"] is None
    assert both["training_reward"] == {"graded_by": "the training reward (correct, format)",
                                       "independent_of_training_reward": False}
    served = judge_independence("llm", {"http"}, proxy=False, reward_parts=["http"])
    assert {k: v["independent_of_training_reward"] for k, v in served.items()} == {
        "accuracy": None, "win_rate": None, "solution_check_work": None, "solution_check": None,
        "training_reward": False}


def test_summary_names_the_checkpoint_and_every_alarm(tmp_path, capsys):
    from rloo.eval import report
    from rloo_workflow.cli import main

    metrics = {"selected_step": 300, "steps_trained": 350, "select": "best", "selected_val_accuracy_sampled": 0.78,
               "stopped_early": {"step": 350, "alarm": "reward_hacking"},
               "alarms": {"zero_signal": 1, "kl_without_reward": None, "length_climb": None, "reward_hacking": 350}}
    lines = report.rloo_lines(metrics)
    assert lines[0].startswith("rloo: wrote the policy after 300 of 350 steps")
    assert [x for x in lines if x.startswith("!!")] == [
        "!! rloo: stopped early after 350 steps: alarm/reward_hacking (rloo.stop_on)",
        "!! rloo: alarm/zero_signal fired at step 1 (docs/failure-modes.md)",
        "!! rloo: alarm/reward_hacking fired at step 350 (docs/failure-modes.md)"]
    (tmp_path / "metrics.json").write_text(json.dumps(metrics))
    assert main(["summary", str(tmp_path / "metrics.json")]) == 0
    assert "alarm/reward_hacking fired at step 350" in capsys.readouterr().err



def test_summary_of_a_file_it_does_not_read_is_one_line(micro_run, capsys):
    """The SFT stage's metrics (its log's last lines say what it did): one line naming the file and the kinds
    `rloo summary` reads, exit status 2, not a traceback."""
    from rloo_workflow.cli import main

    path = micro_run["sft"] / "metrics.json"
    assert main(["summary", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"rloo summary: error: {path}: not a file rloo summary reads; it reads a sweep")


def test_summary_reports_the_sampling_mismatch():
    from rloo.eval import report

    mm = {"mismatch_abs_mean": 0.012, "mismatch_abs_max": 0.9, "mismatch_k3_token": 1e-4, "mismatch_k3_seq": 0.02,
          "mismatch_out_of_band": 0.004, "correction_truncated_share": 0.001, "correction_masked_share": 0.0,
          "mode": "token_tis", "cap": 2.0}
    metrics = {"selected_step": 3, "steps_trained": 3, "select": "last", "sampling_mismatch": mm}
    (line,) = [x for x in report.rloo_lines(metrics) if "sampler vs trainer" in x]
    assert "1.20e-02" in line and "0.4% of tokens outside [1/2, 2]" in line and "token_tis (truncated 0.1%" in line
    assert not any("sampler" in x for x in report.rloo_lines({**metrics, "sampling_mismatch": None}))


def test_sampled_accuracy_averages_independent_draws(micro_run):
    from rloo.data.gsm8k import format_prompt
    from rloo.eval.evaluation import decode, evaluate_policy, spec_for
    from rloo.io import read_jsonl
    from rloo.model import models

    cfg = json.loads(json.dumps(micro_run["cfg"]))
    cfg["evaluate"]["samples_per_prompt"] = 3
    rows = [r for _, r in read_jsonl(micro_run["data"] / "test.jsonl")][:8]
    tok = models.load_tokenizer(micro_run["sft"])
    ref = models.load_causal_lm(micro_run["sft"])
    spec = spec_for(cfg, "evaluate", cfg["evaluate"]["max_new_tokens"], 3, stream=21)
    report, texts = evaluate_policy(models.load_causal_lm(micro_run["sft"]), tok, rows, spec, reference=ref)
    assert len(report["accuracy_sampled_draws"]) == 3
    assert report["accuracy_sampled"] == pytest.approx(sum(report["accuracy_sampled_draws"]) / 3)
    ids = [tok(format_prompt(r["question"], cfg["prompt"]["template"]))["input_ids"] for r in rows]
    first, second, _ = (d.texts for d in decode(ref, tok, ids, spec, greedy=False))
    assert first != second  # each draw has its own noise
    assert texts["sampled"] == first  # the pairwise judge sees the first draw, as with one draw


def test_decoding_in_several_calls_matches_each_slice_decoded_alone(micro_run):
    """More prompts than one call holds: every call decodes its own slice of the prompts (the full
    evaluation set is 500 problems in calls of 256 rows; the micro one fits in one call)."""
    from dataclasses import replace

    from rloo.data.gsm8k import format_prompt
    from rloo.eval.evaluation import decode, spec_for
    from rloo.io import read_jsonl
    from rloo.model import models

    cfg = micro_run["cfg"]
    rows = [r for _, r in read_jsonl(micro_run["data"] / "test.jsonl")][:6]
    tok = models.load_tokenizer(micro_run["sft"])
    policy = models.load_causal_lm(micro_run["sft"])
    ids = [tok(format_prompt(r["question"], cfg["prompt"]["template"]))["input_ids"] for r in rows]
    spec = replace(spec_for(cfg, "evaluate", 12, 1, stream=21), batch_size=2)
    whole = decode(policy, tok, ids, spec, greedy=True)[0]
    parts = [decode(policy, tok, ids[s : s + 2], spec, greedy=True)[0] for s in range(0, len(ids), 2)]
    assert len(whole.texts) == len(rows)
    assert whole.texts == [t for p in parts for t in p.texts]
    assert whole.ids == [i for p in parts for i in p.ids]


def test_other_field_names_and_bare_numbers_through_prepare_and_evaluate(micro_run, tmp_path):
    """config/examples/your-data.yaml's records ({"id", "problem", "result": 85, "steps"}) prepared and
    evaluated on, with reward functions that read the records' own columns (`steps`, `id`)."""
    from rloo.io import read_jsonl
    from rloo_workflow.config import load_config
    from rloo_workflow.stages import evaluate, prepare

    root = Path(rloo.__file__).resolve().parents[1]
    (tmp_path / "columns.py").write_text(
        "def steps(completions, steps, **kwargs):\n    return [float(s) for s in steps]\n\n"
        "def test_id(completions, id, **kwargs):\n    return [float(i.startswith('test-')) for i in id]\n")
    examples = root / "config" / "examples"
    cfg = load_config([root / "config" / "micro.yaml", examples / "your-data.yaml"], {
        "tracking": {"enabled": False},
        "data": {"train_file": str(examples / "data" / "word_problems_train.jsonl"),
                 "test_file": str(examples / "data" / "word_problems_test.jsonl")},
        "evaluate": {"examples": 8, "samples_per_prompt": 2},
        "reward": {"source": "function", "functions": [
            {"name": "correct", "fn": "rloo.reward.verifier:reward"},
            {"name": "steps", "fn": f"{tmp_path}/columns.py:steps", "weight": 0.5},
            {"name": "test_id", "fn": f"{tmp_path}/columns.py:test_id", "weight": 0.0}]}})
    prepare.run(cfg, tmp_path / "data")
    rows = [r for _, r in read_jsonl(tmp_path / "data" / "test.jsonl")][:8]
    assert rows[0]["answer"].startswith("#### ") and {"id", "steps"} <= set(rows[0])
    summary = evaluate.run(cfg, tmp_path / "data", micro_run["sft"], "rloo", str(micro_run["sft"]),
                           tmp_path / "eval" / "rloo.jsonl")
    from rloo.eval.records import read

    evaluation = read("rloo", tmp_path / "eval" / "rloo.jsonl")
    assert evaluation.summary["figures"] == summary and evaluation.summary["reward_parts"] == ["correct", "steps", "test_id"]
    # each draw's parts, in its record: the column each function read
    assert [r["draws"][0]["reward"]["steps"] for r in evaluation.records] == [float(r["steps"]) for r in rows]
    from rloo_workflow.stages import report

    evaluations = {"base": evaluation, "sft": evaluation, "rloo": evaluation}  # one policy, three roles
    result = report.run(cfg, evaluations, "rloo", micro_run["sft"], tmp_path / "data" / "manifest.json",
                        tmp_path / "result.json")
    mean_steps = sum(r["steps"] for r in rows) / len(rows)
    for policy in result["policies"].values():
        parts = policy["training_reward"]["parts"]
        assert parts["steps"]["mean"] == pytest.approx(mean_steps) and parts["test_id"]["mean"] == 1.0
        assert parts["correct"]["mean"] == policy["accuracy_sampled"]  # the verifier, graded against the bare numbers
        assert policy["training_reward"]["weighted_sum"]["mean"] == pytest.approx(
            parts["correct"]["mean"] + 0.5 * mean_steps)
    assert result["examples"] == 8 and result["judges"]["training_reward"]["independent_of_training_reward"] is False
