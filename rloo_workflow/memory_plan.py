"""Peak GPU memory per device of each GPU stage, predicted from the config before any job runs (`rloo plan`).

Notation: P parameters of the policy, w bytes per weight (model.dtype: 4 for float32, 2 for bfloat16 /
float16), W ranks (distributed.nproc_per_node x nodes; 1 under strategy none), S = W under fsdp else 1
(how many ways the trained state is sharded), L layers, h hidden size, i intermediate size, a attention
heads, g key/value heads, d = h / a, V vocabulary, N tokens of one micro-batch, T = model.max_length
(the shape and where it is read from: rloo_workflow/model_shape.py).

Each stage runs in phases (an update, sampling, ...); its peak is that of its largest phase:

    peak = model state + activations + logits + vLLM

model state (for the whole stage; weights also gathered during the phase under FSDP)
  trained     P x w x 4 / S: weight, gradient and AdamW's exp_avg and exp_avg_sq, which torch keeps in
              the parameter's dtype (this code has no separate float32 master copy: float32 weights,
              as in config/gpu.yaml, are the master weights)
  LoRA        P x w / S for the frozen base + A x w x 4 / S for the A adapter parameters
  frozen      P x w, a whole copy on every rank (the code does not shard them): the RLOO reference
              (none under LoRA: the policy with its adapters off), the reward model in the rloo stage
              when reward.source is model, the SFT policy the reward stage samples pairs from, and the
              evaluate stage's SFT reference, reward model and one evaluated policy at a time
  PPO critic  a second trained network (P x w x 4), never sharded (PPO is refused data-parallel)
  FSDP        during an update the root (embeddings, final norm, head) stays gathered after forward
              and two decoder layers are gathered at a time: (root + 2 layers) x w x (W-1)/W; while
              sampling or evaluating the whole policy is gathered: P x w x (W-1)/W
activations (an update: what one micro-batch keeps for its backward pass)
  N = min(the rank's whole step, max(<stage>.micro_batch_tokens, one row)); a row is model.max_length
  tokens (a reward pair is two rows: pairs stay whole); 0 = the whole step in one pass
  float32 (no autocast): N x L x (11h + 4i) x 4 bytes: the layer input, RMSNorm's normalised input
      and output twice, q after rotary, k and v repeated to every head (a padded batch makes sdpa take
      transformers' repeated k/v), the attention output and o_proj's input; the MLP's gate, SiLU(gate),
      up and their product
  bfloat16 autocast on float32 weights: N x L x (36h + 8i) bytes (residual stream and RMSNorm in
      float32, each linear's input cast to bfloat16 on its own, the rest in bfloat16) + 2 bytes per
      weight of every linear layer (autocast's bfloat16 copies, kept for the backward pass)
  bfloat16 / float16 weights: N x L x ((11h + 4i) x 2 + 16h) (RMSNorm upcasts to float32)
  eager attention: + N x L x a x T x 4 (the softmax probabilities; sdpa keeps none)
  gradient checkpointing: every layer keeps only its input (N x L x h x 4) + one layer's activations
      recomputed in the backward pass with its gradients (N x (h + i) x 4); the logits' peak (the
      head's backward) comes before any layer is recomputed: they count for what they exceed it by
  outside the layers: N x 4h x 4 (embedding output, final RMSNorm)
logits (an update)
  model.logits_chunk_tokens = c > 0 (rloo.model.head): min(c, N) x V x 4 (one chunk's float32 logits at a
      time, recomputed in the backward pass) + the head's weight gradient built there chunk by chunk:
      a float32 [V, h] accumulator and each chunk's [V, h] product, 10 x V x h bytes under bf16 autocast
      on float32 weights (their bf16 copies too), 7 x V x h in float32, 6 x V x h on bf16 weights (fitted
      to CPU measurements of rloo.model.head at two hidden sizes and two chunk sizes)
  c = 0: 3 x N x V x 4 (the whole micro-batch's logits, log-softmax and gradient in float32)
sampling (a phase of decoding with the HF path: sft's and rloo's evaluations, rloo's rollouts with
  rollout.backend hf, the reward stage's pair sampling, the evaluate stage)
  KV cache: rows x T x L x 2 x g x d x w (allocated once for the longest row, in the weights' dtype)
  logits of the last position: rows x V x 4 x 2
vLLM: rollout.gpu_memory_utilization x GPU memory in the rloo stage with rollout.backend vllm (the
  engine reserves its share of the whole GPU, whatever it uses)
off-policy (rloo.off_policy_steps 1): the rollouts (and a vLLM engine) move to the sampler process, which
  is planned on a second GPU of its own ("rloo sampler"): its copy of the policy (P x w; under LoRA the
  base and the adapters), the reward model when it scores with one (reward.source model), the KV cache of
  the step's rows (or vLLM's share of that GPU); the trainer's GPU keeps the update and the validation
  decoding. Planned, not run: the GPU profile asks for the second GPU (workflow/rules/common.smk), and
  on a CPU both processes share the machine's memory (rloo_workflow/host_memory.py)

A stage fits when its peak is at most the GPU's memory less MARGIN_GB and MARGIN_SHARE of it: the CUDA
context (about 0.5 GB), NCCL's buffers and the caching allocator's fragmentation. Validated on a CPU
against measured peaks of one forward + backward (tests/e2e/test_memory_plan.py, docs/scaling.md); not
counted: no-grad passes (reference, old log-probs, reward scoring: one layer's temporaries at a time,
less than the update's at the same tokens), the judge, which the evaluate job serves on its own GPU.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rloo.settings import Config, ModelConfig
from rloo_workflow.model_shape import Shape, model_shape

GB = 1e9
MARGIN_GB = 1.0       # the CUDA context and NCCL's buffers
MARGIN_SHARE = 0.10   # the caching allocator's fragmentation
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# ---- the terms -------------------------------------------------------------------------------------

def _activation_parts(shape: Shape, tokens: int, dtype: str, autocast: str, checkpointing: bool, eager: bool,
                      seq_len: int) -> tuple[int, int]:
    """(bytes kept through the whole backward pass, bytes of the one layer recomputed in it: 0 without
    gradient checkpointing)."""
    h, i, L = shape.hidden_size, shape.intermediate_size, shape.num_layers
    if DTYPE_BYTES[dtype] == 2:
        per_layer_token, weight_copies = (11 * h + 4 * i) * 2 + 16 * h, 0
    elif autocast == "bfloat16":
        per_layer_token, weight_copies = 36 * h + 8 * i, 2 * shape.layer_linear_params()
    else:
        per_layer_token, weight_copies = (11 * h + 4 * i) * 4, 0
    if eager:
        per_layer_token += shape.num_heads * seq_len * 4
    one_layer = tokens * per_layer_token + weight_copies
    outside = tokens * 4 * h * 4  # embedding output, final RMSNorm
    if autocast == "bfloat16" and DTYPE_BYTES[dtype] == 4:
        outside += 2 * shape.vocab_size * h  # autocast's bfloat16 copy of the head
    if checkpointing:  # the layers' inputs; the recomputed layer with its input and MLP gradients
        return tokens * L * h * 4 + outside, one_layer + tokens * (h + i) * 4
    return L * one_layer + outside, 0


def activation_bytes(shape: Shape, tokens: int, dtype: str = "float32", autocast: str = "none",
                     checkpointing: bool = False, eager: bool = False, seq_len: int = 0) -> int:
    """What one micro-batch of `tokens` tokens keeps for its backward pass (module docstring): under
    gradient checkpointing, the layers' inputs and the one layer recomputed."""
    return sum(_activation_parts(shape, tokens, dtype, autocast, checkpointing, eager, seq_len))


