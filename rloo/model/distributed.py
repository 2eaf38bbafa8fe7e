"""Data-parallel training on torch.distributed: DDP or FSDP2, started by torchrun (`rloo train --nproc N`)
or by srun inside a Slurm allocation (one task per process; `adopt_slurm_env` maps its ranks).

`distributed.strategy: none` (the default) is the single-process path: every helper here is then the
identity, and no process group exists. Under torchrun (RANK, WORLD_SIZE, LOCAL_RANK in the environment)
with `ddp` or `fsdp`, `init(cfg)` joins the process group (gloo on CPU, nccl on CUDA) and:

- `wrap(model)` gives the module the gradient pass runs through: `DistributedDataParallel(model)`, or
  the model itself after FSDP2's `fully_shard` of each decoder layer and of the whole model;
- `shard(n)` is this rank's contiguous slice of a step's n prompts (or examples), and `loss_scale`
  the factor that makes DDP's / FSDP's gradient average over ranks equal the single-process gradient
  over the whole step (`W * local denominator / global denominator`);
- `gathered(model)` holds an FSDP model's parameters unsharded (sampling, evaluation: any number of
  forward passes, none of them collective), `on_main(fn)` runs fn on rank 0 and hands its result to all;
- `model_state` / `optim_state` gather full state dicts (rank 0 writes them), `load_model_state` /
  `load_optim_state` put full ones back on every rank, sharding them again under FSDP;
- `all_sum`, `mean_over_ranks`, `gather_rows` reduce a step's metrics before rank 0 logs them.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rloo.console import configure_logging
from rloo.errors import InputError
from rloo.model.launcher import adopt_slurm_env, launched_rank, launched_world
from rloo.settings import Config

log = logging.getLogger("rloo")

_strategy = "none"  # the strategy this process runs under, set by init


def init(cfg: Config | Mapping) -> int:
    """Join the process group of this torchrun job or srun step (once); return the world size (1: single
    process).

    `strategy: none` under a launcher with several processes is refused: every process would train
    the same batch and write the same outputs."""
    global _strategy
    configure_logging()  # before setup(): what init says (strategy, processes, backend) reaches the log
    adopt_slurm_env()
    config = Config.of(cfg)
    strategy, world = config.distributed.strategy, launched_world()
    if world > 1 and strategy == "none":
        raise InputError(f"{world} processes were launched (WORLD_SIZE={world}) but distributed.strategy is "
                         "none; set distributed.strategy to ddp or fsdp")
    # One process joins a process group of one only when a launcher started it (torchrun
    # --nproc-per-node 1: FSDP's and DDP's code paths on a single GPU, as scripts/gpu_check.sh runs them).
    if strategy == "none" or (world == 1 and not under_launcher()):
        if strategy != "none":
            log.info("distributed.strategy=%s in a single process: trains as strategy none", strategy)
        _strategy = "none"
        return 1
    if not dist.is_initialized():
        cuda = config.model.device != "cpu" and torch.cuda.is_available()
        if cuda:
            # srun may show a task every GPU of its node or its own one only
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        # Rank 0 alone evaluates and writes outputs while the others wait in a collective: a long timeout.
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(hours=2))
    _strategy = strategy
    if not is_main():
        logging.getLogger("rloo").setLevel(logging.WARNING)  # one copy of the progress log: rank 0's
    log.info("distributed: %s on %d processes (%s)", strategy, world, dist.get_backend())
    return world


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def under_launcher() -> bool:
    """Whether torchrun (or an srun step mapped to its variables) started this process."""
    return "TORCHELASTIC_RUN_ID" in os.environ or {"RANK", "WORLD_SIZE", "MASTER_ADDR"} <= set(os.environ)


def enabled() -> bool:
    """Whether this process trains in a process group (of one or more processes)."""
    return _strategy != "none" and dist.is_initialized()


def world() -> int:
    return dist.get_world_size() if enabled() else 1


def rank() -> int:
    """This process's rank: the process group's, else the launcher's RANK (0 outside a launcher)."""
    if dist.is_initialized():
        return dist.get_rank()
    return launched_rank()


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    if enabled():
        dist.barrier()


