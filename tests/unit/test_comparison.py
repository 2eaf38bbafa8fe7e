"""The comparison refuses runs that are not like for like (rloo_workflow.stages.comparison.require_fair)."""

from __future__ import annotations

import copy

import pytest

from rloo.errors import InputError
from rloo_workflow.stages.comparison import compare


def _result(name: str) -> dict:
    """One evaluation result as `rloo evaluate` writes it, trimmed to what the comparison reads."""
    policy = {"accuracy": 0.5, "accuracy_sampled": 0.4, "kl": 0.1, "mean_length": 30.0}
    return {"policies": {"sft": {"accuracy": 0.45, "accuracy_sampled": 0.35, "kl": 0.0}, name: policy},
            "win_rates": {}, "gains": {}, "examples": 8, "data_manifest_sha256": "abc",
            "training": {name: {"steps": 4, "samples_per_step": 8, "evals": []}}}


def test_like_for_like_runs_compare_and_say_so():
    table = compare({"rloo": _result("rloo"), "grpo": _result("grpo")})
    assert set(table["checks"]) == {"same_data", "same_examples", "same_sft_accuracy", "same_steps",
                                    "same_samples_per_step"} and all(table["checks"].values())


@pytest.mark.parametrize(("change", "message"), [
    (lambda r: r.update(data_manifest_sha256="def"), r"data differs \(rloo: abc, grpo: def\)"),
    (lambda r: r.update(examples=9), r"examples differs \(rloo: 8, grpo: 9\)"),
    (lambda r: r["policies"]["sft"].update(accuracy=0.5), r"sft accuracy differs"),
    (lambda r: r["training"]["grpo"].update(steps=8), r"steps differs \(rloo: 4, grpo: 8\)"),
    (lambda r: r["training"]["grpo"].update(samples_per_step=16), r"samples per step differs"),
    (lambda r: r.update(data_manifest_sha256=None), r"grpo: no data manifest"),
])
def test_runs_that_differ_are_refused_naming_what_differs(change, message):
    other = copy.deepcopy(_result("grpo"))
    change(other)
    with pytest.raises(InputError, match=message):
        compare({"rloo": _result("rloo"), "grpo": other})


def test_the_highest_greedy_accuracy_is_best_and_equal_ones_are_a_tie():
    results = {name: _result(name) for name in ("rloo", "grpo", "reinforce")}
    results["grpo"]["policies"]["grpo"]["accuracy"] = 0.6
    assert compare(results)["best_by_accuracy"] == "grpo" and compare(results)["tie_by_accuracy"] is None
    results["reinforce"]["policies"]["reinforce"]["accuracy"] = 0.6  # the table's order must not pick one
    table = compare(results)
    assert table["best_by_accuracy"] is None and table["tie_by_accuracy"] == ["grpo", "reinforce"]
