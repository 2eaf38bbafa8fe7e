"""Issue 70, every key: the config keys every stage of the chain reads, enumerated from the declaration (the
stages' keys, `rloo.stages.stage_keys` on the micro config, and each leaf below a declared section, from the
JSON schema the typed settings make), never from a hand list. A sample drawn by a fixed seed, five keys of
each stage (prepare, base, sft, reward, rloo, evaluate, report), five of the training stages' bookkeeping
keys and five that no stage reads, each changed to another valid value (derived from its schema: another
enum member, the other boolean, another number within its bounds, ...; the leaves left out are counted,
each kind with its reason, SKIP_REASONS):

- under Snakemake, on a copy of the session's finished micro chain (`micro_workflow`): the dry run's plan
  is exactly the stages that read the key and those below them, nothing above (what Snakemake itself plans
  when those stages are forced: `--forcerun`); a key no stage reads plans nothing;
- through the training stages' own entry point (what `rloo sft|reward|train` runs) and through rloo.api
  (train_sft, train_reward_model: an identity computed from rows and objects), on a copy of a work folder
  whose checkpoints an interrupted run would have left: the checkpoint is refused in one line, kept, and
  no output written, unless the key is bookkeeping (rloo.identity.bookkeeping: what a run may change
  and still resume) or one the run's stage does not read, which resume. The unchanged config resumes
  each of them first.

The estimator's code and a user's reward file, the other half of issue 70's "every key": a semantic edit of
`rloo_advantages` plans rloo and below (tests/e2e/test_workflow.py), a reward file's edited body plans rloo,
the evaluations and the report (tests/e2e/test_reward_plugins.py), and either refuses the checkpoint of
`rloo train` where a comment resumes it (tests/e2e/test_crash_safety.py).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import copy_tree
from workflow_helpers import CONFIGFILES, JOBS, job_counts, make_copy, planned, plans, snakemake

from rloo.errors import UserError
from rloo.identity import bookkeeping
from rloo.settings import Config, json_schema
from rloo.settings.selection import put
from rloo.stages import reads_key, stage_keys
from rloo_workflow.config import load_config
from rloo_workflow.config.overlays import ConfigError

pytestmark = pytest.mark.slow

RLOO = "results/gsm8k_rloo.json"
CHAIN = ("prepare", "base", "sft", "reward", "rloo", "evaluate", "report")  # the rules of RLOO's results
TRAINING = ("sft", "reward", "rloo")  # the stages that checkpoint (rloo.stages: work=True)
SEED = 70
# keys drawn per group: each stage of the chain, the bookkeeping keys, the unread keys (45); every key of
# every group with RLOO_EVERY_KEY=all (about 160: several minutes, for a change of the declaration)
PER_STAGE = 10**6 if os.environ.get("RLOO_EVERY_KEY") == "all" else 5
# Where a key has no other valid value that a run here can use, it is left out, with the reason; the
# test states the count (a new key of such a kind is left out by the same rule, never silently).
SKIP_REASONS = {
    "paths": "an output folder: another one plans every job, as a missing output does",
    "file": "a file or model path: no other file or model exists here",
    "section": "a section that is off (null) in the micro config: no value to change below it",
    "list of records": "a list of user records (a reward function's file, a tool): the second half of the "
                       "issue's test, in the files named in the docstring",
    "extra": "a value that needs what this machine lacks (vLLM, a GPU, a hub, a served judge, a user's file)",
}
PATH_KEYS = ("paths.", "data.train_file", "data.test_file", "model.name_or_path", "model.gguf", "model.tokenizer",
             "model.revision", "reward.init", "reward.http.url", "tracking.tracking_uri")
# values that need what this machine lacks; a run of them is tests/e2e/test_vllm.py's and test_judge_server.py's
NEEDS_EXTRA = {("rollout.backend", "vllm"), ("evaluate.judge", "llm"), ("reward.source", "judge"),
               ("reward.source", "http"), ("reward.source", "function"), ("model.device", "cuda"),
               ("data.source", "hub"), ("data.source", "jsonl"), ("model.lora.enabled", True),
               ("model.attn_implementation", "flash_attention_2"), ("distributed.strategy", "ddp"),
               ("distributed.strategy", "fsdp")}


# Keys a job of RLOO's results takes from its target, not from the config: under Snakemake they plan nothing
# (test_workflow.py holds the same); a run started by hand reads them from the config (the resume check).
FROM_THE_TARGET = {"rloo.estimator": "the RLOO job's estimator is its target's name's (results/gsm8k_<estimator>.json, "
                                    "rloo_workflow.pipeline.job_settings)"}


def _configs(copy: Path) -> list[Path]:
    """The config files the chain was built with, as Snakemake reads them (its own configfile first)."""
    return [copy / "config" / "config.yaml", *(copy / f for f in CONFIGFILES[1:])]


def _leaves(schema: dict, value: Any, prefix: str = "") -> dict[str, tuple[dict, Any]]:
    """{dotted key: (its schema, its value in the config)} for every leaf of the config's schema."""
    props = schema.get("properties")
    if props and isinstance(value, dict):
        out = {}
        for name, node in props.items():
            out.update(_leaves(node, value.get(name), f"{prefix}{name}."))
        return out
    return {prefix[:-1]: (schema, value)}


