"""A batch larger than the data is refused in one way wherever it is found (rloo.settings.training
`batch_within_data`): at validation where the config says how large the training split is
(tests/unit/test_config.py), and at run time where a stage counts its rows, which the config cannot know
(examples longer than the context, rloo.min_solution_steps, the preference pairs the samples give). The
error names the key, the file and the row count, before any step is trained."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rloo.errors import InputError
from rloo.io import sha256_file
from rloo_workflow.stages import reward, sft
from rloo_workflow.stages import rloo as rloo_stage


def _fewer_rows(micro_run, tmp_path: Path, n: int) -> Path:
    """A copy of the micro data folder whose training split holds its first `n` rows (the manifest's
    digest of it updated, as `rloo prepare` would write it)."""
    data = shutil.copytree(micro_run["data"], tmp_path / "data")
    lines = (data / "train.jsonl").read_text().splitlines(keepends=True)
    (data / "train.jsonl").write_text("".join(lines[:n]))
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["sha256"]["train"] = sha256_file(data / "train.jsonl")
    (data / "manifest.json").write_text(json.dumps(manifest))
    return data


def _with(cfg: dict, section: str, **values) -> dict:
    return {**cfg, section: {**cfg[section], **values}}


def test_sft_refuses_a_batch_over_its_examples_naming_key_file_and_count(micro_run, tmp_path):
    data = _fewer_rows(micro_run, tmp_path, 10)  # the config says 256 problems: validation lets 16 pass
    with pytest.raises(InputError) as info:
        sft.run(micro_run["cfg"], data, micro_run["base_model"], tmp_path / "out", tmp_path / "work")
    assert str(info.value) == (f"key 'sft.batch_size': 16 is more than the 10 training examples ({data / 'train.jsonl'}: "
                               "10 rows, 0 longer than model.max_length); lower sft.batch_size to at most 10")
    assert not (tmp_path / "out").exists() and not (tmp_path / "work" / "checkpoints").exists()


def test_rloo_refuses_more_prompts_per_step_than_its_prompts(micro_run, tmp_path):
    data = _fewer_rows(micro_run, tmp_path, 3)
    cfg = _with(_with(micro_run["cfg"], "rloo", min_solution_steps=0), "reward", source="verifier")
    with pytest.raises(InputError) as info:
        rloo_stage.run(cfg, data, micro_run["sft"], tmp_path / "out", tmp_path / "work")
    assert str(info.value) == (f"key 'rloo.prompts_per_step': 4 is more than the 3 training prompts "
                               f"({data / 'train.jsonl'}: the prompts of rloo.min_solution_steps=0 or more solution "
                               "steps); lower rloo.prompts_per_step to at most 3")
    assert not (tmp_path / "out").exists()


def test_the_reward_model_refuses_a_batch_over_its_pairs(micro_run, tmp_path):
    cfg = _with(micro_run["cfg"], "reward", prompts=4, batch_size=1000)
    with pytest.raises(InputError, match=r"^key 'reward\.batch_size': 1000 is more than the (\d+) training pairs "
                                         rf"\({micro_run['data'] / 'train.jsonl'}: pairs of 4 rows' samples, less "
                                         r"reward\.val_fraction's\); lower reward\.batch_size to at most \1$"):
        reward.run(cfg, micro_run["data"], micro_run["sft"], tmp_path / "out", tmp_path / "work")
    assert not (tmp_path / "out").exists()
