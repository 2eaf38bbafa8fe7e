"""One RLOO run from a policy folder: the trainer of `rloo.estimator` (rloo/train/rloo_trainer.py, or PPO's,
rloo/train/ppo.py) on one training loop (resume, the divergence guard, checkpoints), validation with the
checkpoint of best accuracy kept, the alarms that stop a run, and the output folder (the policy's weights,
steps.jsonl, metrics.json). `rloo train` runs it on the pipeline's files (rloo_workflow/stages/rloo.py);
`rloo.api.train_rloo` on a notebook's rows and reward function.
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path

import numpy as np

from rloo.algo.estimators import MovingBaseline
from rloo.console import console
from rloo.errors import MissingInputError
from rloo.model import checkpoint, distributed
from rloo.reward.rewards import FunctionReward, HttpReward, RewardSource
from rloo.settings import Config, RlooConfig, RolloutCorrectionConfig
from rloo.train import alarms
from rloo.train.loop import TrainingLoop, write_model_output
from rloo.train.rloo_trainer import RlooTrainer
from rloo.train.run_log import RunLog

log = logging.getLogger("rloo.train")

# The per-step figures `rloo summary` reports the run's mean of (rloo/algo/rollout_correction.py).
MISMATCH_KEYS = ("mismatch_abs_mean", "mismatch_abs_max", "mismatch_k3_token", "mismatch_k3_seq",
                 "mismatch_out_of_band", "correction_truncated_share", "correction_masked_share")
# Off-policy, the whole sampler-to-trainer ratio and, where measured, its policy-lag factor (rloo/train/correction.py).
OFF_POLICY_KEYS = ("offpolicy_abs_mean", "offpolicy_abs_max", "offpolicy_k3_token", "offpolicy_out_of_band",
                   "lag_abs_mean", "lag_k3_token", "correction_truncated_share")


def check_sampling(rc: RlooConfig) -> list[str]:
    """Loud warnings for sampling settings that bias the estimator (the article's sampling mismatch)."""
    problems = []
    if rc.temperature != 1.0:
        problems.append(f"rloo.temperature={rc.temperature}")
    if rc.top_p < 1.0:
        problems.append(f"rloo.top_p={rc.top_p}")
    if rc.top_k:
        problems.append(f"rloo.top_k={rc.top_k}")
    for p in problems:
        log.warning(
            "!!! %s: training samples no longer come from the policy whose log-probabilities are "
            "differentiated; the RLOO gradient is biased. Sample with temperature 1.0, no top-p/top-k.", p
        )
    return problems


def make_trainer(config: Config | Mapping, policy_dir: str | Path, reward: RewardSource, train: list[dict],
                 reward_model_dir: str | Path | None = None, source: str = "the rows handed in") -> RlooTrainer:
    """The trainer of `rloo.estimator`: PPO (its critic grown from the policy or the reward model), or
    the critic-free RlooTrainer for every other estimator (`source` names `train` in errors)."""
    config = config if isinstance(config, Config) else Config.from_config(config)
    rc = config.rloo
    if rc.estimator != "ppo":
        return RlooTrainer(config, policy_dir, reward, train, source)
    from rloo.train.ppo import PPOTrainer

    critic_dir = policy_dir
    if rc.ppo.critic_init == "reward_model":
        if not reward_model_dir:
            raise MissingInputError("rloo.ppo.critic_init=reward_model: no reward model folder given (--reward-model)")
        critic_dir = reward_model_dir
    return PPOTrainer(config, policy_dir, reward, train, critic_dir, source)


def _samples(history: list[dict], rc: RlooConfig) -> int:
    """Samples drawn over these steps: B * k each, plus dynamic sampling's extra rounds."""
    return sum(rc.prompts_per_step * rc.k + x.get("train/extra_samples", 0) for x in history)


def _means(history: list[dict], keys: tuple[str, ...]) -> dict[str, float]:
    """The run's mean of each train/<key> over the steps where it is finite (keys never logged left out)."""
    means = {}
    for key in keys:
        values = [x[f"train/{key}"] for x in history if math.isfinite(x.get(f"train/{key}", math.nan))]
        if values:
            means[key] = float(np.mean(values))
    return means


def _mismatch_summary(history: list[dict], correction: RolloutCorrectionConfig) -> dict | None:
    """The run's mean of each train/mismatch_* and train/correction_* figure and the correction applied
    (`correction` resolved); None when the mismatch was not measured (the sampler reported no
    log-probabilities; off-policy without rloo.rollout_correction.mismatch_every)."""
    means = _means(history, MISMATCH_KEYS)
    return {**means, "mode": correction.mode, "cap": correction.cap} if "mismatch_abs_mean" in means else None


def _off_policy_summary(history: list[dict], rc: RlooConfig, correction: RolloutCorrectionConfig) -> dict:
    """An off-policy run's lag, the correction it applied (resolved) and the run's mean of the whole ratio's
    figures and of the lag's."""
    return {"off_policy_steps": rc.off_policy_steps, "mode": correction.mode, "cap": correction.cap,
            "mismatch_every": correction.mismatch_every, **_means(history, OFF_POLICY_KEYS)}


def _final_mean(values: list[float]) -> float | None:
    """The mean of the finite `values` (None, which JSON can hold, where there is none)."""
    finite = [v for v in values if math.isfinite(v)]
    return float(np.mean(finite)) if finite else None


def run(config: Config, policy_dir: str | Path, rows: list[dict], out_dir: str | Path, work_dir: str | Path,
        fingerprint: str, *, val: list[dict], reward: RewardSource, reward_model_dir: str | Path | None = None,
        log_to: RunLog | Callable[[dict, int], None] | None = None, facts: dict[str, int] | None = None,
        source: str = "the rows handed in") -> dict:
    """Train the policy in `policy_dir` on the prompt rows `rows` ({question, answer, ...}) and write `out_dir` (save_pretrained policy,
    steps.jsonl, metrics.json); return the run's summary (metrics.json) and its run facts (times, peak
    memory, the step it resumed from).

    Checkpoints go to `work_dir`; one made for the same `fingerprint` (what a checkpoint must match) is
    resumed. The policy written is the one of `rloo.select`: `best`, the checkpoint of highest accuracy on
    `val` (the starting policy itself, step 0, included), or `last`. A run stops early when an alarm named
    in `rloo.stop_on` fires. Every step's figures go to `log_to` (a RunLog, or a `log(metrics, step)`); the
    run's facts (`facts`, such as its thread count, with its times) to it and to `work_dir`/timings.json.

    Data-parallel (the process group set up beforehand: rloo/model/distributed.py), every process runs
    this, each training on its share of every step; rank 0 alone writes the outputs, the best snapshot and
    the checkpoints."""
    rc = config.rloo
    check_sampling(rc)
    out_dir, work_dir = Path(out_dir), Path(work_dir)
    trainer = make_trainer(config, policy_dir, reward, rows, reward_model_dir, source)
    try:
        loop = resumed_loop(trainer, rc, work_dir, fingerprint, log_to)
        select = checkpoint.Selection(work_dir / "best", rc.select == "best" and rc.eval_every > 0)
        t_start = time.perf_counter()
        stopped = train_steps(loop, trainer, rc, val, select)
        seconds = time.perf_counter() - t_start
        h = trainer.history
        trained = h[-1]["step"] + 1 if h else 0
        chosen = select.best if select.enabled and select.best else {"step": trained, **(trainer.evals[-1] if (
            trainer.evals and trainer.evals[-1]["step"] == trained) else {})}
        if select.enabled and select.best and select.best["step"] != trained:
            checkpoint.load_snapshot(select.folder, trainer.policy)
        summary = summarize(trainer, rc, reward, chosen, trained, stopped)
        timings = loop.record_timings(
            run_facts(trainer, reward, facts),
            train_seconds=seconds,
            # the samples this process drew (dynamic sampling's extra rounds included), per second
            samples_per_second=_samples([x for x in h if x["step"] >= loop.start], rc) / max(seconds, 1e-9),
            seconds_per_step=seconds / max(trained - loop.start, 1))
        loop.run_log.metrics({"rloo/selected_step": chosen["step"]}, trained)
        loop.check_weights(trained, "the output")
        # Per-step wall-clock times (time/*) go to the run's log only: the output is a function of its inputs.
        steps = [{k: v for k, v in x.items() if not k.startswith("time/")} for x in h]
        write_model_output(out_dir, trainer.adapted, trainer.policy, trainer.tokenizer,
                           {"steps.jsonl": steps, "metrics.json": summary})
        log.info("rloo done: %s", {**{k: v for k, v in summary.items() if k != "evals"}, **timings})
        return {**summary, **timings}
    finally:
        trainer.close()  # the off-policy sampler ends; a vLLM engine frees its memory (and its process)


def resumed_loop(trainer: RlooTrainer, rc: RlooConfig, work_dir: Path, fingerprint: str,
                 log_to: RunLog | Callable[[dict, int], None] | None) -> TrainingLoop:
    """The run's training loop, resumed from `work_dir`'s newest checkpoint of this `fingerprint` (the
    trainer's evaluations, moving baseline and lagged weights restored with it) or started afresh (an
    earlier run's best snapshot removed); the off-policy sampler started on the next step's batch."""
    best_dir = work_dir / "best"
    loop = TrainingLoop.for_stage("rloo", trainer.config, work_dir, trainer.policy, trainer.optimizer, trainer.scheduler,
                                  fingerprint, log=log_to, keep=rc.keep_checkpoints,
                                  state=lambda: {"evals": trainer.evals, "baseline": asdict(trainer.baseline)},
                                  companions=trainer.companions(), tensors=lambda: {"lagged": trainer.lagged_state()})
    trainer.guard = loop.finite  # the trainer asks before every optimizer step
    # The step-0 evaluation is the only record logged outside the history.
    extra = loop.resume(replay=lambda extra: [e for e in extra.get("evals", []) if e["step"] == 0])
    trainer.history = loop.history  # one list: the loop saves it, the alarms read it
    lagged = extra.get("tensors", {}).get("lagged")
    if loop.start:
        trainer.evals = extra.get("evals", [])
        trainer.baseline = MovingBaseline(**extra["baseline"]) if extra.get("baseline") else trainer.baseline
        trainer.rollout.sync_weights(trainer.policy)  # rollout backend (issue 8): engine holds policy_dir's weights
        if trainer.lagged is not None and lagged is None:
            raise checkpoint.CheckpointError(f"{loop.ckpt_dir}: an off-policy run's checkpoint of step "
                                             f"{loop.start} without its lagged weights; delete {loop.ckpt_dir} "
                                             "to start this stage afresh")
    elif distributed.is_main():
        shutil.rmtree(best_dir, ignore_errors=True)  # a best snapshot of another run
    distributed.barrier()
    if loop.start < rc.steps:  # off-policy: the sampler starts on the next batch (beside the evaluation)
        trainer.start_lagged(loop.start, lagged)
    return loop


def validate(trainer: RlooTrainer, rc: RlooConfig, val: list[dict], select: checkpoint.Selection, done: int) -> dict:
    """The policy after `done` steps evaluated on `val`, with the reward-hacking alarm over the evaluations
    so far, and offered to `select`."""
    e = {"step": done, **trainer.evaluate(val, rc.eval_examples, rc.eval_draws)}
    trainer.evals.append(e)
    e["alarm/reward_hacking"] = int(alarms.reward_hacking(
        [x["eval/accuracy_sampled"] for x in trainer.evals], [x["eval/proxy_reward"] for x in trainer.evals],
        min(rc.eval_examples, len(val)) * rc.eval_draws, trainer.alarm_cfg.hacking_z))
    select.offer(e, trainer.policy)
    log.info("eval after %d steps: %s", done, {k: round(v, 4) for k, v in e.items() if k != "step"})
    return e


def train_steps(loop: TrainingLoop, trainer: RlooTrainer, rc: RlooConfig, val: list[dict],
                select: checkpoint.Selection) -> dict | None:
    """The loop's steps, the policy validated every `rloo.eval_every` steps (and first the starting policy,
    where `select` keeps the best); returns where an alarm of `rloo.stop_on` stopped the run, or None."""
    stopped = None
    if select.enabled and not trainer.evals:  # the starting policy is a candidate too
        loop.run_log.metrics({k: v for k, v in validate(trainer, rc, val, select, 0).items() if k != "step"}, 0)
    for step in loop:
        m = trainer.step(step)
        done = step + 1
        if rc.eval_every and (done % rc.eval_every == 0 or done == rc.steps):
            m.update({k: v for k, v in validate(trainer, rc, val, select, done).items() if k != "step"})
        loop.log(m, step, reward=f"{m['train/reward_mean']:.3f}", kl=f"{m['train/kl']:.3f}")
        if fired := [a for a in rc.stop_on if m.get(f"alarm/{a}")]:
            stopped = {"step": done, "alarm": fired[0]}
            log.warning("rloo.stop_on: alarm/%s fired after %d steps; stopping here", fired[0], done)
            loop.finish()
    return stopped


def summarize(trainer: RlooTrainer, rc: RlooConfig, reward: RewardSource, chosen: dict, trained: int,
              stopped: dict | None) -> dict:
    """The run's summary (metrics.json): what was trained and selected, the last 10 steps' reward and KL,
    the samples drawn, the sampling mismatch, the alarms, the evaluations and, where they apply, the
    off-policy figures and each reward function's mean."""
    h = trainer.history
    last10 = h[-10:]
    summary = {
        "steps": rc.steps,
        "steps_trained": trained,
        "samples_per_step": rc.prompts_per_step * rc.k,
        "estimator": rc.estimator,
        "reward_source": reward.name,
        "select": rc.select,
        "selected_step": chosen["step"],
        "selected_val_accuracy_sampled": chosen.get("eval/accuracy_sampled"),
        "stopped_early": stopped,
        "final_reward_mean": float(np.nanmean([x["train/reward_mean"] for x in last10])) if last10 else math.nan,
        "final_kl": float(np.mean([x["train/kl"] for x in last10])) if last10 else math.nan,
        # Samples drawn in all (dynamic sampling draws more than B*k a step) and the share of trained
        # groups without signal, over the whole run.
        "samples_generated": _samples(h, rc),
        "zero_adv_frac_mean": float(np.mean([x["train/zero_adv_frac"] for x in h])) if h else math.nan,
        "sampling_mismatch": _mismatch_summary(h, trainer.correction_settings),
        "alarms": alarms.first_alarms(h),
        "evals": trainer.evals,
        "networks": trainer.networks(),  # parameters of every network the stage holds
    }
    if trainer.lagged is not None:
        summary["off_policy"] = _off_policy_summary(h, rc, trainer.correction_settings)
    if isinstance(reward, FunctionReward):  # each function, and its mean reward over the last 10 steps
        summary["reward_functions"] = {f.name: {"fn": f.fn, "weight": f.weight, "final_mean": _final_mean(
            [x.get(f"train/reward/{f.name}", math.nan) for x in last10])} for f in reward.functions}
    return summary


def run_facts(trainer: RlooTrainer, reward: RewardSource, facts: dict[str, int] | None) -> dict[str, int]:
    """The run's facts beside `facts`: the reward server's record (a rerun's may differ: not an output) and
    the off-policy sampler's."""
    if isinstance(reward, HttpReward):
        client = reward.client
        facts = {**(facts or {}), "reward_server_requests": client.requests,
                 "reward_server_retries": client.retries.count, "reward_server_failed": client.failed}
        if distributed.is_main():
            console(f"rloo: {client.summary()}", log)
    return {**(facts or {}), **(trainer.lagged.facts if trainer.lagged is not None else {})}
