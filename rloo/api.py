"""RLOO, SFT and the reward model from Python, without the pipeline. `train_rloo` trains a policy (a folder,
or a model object with its tokenizer) on prompt rows with a reward function, through the same trainer,
estimator, divergence guard, checkpoints, validation and metrics as `rloo train` (rloo/train/rloo.py);
`train_sft` fine-tunes one on question/answer rows as `rloo sft` does (rloo/train/sft.py);
`train_reward_model` trains a Bradley-Terry reward model on pairs of a policy's samples as `rloo reward`
does (rloo/train/reward.py). The three take the same leading arguments (the policy, the rows, the output
folder), then keywords. `evaluate` grades policies on held-out rows as `rloo evaluate` and `rloo report`
do, with the paired gain of each over one of them. `load_rows` reads
the rows from a JSONL file or a list of records as `rloo prepare` does, other field names and bare-number
answers included (data.fields, data.answer_format).

A row is a dict: `question` (the prompt's question), `answer` (GSM8K's form: the solution's lines, then
`#### N`; `#### N` alone where the data gives a bare number) and any further field. RLOO reads the question
and hands every field to the reward functions as a column; SFT learns the answer as written, so it needs
full solutions. Each reward function's mean is logged as `train/reward/<name>`: its Python name by
default (the verifier, `rloo.reward.verifier.reward`, logs as `train/reward/reward`), or the name given
as `(function, weight, name)`.

    from rloo.api import Config, RlooConfig, load_rows, train_rloo

    def correct(completions, answer, **kwargs):       # TRL's form: one float (or None) per completion
        return [1.0 if c.strip().endswith(a.split("####")[-1].strip()) else 0.0 for c, a in zip(completions, answer)]

    rows = load_rows("my_problems.jsonl", fields={"question": "problem", "answer": "result"}, answer_format="number")
    summary = train_rloo("my-sft-model", rows[32:], "runs/rloo", reward=correct, validation=rows[:32],
                         config=Config(rloo=RlooConfig(k=4, steps=100, lr=5e-5)), log=print_metrics)

Nothing of the pipeline (config files, Snakemake, MLflow, DVC) is imported: a notebook, a script or
another framework's loop can use it as it is.
"""

from __future__ import annotations

import contextlib
import os
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rloo.data import gsm8k
from rloo.errors import InputError
from rloo.eval.at_k import completion_figures
from rloo.eval.evaluation import evaluate_spec, evaluate_with_records
from rloo.eval.gains import add_tool_figures, correctness, gain
from rloo.identity import (
    Identity,
    claim_work,
    digest,
    folder_identity,
    job_identity,
    rows_identity,
    training_code,
)
from rloo.model import models
from rloo.reward.functions import RewardFunction, callable_files
from rloo.reward.rewards import FunctionReward, RewardModelReward, RewardSource, VerifierReward, build_plugin
from rloo.runtime import setup
from rloo.settings import (
    Config,
    EvaluateConfig,
    ModelConfig,
    PromptConfig,
    RewardConfig,
    RlooConfig,
    SftConfig,
)
from rloo.settings.data import DataConfig, DataFieldsConfig
from rloo.train import reward as reward_model
from rloo.train import rloo as rloo_run
from rloo.train import sft as sft_run
from rloo.train.run_log import RunLog

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["Config", "EvaluateConfig", "ModelConfig", "PromptConfig", "RewardConfig", "RewardSource", "RlooConfig",
           "RunLog", "SftConfig", "VerifierReward", "evaluate", "load_rows", "train_reward_model", "train_rloo",
           "train_sft"]

Reward = RewardSource | Callable | Sequence[Callable | tuple[Callable, float] | tuple[Callable, float, str]]


