"""Each stage's code inputs (rloo/code_inputs.py): the files a rule reruns on, so they must hold the
stage's own module and everything it imports, and a stage whose module is missing must fail loudly."""

import pytest

from rloo.code_inputs import module_sources, stage_sources
from rloo.pipeline import STAGES


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_every_stage_counts_its_own_module_and_the_cli(stage):
    verb = STAGES[stage].verb
    files = stage_sources(verb)
    assert f"rloo/stages/{verb}.py" in files and "rloo/cli.py" in files
    assert "rloo/schemas/config.schema.yaml" in files


def test_the_rloo_stage_counts_the_trainer_and_the_maths():
    files = stage_sources(STAGES["rloo"].verb)
    for f in ("rloo/train/rloo.py", "rloo/train/ppo.py", "rloo/algo/estimators.py", "rloo/algo/losses.py",
              "rloo/model/logprobs.py", "rloo/rollout/collect.py"):
        assert f in files, f


def test_a_module_that_does_not_exist_is_an_error_not_an_empty_closure():
    with pytest.raises(ValueError, match=r"rloo\.stages\.rloo: no such module"):
        module_sources("rloo.stages.rloo")
