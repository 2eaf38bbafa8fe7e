"""Held-out evaluation of one policy: the one function SFT's final eval, RLOO's periodic eval and the
evaluate stage share, so `accuracy_sampled` means the same everywhere: the mean over `draws`
independent T = 1 samples per problem (`sampled_draws` says how many)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np
import torch

from rloo.algo.losses import sequence_kl
from rloo.data.prompting import PromptFormat
from rloo.eval.records import problem_records
from rloo.eval.reward_figures import reward_figures
from rloo.eval.tool_use import tool_use
from rloo.model.logprobs import completion_logprobs, join, model_device
from rloo.progress import Progress
from rloo.reward.verifier import Mode, is_correct
from rloo.rollout import generate
from rloo.rollout.tools import ToolRunner
from rloo.runtime import autocast, inference_dtype, step_generator
from rloo.settings import Config, PromptConfig
from rloo.tools import Toolbox


class Scorer(Protocol):
    """What scores completions as a proxy: any reward source (rloo.reward.rewards), not imported here so that
    a stage that evaluates without one does not count the reward sources as its code."""

    def score(self, prompts: list[str], completions: list[str], golds: list[str],
              finished: list[bool]) -> torch.Tensor: ...


def record_arguments(source: object, rows: list[dict], completion_ids) -> dict:
    """The keyword arguments a reward source's `score` takes beyond the four every source takes: the
    completions' data records and token ids (`completion_ids`: the ids, or a function giving them, called
    only when needed), for a source that reads them (`reads_records`: reward functions, a reward server;
    rloo.reward.rewards), else none."""
    if not getattr(source, "reads_records", False):
        return {}
    return {"rows": rows, "completion_ids": completion_ids() if callable(completion_ids) else completion_ids}


class Components(Protocol):
    """A training reward made of named parts with weights: the user's reward functions, or a reward
    server as one part (rloo.reward.rewards.FunctionReward, HttpReward)."""

    weights: dict[str, float]

    def components(self, prompts: list[str], completions: list[str], finished: list[bool], rows: list[dict],
                   completion_ids: list[list[int]] | None = None) -> dict[str, list[float | None]]: ...


@dataclass(frozen=True)
class EvalSpec:
    """How to evaluate: the `prompt` config (rloo.data.prompting), the token budget, the sampled draws per
    problem, the decoding batch (rows per call), the sampling noise's (seed, stream), the autocast mode."""

    prompt: PromptConfig
    max_new_tokens: int
    draws: int
    batch_size: int
    seed: int
    stream: int
    autocast: str = "none"
    logits_chunk_tokens: int = 0  # the KL pass's log-probabilities: the head applied this many tokens at a time
    inference_dtype: str | None = None  # model.inference_dtype: the decoding's dtype (None: the weights')
    progress_every_s: float = Config.progress_every_s  # how often a long pass reports (rloo/progress.py)
    tools: Toolbox | None = None  # `tools:` (rloo/tools): the tools the completions call; None = none
    without_tools: bool = False  # with tools: evaluate_with_records decodes a second time without them


@dataclass
class Decoded:
    """One decoding pass over the prompts: greedy, or one sampled draw."""

    texts: list[str] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)  # tokens, EOS included
    finished: list[bool] = field(default_factory=list)  # ended with EOS within the budget
    ids: list[list[int]] = field(default_factory=list)  # token ids, EOS included
    kl: list[float] = field(default_factory=list)  # sequence KL to the reference (sampled draws only)
    calls: list[int] = field(default_factory=list)  # tool calls of each completion (with tools only)