def load_rows(path_or_records: str | os.PathLike | Iterable[Mapping], *, fields: Mapping[str, str] | None = None,
              answer_format: str | None = None, on_bad: str | None = None) -> list[dict]:
    """Rows for `train_rloo` and `train_sft` from a JSONL file (one record per line) or from records in
    memory, read and checked by the functions `rloo prepare` reads `data.train_file` with
    (rloo.data.gsm8k): each row `{"question", "answer" (GSM8K's form, '... #### N'), every further
    field}`. `fields` names the record's question and answer fields (data.fields: `{"question":
    "problem", "answer": "result"}`), `answer_format` says how the answer is written (data.answer_format:
    "gsm8k", or "number", a bare number written as '#### N'), `on_bad` what a bad record does
    (data.on_bad_record: "error", or "skip" it); the defaults are the pipeline's. A bad record is a
    DataError (a UserError) naming the file and line (or `records[i]`) and the field."""
    defaults = DataConfig()
    try:
        field_names = DataFieldsConfig(**dict(fields or {}))
    except TypeError:
        raise InputError(f"fields: {dict(fields or {})} names other keys than question and answer") from None
    shape = {"fields": field_names.to_config(), "answer_format": answer_format or defaults.answer_format}
    on_bad = on_bad or defaults.on_bad_record
    hints = typing.get_type_hints(DataConfig)
    for name, key, value in (("answer_format", "answer_format", shape["answer_format"]),
                             ("on_bad", "on_bad_record", on_bad)):
        if value not in (allowed := typing.get_args(hints[key])):
            raise InputError(f"{name}: {value!r} is not one of {', '.join(allowed)} (data.{key})")
    if isinstance(path_or_records, str | os.PathLike):
        rows, _ = gsm8k.load_jsonl_split(os.fspath(path_or_records), on_bad, **shape)
    else:
        rows, _ = gsm8k.load_records(path_or_records, "records", on_bad, **shape)
    return rows


def reward_source(reward: Reward) -> RewardSource:
    """A reward source from what a caller hands in: a source as it is (rloo.reward.rewards), one function in
    TRL's form, or several (each alone, weight 1, as (function, weight) or as (function, weight, name)):
    their weighted sum. A function's mean is logged as `train/reward/<name>`: the name given, else its
    Python name (`__name__`: the verifier `rloo.reward.verifier.reward` is `train/reward/reward`)."""
    if hasattr(reward, "score"):
        return reward  # type: ignore[return-value]
    parts = [reward] if callable(reward) else list(reward)
    return FunctionReward([RewardFunction.of(*p) if isinstance(p, tuple) else RewardFunction.of(p) for p in parts])


def _checked(config: Config) -> Config:
    if problems := config.problems():
        raise InputError("invalid settings:\n  " + "\n  ".join(problems))
    return config


def _started(policy: str | Path | PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, out_dir: str | Path,
             work_dir: str | Path | None, config: Config) -> tuple[Path, Path, Path, int]:
    """(the output folder, the work folder (default: beside it), the policy's folder (`policy_folder`),
    the thread count) of a run whose process is set up (threads, seed) for it."""
    out_dir = Path(out_dir)
    work_dir = Path(work_dir) if work_dir is not None else out_dir.with_name(out_dir.name + ".work")
    policy = policy_folder(policy, tokenizer, work_dir)
    return out_dir, work_dir, policy, setup(config.threads, config.seed)


def policy_folder(policy: str | Path | PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None,
                  work_dir: Path) -> Path:
    """The folder the trainer loads the policy from: `policy` itself, or a model object and its tokenizer
    saved to `work_dir`/start (the trainer loads the policy and its frozen reference from one folder, and
    a rollout engine such as vLLM reads weights only from files)."""
    if isinstance(policy, str | Path):
        return Path(policy)
    if not hasattr(policy, "save_pretrained"):
        raise InputError(f"policy: a model folder or a transformers model object, not {type(policy).__name__}")
    if tokenizer is None:
        raise InputError("policy: a model object needs its tokenizer: train_rloo(model, ..., tokenizer=tokenizer)")
    folder = work_dir / "start"
    policy.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _identity(config: Config, stage: str, rows: Sequence[Mapping], policy: Path, work_dir: Path,
              upstream: Mapping[str, str] | None = None, user_code: Sequence[Path] = ()) -> Identity:
    """The identity of a training run the API starts (rloo.identity.job_identity, as the stages'): the rows
    stand in for the data, the policy folder's identity (recorded, else its content) for the model, the
    training run's own code with the user's (`user_code`); the work folder made the run's, or refused with
    one line where it holds another run's checkpoints (rloo.identity.claim_work)."""
    identity = job_identity(config, stage, upstream={"rows": rows_identity(rows), "policy": folder_identity(policy),
                                                     **(upstream or {})},
                            code=training_code(config, stage, user_code))
    claim_work(work_dir, identity, clear=False)
    return identity


