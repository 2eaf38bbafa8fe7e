# Shared helpers: the validated config, what each stage reads of it, stage code fingerprints, resources.
import os
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError

from rloo_workflow.config import config_extends as _config_extends
from rloo_workflow.config import load_schema
from rloo_workflow.config import job_args_file, job_config_file
from rloo_workflow.config import validate as _validate_config
from rloo_workflow.dvc.dag import force_rerun
from rloo_workflow.commands import aggregate_options, chain_options, job_logs, local_inputs
from rloo_workflow.launch import srun_command
from rloo.settings import Config
from rloo_workflow.pipeline import STAGES, VARIANT_FIELDS, VARIANT_PATTERN, identity, job_inputs, job_settings, outputs
from rloo_workflow.pipeline import stage_config as _stage_config
from rloo_workflow.pipeline import POLICIES, parse_variant, rule_outputs, work_dir
from rloo_workflow.code_fingerprint import save_identity, save_manifest, stage_code_param, stage_fingerprint

# Snakemake reads each --configfile as it is and knows nothing of an overlay's `extends:` (the file it
# overlays, which `rloo <stage> -c` reads first). The Snakefile's own configfile is config/config.yaml;
# any other file extended must be given too, before its overlay, or its keys would be silently missing.
_read = [Path("config/config.yaml").resolve(), *(Path(f).resolve() for f in workflow.overwrite_configfiles or [])]
for _i, _file in enumerate(_read[1:], start=1):
    _extended = _config_extends(_file)
    if _extended is not None and _extended not in _read[:_i]:
        raise WorkflowError(
            f"{_file}: the file it extends, {_extended}, was not read: Snakemake does not follow `extends:`; give "
            f"both, the extended file first: --configfile {os.path.relpath(_extended)} {os.path.relpath(_file)}")
# The same schema and validator as `rloo <stage>`: defaults filled in place, unknown keys named; a rule
# across keys names the one given with --config first, as --set does.
_validate_config(config, source="snakemake config", overrides=dict(workflow.config_settings.config))

# Every rule's software: the rloo package and its dependencies (used with --software-deployment-method
# conda; a plain run uses the environment it was started in). Relative to the rule files.
RLOO_ENV = "../envs/rloo.yaml"

# The validated config, typed: the rules read their settings from it, never the dict's keys.
SETTINGS = Config.of(config)
RESULTS = SETTINGS.paths.results
LOGS = SETTINGS.paths.logs
# Each rule's output paths, from the pipeline's one declaration (rloo_workflow/pipeline.py): the CLI's defaults,
# MLflow's output tags and dvc.yaml agree with these (tests/e2e/test_pipeline.py). `{estimator}` is a wildcard.
OUT = {name: rule_outputs(name, config) for name in STAGES}
# Their logs and benchmark files, and the local files their config names as inputs (rloo_workflow.commands: what
# dvc.yaml's compiler reads too). `{estimator}`, `{policy}` and `{sweep}` are wildcards.
LOG = {name: job_logs(name, config, "{estimator}", "{policy}", sweep="{sweep}") for name in STAGES}
LOCAL_INPUTS = {name: local_inputs(name, config) for name in STAGES}

# Every estimator of the RLOO stage (results/gsm8k_{estimator}.json); the default target uses the
# config's own rloo.estimator.
ESTIMATORS = load_schema()["properties"]["rloo"]["properties"]["estimator"]["enum"]
ESTIMATOR = SETTINGS.rloo.estimator
# The estimators the comparison target tables (comparison.estimators; RLOO among them).
COMPARED = list(SETTINGS.comparison.estimators)


wildcard_constraints:
    estimator="|".join(ESTIMATORS),
    # an evaluation's policy: the untrained base, SFT, or an estimator's trained policy
    policy="|".join([*POLICIES, *ESTIMATORS]),
    # a sweep (a key of `sweeps`); a variant's folder: seeds/seed<N> or sweeps/<sweep>/<point id>
    # (rloo_workflow.pipeline.VARIANT_FOLDERS, workflow/rules/variants.smk)
    sweep=VARIANT_FIELDS["sweep"],
    variant=VARIANT_PATTERN,


def stage_config(stage, overrides=None):
    """The `cfg` param of the jobs outside the chain (the chain's are `chain_cfg`), and their command's --job-config:
    the file of what the stage reads of the config (rloo_workflow.pipeline.stage_config), named by its content
    (rloo_workflow.config.job_config_file), so a changed value reruns the stage and a command stays one line."""
    return job_config_file(stage, _stage_config(config, stage, overrides))


