"""`rloo sft`: supervised fine-tuning of the reference policy on the pipeline's files: the base stage's
model, the training split, the test split it is evaluated on. The run itself (the loss on the solution
only, one training loop) is rloo/train/sft.py's; this module reads the inputs, names what a
checkpoint must match and logs to the stage's MLflow run.
"""

from __future__ import annotations

from pathlib import Path

from rloo.data.gsm8k import read_split
from rloo.model import base, distributed
from rloo.runtime import setup
from rloo.settings import Config
from rloo.train import sft
from rloo_workflow import pipeline, tracking


def run(cfg: dict, data_dir: str | Path, base_dir: str | Path, out_dir: str | Path, work_dir: str | Path) -> dict:
    """Fine-tune the starting model of `base_dir` (the base stage's folder) on `data_dir`'s training split,
    evaluate it on its test split and write `out_dir` (save_pretrained + metrics.json); resumable via
    `work_dir`. Under torchrun with `distributed.strategy` ddp or fsdp every process runs this
    (rloo.train.sft.run)."""
    config = Config.of(cfg)
    distributed.init(config)
    threads = setup(distributed.threads(config.threads), config.seed)
    data_dir = Path(data_dir)
    train, test = read_split(data_dir, "train"), read_split(data_dir, "test")
    base.check_matches(Path(base_dir), config.model)
    # what a checkpoint must match: the job's resume identity (rloo.identity)
    fingerprint = distributed.fingerprint(pipeline.input_identity(cfg, "sft", {"prepare": data_dir, "base": base_dir}).resume)
    return sft.run(config, base_dir, train, out_dir, work_dir, fingerprint, test=test, log_to=tracking.STAGE_LOG,
                   facts={"threads": threads}, source=str(data_dir / "train.jsonl"))