def threads(requested: int | None) -> int | None:
    """torch threads per process: as configured, else the machine's cores shared by its local processes."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    if requested is not None or local <= 1:
        return requested
    cores = int(os.environ.get("SLURM_CPUS_PER_TASK", 0)) or len(os.sched_getaffinity(0))
    return max(1, cores // local)


def fingerprint(base: str) -> str:
    """A checkpoint fingerprint that also names the process layout (a sharded optimizer state is
    resumed by the same strategy and world size only); unchanged in a single process."""
    if not enabled():
        return base
    return hashlib.sha256(f"{base}:{_strategy}:{world()}".encode()).hexdigest()[:16]


def refuse(what: str) -> None:
    """A feature not (yet) data-parallel: an error naming it."""
    if enabled():
        raise InputError(f"{what} does not run under distributed.strategy={_strategy} yet; use strategy none")


# -- splitting a step and scaling its loss ------------------------------------------------------------
def shard(n: int, empty_ok: bool = False) -> tuple[int, int]:
    """[lo, hi) of this rank's contiguous share of n items (the first n % W ranks take one more);
    `empty_ok`: a share may be empty (fewer items than ranks), else that is an error."""
    if not enabled():
        return 0, n
    w, r = world(), rank()
    if n < w and not empty_ok:
        raise InputError(f"{n} prompts or examples per step cannot be split over {w} processes")
    base, extra = divmod(n, w)
    lo = r * base + min(r, extra)
    return lo, lo + base + (1 if r < extra else 0)


def all_sum(*values: float) -> list[float]:
    """The values summed over ranks (float64, one all-reduce)."""
    t = torch.tensor([float(v) for v in values], dtype=torch.float64)
    if enabled():
        dist.all_reduce(t)
    return t.tolist()


def all_max(value: float) -> float:
    """The largest of the ranks' values (one all-reduce)."""
    t = torch.tensor([float(value)], dtype=torch.float64)
    if enabled():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def any_rank(flag: bool) -> bool:
    """Whether `flag` is set on any rank (a stop request that reached some processes first)."""
    if not enabled():
        return flag
    return all_sum(float(flag))[0] > 0


def loss_scale(local_denominator: float) -> float:
    """What this rank's loss (normalised by its own denominator: rows or tokens) is multiplied by, so
    that the mean of the ranks' gradients, which DDP and FSDP take, is the gradient of the loss
    normalised by the global denominator: W * local / global."""
    (total,) = all_sum(local_denominator)
    return world() * float(local_denominator) / max(total, 1e-12)


def mean_over_ranks(metrics: dict[str, float]) -> dict[str, float]:
    """Numeric values averaged over ranks (every rank must pass the same keys)."""
    if not enabled():
        return metrics
    keys = sorted(k for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool))
    sums = all_sum(*(metrics[k] for k in keys))
    return {**metrics, **{k: s / world() for k, s in zip(keys, sums, strict=True)}}