@torch.no_grad()
def decode(policy, tokenizer, ids: list[list[int]], spec: EvalSpec, greedy: bool, reference=None,
           label: str = "policy", records: list[dict] | None = None) -> list[Decoded]:
    """Completions of the prompt `ids`: greedy (one pass), or `spec.draws` samples per prompt at T = 1.

    The draws of a prompt are decoded side by side (its prompt prefilled once, its keys shared),
    `spec.batch_size` rows per call. The noise of the call at prompt offset s depends only on
    (seed, s, stream), so every evaluation of a run sees the same noise (checkpoints compare fairly).
    With a `reference`, each sample's KL(π‖π_ref) is estimated on it (k1 is unbiased on π's samples).
    """
    device = model_device(policy)
    draws = 1 if greedy else spec.draws
    out = [Decoded() for _ in range(draws)]
    per_call = max(1, spec.batch_size // draws)
    what = "greedy" if greedy else f"{draws} draw{'s' if draws > 1 else ''}"
    progress = Progress(f"evaluate: {label}, {what}", len(ids), spec.progress_every_s, unit="problem")
    runner = None if spec.tools is None else ToolRunner(spec.tools, tokenizer)
    for s in range(0, len(ids), per_call):
        rows = [p for p in ids[s : s + per_call] for _ in range(draws)]
        tools = {} if runner is None else {"tools": runner, "records": None if records is None else
                                           [r for r in records[s : s + per_call] for _ in range(draws)]}
        with autocast(spec.autocast, device):
            ro = generate(policy, rows, max_new_tokens=spec.max_new_tokens, eos_id=tokenizer.eos_token_id,
                          pad_id=tokenizer.pad_token_id, greedy=greedy, dtype=inference_dtype(spec.inference_dtype, device),
                          generator=step_generator(spec.seed, s, stream=spec.stream), **tools)
            kl = None
            if not greedy and reference is not None:
                batch = join(ro.prompt_ids, ro.prompt_mask, ro.completions, ro.completion_mask)
                chunk = spec.logits_chunk_tokens
                kl = sequence_kl(completion_logprobs(policy, batch, logits_chunk_tokens=chunk),
                                 completion_logprobs(reference, batch, logits_chunk_tokens=chunk),
                                 ro.loss_mask.to(batch.completion_mask.dtype)).tolist()  # the policy's tokens
        texts, lengths, finished = ro.texts(tokenizer), ro.lengths.tolist(), ro.finished.tolist()
        completion_ids = ro.token_ids()
        for j, d in enumerate(out):
            d.texts += texts[j::draws]
            d.ids += completion_ids[j::draws]
            d.lengths += lengths[j::draws]
            d.finished += finished[j::draws]
            d.kl += kl[j::draws] if kl is not None else []
            d.calls += ro.tool_calls.tolist()[j::draws] if ro.tool_calls is not None else []
        progress.update(len(rows) // draws)
    progress.close()
    return out


def accuracy(texts: list[str], golds: list[str], mode: Mode = "strict") -> float:
    """Share of completions whose answer the verifier finds equal to the gold answer."""
    if not texts:
        return 0.0
    return sum(is_correct(t, g, mode) for t, g in zip(texts, golds, strict=True)) / len(texts)


@torch.no_grad()
def evaluate_policy(policy, tokenizer, rows: list[dict], spec: EvalSpec, reference=None,
                    proxy: Scorer | None = None, label: str = "policy",
                    training_reward: Components | None = None) -> tuple[dict, dict[str, list[str]]]:
    """Verifier accuracy of `policy` on `rows` (greedy, and sampled as the mean of `spec.draws` draws;
    strict and flexible), mean sampled length, KL to `reference` and the `proxy` reward's mean over the
    sampled completions where given (else None); with `training_reward`, each of its parts' rewards of
    every sampled draw (`training_reward_parts`: one {part: rewards} per draw; the evaluate stage turns
    them into figures, rloo.eval.reward_figures). Also the completions by mode, for a pairwise judge:
    `greedy`, and `sampled` = the first draw (an LLM judge is paid per comparison); `draws`, each
    problem's list of every sampled draw (per-problem correctness: rloo.eval.gains, rloo.reward.solution_check);
    and what the evaluate stage records of each completion (rloo.eval.records): `greedy_lengths`,
    `greedy_finished`, and per problem per draw `draw_lengths`, `draw_finished`, `draw_kl` (None without
    a reference) and `draw_proxy` (with a proxy)."""
    fmt = PromptFormat(tokenizer, spec.prompt)
    prompts = [fmt.prompt(r["question"]) for r in rows]
    golds = [r["answer"] for r in rows]
    ids = [fmt.encode(p) for p in prompts]
    greedy = decode(policy, tokenizer, ids, spec, greedy=True, label=label, records=rows)[0]
    draws = decode(policy, tokenizer, ids, spec, greedy=False, reference=reference, label=label, records=rows)
    per_draw = [accuracy(d.texts, golds, "strict") for d in draws]
    report = {
        "accuracy": accuracy(greedy.texts, golds, "strict"),
        "accuracy_flexible": accuracy(greedy.texts, golds, "flexible"),
        "accuracy_sampled": float(np.mean(per_draw)),
        "accuracy_sampled_flexible": float(np.mean([accuracy(d.texts, golds, "flexible") for d in draws])),
        "accuracy_sampled_draws": per_draw,
        "sampled_draws": len(draws),
        "kl": float(np.mean([x for d in draws for x in d.kl])) if reference is not None else None,
        "mean_length": float(np.mean([x for d in draws for x in d.lengths])),
        "proxy_reward": None,
        "examples": len(rows),
    }
    if spec.tools is not None:  # tool calls per completion (rloo/rollout/tools.py)
        report["tool_calls"] = float(np.mean(greedy.calls))
        report["tool_calls_sampled"] = float(np.mean([x for d in draws for x in d.calls]))
    per_problem = {"lengths": _by_problem(d.lengths for d in draws), "finished": _by_problem(d.finished for d in draws),
                   "kl": _by_problem(d.kl for d in draws) if reference is not None else None}
    if proxy is not None:  # what the reward the policy is judged by as a proxy thinks of these samples
        per_draw = [proxy.score(prompts, d.texts, golds, d.finished, **record_arguments(proxy, rows, d.ids))
                    for d in draws]
        scores = torch.cat(per_draw)
        ok = torch.isfinite(scores)
        report["proxy_reward"] = float(scores[ok].mean()) if ok.any() else None
        per_problem["proxy"] = _by_problem(s.tolist() for s in per_draw)
    if training_reward is not None:  # the reward RLOO trains on, part by part
        report["training_reward_parts"] = [training_reward.components(prompts, d.texts, d.finished, rows, d.ids)
                                           for d in draws]
    texts = {"greedy": greedy.texts, "sampled": draws[0].texts, "draws": _by_problem(d.texts for d in draws),
             # what the evaluate stage records of every completion (rloo.eval.records)
             "greedy_lengths": greedy.lengths, "greedy_finished": greedy.finished, **{f"draw_{k}": v for k, v in
                                                                                      per_problem.items()}}
    return report, texts


def evaluate_with_records(policy, tokenizer, rows: list[dict], spec: EvalSpec, reference=None,
                          proxy: Scorer | None = None, label: str = "policy",
                          training_reward: Components | None = None) -> tuple[dict, list[dict], dict[str, list]]:
    """`evaluate_policy`, and what the evaluate stage writes of it (rloo.eval.records): (the figures, the
    training reward's parts made figures with their intervals (rloo.eval.reward_figures); a record per
    problem; the completions). The evaluate stage and rloo.api.evaluate share it.

    With tools, the figures add how the completions used them (rloo.eval.tool_use); with
    `spec.without_tools` too, the policy is decoded a second time without the tools, with the same noise
    (the spec's seed and stream), and its accuracies (`without_tools` in the figures), its completions
    (`without_tools` in each record and in the completions) sit beside those with the tools: the tool's
    paired gain is computed from them (rloo.eval.gains.add_tool_figures)."""
    report, texts = evaluate_policy(policy, tokenizer, rows, spec, reference=reference, proxy=proxy, label=label,
                                    training_reward=training_reward)
    report.pop("examples")  # one figure for the whole result
    parts = report.pop("training_reward_parts", None)
    if training_reward is not None:
        report["training_reward"] = reward_figures(parts, training_reward.weights)
    if spec.tools is not None:
        report.update(tool_use(texts, [r["answer"] for r in rows], spec.tools))
        if spec.without_tools:  # accuracy only: no KL, proxy or training reward on the second pass
            without, texts["without_tools"] = evaluate_policy(policy, tokenizer, rows, replace(spec, tools=None),
                                                              label=f"{label} without tools")
            report["without_tools"] = {k: without[k] for k in WITHOUT_TOOLS_FIGURES}
    return report, problem_records(rows, texts, parts), texts


# What the figures keep of the pass without the tools (the report adds its intervals, pass@k and maj@k).
WITHOUT_TOOLS_FIGURES = ("accuracy", "accuracy_flexible", "accuracy_sampled", "accuracy_sampled_flexible",
                         "accuracy_sampled_draws", "sampled_draws", "mean_length")


def _by_problem(per_draw) -> list[list]:
    """Per-draw lists (draws x problems) as per-problem lists (problems x draws)."""
    return [list(values) for values in zip(*per_draw, strict=True)]


def spec_for(config: Config | Mapping, section: str, max_new_tokens: int, draws: int, stream: int) -> EvalSpec:
    """A stage's EvalSpec: the config's prompt, seed, autocast and progress interval, and its own section's decoding
    batch (`<section>.eval_batch_size`, or `evaluate.batch_size`): the batch decides which noise each
    row draws, so it must be a key the stage reruns on."""
    config = config if isinstance(config, Config) else Config.from_config(config)
    part = getattr(config, section)
    batch = part.batch_size if section == "evaluate" else part.eval_batch_size
    return EvalSpec(prompt=config.prompt, max_new_tokens=max_new_tokens, draws=draws, batch_size=batch,
                    seed=config.seed, stream=stream, autocast=config.model.autocast,
                    logits_chunk_tokens=config.model.logits_chunk_tokens, inference_dtype=config.model.inference_dtype,
                    progress_every_s=config.progress_every_s, tools=Toolbox.from_config(config))


# The evaluate stage's decoding noise: a stream of its own, so that no training evaluation (SFT's 7, RLOO's
# validation 11) shares it.
EVALUATE_STREAM = 21


def evaluate_spec(config: Config | Mapping) -> EvalSpec:
    """The evaluate stage's EvalSpec (`evaluate.*`: the token budget, the draws, the batch; the config's seed,
    its own stream): rloo.api.evaluate uses it too, so both decode every problem with the same noise."""
    config = config if isinstance(config, Config) else Config.from_config(config)
    ec = config.evaluate
    spec = spec_for(config, "evaluate", ec.max_new_tokens, ec.samples_per_prompt, stream=EVALUATE_STREAM)
    return replace(spec, without_tools=config.tools.on and config.tools.evaluate_without)
