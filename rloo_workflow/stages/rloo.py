"""`rloo train`: the RLOO stage on the pipeline's files: the SFT policy, the training and validation splits,
the configured reward; the run itself (REINFORCE Leave-One-Out with a frozen reference and no critic, or PPO
with one, on one training loop) is rloo/train/rloo.py's. This module reads the inputs, names what a
checkpoint must match, logs to the stage's MLflow run and reports what it wrote.
"""

from __future__ import annotations

import logging
from pathlib import Path

from rloo.data.gsm8k import read_split
from rloo.eval import report
from rloo.model import distributed
from rloo.reward.rewards import build_reward
from rloo.rollout.collect import training_prompts
from rloo.runtime import setup
from rloo.settings import Config
from rloo.train import rloo
from rloo_workflow import pipeline, tracking

log = logging.getLogger("rloo.train")


def run(
    cfg: dict,
    data_dir: str | Path,
    policy_dir: str | Path,
    out_dir: str | Path,
    work_dir: str | Path,
    reward_model_dir: str | Path | None = None,
) -> dict:
    """Train and write `out_dir` (save_pretrained policy + steps.jsonl + metrics.json): rloo.train.rloo.run
    on `data_dir`'s splits (the training prompts of at least rloo.min_solution_steps steps), the reward of
    `reward.source` and `policy_dir`, logged to the stage's MLflow run.

    Under torchrun with `distributed.strategy` ddp or fsdp every process runs this, each training on its
    share of every step (rloo/train/rloo_trainer.py); rank 0 alone writes the outputs and logs to MLflow.
    """
    config = Config.of(cfg)
    distributed.init(config)
    threads = setup(distributed.threads(config.threads), config.seed)
    rc = config.rloo
    data_dir = Path(data_dir)
    train = training_prompts(read_split(data_dir, "train"), rc.min_solution_steps)
    val = read_split(data_dir, "val")
    reward = build_reward(cfg, str(reward_model_dir) if reward_model_dir else None)
    # what a checkpoint must match: the job's resume identity (rloo.identity)
    inputs = {"prepare": data_dir, "sft": policy_dir, "reward": reward_model_dir}
    fingerprint = pipeline.input_identity(cfg, "rloo", inputs).resume
    summary = rloo.run(config, policy_dir, train, out_dir, work_dir, distributed.fingerprint(fingerprint), val=val,
                       reward=reward, reward_model_dir=reward_model_dir, log_to=tracking.STAGE_LOG,
                       facts={"threads": threads},
                       source=f"{data_dir / 'train.jsonl'}: the prompts of rloo.min_solution_steps="
                              f"{rc.min_solution_steps} or more solution steps")
    for line in report.rloo_lines(summary):
        log.warning(line) if line.startswith("!!") else log.info(line)
    return summary