def logits_bytes(shape: Shape, tokens: int, chunk_tokens: int, dtype: str = "float32", autocast: str = "none") -> int:
    """The logits temporaries of one micro-batch's log-probs (module docstring)."""
    if chunk_tokens:
        per_vh = 6 if DTYPE_BYTES[dtype] == 2 else 10 if autocast == "bfloat16" else 7  # bytes per V x h
        return 4 * min(chunk_tokens, tokens) * shape.vocab_size + per_vh * shape.vocab_size * shape.hidden_size
    return 3 * tokens * shape.vocab_size * 4


def update_bytes(shape: Shape, tokens: int, chunk_tokens: int, dtype: str = "float32", autocast: str = "none",
                 checkpointing: bool = False, eager: bool = False, seq_len: int = 0) -> tuple[int, int]:
    """(activations, logits) of one micro-batch's forward + backward; their sum is its peak. Under gradient
    checkpointing the logits' peak (the head's backward) comes before any layer is recomputed, so the
    logits count only for what they exceed the recomputed layer by."""
    kept, recomputed = _activation_parts(shape, tokens, dtype, autocast, checkpointing, eager, seq_len)
    return kept + recomputed, max(0, logits_bytes(shape, tokens, chunk_tokens, dtype, autocast) - recomputed)