def _recorded(identity: Identity, out_dir: Path, summary: dict) -> dict:
    """`summary`, once `out_dir` records the identity of the run that made it (rloo.identity.IDENTITY_FILE)."""
    identity.write(out_dir)
    return summary


def train_rloo(policy: str | Path | PreTrainedModel, rows: Sequence[Mapping], out_dir: str | Path, *,
               reward: Reward, tokenizer: PreTrainedTokenizerBase | None = None,
               validation: Sequence[Mapping] = (), config: Config | RlooConfig | None = None,
               work_dir: str | Path | None = None, log: RunLog | Callable[[dict, int], None] | None = None) -> dict:
    """Train `policy` (a folder holding a transformers causal LM and its tokenizer, or a model object
    with its `tokenizer`: saved to `work_dir`/start and trained from there; the trained policy is
    written to `out_dir`, the object left as it was) with RLOO on
    `rows` (prompts: rows of at least `question`; their other fields, `answer` among them, reach the reward
    functions as columns) and write the trained policy, steps.jsonl and metrics.json to `out_dir`.

    `reward`: a function in TRL's form (`f(completions, **kwargs) -> list[float | None]`), several
    (each alone, `(f, weight)` or `(f, weight, name)`: their weighted sum), or a RewardSource; each
    function's mean is logged as `train/reward/<name>`, its Python name unless the tuple names it
    (`reward_source`). `validation`: held-out rows (with `answer`) the policy is evaluated on
    every `rloo.eval_every` steps, the best checkpoint kept (`rloo.select`). `config`: the settings (an
    RlooConfig alone is the `rloo` section; default: the pipeline's defaults). Checkpoints go to `work_dir`
    (default: beside `out_dir`), and a rerun of the same call resumes from them. `log(metrics, step)`
    receives every step's figures. Returns the run's summary (metrics.json) and its wall-clock figures."""
    config = _checked(Config(rloo=config) if isinstance(config, RlooConfig) else config or Config())
    rc = config.rloo
    if rc.eval_every and not validation:
        raise InputError("validation rows are needed to evaluate every rloo.eval_every steps; pass validation= "
                         "(held-out rows with their answers) or RlooConfig(eval_every=0, select='last')")
    if not rows:
        raise InputError("no prompts to train on")
    out_dir, work_dir, policy, threads = _started(policy, tokenizer, out_dir, work_dir, config)
    source = reward_source(reward)
    functions = getattr(source, "functions", [])
    names = [f.fn for f in functions] or [source.name]
    identity = _identity(config, "rloo", rows, policy, work_dir, {"reward": digest(names)}, callable_files(functions))
    return _recorded(identity, out_dir, rloo_run.run(
        config, policy, [dict(r) for r in rows], out_dir, work_dir, identity.resume,
        val=[dict(r) for r in validation], reward=source, log_to=log, facts={"threads": threads}))


def train_sft(policy: str | Path | PreTrainedModel, rows: Sequence[Mapping], out_dir: str | Path, *,
              test: Sequence[Mapping], tokenizer: PreTrainedTokenizerBase | None = None,
              config: Config | SftConfig | None = None, work_dir: str | Path | None = None,
              log: RunLog | Callable[[dict, int], None] | None = None) -> dict:
    """Fine-tune `policy` (a folder, or a model object with its `tokenizer`, as for train_rloo) on `rows`
    ({question, answer}: the loss on the answer and its EOS only, so the answer must be a full solution
    ending in '#### N', not a bare '#### N'), through the same loop as `rloo sft`;
    evaluate it on the first `sft.eval_examples` rows of `test` and write the policy, metrics.json and
    history.json to `out_dir`. `config`: the settings (an SftConfig alone is the `sft` section).
    Checkpoints go to `work_dir` (default: beside `out_dir`), and a rerun of the same call resumes from
    them. `log(metrics, step)` receives every logged step's figures. Returns the metrics and the run's
    wall-clock figures."""
    config = _checked(Config(sft=config) if isinstance(config, SftConfig) else config or Config())
    if not rows:
        raise InputError("no training rows")
    if not test:
        raise InputError("test rows are needed: the fine-tuned policy is evaluated on them (sft.eval_examples)")
    out_dir, work_dir, policy, threads = _started(policy, tokenizer, out_dir, work_dir, config)
    identity = _identity(config, "sft", rows, policy, work_dir)
    return _recorded(identity, out_dir, sft_run.run(config, policy, [dict(r) for r in rows], out_dir, work_dir,
                                                    identity.resume, test=[dict(r) for r in test], log_to=log,
                                                    facts={"threads": threads}))