def _candidates(key: str, node: dict, value: Any) -> list[Any] | str:
    """Other values of `key` its schema allows, most likely valid first; or why there is none (SKIP_REASONS)."""
    kinds = node.get("type", [])
    kinds = [kinds] if isinstance(kinds, str) else kinds
    if key.startswith(PATH_KEYS[0]):
        return "paths"
    if key.startswith(PATH_KEYS[1:]):
        return "file"
    if "object" in kinds or "properties" in node or key == "sweeps":
        return "section" if value is None else "list of records"  # sweeps: records of the sweep target
    if "enum" in node:
        out = [m for m in node["enum"] if m != value and (key, m) not in NEEDS_EXTRA]
        return out or "extra"
    if "boolean" in kinds:
        return "extra" if (key, not value) in NEEDS_EXTRA else [not value]
    if "integer" in kinds or "number" in kinds:
        low = node.get("minimum", node.get("exclusiveMinimum", 0))
        high = node.get("maximum", node.get("exclusiveMaximum"))
        if value is None:
            out = [64, 8, max(low, 1), 1000]  # 64 first: a memory plan of 1 GB holds no model
        else:
            out = [value + 1, value - 1] if "integer" in kinds else [value * 2, value / 2, value + 0.1, value - 0.1]
        ok = [v for v in out if v != value and v >= low and (high is None or v <= high)
              and not (v == node.get("exclusiveMinimum") or v == node.get("exclusiveMaximum"))]
        return [round(v, 6) if isinstance(v, float) else v for v in ok]
    if "array" in kinds or "anyOf" in node:
        items = node.get("items", {})
        if (value and isinstance(value[0], dict)) or items.get("type") == "object":
            return "list of records"
        if not isinstance(value, list):
            return [["q_proj", "v_proj"]]  # model.lora.target_modules: 'all-linear' or a list of names
        out = [value[:-1]] if len(value) > node.get("minItems", 0) else []
        out += [[*value, m] for m in items.get("enum", []) if m not in value]
        return [*out, list(reversed(value))] if len(set(map(str, value))) > 1 else out
    if "string" in kinds:
        return [f"{value or ''}changed"]  # a name, a template, a URL, a system prompt (files are PATH_KEYS)
    raise AssertionError(f"{key}: no rule for a value of schema {node}")


