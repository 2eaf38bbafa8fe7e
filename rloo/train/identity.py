"""A training run's identity: what a checkpoint must match to be resumed (rloo/train/loop.py refuses one of
another identity). One formula for the three training runs, from a stage's files or from `rloo.api`'s
rows: the run's settings less the keys it may change and still resume (`BOOKKEEPING`), what it trains on
(the data folder's manifest, or the rows), the model it starts from (its config and weights index) and the
user's reward code. The workflow reads the keys a stage does not read from here too
(rloo_workflow.pipeline.STAGES: a change of them reruns no job either).
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from rloo import tools
from rloo.io import config_hash, sha256_file
from rloo.settings import Config

# The config sections each run's settings are read from: the RLOO run reads the reward's too.
SECTIONS = {"sft": ("seed", "model", "prompt", "sft"), "reward": ("seed", "model", "prompt", "reward"),
            "rloo": ("seed", "model", "prompt", "reward", "rloo")}
# What scores RLOO's samples: the reward model's run does not read it.
NOT_READ_BY_REWARD_MODEL = ("reward.source", "reward.batch_size_score", "reward.functions", "reward.http")
# The keys a run may change and still resume its checkpoints: the checkpoint interval, what the run does
# not read, and (RLOO) what changes what is written, not the trajectory: evaluation, selection, stopping
# rules. `bookkeeping` adds the keys that depend on other settings.
BOOKKEEPING: dict[str, tuple[str, ...]] = {
    "sft": (),
    "reward": ("reward.checkpoint_every", *NOT_READ_BY_REWARD_MODEL, "model.shape"),
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
                 reward_names: Sequence[str] = (), reward_files: Sequence[str | Path] = ()) -> str:
    """The identity (16 hex digits) of `stage`'s run (sft, reward or rloo) on `config`: its settings
    (`SECTIONS`, less `bookkeeping`), then what it trains on, the data folder `data_dir` (its manifest) or
    the `rows`, the model folder it starts from (`model_dir`: its config and the name and size of each
    weights file), the names of the reward functions given as code (`reward_names`), and the content of the
    reward files the config names (`reward_files`: a checkpoint of an earlier version of the user's reward
    code is not resumed)."""
    part = copy.deepcopy(config.to_config())
    tools_on = stage in ("sft", "rloo") and config.tools.on
    # the tools, where enabled (without, the identity is what it was): SFT masks their results, RLOO runs them
    part = {k: part.get(k) for k in (*SECTIONS[stage], *(("tools",) if tools_on else ()))}
    for dotted in bookkeeping(stage, config):
        section, key = dotted.split(".", 1)
        (part.get(section) or {}).pop(key, None)
    h = hashlib.sha256(config_hash(part).encode())
    if data_dir is not None and (manifest := Path(data_dir) / "manifest.json").is_file():
        h.update(manifest.read_bytes())
    if rows is not None:
        h.update(json.dumps([dict(r) for r in rows], sort_keys=True, default=str).encode())
    if model_dir is not None:
        if (model_config := Path(model_dir) / "config.json").is_file():
            h.update(model_config.read_bytes())
        for weights in sorted(Path(model_dir).glob("*.safetensors")):
            h.update(f"{weights.name}:{weights.stat().st_size}".encode())
    if reward_names:
        h.update(json.dumps(list(reward_names)).encode())
    identity = h.hexdigest()[:16]
    code = [*reward_files, *(tools.user_files(config) if tools_on else ())]  # the user's tool code too
    if code:  # over the settings' identity, as the stage has hashed them since they were added
        identity = hashlib.sha256((identity + "".join(sha256_file(f) for f in code)).encode()).hexdigest()[:16]
    return identity