def train_reward_model(policy: str | Path | PreTrainedModel, rows: Sequence[Mapping], out_dir: str | Path, *,
                       tokenizer: PreTrainedTokenizerBase | None = None, config: Config | RewardConfig | None = None,
                       work_dir: str | Path | None = None,
                       log: RunLog | Callable[[dict, int], None] | None = None) -> dict:
    """Train a Bradley-Terry reward model as `rloo reward` does: `policy` (a folder, or a model object with
    its `tokenizer`, as for train_rloo) samples `reward.samples_per_prompt` completions for each of the first
    `reward.prompts` of `rows` ({question, answer}: the answer's final number grades them), a right and a
    wrong one make a pair, and the model (from `reward.init`, else the policy, with a new score head) is
    trained on the pairs of all but `reward.val_fraction` of the prompts; its pairwise accuracy on the held-out
    ones, the model, metrics.json and history.json are written to `out_dir`. `config`: the settings (a
    RewardConfig alone is the `reward` section). Checkpoints go to `work_dir` (default: beside `out_dir`), and
    a rerun of the same call resumes from them. `log(metrics, step)` receives every logged step's figures.
    Returns the metrics and the run's wall-clock figures."""
    config = _checked(Config(reward=config) if isinstance(config, RewardConfig) else config or Config())
    if not rows:
        raise InputError("no rows to sample preference pairs from")
    out_dir, work_dir, policy, threads = _started(policy, tokenizer, out_dir, work_dir, config)
    identity = _identity(config, "reward", rows, policy, work_dir)
    return _recorded(identity, out_dir, reward_model.run(config, policy, [dict(r) for r in rows], out_dir, work_dir,
                                                         identity.resume, log_to=log, facts={"threads": threads}))


