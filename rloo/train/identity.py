"""A training run's identity: what a checkpoint must match to be resumed (rloo/train/loop.py refuses one of
another identity). One formula for the three training runs, from a stage's files or from `rloo.api`'s
rows: the keys the run's stage reads (the pipeline's one declaration, rloo.stages.stage_keys) less the keys
it may change and still resume (`BOOKKEEPING`), what it trains on (the data folder's manifest, or the
rows), the models it starts from (each one's config and weights index), and its code: the library's code
of the run and the user's reward code (rloo.code_fingerprint.training_fingerprint: what the code computes,
so a comment resumes and an edited estimator does not).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from rloo import tools
from rloo.code_fingerprint import training_fingerprint
from rloo.io import config_hash
from rloo.settings import Config
from rloo.settings.selection import drop
from rloo.stages import stage_config

# The keys a run may change and still resume its checkpoints (beside those its stage does not read,
# rloo.stages.STAGES): the checkpoint interval, and (RLOO) what changes what is written, not the
# trajectory: evaluation, selection, stopping rules. `bookkeeping` adds the keys that depend on other settings.
BOOKKEEPING: dict[str, tuple[str, ...]] = {
    "sft": (),
    "reward": ("reward.checkpoint_every",),
    "rloo": ("rloo.checkpoint_every", "rloo.keep_checkpoints", "rloo.eval_every", "rloo.eval_examples",
             "rloo.eval_draws", "rloo.eval_batch_size", "rloo.select", "rloo.stop_on", "rloo.alarms"),
}


def bookkeeping(stage: str, config: Config) -> tuple[str, ...]:
    """`BOOKKEEPING[stage]`, and for RLOO: PPO's settings, which the other estimators' runs do not read, and
    under the constant LR schedule the step count (a run may be extended)."""
    out = BOOKKEEPING[stage]
    if stage != "rloo":
        return out
    rc = config.rloo
    return out + (("rloo.ppo",) if rc.estimator != "ppo" else ()) + (("rloo.steps",) if rc.lr_schedule == "constant" else ())


def run_identity(config: Config, stage: str, *, data_dir: str | Path | None = None,
                 rows: Sequence[Mapping] | None = None, model_dir: str | Path | None = None,
                 reward_model_dir: str | Path | None = None, reward_names: Sequence[str] = (),
                 reward_files: Sequence[str | Path] = (), caller: tuple[str, str] | None = None) -> str:
    """The identity (16 hex digits) of `stage`'s run (sft, reward or rloo) on `config`: the keys its stage
    reads (`stage_config`, less `bookkeeping`), then what it trains on, the data folder `data_dir` (its
    manifest) or the `rows`, the model folders it starts from (`model_dir`, and RLOO's `reward_model_dir`:
    each one's config and the name and size of each weights file), the names of the reward functions given
    as code (`reward_names`), and its code (`code_identity`: `caller`, the (module, function) that starts
    the run and reads its inputs, a workflow stage's, counts too) with the reward files the config names
    (`reward_files`: a checkpoint of an earlier version of the user's reward code is not resumed)."""
    part = stage_config(config.to_config(), stage)
    for dotted in bookkeeping(stage, config):
        drop(part, dotted)
    h = hashlib.sha256(config_hash(part).encode())
    if data_dir is not None and (manifest := Path(data_dir) / "manifest.json").is_file():
        h.update(manifest.read_bytes())
    if rows is not None:
        h.update(json.dumps([dict(r) for r in rows], sort_keys=True, default=str).encode())
    for folder in (model_dir, reward_model_dir):
        if folder is None:
            continue
        if (model_config := Path(folder) / "config.json").is_file():
            h.update(model_config.read_bytes())
        for weights in sorted(Path(folder).glob("*.safetensors")):
            h.update(f"{weights.name}:{weights.stat().st_size}".encode())
    if reward_names:
        h.update(json.dumps(list(reward_names)).encode())
    h.update(code_identity(config, stage, reward_files, caller).encode())
    return h.hexdigest()[:16]


def code_identity(config: Config, stage: str, reward_files: Sequence[str | Path] = (),
                  caller: tuple[str, str] | None = None) -> str:
    """The digest of the code `stage`'s run runs: the library's (rloo.code_fingerprint.TRAINING_CODE), the
    package's reward functions the config names and the user's `reward_files`, each by what it computes."""
    from rloo.reward.functions import package_functions

    functions = package_functions(config) if stage == "rloo" else []
    files = list(reward_files)
    if stage in ("sft", "rloo") and config.tools.on:  # the tools' code, where enabled: SFT masks, RLOO runs them
        files += [f for f in tools.user_files(config) if f not in files]
        functions += [r for r in tools.package_functions(config) if r not in functions]
    return training_fingerprint(stage, files, functions, [caller] if caller else []).digest