def _under(key: str, prefixes: tuple[str, ...] | list[str]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def _is_bookkeeping(stage: str, key: str, *configs: dict) -> bool:
    """Whether `key` is one `stage`'s run may change and still resume, under each of `configs`."""
    return all(_under(key, bookkeeping(stage, Config.of(c))) for c in configs)


def _enumerate(copy: Path) -> tuple[dict, dict[str, list[str]], dict[str, str]]:
    """(the chain's config, {group: its keys}: each stage's, the training stages' bookkeeping keys, and the
    keys no stage of the chain reads ("none"), {skipped key: why})."""
    cfg = load_config(_configs(copy))
    leaves = _leaves(json_schema(Config), cfg)
    groups = {stage: [k for k in leaves if reads_key(cfg, stage, k)] for stage in CHAIN}
    groups["bookkeeping"] = [k for k in leaves if any(_is_bookkeeping(s, k, cfg) for s in TRAINING)]
    groups["none"] = [k for k in leaves if not any(k in groups[s] for s in CHAIN)]
    skipped = {k: why for k, (node, value) in leaves.items()
               if isinstance(why := _candidates(k, node, value), str)}
    return cfg, groups, skipped


def _changed(cfg: dict, key: str) -> tuple[Any, dict] | None:
    """(another valid value of `key`, the config with it), the first of its candidates the config's
    validation (the schema and the checks across keys) accepts; None if none."""
    node, value = _leaves(json_schema(Config), cfg)[key]
    for other in _candidates(key, node, value):
        new = json.loads(json.dumps(cfg))
        put(new, key, other)
        try:
            return other, load_config(None, new)
        except ConfigError:
            continue
    return None


def _sample(copy: Path) -> tuple[dict, list[tuple[str, str, Any, dict]], dict[str, str]]:
    """(the chain's config, [(the stage it was drawn for, key, other value, the changed config)], skipped)."""
    cfg, groups, skipped = _enumerate(copy)
    rng = random.Random(SEED)
    drawn: list[tuple[str, str, Any, dict]] = []
    taken: set[str] = set()
    for stage, keys in groups.items():
        pool = [k for k in keys if k not in skipped and k not in taken]
        rng.shuffle(pool)
        got = 0
        for key in pool:
            if got == PER_STAGE:
                break
            if (change := _changed(cfg, key)) is None:
                skipped[key] = "no candidate value passes the config's validation"
                continue
            drawn.append((stage, key, *change))
            taken.add(key)
            got += 1
        # (with every key drawn, the report's are all the evaluation's, drawn for it already)
        assert got or all(k in taken or k in skipped for k in keys), f"{stage}: no key of its could be changed"
    return cfg, drawn, skipped


def _nested(key: str, value: Any) -> dict:
    out: dict = {}
    put(out, key, value)
    return out


def _dry_run(copy: Path, *args: str, extra: dict | None = None, name: str = "") -> list[str]:
    """The arguments of a dry run for RLOO's results (`extra`: config set on top, in a file of its own)."""
    files = list(CONFIGFILES)
    if extra is not None:
        path = f"config/changed_{name}.yaml"
        (copy / path).write_text(yaml.safe_dump(extra))
        files.append(path)
    return [RLOO, "-n", "--quiet", "rules", *files, *args]


@pytest.fixture(scope="module")
def chain(micro_workflow, tmp_path_factory) -> dict:
    copy = copy_tree(micro_workflow["copy"], tmp_path_factory.mktemp("every_key") / "wf")
    cfg, drawn, skipped = _sample(copy)
    print(f"every key: {len(drawn)} drawn (seed {SEED}), {len(skipped)} of the schema's leaves skipped: "
          + "; ".join(f"{sum(1 for w in skipped.values() if w == why)} {SKIP_REASONS.get(why, why)}"
                      for why in sorted(set(skipped.values()))))
    return {"copy": copy, "cfg": cfg, "drawn": drawn, "skipped": skipped}


def test_the_sample_covers_every_stage_that_reads_keys(chain):
    groups = {group for group, *_ in chain["drawn"]}
    # a group per stage, and the two others (with every key drawn, the report's are the evaluation's)
    assert {*CHAIN, "bookkeeping", "none"} - groups <= ({"report"} if PER_STAGE > 5 else set()), groups
    assert len(chain["drawn"]) >= min(30, 9 * PER_STAGE)
    # what is left out stays the exception (23 of 182 leaves): a rule that skipped most would test little
    assert len(chain["skipped"]) <= 0.2 * len(_leaves(json_schema(Config), chain["cfg"])), sorted(chain["skipped"])
    # each stage's keys come from the declaration: a key drawn for it is one it reads, and every declared
    # section of the stage has leaves in the schema (a declared key the schema lacks would read nothing)
    for stage, key, _, _ in chain["drawn"]:
        assert stage in ("none", "bookkeeping") or reads_key(chain["cfg"], stage, key), (stage, key)
    leaves = _leaves(json_schema(Config), chain["cfg"])
    for stage in CHAIN:
        for declared in stage_keys(chain["cfg"], stage)[0]:
            assert any(k == declared or k.startswith(declared + ".") for k in leaves), (stage, declared)


def test_a_changed_key_plans_the_stages_that_read_it_and_those_below_nothing_above(chain):
    copy, cfg = chain["copy"], chain["cfg"]
    readers = {key: () if key in FROM_THE_TARGET else tuple(s for s in CHAIN if reads_key(cfg, s, key))
               for _, key, _, _ in chain["drawn"]}
    forced = sorted({r for r in readers.values() if r})
    # what Snakemake plans when exactly a key's readers must run again: they and the jobs below them
    runs = [_dry_run(copy), *(_dry_run(copy, "--forcerun", *r) for r in forced),
            *(_dry_run(copy, extra=_nested(key, value), name=str(i)) for i, (_, key, value, _) in enumerate(chain["drawn"]))]
    got = plans(copy, runs)
    assert got[0] == {}  # the finished chain: nothing to do
    expected = {(): {}, **dict(zip(forced, got[1:1 + len(forced)], strict=True))}
    assert all(expected[r] for r in forced), expected  # each forced plan has jobs: the comparison can fail
    wrong = [f"{key}: {value!r} (drawn for {stage}, read by {readers[key] or 'no stage'}): planned {plan}, "
             f"expected {expected[readers[key]]}"
             for (stage, key, value, _), plan in zip(chain["drawn"], got[1 + len(forced):], strict=True)
             if plan != expected[readers[key]]]
    assert not wrong, "\n".join(wrong)


def test_the_micro_dag_plans_every_stage_and_a_key_of_prepare_reruns_it_for_real(tmp_path):
    """Without the shared chain, so that scripts/test_oldest_snakemake.sh runs it with the oldest Snakemake
    pyproject.toml allows at a few seconds' cost: a fresh copy's dry run plans every job of RLOO's results;
    the data target runs; a key prepare reads (drawn from the declaration, as above) plans prepare alone
    and reruns it for real, after which nothing is left to do; the key as it was plans prepare again."""
    copy = make_copy(tmp_path / "wf")
    assert planned(copy, RLOO) == JOBS
    target = "data/gsm8k/manifest.json"
    assert job_counts((r := snakemake(copy, target, "--cores", "1", *CONFIGFILES)).stdout + r.stderr) == {"prepare": 1}
    before = (copy / target).read_text()
    cfg, groups, skipped = _enumerate(copy)
    pool = [k for k in groups["prepare"] if k not in skipped and k != "seed"]  # the seed: every stage's key
    random.Random(SEED).shuffle(pool)
    key = next(k for k in pool if _changed(cfg, k))
    change = yaml.safe_dump(_nested(key, _changed(cfg, key)[0]))
    assert planned(copy, target, extra_config=change) == {"prepare": 1}, key
    rerun = snakemake(copy, target, "--cores", "1", *CONFIGFILES, "config/extra.yaml")
    assert job_counts(rerun.stdout + rerun.stderr) == {"prepare": 1}, key
    assert (copy / target).read_text() != before, key  # the manifest records the data's settings
    assert planned(copy, target, extra_config=change) == {}
    assert planned(copy, target) == {"prepare": 1}


def _stage_run(copy: Path, stage: str, cfg: dict, work: Path, out: Path) -> None:
    """A training run on the chain's own inputs: `stage` (sft, reward, rloo) by the stage's entry point, as
    `rloo <verb>` calls it, or, as `api:sft` / `api:reward`, by rloo.api on the rows of the chain's splits."""
    from rloo import api
    from rloo.data.gsm8k import read_split
    from rloo_workflow.stages import reward, rloo, sft

    data, models = copy / "data" / "gsm8k", copy / "results" / "models"
    if stage == "sft":
        sft.run(cfg, data, models / "base", out, work)
    elif stage == "reward":
        reward.run(cfg, data, models / "sft", out, work)
    elif stage == "rloo":
        reward_model = models / "reward" if Config.of(cfg).reward.source == "model" else None
        rloo.run(cfg, data, models / "sft", out, work, reward_model)
    elif stage == "api:sft":
        api.train_sft(models / "base", read_split(data, "train"), out, test=read_split(data, "test"),
                      config=Config.of(cfg), work_dir=work)
    else:
        assert stage == "api:reward", stage
        api.train_reward_model(models / "sft", read_split(data, "train"), out, config=Config.of(cfg), work_dir=work)


# Each run that checkpoints: the stages' entry points (`rloo sft|reward|train`) and rloo.api's SFT and reward
# model, whose identity is computed from its rows and objects (their checkpoints are the API's own).
RUNS = (*TRAINING, "api:sft", "api:reward")


def _stage(run: str) -> str:
    return run.removeprefix("api:")


@pytest.fixture(scope="module")
def checkpoints(chain, tmp_path_factory) -> dict[str, Path]:
    """{run: a work folder with its checkpoints, as an interrupted run leaves it}: the chain's own (sft,
    rloo); the others from one run each, the reward model's with a shorter checkpoint interval (micro's
    comes after its last step; a bookkeeping key: the same run's checkpoints)."""
    work = chain["copy"] / "results" / "work"
    out = {"sft": work / "sft", "rloo": work / "rloo_rloo"}
    shorter = load_config(None, {**chain["cfg"], "reward": {**chain["cfg"]["reward"], "checkpoint_every": 2}})
    for run, cfg in (("reward", shorter), ("api:sft", chain["cfg"]), ("api:reward", shorter)):
        folder = tmp_path_factory.mktemp("checkpoints")
        _stage_run(chain["copy"], run, cfg, folder / "work", folder / "out")
        out[run] = folder / "work"
    return out


def _resumed(run: str, cfg: dict, copy: Path, checkpoints: dict[str, Path], tmp: Path) -> bool:
    """Whether `run`, on `cfg` with a copy of its work folder of `checkpoints` (what an interrupted run
    leaves), resumes a checkpoint. If not, it must have been refused in one line naming the checkpoint, or
    the input that no longer matches the config (a base folder of another model shape), kept the
    checkpoints and written no output."""
    shutil.rmtree(tmp, ignore_errors=True)
    work = copy_tree(checkpoints[run], tmp / "work")
    (work / "timings.json").unlink(missing_ok=True)
    before = sorted(p.name for p in (work / "checkpoints").iterdir())
    assert before, f"{run}: no checkpoint in {work}"
    out = tmp / "out"
    try:
        _stage_run(copy, run, cfg, work, out)
    except UserError as e:  # a refusal in one line (any other exception fails the test: a bug)
        line = str(e).strip()
        assert line and "\n" not in line, f"{run}: {type(e).__name__}: {line}"
        assert sorted(p.name for p in (work / "checkpoints").iterdir()) == before  # nothing deleted
        assert not out.exists()
        return False
    return json.loads((work / "timings.json").read_text())["resumed_from_step"] > 0


def test_a_changed_key_refuses_the_checkpoint_of_each_training_run_that_reads_it_unless_bookkeeping(
        chain, checkpoints, tmp_path):
    """Each training run (RUNS) whose stage reads a drawn key refuses its checkpoint, or resumes it where the
    key is bookkeeping; one run whose stage does not read it, drawn by the seed, resumes it."""
    copy, cfg = chain["copy"], chain["cfg"]
    for run in RUNS:
        assert _resumed(run, cfg, copy, checkpoints, tmp_path / run), f"{run}: the unchanged config did not resume"
    rng = random.Random(SEED)
    wrong, outcomes = [], {True: 0, False: 0}
    for drawn_for, key, value, changed in chain["drawn"]:
        readers = [r for r in RUNS if reads_key(cfg, _stage(r), key)]
        others = [r for r in RUNS if r not in readers]
        for run in readers + rng.sample(others, min(1, len(others))):
            expect = run not in readers or _is_bookkeeping(_stage(run), key, cfg, changed)
            got = _resumed(run, changed, copy, checkpoints, tmp_path / run)
            outcomes[got] += 1
            if got != expect:
                wrong.append(f"{run}: {key}: {value!r} (drawn for {drawn_for}): "
                             f"{'resumed' if got else 'refused'}, expected {'resume' if expect else 'refusal'}")
    assert not wrong, "\n".join(wrong)
    assert outcomes[True] >= 10 and outcomes[False] >= 20, outcomes  # both kinds, many times
