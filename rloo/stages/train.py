"""`rloo train`: REINFORCE Leave-One-Out on the SFT policy, with a frozen reference and no critic (the
trainer: rloo/train/rloo.py), or PPO with a critic (`rloo.estimator: ppo`, rloo/train/ppo.py), on one training
loop: validation evals, best-checkpoint selection, early stopping on an alarm, resume.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from rloo import tracking
from rloo.algo.estimators import MovingBaseline
from rloo.data.gsm8k import read_split
from rloo.errors import MissingInputError
from rloo.eval import report
from rloo.io import atomic_dir, sha256_file, write_json_atomic
from rloo.model import checkpoint, distributed, lora, models
from rloo.reward.functions import user_files
from rloo.reward.rewards import FunctionReward, RewardSource, build_reward
from rloo.rollout.collect import prompt_indices, training_prompts
from rloo.runtime import run_fingerprint, setup
from rloo.settings import RlooConfig, RolloutCorrectionConfig
from rloo.train import alarms
from rloo.train.loop import TrainingLoop
from rloo.train.rloo import Trainer

# The trainer and the prompt pool are the library's; the stage's names for them stay importable here.
__all__ = ["Trainer", "check_sampling", "make_trainer", "prompt_indices", "run", "training_prompts"]

log = logging.getLogger("rloo.train")


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


def _samples(history: list[dict], rc: RlooConfig) -> int:
    """Samples drawn over these steps: B * k each, plus dynamic sampling's extra rounds."""
    return sum(rc.prompts_per_step * rc.k + x.get("train/extra_samples", 0) for x in history)


# The per-step figures `rloo summary` reports the run's mean of (rloo/algo/rollout_correction.py).
MISMATCH_KEYS = ("mismatch_abs_mean", "mismatch_abs_max", "mismatch_k3_token", "mismatch_k3_seq",
                 "mismatch_out_of_band", "correction_truncated_share", "correction_masked_share")


def _mismatch_summary(history: list[dict], correction: RolloutCorrectionConfig) -> dict | None:
    """The run's mean of each train/mismatch_* and train/correction_* figure and the correction applied;
    None when the sampler reported no log-probabilities."""
    means = {}
    for key in MISMATCH_KEYS:
        values = [x[f"train/{key}"] for x in history if math.isfinite(x.get(f"train/{key}", math.nan))]
        if values:
            means[key] = float(np.mean(values))
    return {**means, "mode": correction.mode, "cap": correction.cap} if means else None


def _final_mean(values: list[float]) -> float | None:
    """The mean of the finite `values` (None, which JSON can hold, where there is none)."""
    finite = [v for v in values if math.isfinite(v)]
    return float(np.mean(finite)) if finite else None


def make_trainer(cfg: dict, policy_dir: str | Path, reward: RewardSource, train: list[dict],
                 reward_model_dir: str | Path | None) -> Trainer:
    """The trainer of `rloo.estimator`: PPO (its critic grown from the policy or the reward model), or
    the critic-free Trainer for every other estimator."""
    rc = RlooConfig.from_config(cfg["rloo"])
    if rc.estimator != "ppo":
        return Trainer(cfg, policy_dir, reward, train)
    from rloo.train.ppo import PPOTrainer

    critic_dir = policy_dir
    if rc.ppo.critic_init == "reward_model":
        if not reward_model_dir:
            raise MissingInputError("rloo.ppo.critic_init=reward_model: no reward model folder given (--reward-model)")
        critic_dir = reward_model_dir
    return PPOTrainer(cfg, policy_dir, reward, train, critic_dir)


