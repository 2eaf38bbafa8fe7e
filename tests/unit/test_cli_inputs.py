"""`rloo <stage>` checks the inputs of the one input graph (rloo_workflow.pipeline.input_graph, which the
Snakemake rules read too) before it loads anything: a missing one is one line naming its path, where the
path came from (the option, else the config) and the stage that writes it."""

from __future__ import annotations

from pathlib import Path

import pytest

from rloo_workflow import cli, pipeline

ROOT = Path(__file__).resolve().parents[2]
MICRO = str(ROOT / "config" / "micro.yaml")


def _last_error(capsys, *argv: str) -> str:
    code = cli.main([*argv, "-c", MICRO, "--set", "tracking.enabled=false"])
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("verb", ["base", "sft", "reward", "train", "evaluate"])
def test_a_missing_data_folder_is_named_for_every_stage_that_reads_it(verb, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert "prepare" in pipeline.upstream(pipeline.BY_VERB[verb].name, _cfg())
    assert _last_error(capsys, verb) == (f"rloo {verb}: error: data/gsm8k (paths.data) does not exist: the prepare "
                                         "stage writes it (rloo prepare, or snakemake runs it)")


def _cfg() -> dict:
    from rloo_workflow.config import load_config

    return load_config(MICRO, {"tracking": {"enabled": False}})


@pytest.mark.parametrize(("verb", "options", "missing"), [
    # each stage's first upstream model after the data, from the graph: the option's name is the input's
    ("sft", [], "results/models/base (the base output) does not exist: the base stage writes it (rloo base"),
    ("sft", ["--base", "elsewhere"], "elsewhere (--base) does not exist: the base stage writes it (rloo base"),
    ("reward", [], "results/models/sft (the sft output) does not exist: the sft stage writes it (rloo sft"),
    ("train", ["--policy", "p"], "p (--policy) does not exist: the sft stage writes it (rloo sft"),
    ("train", ["--set", "rloo.estimator=ppo", "--set", "rloo.ppo.critic_init=reward_model", "--set",
               "reward.source=verifier", "--policy", "."],
     "results/models/reward (rloo.ppo.critic_init=reward_model) does not exist: the reward stage writes it"),
    ("evaluate", ["--sft", ".", "--policy", "grpo=results/models/grpo"],
     "results/models/grpo (the grpo policy) does not exist: the rloo stage writes it (rloo train"),
    ("report", [], "results/eval/rloo.jsonl (the rloo evaluation) does not exist: the evaluate stage writes it"),
])
def test_a_missing_upstream_output_names_its_path_origin_and_writer(verb, options, missing, tmp_path, capsys,
                                                                    monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "gsm8k").mkdir(parents=True)
    assert _last_error(capsys, verb, *options).startswith(f"rloo {verb}: error: {missing}")


def test_an_input_the_command_reads_only_where_given_is_not_required(tmp_path, capsys, monkeypatch):
    """The evaluation's proxy reward model is an input of the rule, and of `rloo evaluate` only with
    --reward-model: without it the check goes on to the next input."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "gsm8k").mkdir(parents=True)
    assert "reward_model" in pipeline.input_graph("evaluate", _cfg())
    assert _last_error(capsys, "evaluate").startswith("rloo evaluate: error: results/models/sft (the sft output)")
    assert _last_error(capsys, "evaluate", "--sft", ".", "--policy", "rloo=.", "--reward-model", "rm").startswith(
        "rloo evaluate: error: rm (--reward-model) does not exist: the reward stage writes it")