def micro_batch_tokens(budget: int, rows: int, row_tokens: int, unit_rows: int = 1) -> int:
    """Tokens of the largest micro-batch: the budget, at least one unit (a row, or a pair), at most the
    rank's whole step; budget 0 = the whole step."""
    whole = rows * row_tokens
    return whole if budget == 0 else min(whole, max(budget, unit_rows * row_tokens))


# ---- the stages ------------------------------------------------------------------------------------

@dataclass
class Phase:
    """One phase of a stage: the bytes each term holds at its peak, and the key that lowers each."""

    name: str
    state: float
    activations: float = 0.0
    logits: float = 0.0
    vllm: float = 0.0
    keys: dict[str, str] = field(default_factory=dict)  # term -> what lowers it ("lower <key>", "set <key>=...")

    @property
    def total(self) -> float:
        return self.state + self.activations + self.logits + self.vllm


@dataclass
class StagePlan:
    stage: str
    strategy: str
    phases: list[Phase]

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.total)


def ranks(sections: Config) -> tuple[int, int]:
    """(ranks, shards of the trained state) of the data-parallel stages."""
    d = sections.distributed
    world = d.nproc_per_node * d.nodes if d.strategy != "none" else 1
    return world, world if d.strategy == "fsdp" else 1


def _strategy(sections: Config) -> str:
    """A training stage's layout and memory options, for the table."""
    world, _ = ranks(sections)
    parts = [f"{sections.distributed.strategy} x{world}" if world > 1 else "1 GPU"]
    if sections.model.lora.enabled:
        parts.append("LoRA")
    if sections.model.gradient_checkpointing:
        parts.append("ckpt")
    return ", ".join(parts)


def _trained(shape: Shape, mc: ModelConfig, shards: int, params: int | None = None) -> float:
    """Weights, gradients and AdamW moments of a trained network (LoRA: a frozen base, trained adapters)."""
    w = DTYPE_BYTES[mc.dtype]
    params = shape.parameters() if params is None else params
    if mc.lora.enabled:
        return (params * w + shape.lora_parameters(mc.lora.r, mc.lora.target_modules) * w * 4) / shards
    return params * w * 4 / shards


def _state_key(sections: Config) -> str:
    """What shrinks a training stage's model state: sharding it, else LoRA, else narrower weights."""
    if sections.distributed.strategy != "fsdp":
        return "set distributed.strategy=fsdp or model.lora.enabled=true"
    return "set model.lora.enabled=true" if not sections.model.lora.enabled else "lower model.dtype"


def _update(shape: Shape, sections: Config, section: str, budget: int, state: float, rows: int, unit_rows: int = 1,
            logits: bool = True) -> Phase:
    """An update phase: `state` + one micro-batch of the gradient pass of `section` (sft, reward or rloo),
    whose `<section>.micro_batch_tokens` is `budget`."""
    mc = sections.model
    world, shards = ranks(sections)
    w = DTYPE_BYTES[mc.dtype]
    if shards > 1:  # FSDP: the root stays gathered after forward, two layers gathered at a time
        state += (shape.root_params() + 2 * shape.layer_params()) * w * (world - 1) / world
    tokens = micro_batch_tokens(budget, rows, mc.max_length, unit_rows)
    # `auto` resolves on the node that runs the job, not here: plan for the larger of its two outcomes
    modes = ("none", "bfloat16") if mc.autocast == "auto" else (mc.autocast,)
    # the reward model's one-output score head: no vocabulary, so no logits term
    outcomes = [update_bytes(shape, tokens, mc.logits_chunk_tokens, mc.dtype, mode, mc.gradient_checkpointing,
                             mc.attn_implementation == "eager", mc.max_length) for mode in modes]
    acts, lg = max(((a, g if logits else 0) for a, g in outcomes), key=sum)
    return Phase("update", state, acts, lg, keys={"activations": _activations_key(section, budget, mc.max_length,
                                                                                  unit_rows),
                                                  "logits": "lower model.logits_chunk_tokens",
                                                  "state": _state_key(sections)})