def run(
    cfg: dict,
    data_dir: str | Path,
    policy_dir: str | Path,
    out_dir: str | Path,
    work_dir: str | Path,
    reward_model_dir: str | Path | None = None,
) -> dict:
    """Train and write `out_dir` (save_pretrained policy + steps.jsonl + metrics.json).

    The policy written is the one of `rloo.select`: `best`, the checkpoint of highest validation
    accuracy (the SFT policy itself, step 0, included), or `last`. A run stops early when an alarm named
    in `rloo.stop_on` fires.

    Under torchrun with `distributed.strategy` ddp or fsdp every process runs this, each training on its
    share of every step (rloo/train/rloo.py); rank 0 alone writes the outputs, the best snapshot and the
    checkpoints, and logs to MLflow.
    """
    distributed.init(cfg)
    threads = setup(distributed.threads(cfg["threads"]), cfg["seed"])
    rc = RlooConfig.from_config(cfg["rloo"])
    check_sampling(rc)
    data_dir, out_dir, work_dir = Path(data_dir), Path(out_dir), Path(work_dir)
    train = training_prompts(read_split(data_dir, "train"), rc.min_solution_steps)
    val = read_split(data_dir, "val")
    if rc.prompts_per_step > len(train):  # validation refuses one above the split; min_solution_steps can still cut it
        log.warning("!!! rloo.prompts_per_step=%d is more than the %d training prompts (rloo.min_solution_steps=%d): "
                    "each step takes all of them", rc.prompts_per_step, len(train), rc.min_solution_steps)
    reward = build_reward(cfg, str(reward_model_dir) if reward_model_dir else None)
    trainer = make_trainer(cfg, policy_dir, reward, train, reward_model_dir)

    try:
        ckpt_dir, best_dir = work_dir / "checkpoints", work_dir / "best"
        # Under the constant LR schedule a run may be extended (more steps) and resume exactly; a decaying
        # schedule depends on the step count, so there it is part of the fingerprint. Evaluation, selection
        # and stopping rules change what is written, not the training trajectory.
        bookkeeping = ("rloo.checkpoint_every", "rloo.keep_checkpoints", "rloo.eval_every", "rloo.eval_examples",
                       "rloo.eval_draws", "rloo.eval_batch_size", "rloo.select", "rloo.stop_on", "rloo.alarms")
        if rc.estimator != "ppo":
            bookkeeping += ("rloo.ppo",)  # PPO's settings do not touch the other estimators' runs
        if rc.lr_schedule == "constant":
            bookkeeping += ("rloo.steps",)
        fingerprint = run_fingerprint(cfg, ["seed", "model", "prompt", "reward", "rloo"], data_dir, policy_dir,
                                      ignore=bookkeeping)
        if files := user_files(cfg):  # the user's reward code: checkpoints of an earlier version are not resumed
            fingerprint = hashlib.sha256((fingerprint + "".join(sha256_file(f) for f in files)).encode()).hexdigest()[:16]
        fingerprint = distributed.fingerprint(fingerprint)
        loop = TrainingLoop("rloo", rc.steps, ckpt_dir, trainer.policy, trainer.optimizer, trainer.scheduler,
                            fingerprint, rc.checkpoint_every, keep=rc.keep_checkpoints,
                            state=lambda: {"evals": trainer.evals, "baseline": asdict(trainer.baseline)},
                            companions=trainer.companions(), max_nonfinite_steps=rc.max_nonfinite_steps,
                            log=tracking.STAGE_LOG)
        trainer.guard = loop.finite  # the trainer asks before every optimizer step
        # The step-0 evaluation is the only record logged outside the history.
        extra = loop.resume(replay=lambda extra: [e for e in extra.get("evals", []) if e["step"] == 0])
        trainer.history = loop.history  # one list: the loop saves it, the alarms read it
        if loop.start:
            trainer.evals = extra.get("evals", [])
            trainer.baseline = MovingBaseline(**extra["baseline"]) if extra.get("baseline") else trainer.baseline
            trainer.rollout.sync_weights(trainer.policy)  # rollout backend (issue 8): engine holds policy_dir's weights
        elif distributed.is_main():
            shutil.rmtree(best_dir, ignore_errors=True)  # a best snapshot of another run
        distributed.barrier()
        select = checkpoint.Selection(best_dir, rc.select == "best" and rc.eval_every > 0)

        def evaluate(done: int) -> dict:
            e = {"step": done, **trainer.evaluate(val, rc.eval_examples, rc.eval_draws)}
            trainer.evals.append(e)
            e["alarm/reward_hacking"] = int(alarms.reward_hacking(
                [x["eval/accuracy_sampled"] for x in trainer.evals], [x["eval/proxy_reward"] for x in trainer.evals],
                min(rc.eval_examples, len(val)) * rc.eval_draws, trainer.alarm_cfg.hacking_z))
            select.offer(e, trainer.policy)
            log.info("eval after %d steps: %s", done, {k: round(v, 4) for k, v in e.items() if k != "step"})
            return e

        t_start = time.perf_counter()
        stopped = None
        if select.enabled and not trainer.evals:  # the starting policy is a candidate too
            tracking.log_metrics({k: v for k, v in evaluate(0).items() if k != "step"}, 0)
        for step in loop:
            m = trainer.step(step)
            done = step + 1
            if rc.eval_every and (done % rc.eval_every == 0 or done == rc.steps):
                m.update({k: v for k, v in evaluate(done).items() if k != "step"})
            loop.log(m, step, reward=f"{m['train/reward_mean']:.3f}", kl=f"{m['train/kl']:.3f}")
            if fired := [a for a in rc.stop_on if m.get(f"alarm/{a}")]:
                stopped = {"step": done, "alarm": fired[0]}
                log.warning("rloo.stop_on: alarm/%s fired after %d steps; stopping here", fired[0], done)
                loop.finish()
        seconds = time.perf_counter() - t_start
        h = trainer.history
        trained = h[-1]["step"] + 1 if h else 0
        chosen = select.best if select.enabled and select.best else {"step": trained, **(trainer.evals[-1] if (
            trainer.evals and trainer.evals[-1]["step"] == trained) else {})}
        if select.enabled and select.best and select.best["step"] != trained:
            checkpoint.load_snapshot(best_dir, trainer.policy)
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
            "sampling_mismatch": _mismatch_summary(h, rc.rollout_correction),
            "alarms": alarms.first_alarms(h),
            "evals": trainer.evals,
            "networks": trainer.networks(),  # parameters of every network the stage holds
        }
        if isinstance(reward, FunctionReward):  # each function, and its mean reward over the last 10 steps
            summary["reward_functions"] = {f.name: {"fn": f.fn, "weight": f.weight, "final_mean": _final_mean(
                [x.get(f"train/reward/{f.name}", math.nan) for x in last10])} for f in reward.functions}
        timings = loop.record_timings(
            {"threads": threads},
            train_seconds=seconds,
            # the samples this process drew (dynamic sampling's extra rounds included), per second
            samples_per_second=_samples([x for x in h if x["step"] >= loop.start], rc) / max(seconds, 1e-9),
            seconds_per_step=seconds / max(trained - loop.start, 1))
        tracking.log_metrics({"rloo/selected_step": chosen["step"]}, trained)
        loop.check_weights(trained, "the output")
        whole = lora.whole(trainer.adapted, trainer.policy)  # LoRA: merged; FSDP: gathered on rank 0
        if distributed.is_main():
            with atomic_dir(out_dir) as tmp:
                models.save_pretrained(whole, trainer.tokenizer, tmp)
                # Per-step wall-clock times (time/*) go to MLflow only: the output is a function of its inputs.
                (tmp / "steps.jsonl").write_text("".join(
                    json.dumps({k: v for k, v in x.items() if not k.startswith("time/")}) + "\n" for x in h))
                write_json_atomic(tmp / "metrics.json", summary)
        distributed.barrier()
        log.info("rloo done: %s", {**{k: v for k, v in summary.items() if k != "evals"}, **timings})
        for line in report.rloo_lines(summary):
            log.warning(line) if line.startswith("!!") else log.info(line)
        return {**summary, **timings}
    finally:
        trainer.rollout.close()  # a vLLM engine frees its memory (and its process) here