def code(stage):
    """The `code` param of the jobs outside the chain (comparison, seeds, sweep, toy; a chain rule's code is a
    part of its `identity`): the stage's code fingerprint (rloo_workflow/code_fingerprint.py), so that a change
    to what the stage computes reruns it, and a comment, a docstring or a schema description reruns nothing.
    Computed from the package `rloo` is imported from here (PYTHONPATH or the installed package); its
    manifest is kept for `rloo why-rerun`. Once per process."""
    if stage not in _CODE:
        _CODE[stage] = stage_code_param(stage, config)
    return _CODE[stage]


_CODE = {}


def aggregate_args(stage, output, results=None, **more):
    """The `args` param of a job outside the chain: its command's options (rloo_workflow.commands.aggregate_options,
    declared once), in a file named by its content (rloo_workflow.config.job_args_file). The command is then
    `rloo <verb> @{params.args} ... --log {log}`: one short line where Snakemake prints it (a job's start, and
    twice when it fails), its options one `cat` away."""
    return job_args_file(stage, aggregate_options(stage, config, dict(output.items()), stage_config(stage), results, **more))


# A chain rule serves the main chain and, as `<rule>_variant` (workflow/rules/variants.smk), every seed
# and sweep point: its inputs and params below read the job's estimator (the `estimator` wildcard, else
# the config's) and its variant (the `variant` wildcard: rloo_workflow.pipeline.parse_variant) off its wildcards.


def job_estimator(wildcards):
    """The job's estimator: its `estimator` wildcard; None (the config's) for a variant's jobs."""
    return wildcards.estimator if "estimator" in wildcards.keys() else None


def job_policy(wildcards):
    """An evaluation's policy: its `policy` wildcard (base, sft or an estimator); None for other jobs."""
    return wildcards.policy if "policy" in wildcards.keys() else None


def job_variant(wildcards):
    """The job's variant (rloo_workflow.pipeline.parse_variant of its `variant` wildcard); None for the main chain's."""
    return parse_variant(config, wildcards.variant) if "variant" in wildcards.keys() else None


_STALE_SAID = set()


def rerun_if_stale(outs, ins):
    """Run a job again, and with it everything below it, where one of its outputs exists while an input it
    was made from is missing: Snakemake alone would leave such a result standing as current (its own
    record is unchanged) once an interrupted rerun above it had deleted what it was made from."""
    made = [str(o) for o in outs if os.path.exists(o)]
    gone = [str(i) for i in ins if not os.path.exists(i)]
    if made and gone:
        force_rerun(workflow, outs)
        if made[0] not in _STALE_SAID:
            _STALE_SAID.add(made[0])
            print(f"rloo: {made[0]} was made from {gone[0]}, which is missing: both are made again",
                  file=sys.stderr)


def chain_inputs(stage):
    """A chain rule's input function: the stage's inputs from the pipeline's one declaration
    (rloo_workflow.pipeline.input_graph), for the job's estimator and variant; a stale job runs again (rerun_if_stale)."""
    def inputs(wildcards):
        est, variant, policy = job_estimator(wildcards), job_variant(wildcards), job_policy(wildcards)
        found = job_inputs(config, stage, est, variant, policy)
        rerun_if_stale(list(outputs(stage, config, est, variant, policy=policy).values()), list(found.values()))
        return found

    return inputs


def guarded(outs, ins):
    """The input function of a job outside the chain, `ins` ({name: path or paths}, or a function of the
    wildcards giving it), the job run again where its outputs (templates) exist while an input is missing."""
    def inputs(wildcards):
        found = ins(wildcards) if callable(ins) else ins
        flat = [p for v in found.values() for p in ([v] if isinstance(v, str) else v)]
        rerun_if_stale([o.format(**dict(wildcards.items())) for o in outs], flat)
        return found

    return inputs


def chain_cfg(stage):
    """A chain rule's `cfg` param and its command's --job-config: the file of what the job reads of its config
    (rloo_workflow.pipeline.job_settings), named by its content, so a changed value reruns exactly the stages that
    read it."""
    return lambda wildcards: job_config_file(stage, job_settings(config, stage, job_estimator(wildcards),
                                                                 job_variant(wildcards), job_policy(wildcards)))


def chain_args(stage):
    """A chain rule's `args` param: its command's options, declared once for the rules and for what else builds
    a job's command (rloo_workflow.commands.chain_options), in a file named by its content (job_args_file)."""
    def args(wildcards, input, output):
        return job_args_file(stage, chain_options(stage, config, dict(input.items()), dict(output.items()),
                                                  chain_cfg(stage)(wildcards), job_estimator(wildcards),
                                                  job_variant(wildcards), job_policy(wildcards)))

    return args