def _activations_key(section: str, budget: int, max_length: int, unit_rows: int) -> str:
    """What lowers an update's activations: its micro-batch budget, unless one unit (a row, or a reward pair)
    at model.max_length already exceeds it, so that every micro-batch is that unit and the budget bounds
    nothing: then the row length, named with the budget it overruns (which lowering would not help)."""
    unit = unit_rows * max_length
    if budget and unit > budget:
        what = "pair of rows" if unit_rows == 2 else "row"
        return (f"lower model.max_length (one {what} of model.max_length={max_length} tokens is over "
                f"{section}.micro_batch_tokens={budget}, so that budget cannot split it)")
    return f"lower {section}.micro_batch_tokens"


def _sampling(shape: Shape, sections: Config, state: float, rows: int, key: str, gathered: bool = True) -> Phase:
    """A decoding phase: `state` (+ the whole policy gathered under FSDP) + the KV cache of `rows` rows."""
    mc = sections.model
    world, shards = ranks(sections)
    w = DTYPE_BYTES[mc.dtype]
    if shards > 1 and gathered:
        state += shape.parameters() * w * (world - 1) / world
    kv = rows * mc.max_length * shape.kv_bytes_per_token(w)
    return Phase("sampling", state, kv, rows * shape.vocab_size * 4 * 2,
                 keys={"activations": f"lower {key}", "logits": f"lower {key}",
                       "state": _state_key(sections) if gathered else "lower model.dtype"})


