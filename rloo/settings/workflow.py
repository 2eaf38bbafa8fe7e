"""The sections about running the pipeline rather than what a stage computes: where outputs go (`paths`),
how training is spread over processes (`distributed`), the memory plan (`plan`), MLflow (`tracking`), and
the targets that run the chain several times (`seeds`, `comparison`, `sweeps`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rloo.settings.fields import Section, setting
from rloo.settings.training import ESTIMATOR_NAMES, Estimator


@dataclass(frozen=True)
class PathsConfig(Section):
    """Where the pipeline writes (relative to the folder it runs in)."""

    data: str = "data/gsm8k"
    """The prepared splits and their manifest."""
    models: str = "results/models"
    """Every stage's model folder (base, sft, reward, rloo_<estimator>)."""
    results: str = "results"
    """Results JSON files, plots, checkpoints (work/) and the MLflow run records (runs/)."""
    logs: str = "logs"
    """The Snakemake jobs' logs and benchmark files."""


@dataclass(frozen=True)
class DistributedConfig(Section):
    """Data-parallel training of the sft, reward and rloo stages on torch.distributed (`rloo train --nproc N`
    starts torchrun; inside a Slurm allocation, as under `snakemake --profile slurm`, srun with one task per
    process). Each process trains on its own contiguous share of every step's prompts (or examples, or
    pairs); gradients are averaged so that the step equals the single-process one."""

    strategy: Literal["none", "ddp", "fsdp"] = "none"
    """none = one process (today's path); ddp = DistributedDataParallel (every process holds the whole
    model); fsdp = FSDP2 fully_shard per decoder layer and the root (parameters, gradients and optimizer
    state sharded). gloo on CPU, nccl on CUDA."""
    nproc_per_node: int = setting(1, minimum=1)
    """Processes per machine (one GPU each on a GPU node) that `rloo sft|reward|train` start under torchrun
    or srun (--nproc overrides); the Slurm jobs ask for this many tasks and GPUs per node."""
    nodes: int = setting(1, minimum=1)
    """Machines of a run. Above 1 the stage must run inside a Slurm allocation (`snakemake --profile slurm`
    asks for them), where it starts its processes with srun."""


@dataclass(frozen=True)
class PlanConfig(Section):
    """The memory plan (`rloo plan`, rloo_workflow/memory_plan.py): each GPU stage's predicted peak per device under
    this config, checked before any job runs."""

    gpu_memory_gb: float | None = setting(None, exclusive_minimum=0)
    """Memory of one GPU (GB) the stages must fit in: `rloo plan` exits 2 and the Snakefile refuses to plan
    (naming the stage and the key to lower) when a stage's predicted peak exceeds it less a margin for the
    CUDA context and the allocator (1 GB + 10 %). null = print the plan only, check nothing. `rloo plan
    --gpu-memory-gb` overrides it."""
    host_memory_gb: float | None = setting(None, exclusive_minimum=0)
    """Memory of the machine a CPU run's stages run on (GB): validation (so `rloo validate-config`, every
    `rloo <stage>` and `snakemake -n`) refuses a CPU config whose stage's predicted peak host memory
    (rloo_workflow/host_memory.py) exceeds it less 10 %, naming the key to lower. null = the memory of the machine
    that validates (its physical memory, cgroup limit or ulimit, the smallest); set it when the stages run
    on other machines (Slurm CPU nodes). Not checked for a GPU run (model.device cuda, or auto with a GPU
    present or plan.gpu_memory_gb set)."""


@dataclass(frozen=True)
class TrackingConfig(Section):
    """MLflow: one parent run per `snakemake` invocation, one child run per stage (docs/tracking.md)."""

    enabled: bool = True
    """Log to MLflow at all."""
    experiment: str = "rloo"
    """The MLflow experiment the runs go to."""
    tracking_uri: str = "sqlite:///mlflow.db"
    """Overridden by the MLFLOW_TRACKING_URI environment variable."""


@dataclass(frozen=True)
class SeedsConfig(Section):
    """The `seeds` target (results/seeds/gsm8k_<rloo.estimator>.json): the chain once per seed, each seed's
    outputs in folders of their own (<paths.*>/seeds/seed<N>/), aggregated with a t-interval across seeds.
    Not read by any stage: changing it reruns nothing of the main chain."""

    values: tuple[int, ...] = setting([0, 1, 2], min_items=1, unique_items=True)
    """The seeds, one chain each."""
    scope: Literal["rloo", "all"] = "rloo"
    """rloo = prepare, sft and reward are the main chain's (the config's own seed), and each seed sets RLOO's
    seed and the evaluation's (which follows it); all = each seed runs the whole chain."""


@dataclass(frozen=True)
class ComparisonConfig(Section):
    """The `comparison` target (results/comparison.json): each listed estimator's RLOO stage and evaluation
    on the same prepare, SFT and reward, tabled, each judged against RLOO's policy. Not read by any stage: it
    only decides which estimators' results the comparison takes."""

    estimators: tuple[Estimator, ...] = setting(list(ESTIMATOR_NAMES), min_items=2, unique_items=True,
                                                contains={"const": "rloo"})
    """The estimators compared, RLOO among them (the others are judged against it)."""


# `sweeps`: named grids of dotted keys to lists of values (rloo_workflow/config/checks.py checks each value).
SWEEPS_SCHEMA = {"type": "object", "propertyNames": {"pattern": "^[A-Za-z0-9_]+$"},
                 "additionalProperties": {"type": "object", "minProperties": 1,
                                          "propertyNames": {"pattern": r"^[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*$"},
                                          "additionalProperties": {"type": "array", "minItems": 1}}}
