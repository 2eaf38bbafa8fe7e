"""The scored groups a step trains on: k completions of each of the step's B prompts from a rollout
backend, scored by the training reward (`StepBatches.collect`). The trainer holds one over its live
policy; off-policy (rloo/train/off_policy.py) another samples with the lagged weights, in the trainer's
process or in a sampler process of its own.

Everything `collect(step)` draws depends only on (seed, step) and the weights the rollout samples with
(rloo/rollout/collect.py), so whichever object or process runs it, it gives the same bytes.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from rloo.eval.evaluation import record_arguments
from rloo.model import distributed
from rloo.reward.rewards import RewardSource
from rloo.rollout import Rollout
from rloo.rollout.collect import REFILL_STREAM, Collected, gather, prompt_indices
from rloo.rollout.tools import ToolRunner
from rloo.runtime import step_generator
from rloo.settings import Config
from rloo.tools import Toolbox


class StepBatches:
    """Sampling (`rollout`, a backend of rloo.rollout) and scoring (`reward`) of the training prompts
    `train`, whose rendered texts and token ids are `prompts` and `prompt_ids`."""

    def __init__(self, config: Config, tokenizer, rollout, reward: RewardSource, train: list[dict], prompts: list[str],
                 prompt_ids: list[list[int]], device: torch.device, gathered: torch.nn.Module | None = None) -> None:
        self.rc, self.seed = config.rloo, config.seed
        self.tokenizer, self.rollout, self.reward = tokenizer, rollout, reward
        self.train, self.prompts, self.prompt_ids = train, prompts, prompt_ids
        self.device = device
        self.gathered = gathered  # the module to gather while sampling (FSDP: the sharded policy)
        box = Toolbox.from_config(config)
        self.tools = None if box is None else ToolRunner(box, tokenizer)  # `tools:`, none by default

    def generate(self, prompts: list[list[int]], **kwargs) -> Rollout:
        ro = self.rollout.generate(prompts, max_new_tokens=self.rc.max_new_tokens,
                                   eos_id=self.tokenizer.eos_token_id, pad_id=self.tokenizer.pad_token_id, **kwargs)
        return ro.to(self.device)  # vLLM hands its samples back on the CPU

    def tool_arguments(self, idx: np.ndarray, repeat: int) -> dict:
        """The tools and the records of the prompts `idx` (each `repeat` times) a sampling call runs them
        with; nothing without tools, so the samplers' calls stay as they were."""
        return {} if self.tools is None else {"tools": self.tools, "records": [self.train[i] for i in idx for _ in range(repeat)]}

    def sample(self, idx: np.ndarray, step: int, round_: int = 0, noise_rows: tuple[int, int] | None = None) -> Rollout:
        k = self.rc.k
        return self.generate(
            [self.prompt_ids[i] for i in idx for _ in range(k)],
            temperature=self.rc.temperature, top_p=self.rc.top_p, top_k=self.rc.top_k,
            generator=step_generator(self.seed, step, stream=(REFILL_STREAM + round_) if round_ else 0),
            **({"noise_rows": noise_rows} if noise_rows else {}), **self.tool_arguments(idx, k),
        )

    def score(self, idx: np.ndarray, ro: Rollout, repeat: int) -> tuple[torch.Tensor, list[str]]:
        rows = [i for i in idx for _ in range(repeat)]
        texts = ro.texts(self.tokenizer)
        scores = self.reward.score(
            [self.prompts[i] for i in rows], texts, [self.train[i]["answer"] for i in rows], ro.finished.tolist(),
            **record_arguments(self.reward, [self.train[i] for i in rows], ro.token_ids),
        )
        return scores.float().to(self.device), texts

    def collect(self, step: int) -> Collected:
        """The groups step `step` trains on: k samples for each of its B prompts, scored; with
        `rloo.dynamic_sampling`, only groups whose raw rewards differ, refilled from further prompts
        (`rloo.rollout.collect.gather`). Depends on (seed, step) and the rollout's weights only.

        Data-parallel, a process takes its contiguous share of the B prompts with their k samples each
        (a group's leave-one-out baseline stays within the process) and samples only those rows, with
        the noise one process sampling all B * k rows would give them (`noise_rows`)."""
        rc = self.rc
        idx, noise_rows = prompt_indices(len(self.train), step, rc.prompts_per_step, self.seed), None
        if distributed.enabled():
            lo, hi = distributed.shard(len(idx))
            idx, noise_rows = idx[lo:hi], (lo * rc.k, len(idx) * rc.k)
        tally = getattr(self.reward, "tally", None)  # reward functions: each one's rewards this step
        if tally is not None:
            tally.clear()
        held = distributed.gathered(self.gathered) if self.gathered is not None else contextlib.nullcontext()
        with held:
            got = gather(
                idx, lambda idx, round_: self.sample(idx, step, round_, noise_rows),
                lambda idx, ro: self.score(idx, ro, rc.k)[0],
                k=rc.k, n_prompts=len(self.train), seed=self.seed, step=step,
                pad_id=self.tokenizer.pad_token_id, dynamic=rc.dynamic_sampling,
                max_rounds=rc.dynamic_sampling_max_rounds,
            )
        if tally is not None:  # train/reward/<name>: over every completion scored (dynamic sampling's dropped too)
            got.stats.update(tally.means("train/reward/"))
        return got