def gather_rows(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Each per-row tensor of this rank's slice joined with the other ranks' in rank order: the
    whole step's rows, as one process holds them (sizes may differ between ranks)."""
    if not enabled():
        return list(tensors)
    mine = [t.detach().cpu() for t in tensors]
    every: list[list[torch.Tensor] | None] = [None] * world()
    dist.all_gather_object(every, mine)
    device = tensors[0].device
    return [torch.cat([part[i] for part in every]).to(device) for i in range(len(tensors))]


def gather_objects(items: list) -> list:
    """This rank's (picklable) items joined with the other ranks' in rank order."""
    if not enabled():
        return items
    every: list[list | None] = [None] * world()
    dist.all_gather_object(every, items)
    return [x for part in every for x in part]


def on_main(fn: Callable[[], Any]) -> Any:
    """fn() on rank 0, its (picklable) result on every rank; the other ranks wait."""
    if not enabled():
        return fn()
    box = [fn() if is_main() else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@contextlib.contextmanager
def main_first() -> Iterator[None]:
    """Rank 0 runs the block first (it builds what the others then find made), then the others."""
    if enabled() and not is_main():
        dist.barrier()
    yield
    if enabled() and is_main():
        dist.barrier()


# -- wrapping the model -----------------------------------------------------------------------------
def _fsdp():
    from torch.distributed.fsdp import FSDPModule, fully_shard

    return FSDPModule, fully_shard


def sharded(model: torch.nn.Module) -> bool:
    """Whether `model` is FSDP-sharded (its parameters are DTensor shards)."""
    return enabled() and isinstance(model, _fsdp()[0])


def wrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module to run the gradient pass through: DDP around `model`, or `model` itself sharded in
    place by FSDP2 (each decoder layer, then the root: embeddings, final norm, head; tied weights stay
    together in the root). Build the optimizer after this (FSDP replaces the parameters)."""
    if not enabled():
        return model
    cuda = next(model.parameters()).device.type == "cuda"
    if _strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # Buffers (rotary frequencies) never change: no broadcast before each forward pass.
        return DistributedDataParallel(model, device_ids=[torch.cuda.current_device()] if cuda else None,
                                       broadcast_buffers=False)
    from torch.distributed.device_mesh import init_device_mesh

    _, fully_shard = _fsdp()
    mesh = init_device_mesh("cuda" if cuda else "cpu", (world(),))
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise InputError(f"distributed.strategy=fsdp: no decoder layers ({sorted(layer_classes)}) found in "
                         f"{type(model).__name__}")
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    model._get_fsdp_state()._lazy_init()  # the root is known now, before any unshard (see `gathered`)
    return model


@contextlib.contextmanager
def gathered(model: torch.nn.Module) -> Iterator[None]:
    """Within the block an FSDP model holds its whole parameters on every rank and its forward passes
    all-gather nothing, so ranks may run different numbers of them (sampling their own rows, rank 0
    alone evaluating). Every rank must enter and leave it together. A no-op for other models."""
    if not sharded(model) or getattr(model, "_rloo_gathered", False):  # nested: the outer block holds them
        yield
        return
    fsdp_module, _ = _fsdp()
    modules = [m for m in model.modules() if isinstance(m, fsdp_module)]
    model._rloo_gathered = True
    for m in modules:
        m.set_reshard_after_forward(False, recurse=False)
    for m in modules:
        m.unshard()
    try:
        yield
    finally:
        model._rloo_gathered = False
        for m in modules:
            m.reshard()
            m.set_reshard_after_forward(m is not model, recurse=False)  # layers reshard, the root keeps


def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_, with the total norm of FSDP's gradient shards made whole."""
    params = list(parameters)
    from torch.distributed.tensor import DTensor

    if not any(isinstance(p.grad, DTensor) for p in params):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    total = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


# -- full state dicts -------------------------------------------------------------------------------
def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's whole state dict: on rank 0 (empty elsewhere) gathered from FSDP shards to the CPU;
    a plain model's own `state_dict()`. Every rank must call it (a collective under FSDP)."""
    if not sharded(model):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(cpu_offload=True))


def whole_model(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model to write an output from (every rank must call it): `model` itself unless sharded;
    under FSDP, on rank 0, a plain copy of its class holding the gathered weights (so that what is
    saved names the model's own architecture), None on the other ranks."""
    if not sharded(model):
        return model
    state = model_state(model)
    if not is_main():
        return None
    plain = plain_like(model, state)
    load_whole(plain, state)
    return plain.eval()


def plain_like(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A fresh, unsharded model of `model`'s own class and config, in the dtype of `state`."""
    import copy

    fsdp_module, _ = _fsdp()
    cls = next(c for c in type(model).__mro__ if issubclass(c, torch.nn.Module) and not issubclass(c, fsdp_module))
    plain = cls(model.config).to(next(iter(state.values())).dtype)
    if getattr(model, "generation_config", None) is not None:  # a classifier (the reward model) has none
        plain.generation_config = copy.deepcopy(model.generation_config)
    return plain


def load_whole(plain: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Gathered weights into a plain model; every weight must fit (tied heads may be left out)."""
    missing, unexpected = plain.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if k not in state and "lm_head" not in k]:
        raise RuntimeError(f"gathered weights do not fit {type(plain).__name__}: missing {missing}, "
                           f"unexpected {unexpected}")


def optim_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's whole state (under FSDP: gathered, keyed by parameter name, on rank 0)."""
    if not sharded(model):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=_options(cpu_offload=True))


def load_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor]):
    """Load a whole state dict (non-strict) into `model`, each rank taking its shard under FSDP;
    returns (missing, unexpected) keys."""
    if not sharded(model):
        return model.load_state_dict(state, strict=False)
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    return set_model_state_dict(model, state, options=_options(strict=False))


def load_optim_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    if not sharded(model):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=_options())
