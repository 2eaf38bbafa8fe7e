# Shared helpers: the validated config, what each stage reads of it, stage source files, resources.
import json
import os
import shlex
from pathlib import Path

from rloo.config import load_schema
from rloo.config import stage_config as _stage_config
from rloo.config import validate as _validate_config
from rloo.config import with_overrides
from rloo.launch import srun_command
from rloo.model.base import gguf_file
from rloo.pipeline import SEED_FOLDER, STAGES, SWEEP_FOLDER, outputs, rule_outputs, seed_variant, work_dir
from rloo.pipeline import reads_reward_model, sweep_grid, sweep_variant, upstream
from rloo.code_inputs import PACKAGE_DIR, stage_sources

# The same schema and validator as `rloo <stage>`: defaults filled in place, unknown keys named.
_validate_config(config, source="snakemake config")

# Every rule's software: the rloo package and its dependencies (used with --software-deployment-method
# conda; a plain run uses the environment it was started in). Relative to the rule files.
RLOO_ENV = "../envs/rloo.yaml"

RESULTS = config["paths"]["results"]
LOGS = config["paths"]["logs"]
# Each rule's output paths, from the pipeline's one declaration (rloo/pipeline.py): the CLI's defaults,
# MLflow's output tags and dvc.yaml agree with these (tests/test_pipeline.py). `{estimator}` is a wildcard.
OUT = {name: rule_outputs(name, config) for name in STAGES}

# Every estimator of the RLOO stage (results/gsm8k_{estimator}.json); the default target uses the
# config's own rloo.estimator.
ESTIMATORS = load_schema()["properties"]["rloo"]["properties"]["estimator"]["enum"]
ESTIMATOR = config["rloo"]["estimator"]
# The estimators the comparison target tables (comparison.estimators; RLOO among them).
COMPARED = config["comparison"]["estimators"]


wildcard_constraints:
    estimator="|".join(ESTIMATORS),
    # a seed of the seeds target; a sweep (a key of `sweeps`) and a point of its grid (rloo.pipeline.point_id)
    seed=r"\d+",
    sweep="[A-Za-z0-9_]+",
    point="p[0-9a-f]{8}",


def stage_config(stage, overrides=None):
    """The config a stage reads (rloo.config.STAGE_KEYS), as compact JSON: a Snakemake param and the
    stage's --config-json, so a changed value reruns exactly the stages that read it.

    `overrides`: {dotted key: value} set on top (e.g. the RLOO estimator from the wildcard).
    """
    return json.dumps(_stage_config(config, stage, overrides), sort_keys=True, separators=(",", ":"))


