"""RLOO from Python, without the pipeline: one call trains a policy folder on prompt rows with a reward
function, through the same trainer, estimator, divergence guard, checkpoints, validation and metrics as
`rloo train` (rloo/train/train_rloo.py).

    from rloo.api import Config, RlooConfig, train_rloo

    def correct(completions, answer, **kwargs):       # TRL's form: one float (or None) per completion
        return [1.0 if c.strip().endswith(a.split("####")[-1].strip()) else 0.0 for c, a in zip(completions, answer)]

    summary = train_rloo("my-sft-model", rows, correct, "runs/rloo", validation=held_out,
                         config=Config(rloo=RlooConfig(k=4, steps=100, lr=5e-5)), log=print_metrics)

Nothing of the pipeline (config files, Snakemake, MLflow, DVC) is imported: a notebook, a script or
another framework's loop can use it as it is.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from rloo.errors import InputError
from rloo.io import config_hash
from rloo.reward.functions import RewardFunction
from rloo.reward.rewards import FunctionReward, RewardSource, VerifierReward
from rloo.runtime import setup
from rloo.settings import Config, ModelConfig, PromptConfig, RlooConfig
from rloo.train.run_log import RunLog
from rloo.train.train_rloo import bookkeeping
from rloo.train.train_rloo import train_rloo as _train

__all__ = ["Config", "ModelConfig", "PromptConfig", "RewardSource", "RlooConfig", "RunLog", "VerifierReward",
           "train_rloo"]

Reward = RewardSource | Callable | Sequence[Callable | tuple[Callable, float]]


def reward_source(reward: Reward) -> RewardSource:
    """A reward source from what a caller hands in: a source as it is (rloo.reward.rewards), one function in
    TRL's form, or several (each alone, weight 1, or as (function, weight)): their weighted sum."""
    if hasattr(reward, "score"):
        return reward  # type: ignore[return-value]
    parts = [reward] if callable(reward) else list(reward)
    return FunctionReward([RewardFunction.of(*p) if isinstance(p, tuple) else RewardFunction.of(p) for p in parts])


def _fingerprint(config: Config, policy: Path, prompts: Sequence[Mapping], source: RewardSource) -> str:
    """What a checkpoint must match to be resumed: the settings that shape the trajectory, the prompts, the
    starting policy's config and weights index, and the reward's functions by name."""
    cfg = config.to_config()
    for dotted in bookkeeping(config.rloo):
        section, key = dotted.split(".", 1)
        cfg[section].pop(key, None)
    h = hashlib.sha256(config_hash(cfg, ["seed", "model", "prompt", "rloo"]).encode())
    h.update(json.dumps([dict(r) for r in prompts], sort_keys=True, default=str).encode())
    for path in [policy / "config.json", *sorted(policy.glob("*.safetensors"))]:
        h.update(f"{path.name}:{path.stat().st_size}".encode())
    h.update(json.dumps([f.fn for f in getattr(source, "functions", [])] or [source.name]).encode())
    return h.hexdigest()[:16]


def train_rloo(policy: str | Path, prompts: Sequence[Mapping], reward: Reward, out_dir: str | Path, *,
               validation: Sequence[Mapping] = (), config: Config | RlooConfig | None = None,
               work_dir: str | Path | None = None, log: RunLog | Callable[[dict, int], None] | None = None) -> dict:
    """Train the policy in the folder `policy` (a transformers causal LM with its tokenizer) with RLOO on
    `prompts` (rows of at least `question`; their other fields, `answer` among them, reach the reward
    functions as columns) and write the trained policy, steps.jsonl and metrics.json to `out_dir`.

    `reward`: a function in TRL's form (`f(completions, **kwargs) -> list[float | None]`), several
    (weighted), or a RewardSource. `validation`: held-out rows (with `answer`) the policy is evaluated on
    every `rloo.eval_every` steps, the best checkpoint kept (`rloo.select`). `config`: the settings (an
    RlooConfig alone is the `rloo` section; default: the pipeline's defaults). Checkpoints go to `work_dir`
    (default: beside `out_dir`), and a rerun of the same call resumes from them. `log(metrics, step)`
    receives every step's figures. Returns the run's summary (metrics.json) and its wall-clock figures."""
    config = Config(rloo=config) if isinstance(config, RlooConfig) else config or Config()
    if problems := config.problems():
        raise InputError("invalid settings:\n  " + "\n  ".join(problems))
    rc = config.rloo
    if rc.eval_every and not validation:
        raise InputError("validation rows are needed to evaluate every rloo.eval_every steps; pass validation= "
                         "(held-out rows with their answers) or RlooConfig(eval_every=0, select='last')")
    if not prompts:
        raise InputError("no prompts to train on")
    out_dir, policy = Path(out_dir), Path(policy)
    work_dir = Path(work_dir) if work_dir is not None else out_dir.with_name(out_dir.name + ".work")
    source = reward_source(reward)
    threads = setup(config.threads, config.seed)
    return _train(config, policy, [dict(r) for r in prompts], [dict(r) for r in validation], source, out_dir,
                  work_dir, _fingerprint(config, policy, prompts, source), log_to=log, facts={"threads": threads})