def chain_identity(stage):
    """A chain rule's `identity` param: `identity:<digest>`, the job's rerun identity (rloo.identity.job_identity,
    through rloo_workflow.pipeline.identity): the keys it reads, its code and user files, and the same of every
    job above it, so a change above it reruns it even where the job between lost its output to an interrupt.
    Its parts are kept for `rloo why-rerun` (rloo_workflow/code_fingerprint.py save_identity)."""
    def param(wildcards):
        ident = identity(config, stage, _job_code, job_estimator(wildcards), job_variant(wildcards), job_policy(wildcards))
        save_identity(Path.cwd(), ident)
        return f"identity:{ident.rerun}"

    return param


def _job_code(stage, cfg):
    """A job's code fingerprint (its config's reward functions and tools among it), its manifest kept for
    `rloo why-rerun` (once a process: stage_fingerprint caches it)."""
    fp = stage_fingerprint(stage, cfg)
    if fp.digest not in _SAVED:
        _SAVED.add(fp.digest)
        save_manifest(Path.cwd(), fp)
    return fp


_SAVED = set()


# GPUs of a judge a job serves itself (evaluate.llm_judge.serve): the judge and comparison rules ask for
# them (those jobs hold no policy).
_SERVE = SETTINGS.evaluate.llm_judge.serve if SETTINGS.evaluate.judge == "llm" else None
JUDGE_GPUS = _SERVE.gpus if _SERVE else 0


# Threads of the torch stages: config `threads`, else 8. Locally Snakemake lowers them to --cores;
# on Slurm they are the job's --cpus-per-task. The stage gets exactly this many (--set threads=).
TORCH_THREADS = SETTINGS.threads or 8


def cpus(wildcards, threads):
    return threads


# A run sized for a cluster: a profile (slurm/config.yaml, profiles/gpu) or the command line sets resources
# for each of the rules (`set-resources`, where every mem_mb and runtime lives; the rules hold none). Only such a run
# asks for GPUs and CPUs per task (`cluster_resources`); a local run's job blocks show the machine's own
# resources, not a cluster's sizes. Snakemake hands set-resources on to each Slurm job's own process, so
# the job's rule asks for the same.
SIZED = bool(workflow.resource_settings.overwrite_resources)


def cluster_resources(stage):
    """What a torch stage's job asks a cluster for beyond its size (`gpu_resources`, its CPUs per task: its
    threads); nothing for a local run (`SIZED`)."""
    return {**gpu_resources(stage), "cpus_per_task": cpus} if SIZED else {}


def judge_resources():
    """The GPUs of a judge its job serves itself (evaluate.llm_judge.serve), asked of a cluster (`SIZED`); none
    for the verifier or an external judge."""
    return {"gpu": JUDGE_GPUS} if SIZED and JUDGE_GPUS else {}


def gpu_resources(stage):
    """A training stage's GPUs and tasks (rloo_workflow.pipeline: `data_parallel`). One process: `gpu: 1`. Under a
    `distributed` strategy with several processes, one Slurm task per process: `nodes`, `gres: gpu:P` (P =
    nproc_per_node GPUs on each node), `tasks_per_node: P` (with one process per node `tasks: nodes`,
    and `tasks_per_gpu: 1`, which the plugin would otherwise take `tasks` for), and `mpi`, which makes
    the plugin run the rule's shell in the batch step instead of under `srun -n1`: there `rloo <stage>`
    finds itself in the allocation and starts its processes with this very srun line (rloo_workflow/launch.py)."""
    d = SETTINGS.distributed
    per_node, nodes = d.nproc_per_node, d.nodes
    if not STAGES[stage].data_parallel or d.strategy == "none" or per_node * nodes == 1:
        # one-step off-policy RLOO: its sampler process on a second GPU (rloo_workflow/memory_plan.py, rloo sampler)
        return {"gpu": 2 if stage == "rloo" and SETTINGS.rloo.off_policy_steps else 1}
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


# The memory plan (rloo_workflow/memory_plan.py, `rloo plan`), where the config names its GPUs' memory
# (plan.gpu_memory_gb): a config whose stage would not fit one GPU is refused before any job is queued.
if SETTINGS.plan.gpu_memory_gb:
    from rloo_workflow.memory_plan import check as _memory_check

    if _problem := _memory_check(config):
        raise ValueError(f"memory plan (plan.gpu_memory_gb={SETTINGS.plan.gpu_memory_gb:g}): {_problem}")