def _local(path):
    """`path` relative to the working directory when it lies below it, else absolute."""
    path = Path(path).resolve()
    try:
        return str(path.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def code(stage):
    """The package source files `rloo <stage>` runs, as inputs: editing one reruns the stage and its
    descendants (an input counts as changed when it is newer and its checksum differs). They are
    the files of the package that `rloo` imports here (PYTHONPATH or the installed package)."""
    return [_local(PACKAGE_DIR.parent / f) for f in stage_sources(stage)]


def local_inputs(*values):
    """Config values that name existing local files or folders (a model to start from, JSONL data):
    inputs, so replacing them reruns the stage. Hub ids and nulls are ignored."""
    return [v for v in values if v and os.path.exists(v)]


# Drops training checkpoints that belong to other inputs or parameters, so that a rerun resumes only
# from an interrupted run of the same job (a `guard` param of sft and rloo).
WORKDIR_GUARD = _local(Path(workflow.basedir) / "workflow" / "scripts" / "workdir.py")


def reward_model(wildcards):
    """The reward model as a named input, where the RLOO stage reads it (rloo.pipeline.reads_reward_model)."""
    return {"reward_model": OUT["reward"]["model"]} if reads_reward_model(config, wildcards.estimator) else {}


def reward_model_arg(wildcards, input):
    return f"--reward-model {input.reward_model}" if "reward_model" in input.keys() else ""


def base_data(wildcards):
    """The training split as a named input of the base rule where it builds the embedded model from it."""
    return {"train": OUT["prepare"]["train"]} if "prepare" in upstream("base", config) else {}


def base_data_arg(wildcards, input):
    return f"--data {os.path.dirname(input.train)}" if "train" in input.keys() else ""


def gguf_input(cfg):
    """The GGUF file `model.gguf` names (a path, or a file inside an installed package), as an input."""
    return [str(gguf_file(cfg["model"]["gguf"]))] if cfg["model"].get("gguf") else []


def data_dir(wildcards, input):
    """The data folder, from the rule's data inputs."""
    return os.path.dirname(input.train if "train" in input.keys() else input.test)


# GPUs of a judge the evaluate job serves itself (evaluate.llm_judge.serve): the evaluate rule asks for
# them beside its own GPU, the comparison rule (which only judges) for them alone.
_SERVE = config["evaluate"]["llm_judge"]["serve"] if config["evaluate"]["judge"] == "llm" else None
JUDGE_GPUS = _SERVE["gpus"] if _SERVE else 0
# The served judge's weights, when they are a local folder: an input, so replacing them reruns the judging.
JUDGE_MODEL = local_inputs(_SERVE["model"]) if _SERVE else []


# Threads of the torch stages: config `threads`, else 8. Locally Snakemake lowers them to --cores;
# on Slurm they are the job's --cpus-per-task. The stage gets exactly this many (--set threads=).
TORCH_THREADS = config["threads"] or 8


def cpus(wildcards, threads):
    return threads


def gpu_resources(stage):
    """A training stage's GPUs and tasks (rloo.pipeline: `data_parallel`). One process: `gpu: 1`. Under a
    `distributed` strategy with several processes, one Slurm task per process: `nodes`, `gres: gpu:P` (P =
    nproc_per_node GPUs on each node), `tasks_per_node: P` (with one process per node `tasks: nodes`,
    and `tasks_per_gpu: 1`, which the plugin would otherwise take `tasks` for), and `mpi`, which makes
    the plugin run the rule's shell in the batch step instead of under `srun -n1`: there `rloo <stage>`
    finds itself in the allocation and starts its processes with this very srun line (rloo/launch.py)."""
    d = config["distributed"]
    per_node, nodes = d["nproc_per_node"], d["nodes"]
    if not STAGES[stage].data_parallel or d["strategy"] == "none" or per_node * nodes == 1:
        return {"gpu": 1}
    tasks = {"tasks_per_node": per_node} if per_node > 1 else {"tasks": nodes, "tasks_per_gpu": 1}
    def srun(wildcards, threads):  # the job's threads: what `--set threads={threads}` hands the stage
        return " ".join(srun_command({**config, "threads": threads}))

    return {"nodes": nodes, "gres": f"gpu:{per_node}", **tasks, "mpi": srun}


def no_such_estimator(wildcards):
    """The input of results/gsm8k_<name>.json for an unknown <name>: an error naming the valid estimators."""
    raise ValueError(
        f"{RESULTS}/gsm8k_{wildcards.name}.json: no estimator named '{wildcards.name}'; "
        f"the targets are {RESULTS}/gsm8k_<estimator>.json with <estimator> one of {', '.join(ESTIMATORS)}"
    )


# The memory plan (rloo/memory_plan.py, `rloo plan`), where the config names its GPUs' memory
# (plan.gpu_memory_gb): a config whose stage would not fit one GPU is refused before any job is queued.
if config["plan"]["gpu_memory_gb"]:
    from rloo.memory_plan import check as _memory_check

    if _problem := _memory_check(config):
        raise ValueError(f"memory plan (plan.gpu_memory_gb={config['plan']['gpu_memory_gb']:g}): {_problem}")


# Seeds and sweeps (rloo.pipeline.Variant): the chain's rules again (workflow/rules/variants.smk), per
# seed (wildcard `seed`) or per sweep point (`sweep`, `point`), outputs in folders of their own; a
# variant's job reads the main chain's outputs for the stages it does not change.
NO_VARIANT = ""  # the main chain's jobs: MLflow runs named after the stage alone
SEEDS = config["seeds"]["values"]
# The rule outputs of a seed's and of a sweep point's jobs (`{seed}`, `{sweep}`/`{point}` wildcards);
# the estimator is the config's (the seeds target is results/seeds/gsm8k_<rloo.estimator>.json).
SEED_OUT = {name: {k: v.replace("{estimator}", ESTIMATOR) for k, v in rule_outputs(name, config, SEED_FOLDER).items()}
            for name in STAGES}
SWEEP_OUT = {name: {k: v.replace("{estimator}", ESTIMATOR) for k, v in rule_outputs(name, config, SWEEP_FOLDER).items()}
             for name in STAGES}


def variant(wildcards):
    """The seed (wildcard `seed`) or sweep point (`sweep`, `point`) of a variant rule's job."""
    if "seed" in wildcards.keys():
        return seed_variant(config, wildcards.seed)
    return sweep_variant(config, wildcards.sweep, wildcards.point)


def variant_config(wildcards):
    """The whole config of the job's seed or point: the config with its keys set."""
    return with_overrides(config, variant(wildcards).overrides)


def v_input(stage, kind):
    """An input function: `stage`'s output `kind` for the job's variant, the main chain's where the
    variant does not change the stage (shared)."""
    return lambda wildcards: outputs(stage, config, ESTIMATOR, variant(wildcards))[kind]


def v_cfg(stage):
    """A variant rule's `cfg` param: what `stage` reads of the variant's config (a key the stage does not
    read, e.g. sft.lr for rloo, stays out of it, as in the main chain's rules)."""
    def cfg(wildcards):
        part = _stage_config(variant_config(wildcards), stage,
                             {"rloo.estimator": variant_config(wildcards)["rloo"]["estimator"]} if stage == "rloo" else None)
        return json.dumps(part, sort_keys=True, separators=(",", ":"))

    return cfg


def v_work(stage):
    return lambda wildcards: work_dir(stage, config, ESTIMATOR, variant(wildcards))


def v_label(wildcards):
    """`--variant LABEL`: the job's MLflow run is named <stage>[LABEL] (rloo[seed=1])."""
    return f"--variant {shlex.quote(variant(wildcards).label)}"


def v_policy(wildcards):
    """The trained policy's name in a variant's results: its estimator (a sweep may set rloo.estimator)."""
    return variant_config(wildcards)["rloo"]["estimator"]


def v_base_data(wildcards):
    """A variant's base job reads its training split where it builds the embedded model (base_data)."""
    reads = "prepare" in upstream("base", variant_config(wildcards))
    return {"train": v_input("prepare", "train")(wildcards)} if reads else {}


def v_reward_model(wildcards):
    """The reward model as a named input of a variant's rloo job, where it reads it (rloo.pipeline.reads_reward_model)."""
    reads = reads_reward_model(variant_config(wildcards))
    return {"reward_model": v_input("reward", "model")(wildcards)} if reads else {}


# The results file of every seed, and of every point of every sweep: the aggregate rules' inputs.
SEED_RESULTS = {s: outputs("evaluate", config, ESTIMATOR, seed_variant(config, s))["result"] for s in SEEDS}


def sweep_results(sweep):
    """{point id: results file} of sweep `sweep`; an error naming the sweeps there are, for another name."""
    return {p: outputs("evaluate", config, ESTIMATOR, sweep_variant(config, sweep, p))["result"]
            for p in sweep_grid(config, sweep)}
