"""How the completions used the tools (rloo/eval/tool_use.py) and the tool's paired gain
(rloo.eval.gains.add_tool_figures), on completions written by hand where the answers are known."""

from __future__ import annotations

import numpy as np
import pytest

from rloo.eval.gains import add_tool_figures, correctness, gain
from rloo.eval.tool_use import tool_results, tool_use
from rloo.tools import Tool, Toolbox
from rloo.tools.calculator import calculate

CALC = [("<<", "=", ">>")]


def test_the_results_are_the_first_max_calls_calls_without_their_closing_marker():
    text = "3+4=<<3+4=7>>7, <<7*2=ERROR>> then <<1+1=2>> and <<5*5=2"
    assert tool_results(text, CALC, 8) == ["7", "ERROR", "2", "2"]  # the last cut off by the budget
    assert tool_results(text, CALC, 2) == ["7", "ERROR"]  # later calls are the policy's own text
    assert tool_results("no call #### 3", CALC, 8) == []
    two = [*CALC, ("[[", "=", "]]")]
    assert tool_results("[[5 km=3.107]] and <<2*3=6>>", two, 8) == ["3.107", "6"]


def test_the_error_share_and_the_share_of_right_answers_a_tool_gave():
    box = Toolbox([Tool.of(calculate)], max_calls=2)
    golds = ["3+4=<<3+4=7>>7\n7*2=<<7*2=14>>14\n#### 14", "#### 5"]
    draws = [
        ["3+4=<<3+4=7>>7\n7*2=<<7*2=14>>14\n#### 14",  # right, and 14 is a tool's result
         "7*2=<<7*2=ERROR>>\n#### 14",                    # right, but the tool erred: the policy's own 14
         "5*5=<<5*5=2"],                                   # wrong: a call cut off by the budget
        ["<<10/2=5.0>> <<5-5=0>>\n#### 5",                # right: 5.0 is 5 as a number, not the last result
         "<<1+1=2>> <<2+2=4>> <<4+1=5>>\n#### 5",         # right, but the third call is past max_calls: the policy's
         "<<2*3=6>>\n#### 6"],                             # wrong
    ]
    figures = tool_use({"draws": draws}, golds, box)
    # calls: 2 + 1 + 1 + 2 + 2 + 1 = 9, one of them ERROR; right answers: 4, of which 2 are a tool's result
    assert figures == {"tool_error_share_sampled": pytest.approx(1 / 9), "tool_answer_share_sampled": pytest.approx(2 / 4)}
    none = tool_use({"draws": [["#### 1"], ["#### 9"]]}, ["#### 1", "#### 2"], box)
    assert none == {"tool_error_share_sampled": None, "tool_answer_share_sampled": 0.0}
    assert tool_use({"draws": [["<<1/0=ERROR>> #### 9"]]}, ["#### 1"], box) == {
        "tool_error_share_sampled": 1.0, "tool_answer_share_sampled": None}


def texts(greedy: list[str], draws: list[list[str]]) -> dict:
    return {"greedy": greedy, "sampled": [d[0] for d in draws], "draws": draws}


def test_the_tools_gain_is_paired_and_equals_the_difference_of_the_accuracies():
    golds = [f"#### {i}" for i in range(1, 7)]
    right, wrong = (lambda i: f"#### {i}"), (lambda i: "#### 0")
    with_tools = texts([right(i) for i in range(1, 7)],
                       [[right(i), right(i) if i < 5 else wrong(i)] for i in range(1, 7)])
    with_tools["without_tools"] = texts([right(i) if i < 3 else wrong(i) for i in range(1, 7)],
                                        [[right(i) if i < 4 else wrong(i), wrong(i)] for i in range(1, 7)])
    correct = correctness(with_tools, golds)
    figures = {"without_tools": {"accuracy": 2 / 6}}  # what the evaluation wrote: kept
    add_tool_figures(figures, with_tools, correct, golds, seed=3)
    g = figures["tool_gain"]
    acc_with, acc_without = 10 / 12, 3 / 12  # sampled: right draws of 12, with and without
    assert g["sampled"]["gain"] == pytest.approx(acc_with - acc_without)
    assert g["greedy"]["gain"] == pytest.approx(1 - 2 / 6)
    assert g["sampled"]["ci95"][0] <= g["sampled"]["gain"] <= g["sampled"]["ci95"][1]
    assert g["greedy"]["discordant"] == {"policy_only": 4, "sft_only": 0}
    without = correctness(with_tools["without_tools"], golds)
    assert g == gain(correct, without, 3)  # the one paired gain the report computes between policies
    w = figures["without_tools"]
    assert w["accuracy"] == pytest.approx(2 / 6) and w["pass_at_k"]["value"] == pytest.approx(3 / 6)
    assert w["maj_at_k"]["k"] == 2 and w["accuracy_sampled_ci95"] is not None
    plain = {k: v for k, v in with_tools.items() if k != "without_tools"}
    untouched: dict = {}
    add_tool_figures(untouched, plain, correct, golds, seed=3)
    assert untouched == {}
    assert np.array_equal(correct["sampled"], correctness(plain, golds)["sampled"])