def evaluate(policies: Mapping[str, str | Path | PreTrainedModel] | Sequence[str | Path],
             rows: Sequence[Mapping] | str | os.PathLike, *, against: str | None = None,
             reference: str | Path | PreTrainedModel | None = None,
             tokenizer: PreTrainedTokenizerBase | None = None, reward: Reward | None = None,
             reward_model: str | Path | None = None, config: Config | EvaluateConfig | None = None) -> dict:
    """Evaluate `policies` ({name: a folder or a model object}, or folders, each named by its last part) on
    `rows` (held-out rows with their `answer`, all of them; or a prepared data folder: its test split's first
    `evaluate.examples`, as the evaluate stage reads it; or a JSONL file, read by `load_rows`) as `rloo
    evaluate` does: the same decoding (`evaluate.*`: draws, token budget, batch; the config's seed and the
    stage's noise stream), so a policy scores here what the stage would score it on the same rows.

    Returns what the report writes for them (rloo_workflow/stages/report.py): `policies`, each one's figures
    (accuracy greedy and sampled, strict and flexible, with 95 % intervals over problems; pass@k and maj@k;
    the solution checker's figures; mean length; `kl` to `reference` (the pipeline's: SFT), else None;
    `proxy_reward`, the `reward_model` folder's mean score, else None; `training_reward`, each part of
    `reward` (reward functions as for train_rloo; default: the config's `reward.source` function or http)
    with its interval; with tools on (`tools:`), the calls per completion, the share of calls that erred and
    the share of right answers taken from a tool's result (rloo.eval.tool_use), and with
    `tools.evaluate_without` the same policy's figures without the tools (`without_tools`) and the tool's
    paired gain (`tool_gain`)); `gains`, each other policy's paired gain over `against` (default: the first
    policy), sampled and greedy, with its 95 % paired-bootstrap interval and p-value (rloo.eval.gains);
    `against`; `examples`; and `records`, each policy's line per problem as `rloo evaluate` writes them
    (the completions and their grades). `config`: the settings (an EvaluateConfig alone is the `evaluate`
    section). A model object needs its `tokenizer`, which then serves every policy (a folder brings its own);
    it is evaluated in eval mode and left in the mode it was in."""
    config = _checked(Config(evaluate=config) if isinstance(config, EvaluateConfig) else config or Config())
    named = _named(policies)
    against = against if against is not None else next(iter(named))
    if against not in named:
        raise InputError(f"against: {against!r} is not one of the policies ({', '.join(named)})")
    if isinstance(rows, str | os.PathLike):
        rows = (gsm8k.read_split(rows, "test")[: config.evaluate.examples] if Path(rows).is_dir()
                else load_rows(rows))
    rows = [dict(r) for r in rows]
    if not rows:
        raise InputError("no rows to evaluate on")
    missing = next((i for i, r in enumerate(rows) if "question" not in r or "answer" not in r), None)
    if missing is not None:
        raise InputError(f"rows[{missing}]: a row needs its question and answer (load_rows reads them)")
    setup(config.threads, config.seed)
    mc = config.model
    def load(policy: str | Path | PreTrainedModel) -> PreTrainedModel:
        return models.load_causal_lm(policy, **models.load_options(mc)) if isinstance(policy, str | Path) else policy

    ref = load(reference) if reference is not None else None
    proxy = None
    if reward_model is not None:  # the evaluate stage's proxy: the learned reward model's view of the samples
        proxy = RewardModelReward(models.load_reward_model(reward_model, **models.load_options(mc)),
                                  models.load_tokenizer(reward_model, mc.trust_remote_code),
                                  batch_size=config.evaluate.batch_size, max_length=mc.max_length,
                                  prompt_cfg=config.prompt, inference_dtype=mc.inference_dtype)
    parts = build_plugin(config) if reward is None else reward_source(reward)
    parts = parts if hasattr(parts, "components") else None  # a source without parts (the verifier) adds none
    spec = evaluate_spec(config)
    golds = [r["answer"] for r in rows]
    figures, records, correct = {}, {}, {}
    for name, policy in named.items():
        tok = tokenizer
        if tok is None:
            if not isinstance(policy, str | Path):
                raise InputError(f"policies[{name!r}]: a model object needs its tokenizer: "
                                 "evaluate(..., tokenizer=tokenizer)")
            tok = models.load_tokenizer(policy, mc.trust_remote_code)
        model = load(policy)
        with _eval_mode(model, ref):
            figures[name], records[name], texts = evaluate_with_records(model, tok, rows, spec, reference=ref,
                                                                        proxy=proxy, label=name, training_reward=parts)
        correct[name] = correctness(texts, golds)
        figures[name].update(completion_figures(texts, correct[name], golds))
        add_tool_figures(figures[name], texts, correct[name], golds, config.seed)
    return {"policies": figures,
            "gains": {name: gain(correct[name], correct[against], config.seed) for name in named if name != against},
            "against": against, "examples": len(rows), "records": records}


@contextlib.contextmanager
def _eval_mode(*nets: PreTrainedModel | None) -> Iterator[None]:
    """The networks in eval mode (no dropout) while it lasts, then each in the mode it was in: a caller's
    model object may be training."""
    modes = [(net, net.training) for net in nets if net is not None and hasattr(net, "train")]
    for net, _ in modes:
        net.eval()
    try:
        yield
    finally:
        for net, mode in modes:
            net.train(mode)


def _named(policies: Mapping[str, str | Path | PreTrainedModel] | Sequence[str | Path],
           ) -> dict[str, str | Path | PreTrainedModel]:
    """{name: policy}: a mapping as it is, folders by their last part."""
    if isinstance(policies, Mapping):
        named = dict(policies)
    else:
        if isinstance(policies, str | Path):
            policies = [policies]
        if unnamed := [p for p in policies if not isinstance(p, str | Path)]:
            raise InputError(f"policies: name a model object: evaluate({{'mine': model}}, ...), not "
                             f"{type(unnamed[0]).__name__} in a list")
        named = {Path(p).name: p for p in policies}
        if len(named) < len(policies):
            raise InputError(f"policies: two folders share a name ({', '.join(map(str, policies))}): "
                             "name them, evaluate({'a': folder_a, 'b': folder_b}, ...)")
    if not named:
        raise InputError("policies: none given")
    for name, policy in named.items():
        if not isinstance(policy, str | Path) and not hasattr(policy, "generate"):
            raise InputError(f"policies[{name!r}]: a model folder or a transformers model object, not "
                             f"{type(policy).__name__}")
    return named
