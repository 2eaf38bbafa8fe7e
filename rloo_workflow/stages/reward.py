"""`rloo reward`: the Bradley-Terry reward model on the pipeline's files: the SFT policy and the training
split. The run itself (pairs from labelled SFT samples, one training loop, held-out pairwise accuracy) is
rloo/train/reward.py's; this module reads the inputs, names what a checkpoint must match and logs to the
stage's MLflow run.
"""

from __future__ import annotations

from pathlib import Path

from rloo.data.gsm8k import read_split
from rloo.model import distributed
from rloo.runtime import setup
from rloo.settings import Config
from rloo.train import reward
from rloo_workflow import pipeline, tracking


def run(cfg: dict, data_dir: str | Path, policy_dir: str | Path, out_dir: str | Path,
        work_dir: str | Path | None = None) -> dict:
    """Train the reward model on pairs sampled from `policy_dir` (the SFT stage's folder) on `data_dir`'s
    training split and write `out_dir` (save_pretrained + metrics.json, history.json): rloo.train.reward.
    Checkpoints go to `work_dir` (default: a `work` folder next to `out_dir`); a rerun resumes. Under
    torchrun with `distributed.strategy` ddp or fsdp every process runs this."""
    config = Config.of(cfg)
    distributed.init(config)
    threads = setup(distributed.threads(config.threads), config.seed)
    out_dir = Path(out_dir)
    work_dir = Path(work_dir) if work_dir is not None else out_dir.parent / "work" / out_dir.name
    # what a checkpoint must match: the job's resume identity (rloo.identity)
    fingerprint = distributed.fingerprint(pipeline.input_identity(cfg, "reward", {"prepare": data_dir, "sft": policy_dir}).resume)
    return reward.run(config, policy_dir, read_split(data_dir, "train"), out_dir, work_dir,
                      fingerprint, log_to=tracking.STAGE_LOG, facts={"threads": threads},
                      source=str(Path(data_dir) / "train.jsonl"))