def plan(sections: Config, shape: Shape, gpu_gb: float | None = None) -> list[StagePlan]:
    """The predicted phases of each GPU stage under the config (terms: module docstring). `gpu_gb` sizes
    vLLM's share; without it the share is left out."""
    mc, w = sections.model, DTYPE_BYTES[sections.model.dtype]
    world, shards = ranks(sections)
    P = shape.parameters()
    per_rank = lambda n: math.ceil(n / world)  # noqa: E731  (a rank's contiguous share of a step)
    plans = []

    s = sections.sft
    trained = _trained(shape, mc, shards)
    plans.append(StagePlan("sft", _strategy(sections), [
        _update(shape, sections, "sft", s.micro_batch_tokens, trained, per_rank(s.batch_size)),
        _sampling(shape, sections, trained, s.eval_batch_size, "sft.eval_batch_size")]))

    r = sections.reward
    # rloo/train/reward.py samples 128 // k prompts x k completions a call, split over the ranks
    sample_rows = per_rank(max(1, 128 // r.samples_per_prompt) * r.samples_per_prompt)
    rm_trained = _trained(shape, mc, shards, shape.reward_model_parameters())
    plans.append(StagePlan("reward", _strategy(sections), [
        _sampling(shape, sections, P * w, sample_rows, "model.max_length", gathered=False),
        _update(shape, sections, "reward", r.micro_batch_tokens, rm_trained, 2 * per_rank(r.batch_size), unit_rows=2,
                logits=False)]))

    o, backend = sections.rloo, sections.rollout.backend
    ppo = o.estimator == "ppo"
    frozen = (0 if mc.lora.enabled else P * w) + (shape.reward_model_parameters() * w if r.source == "model" else 0)
    state = trained + frozen + (shape.parameters() * w * 4 if ppo else 0)  # PPO's critic trains whole
    vllm = 0.0
    if backend == "vllm" and gpu_gb:
        vllm = sections.rollout.gpu_memory_utilization * gpu_gb * GB
    rows = per_rank(o.prompts_per_step) * o.k
    off = o.off_policy_steps > 0  # the rollouts, and the engine, are the sampler's, on a GPU of its own
    update = _update(shape, sections, "rloo", o.micro_batch_tokens, state, rows // o.ppo.minibatches if ppo else rows)
    decode_rows = max(rows if backend == "hf" and not off else 0, o.eval_batch_size if o.eval_every else 0)
    key = "rloo.eval_batch_size" if decode_rows != rows or backend != "hf" else "rloo.prompts_per_step"
    sampling = _sampling(shape, sections, state, decode_rows, key)
    for p in (update, sampling):
        p.vllm = 0.0 if off else vllm
        p.keys["vllm"] = "lower rollout.gpu_memory_utilization"
    plans.append(StagePlan(f"rloo ({o.estimator})", _strategy(sections), [update, sampling]))
    if off:
        # Its own copy of the policy (LoRA: the base with the adapters) and the reward model it scores with.
        held = (P + (shape.lora_parameters(mc.lora.r, mc.lora.target_modules) if mc.lora.enabled else 0)) * w
        held += shape.reward_model_parameters() * w if r.source == "model" else 0
        sampler = _sampling(shape, sections, held, rows if backend == "hf" else 0, "rloo.prompts_per_step",
                            gathered=False)
        sampler.vllm = vllm
        sampler.keys["vllm"] = "lower rollout.gpu_memory_utilization"
        plans.append(StagePlan(f"rloo sampler ({o.estimator})", "1 GPU of its own", [sampler]))

    copies = P * w * 2 + shape.reward_model_parameters() * w  # the SFT reference, one policy, the reward model
    plans.append(StagePlan("evaluate", "1 GPU", [_sampling(shape, sections, copies, sections.evaluate.batch_size,
                                                           "evaluate.batch_size", gathered=False)]))
    return plans


# ---- verdicts --------------------------------------------------------------------------------------

def usable_gb(gpu_gb: float) -> float:
    """What a stage may use of a GPU of `gpu_gb`: less the margin (module docstring)."""
    return gpu_gb * (1 - MARGIN_SHARE) - MARGIN_GB


def problem(plans: list[StagePlan], gpu_gb: float) -> str | None:
    """One line naming the first stage that does not fit and the config key to lower, or None. The key
    is that of the largest transient term (activations or KV cache, logits, vLLM) when lowering it alone
    could make the stage fit, else the model state's."""
    usable = usable_gb(gpu_gb)
    if usable <= 0:  # else every stage "needs more than -0.1 GB usable"
        return (f"a GPU of {gpu_gb:g} GB leaves nothing usable after the margin for the CUDA context and the "
                f"allocator ({MARGIN_GB:g} GB + {MARGIN_SHARE:.0%}): plan.gpu_memory_gb (or --gpu-memory-gb) must "
                f"exceed {MARGIN_GB / (1 - MARGIN_SHARE):.2f}")
    for sp in plans:
        p = sp.peak
        if p.total / GB <= usable:
            continue
        terms = {"activations": p.activations, "logits": p.logits, "vllm": p.vllm}
        term = max(terms, key=terms.get)
        if (p.total - terms[term]) / GB > usable:
            term = "state"
        key = p.keys[term]
        if term == "activations" and p.name == "update" and "ckpt" not in sp.strategy:
            key += " (or set model.gradient_checkpointing=true)"
        label = {"state": "model state", "activations": "KV cache" if p.name == "sampling" else "activations",
                 "logits": "logits", "vllm": "vLLM"}[term]
        size = p.state if term == "state" else terms[term]
        return (f"{sp.stage} needs {p.total / GB:.1f} GB per GPU ({p.name}: {label} {size / GB:.1f} GB), over the "
                f"{usable:.1f} GB usable of {gpu_gb:g} GB: {key}")
    return None


def table(plans: list[StagePlan], gpu_gb: float | None) -> str:
    """The plan as a fixed-width table, one row per stage (its peak phase), in GB."""
    head = ("stage", "strategy", "phase", "model state", "activations", "logits", "vLLM", "total", "fits?")
    rows = [head]
    for sp in plans:
        p = sp.peak
        fits = "-" if not gpu_gb else "yes" if p.total / GB <= usable_gb(gpu_gb) else "NO"
        rows.append((sp.stage, sp.strategy, p.name, *(f"{x / GB:.1f}" for x in (p.state, p.activations, p.logits,
                                                                                p.vllm, p.total)), fits))
    widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
    lines = ["  ".join(v.ljust(widths[c]) if c < 3 else v.rjust(widths[c]) for c, v in enumerate(r)) for r in rows]
    return "\n".join(lines)


def check(cfg: Mapping[str, Any], gpu_gb: float | None = None) -> str | None:
    """The one-line problem of the validated config `cfg` on GPUs of `gpu_gb` (default plan.gpu_memory_gb),
    or None: what the Snakefile raises at parse time (it holds the config as a dict)."""
    sections = Config.from_config(cfg)
    gpu_gb = gpu_gb or sections.plan.gpu_memory_gb
    if not gpu_gb:
        return None
    shape, _ = model_shape(sections.model)
    return problem(plan(sections, shape, gpu_gb), gpu_gb)
