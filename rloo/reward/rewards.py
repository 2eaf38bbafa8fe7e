"""Reward sources for RLOO behind one interface: the verifier, a Bradley-Terry reward model, a judge,
a user's reward functions (rloo/reward/functions.py) or a reward server (rloo/reward/remote.py).

`score(prompts, completions, golds, finished) -> Tensor[N]` with NaN for a missing reward (kept out of
the leave-one-out baselines by the estimators). A source that reads more of a completion says so with
`reads_records = True` (the plug-ins): its callers then also pass `rows=`, the completions' data records,
and `completion_ids=`, their token ids. A completion cut off by the token budget scores 0 from the
verifier: it never produced a final answer.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Protocol

import torch

from rloo.data.prompting import PromptFormat
from rloo.errors import UserError
from rloo.reward.functions import RewardFunction, Tally, arguments, weighted_sum
from rloo.reward.remote import RewardClient
from rloo.reward.verifier import is_correct
from rloo.settings import Config

log = logging.getLogger("rloo.reward.rewards")


class RewardSource(Protocol):
    name: str

    def score(
        self, prompts: list[str], completions: list[str], golds: list[str], finished: list[bool]
    ) -> torch.Tensor: ...


class VerifierReward:
    """1 for a finished completion whose `#### N` equals the gold answer, else 0."""

    name = "verifier"

    def __init__(self, mode: str = "strict") -> None:
        self.mode = mode

    def score(self, prompts, completions, golds, finished) -> torch.Tensor:
        return torch.tensor(
            [float(f and is_correct(c, g, self.mode)) for c, g, f in zip(completions, golds, finished, strict=True)]
        )


class BrokenRewardError(UserError, RuntimeError):
    """The reward source scored none of a batch: training on it would be training on nothing."""


class RewardModelReward:
    """The scalar head of a sequence classifier on prompt + completion, scored in batches."""

    name = "model"

    def __init__(self, model, tokenizer, batch_size: int = 64, max_length: int = 512,
                 prompt_cfg: dict | None = None, inference_dtype: str | None = None) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.inference_dtype = inference_dtype  # model.inference_dtype: None scores in the enclosing precision
        self.format = PromptFormat(tokenizer, prompt_cfg)  # how the rendered prompts were made
        self.batch_size, self.max_length = batch_size, max_length
        self.nonfinite = 0  # running count of NaN/inf scores turned into missing rewards

    @torch.no_grad()
    def score(self, prompts, completions, golds, finished) -> torch.Tensor:
        texts = [p + c for p, c in zip(prompts, completions, strict=True)]
        from rloo.model.logprobs import model_device
        from rloo.runtime import scoring_precision

        with scoring_precision(self.inference_dtype, model_device(self.model)):
            scores = score_texts(self.model, self.format, texts, self.batch_size, self.max_length)
        bad = ~torch.isfinite(scores)
        if len(scores) and bad.all():  # a broken model, not a few missing rewards: stop, do not train at zero advantage
            self.nonfinite += int(bad.sum())
            raise BrokenRewardError(f"the reward model gave non-finite scores to all {len(scores)} completions of "
                                    "the batch: it is broken (diverged, or a damaged file); the run stops here")
        if bad.any():
            n = int(bad.sum())
            self.nonfinite += n
            log.warning("reward model gave %d non-finite scores; they count as missing rewards", n)
            scores = torch.where(bad, torch.full_like(scores, math.nan), scores)
        return scores


@torch.no_grad()
def score_texts(model, fmt: PromptFormat, texts: list[str], batch_size: int, max_length: int) -> torch.Tensor:
    """Reward-model scores [N] in float32 of prompt + completion texts, each followed by the EOS
    (`PromptFormat.scored_ids`); texts are sorted by length so batches pad little."""
    ids = [fmt.scored_ids(t, max_length) for t in texts]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out = torch.empty(len(ids), dtype=torch.float32)
    from rloo.model.logprobs import sequence_scores

    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        out[idx] = sequence_scores(model, [ids[i] for i in idx], fmt.tokenizer.pad_token_id).float().cpu()
    return out


class FunctionReward:
    """`reward.source: function`: the weighted sum of the configured reward functions (NaN where none
    gave a number). Each function's rewards are also tallied (`tally`), for its mean over a step."""

    name = "function"
    reads_records = True

    def __init__(self, functions: list[RewardFunction]) -> None:
        self.functions = functions
        self.weights = {f.name: f.weight for f in functions}
        self.tally = Tally()

    def components(self, prompts: list[str], completions: list[str], finished: list[bool], rows: list[dict],
                   completion_ids: list[list[int]] | None = None) -> dict[str, list[float | None]]:
        """Each function's rewards of the completions, by name."""
        batch = arguments(prompts, completions, finished, rows, completion_ids)
        return {f.name: f(batch) for f in self.functions}

    def score(self, prompts, completions, golds, finished, rows=None, completion_ids=None) -> torch.Tensor:
        values = self.components(prompts, completions, finished, _records(rows, golds), completion_ids)
        self.tally.add(values)
        return torch.tensor(weighted_sum(values, self.weights), dtype=torch.float32)


class HttpReward:
    """`reward.source: http`: the rewards a reward server returns (rloo/reward/remote.py)."""

    name = "http"
    reads_records = True

    def __init__(self, client: RewardClient) -> None:
        self.client = client
        self.weights = {"http": 1.0}  # one figure, as the evaluation reports it

    def components(self, prompts: list[str], completions: list[str], finished: list[bool], rows: list[dict],
                   completion_ids: list[list[int]] | None = None) -> dict[str, list[float | None]]:
        return {"http": self.client.rewards(list(prompts), list(completions), rows)}

    def score(self, prompts, completions, golds, finished, rows=None, completion_ids=None) -> torch.Tensor:
        values = self.components(prompts, completions, finished, _records(rows, golds))["http"]
        return torch.tensor([math.nan if v is None else v for v in values], dtype=torch.float32)


def _records(rows: list[dict] | None, golds: list[str]) -> list[dict]:
    """The completions' data records; where a caller has none, the gold answers alone."""
    return rows if rows is not None else [{"answer": g} for g in golds]


def build_plugin(cfg: Config | Mapping) -> FunctionReward | HttpReward | None:
    """The user's reward functions or reward server that `reward.source` names, else None."""
    config = Config.of(cfg)
    source = config.reward.source
    if source == "function":
        return FunctionReward(RewardFunction.from_config(config))
    if source == "http":
        return HttpReward(RewardClient.from_config(cfg))
    return None


def build_reward(cfg: Config | Mapping, reward_model_dir: str | None = None) -> RewardSource:
    """The training reward named by `reward.source`."""
    sections = Config.of(cfg)
    if sections.reward.source == "verifier":
        return VerifierReward()
    if plugin := build_plugin(cfg):
        return plugin
    if sections.reward.source == "model":
        if not reward_model_dir:
            raise ValueError("reward.source is 'model' but no reward model folder was given (--reward-model)")
        from rloo.model import models

        mc = sections.model
        return RewardModelReward(
            models.load_reward_model(reward_model_dir, **models.load_options(mc)),
            models.load_tokenizer(reward_model_dir, mc.trust_remote_code),
            batch_size=sections.reward.batch_size_score,
            max_length=mc.max_length,
            prompt_cfg=sections.prompt,
            inference_dtype=mc.inference_dtype,
        )
    from rloo.reward.judges import JudgeReward

    return JudgeReward.from_config(cfg)
