"""Peak host memory (RSS) of each stage of a CPU run, predicted from the config before any job runs: what
validation holds a CPU config to (rloo_workflow.config.checks: `rloo validate-config`, every `rloo <stage>`, and
`snakemake -n`, which validates at parse time), beside `rloo plan`'s GPU memory (rloo_workflow/memory_plan.py),
whose phases and terms it takes as they are: the model state, one micro-batch's activations and logits,
the KV cache. On top of them, per process, what a CPU run holds and the GPU plan leaves out:

  interpreter  BASELINE_BYTES: Python with torch, transformers and rloo imported, and their allocators'
               arenas (0.37-0.40 GB in the measured runs of bench/host_memory.py, fresh processes)
  decode       the lean decode loop (rloo/rollout/decode.py) over G prompts of k samples each (rows =
               G x k), W prompt tokens and N new ones, H attention heads (rep per key/value head), V
               the vocabulary, w bytes per weight: its additive attention mask, G x k x rep x (W + kN)
               x w, and one layer's attention scores at the last token, G x H x k x (W + kN) x 8 (the
               float32 scores and their softmax): both grow with k x k x N; and the sampler's temporaries
               per token, 6 x rows x V x 4 (logits, the Gumbel noise and its logarithms, log-softmax),
               of which the GPU plan counts 2
  step rows    the RLOO step's sampled rows, held through its update: token ids, masks, the sampler's,
               the old and the reference log-probabilities, rows x model.max_length x 25 bytes
  sampler      off-policy (rloo.off_policy_steps 1), the sampler process's own peak (its interpreter, its
               copy of the policy and of the reward model, the rollouts' decode), beside every phase of
               the trainer's

Each of the `distributed.nproc_per_node` processes a run starts on one machine holds all of it. A
config fits when its largest stage's peak is at most the machine's memory less MARGIN_SHARE:
`plan.host_memory_gb`, else the smallest of the machine's memory, its cgroup's limit and the process's
address-space and data limits (`ulimit -v`, `ulimit -d`), read where validation runs.

Measured (bench/host_memory.py, docs/figures/host_memory.json: the peak RSS of `rloo train`, 2 steps in a
fresh process, glibc's default allocator): within 4 % either way where the interpreter, the model state
or the decode loop dominates (the micro model at k = 2 and at k = 512; a random model of Qwen2.5-0.5B's
widths and vocabulary with 2 layers at k = 4), and 41 % over where the update's activations do (the
same model at k = 32): like the GPU plan, the update counts every row at model.max_length tokens, an
upper bound (those rows held 40 % of it).
"""

from __future__ import annotations

import math
import os
import resource
from dataclasses import dataclass, field
from pathlib import Path

from rloo.errors import UserError
from rloo.settings import Config
from rloo_workflow.memory_plan import DTYPE_BYTES, GB, MARGIN_SHARE, StagePlan, plan, ranks
from rloo_workflow.model_shape import Shape, model_shape

BASELINE_BYTES = 0.4e9
SAMPLER_BYTES_PER_LOGIT = 6 * 4  # logits, noise, its two logarithms, the noisy logits, log-softmax (float32)
ROW_BYTES_PER_TOKEN = 8 + 8 + 1 + 4 * 3  # prompt and completion ids, mask, three log-probabilities


@dataclass
class HostPhase:
    stage: str
    name: str
    terms: dict[str, float]
    keys: dict[str, str] = field(default_factory=dict)  # term -> what lowers it

    @property
    def total(self) -> float:
        return sum(self.terms.values())


@dataclass(frozen=True)
class Decode:
    """One decode call of a stage: `groups` prompts of `k` samples, `new` tokens each; `key` lowers it."""

    groups: int
    k: int
    new: int
    key: str


def decode_bytes(shape: Shape, d: Decode, max_length: int, weight_bytes: int) -> float:
    """The lean decode loop's mask, attention scores and sampler temporaries beyond the GPU plan's terms
    (module docstring)."""
    width = max(1, max_length - d.new)
    keys = width + d.k * d.new  # key slots of a group's cache: its prompt, then k x N generated tokens
    rep = shape.num_heads // shape.num_kv_heads
    mask = d.groups * d.k * rep * keys * weight_bytes
    scores = d.groups * shape.num_heads * d.k * keys * 8
    sampler = d.groups * d.k * shape.vocab_size * (SAMPLER_BYTES_PER_LOGIT - 8)  # the GPU plan counts 8
    return mask + scores + sampler


def decodes(sections: Config) -> dict[str, list[Decode]]:
    """The decode calls of each stage (its largest ones), by the GPU plan's stage name."""
    world, _ = ranks(sections)
    s, r, o, e = sections.sft, sections.reward, sections.rloo, sections.evaluate

    def evaluation(batch: int, draws: int, new: int, key: str) -> Decode:  # rloo.eval.evaluation.decode
        return Decode(max(1, batch // draws), draws, new, key)

    rollouts = [Decode(math.ceil(o.prompts_per_step / world), o.k, o.max_new_tokens,
                       "lower rloo.k (the mask and scores grow with its square) or rloo.max_new_tokens")]
    rollouts = rollouts if sections.rollout.backend == "hf" else []
    validation = [evaluation(o.eval_batch_size, o.eval_draws, o.max_new_tokens, "lower rloo.eval_batch_size")]
    validation = validation if o.eval_every else []
    spp = r.samples_per_prompt
    return {
        "sft": [evaluation(s.eval_batch_size, s.eval_draws, s.eval_max_new_tokens, "lower sft.eval_batch_size")],
        "reward": [Decode(math.ceil(max(1, 128 // spp) / world), spp, r.max_new_tokens,
                          "lower reward.samples_per_prompt or reward.max_new_tokens")],
        # off-policy, the sampler process decodes the rollouts (memory_plan: "rloo sampler")
        f"rloo ({o.estimator})": validation if o.off_policy_steps else rollouts + validation,
        f"rloo sampler ({o.estimator})": rollouts,
        "evaluate": [evaluation(e.batch_size, e.samples_per_prompt, e.max_new_tokens, "lower evaluate.batch_size")],
    }


def host_plan(sections: Config, shape: Shape) -> list[HostPhase]:
    """Every phase of every stage with its host-memory terms for one machine (module docstring)."""
    max_length, w = sections.model.max_length, DTYPE_BYTES[sections.model.dtype]
    local = sections.distributed.nproc_per_node if sections.distributed.strategy != "none" else 1
    calls = decodes(sections)
    out = []
    sp: StagePlan
    for sp in plan(sections, shape, None):
        for p in sp.phases:
            terms = {"interpreter": BASELINE_BYTES, "state": p.state, "activations": p.activations, "logits": p.logits}
            keys = dict(p.keys)
            if p.name == "sampling" and calls.get(sp.stage):
                biggest = max(calls[sp.stage], key=lambda d: decode_bytes(shape, d, max_length, w))
                terms["decode"] = decode_bytes(shape, biggest, max_length, w)
                keys["decode"] = keys["activations"] = biggest.key
            if sp.stage.startswith("rloo") and p.name == "update":
                o = sections.rloo
                rows = math.ceil(o.prompts_per_step / max(1, local)) * o.k
                terms["rows"] = rows * max_length * ROW_BYTES_PER_TOKEN
                keys["rows"] = "lower rloo.k or rloo.prompts_per_step"
            out.append(HostPhase(sp.stage, p.name, {k: v * local for k, v in terms.items()}, keys))
    # Off-policy on one machine, the sampler process runs beside the trainer all along: each of the
    # trainer's phases holds the sampler's peak too.
    sampler = [p for p in out if p.stage.startswith("rloo sampler")]
    if sampler:
        peak = max(sampler, key=lambda p: p.total)
        for p in out:
            if p.stage.startswith("rloo (") and not p.stage.startswith("rloo sampler"):
                p.terms["sampler"] = peak.total
                p.keys["sampler"] = peak.keys.get("decode", "set rollout.sampler_threads=0 (no sampler process)")
    return out


def machine_memory() -> tuple[float, str]:
    """(bytes, what they are) of the memory a run on this machine may hold: the smallest of its physical
    memory, its cgroup's limit and this process's address-space and data limits."""
    found: list[tuple[float, str]] = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    found.append((int(line.split()[1]) * 1024, "this machine's memory"))
    except OSError:
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:
            found.append((int(text), f"the cgroup's limit ({path})"))
    for limit, name in ((resource.RLIMIT_AS, "ulimit -v"), (resource.RLIMIT_DATA, "ulimit -d")):
        soft = resource.getrlimit(limit)[0]
        if soft != resource.RLIM_INFINITY:
            found.append((soft, f"this process's limit ({name})"))
    if not found:  # not Linux: the page count
        found.append((os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's memory"))
    return min(found)


def cpu_run(sections: Config) -> bool:
    """Whether the stages run on the CPU: model.device cpu, or auto with no GPU here and none planned
    (plan.gpu_memory_gb: a config for GPU nodes, validated on a login node without one)."""
    device = sections.model.device
    if device != "auto":
        return device == "cpu"
    if sections.plan.gpu_memory_gb:
        return False
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1")
    return hidden or not any(Path("/proc/driver/nvidia/gpus").glob("*"))


def _size(b: float) -> str:
    return f"{b / 1e12:.1f} TB" if b >= 1e12 else f"{b / GB:.1f} GB"


def problem(sections: Config, shape: Shape) -> str | None:
    """One line naming the key to lower when a stage's predicted host memory exceeds what this machine
    (or plan.host_memory_gb) gives, else None."""
    limit_gb = sections.plan.host_memory_gb
    limit, what = (limit_gb * GB, "plan.host_memory_gb") if limit_gb else machine_memory()
    usable = limit * (1 - MARGIN_SHARE)
    worst = max(host_plan(sections, shape), key=lambda p: p.total)
    if worst.total <= usable:
        return None
    # the largest term names the key (the interpreter's share is no key's)
    term = max((k for k in worst.terms if k != "interpreter"), key=worst.terms.get)
    key = worst.keys.get(term, "lower the model's size")
    size = worst.terms[term]
    label = {"decode": "decode mask, scores and sampler", "rows": "the step's rows", "activations": "activations",
             "logits": "logits", "state": "model state", "sampler": "the off-policy sampler process"}[term]
    key_name = key.split()[1] if key.startswith(("lower ", "set ")) else key
    key_name = key_name.split("=")[0]
    return (f"key '{key_name}': {worst.stage} would need {_size(worst.total)} of host memory on this CPU run "
            f"({worst.name}: {label} {_size(size)}), over the {_size(usable)} usable of {_size(limit)} ({what}, "
            f"less {MARGIN_SHARE:.0%}): {key}")


def config_problems(sections: Config) -> list[str]:
    """The host-memory refusal of a CPU config, as validation asks it (none for a GPU run, or a model whose
    shape cannot be read: `rloo plan` names model.shape when asked)."""
    if not cpu_run(sections):
        return []
    try:
        shape, _ = model_shape(sections.model)
    except UserError:  # no shape to plan with: `rloo plan` names model.shape when asked
        return []
    found = problem(sections, shape)
    return [found] if found else []
