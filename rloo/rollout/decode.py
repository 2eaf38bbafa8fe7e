"""A lean decode loop for Llama-family models: the model's own weights, a KV cache allocated once.

HF's forward pass costs more than its arithmetic at this scale: per token it rebuilds masks, grows the
KV cache by concatenation and dispatches through cache and attention interfaces. This loop runs the
same equations (RMSNorm, rotary attention, SwiGLU MLP) in a few tensor ops per layer:

- the prompt is prefilled once by HF's own forward pass (any padding, any RoPE variant), once per
  distinct prompt; the k samples of a prompt read that prompt's keys and values in place: the rows of
  a prompt sit side by side, so a prompt's queries form one small matrix product against its keys;
- keys and values of generated tokens go into a cache allocated once for the whole completion;
- finished rows stay in the batch until a quarter of the prompts is done, then whole prompts leave
  (their cache rows are dropped), so late steps cost what the rows still running cost.

Sampling noise is drawn exactly as in the HF loop (`rloo.rollout.hf`): in float32 the two loops give
the same tokens (tested).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rloo.model.logprobs import kv_cache, left_pad, model_device, positions, unique_rows
from rloo.model.lora import adapter_weight
from rloo.rollout.sampling import Rollout, gumbel_noise, noise_generator, sample_token
from rloo.rollout.tools import ToolRunner

SUPPORTED = ("llama", "qwen2", "mistral")


def supports(model: torch.nn.Module) -> bool:
    """True for the architectures whose decoder layer this loop reproduces exactly."""
    c = getattr(model, "config", None)
    if c is None or getattr(c, "model_type", None) not in SUPPORTED or getattr(c, "hidden_act", None) != "silu":
        return False
    if getattr(c, "sliding_window", None) and getattr(c, "use_sliding_window", True) and c.model_type != "llama":
        return False
    inner = getattr(model, "model", None)
    return all(hasattr(inner, a) for a in ("layers", "norm", "embed_tokens", "rotary_emb"))


class _Weights:
    """The model's weights in the compute dtype, with q/k/v and gate/up fused (one matrix product each)
    and 1/sqrt(head_dim) folded into the query projection. Built per call: the policy changes every step."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype) -> None:
        c = model.config
        self.heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // self.heads
        self.eps, self.hidden = c.rms_norm_eps, c.hidden_size
        scale = self.head_dim**-0.5

        def cast(*ts):
            ts = [t.detach() for t in ts if t is not None]
            return torch.cat(ts).to(dtype) if ts else None

        w = adapter_weight  # W, or under LoRA with its adapters on W + (alpha / r) B A
        self.layers = []
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            q_bias = None if a.q_proj.bias is None else a.q_proj.bias * scale
            self.layers.append((
                cast(layer.input_layernorm.weight),
                cast(w(a.q_proj) * scale, w(a.k_proj), w(a.v_proj)),
                cast(q_bias, a.k_proj.bias, a.v_proj.bias),
                cast(w(a.o_proj)), cast(a.o_proj.bias),
                cast(layer.post_attention_layernorm.weight),
                cast(w(m.gate_proj), w(m.up_proj)), cast(m.gate_proj.bias, m.up_proj.bias),
                cast(w(m.down_proj)), cast(m.down_proj.bias),
            ))
        self.norm = cast(model.model.norm.weight)
        self.embed = cast(w(model.model.embed_tokens))
        self.lm_head = cast(w(model.lm_head))
        self.lm_bias = cast(getattr(model.lm_head, "bias", None))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, -1)
    return x * cos + torch.cat([-b, a], -1) * sin


def _groups(inverse: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Each row's slot in a [distinct prompts, k] layout, and k (the largest group)."""
    counts = torch.bincount(inverse)
    k = int(counts.max())
    order = torch.argsort(inverse, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.empty_like(inverse)
    slot[order] = torch.arange(len(inverse), device=inverse.device) - starts[inverse[order]]
    return inverse * k + slot, k


def generate(model: torch.nn.Module, prompts: list[list[int]], dtype: torch.dtype | None = None, **sampling):
    """`rloo.rollout.hf.generate` for a supported model: the same keyword arguments and result."""
    device = model_device(model)
    # The policy samples in one dtype, `dtype` or else its weights' own; an enclosing autocast is switched
    # off, since autocast's per-op conversions cost more than its bf16 products save here. Casting the
    # whole loop to bfloat16 is faster (1.5x on SmolLM2-135M, docs/models.md) but changes the samples,
    # so it is the config's choice (`model.inference_dtype`), off by default.
    with torch.inference_mode(), torch.autocast(device.type, enabled=False):
        ro = _generate(model, prompts, dtype or next(model.parameters()).dtype, **sampling)
    return ro.clone()


def _generate(model, prompts, dtype, *, max_new_tokens: int, eos_id: int, pad_id: int, greedy: bool = False,
              temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
              generator: torch.Generator | None = None, compact: bool = True,
              noise_rows: tuple[int, int] | None = None, tools: ToolRunner | None = None,
              records: list[dict] | None = None):

    device = model_device(model)
    w = _Weights(model, dtype)
    H, Hkv, d = w.heads, w.kv_heads, w.head_dim
    rep = H // Hkv
    noise = None if greedy else noise_generator(generator, device)

    prompt_ids, prompt_mask = (t.to(device) for t in left_pad(prompts, pad_id))
    batch, width = prompt_ids.shape
    offset, drawn = noise_rows or (0, batch)  # these rows' place in the batch the noise is drawn for
    first, inverse = unique_rows(torch.cat([prompt_ids, prompt_mask], 1))
    out = model(input_ids=prompt_ids[first], attention_mask=prompt_mask[first],
                position_ids=positions(prompt_mask[first]), use_cache=True, logits_to_keep=1)
    # Rows in a [G, k] layout (padded slots of smaller groups start finished); row j of a group writes
    # its step-t key to cache slot P + t*k + j, so the keys written so far are one contiguous block.
    flat, k = _groups(inverse)
    n_groups, n_layers = len(first), len(w.layers)
    slots = n_groups * k
    size = width + k * max_new_tokens
    ck = torch.zeros((n_layers, n_groups, Hkv, size, d), dtype=dtype, device=device)
    cv = torch.zeros_like(ck)
    for i, layer in enumerate(kv_cache(out).layers):
        ck[i, :, :, :width], cv[i, :, :, :width] = layer.keys, layer.values
    # Additive mask per (group, query row, key slot): prompt padding, and other rows' tokens.
    bias = torch.zeros((n_groups, 1, k * rep, size), dtype=dtype, device=device)
    bias[:, :, :, :width].masked_fill_((prompt_mask[first] == 0)[:, None, None, :], float("-inf"))
    own = torch.arange(k * rep, device=device)[:, None] // rep == torch.arange(k * max_new_tokens, device=device) % k
    bias[:, :, :, width:].masked_fill_(~own, float("-inf"))

    row_of = torch.full((slots,), -1, dtype=torch.long, device=device)
    row_of[flat] = torch.arange(batch, device=device)
    logits = out.logits[:, -1].float().repeat_interleave(k, 0)  # [slots, V]
    start_pos = torch.zeros(slots, dtype=torch.long, device=device)
    start_pos[flat] = positions(prompt_mask)[:, -1]
    cos_t, sin_t = model.model.rotary_emb(w.embed[:1][None], torch.arange(
        int(start_pos.max()) + max_new_tokens + 1, device=device)[None])
    cos_t, sin_t = cos_t[0].to(dtype)[:, None], sin_t[0].to(dtype)[:, None]  # [positions, 1, d]

    tokens = torch.full((batch, max_new_tokens), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((batch, max_new_tokens), dtype=torch.bool, device=device)
    logprobs = None if greedy else torch.zeros((batch, max_new_tokens), dtype=torch.float32, device=device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    done = row_of < 0  # per slot: finished (or an empty slot)
    calls = None if tools is None else tools.start(records, batch, max_new_tokens, logits.shape[-1], device)
    steps = 0
    for t in range(max_new_tokens):
        real = row_of >= 0
        rows = row_of.clamp(min=0)
        gumbel = None if greedy else gumbel_noise(drawn, logits.shape[-1], noise, device)[offset + rows]
        nxt, lp = sample_token(logits, greedy, temperature, top_p, top_k, gumbel)
        live = ~done
        nxt = torch.where(live, nxt, pad_id)
        if calls is not None:  # a tool's result in place of the sampled tokens, where a call is open
            nxt, forced = calls.override(t, rows, live, nxt, tokens)
            if forced is not None and lp is not None:
                lp = torch.where(forced, 0.0, lp)
        tokens[rows[live], t], mask[rows[live], t] = nxt[live], True
        if lp is not None:
            logprobs[rows[live], t] = lp[live]
        steps = t + 1
        done = done | (nxt == eos_id)
        finished[rows[real & done]] = True
        if t == max_new_tokens - 1 or bool(finished.all()):
            break
        group_live = (~done).view(-1, k).any(1)
        if compact and int(group_live.sum()) <= 0.75 * len(group_live):
            keep = group_live.nonzero().squeeze(-1)
            kept_slots = (keep[:, None] * k + torch.arange(k, device=device)).reshape(-1)
            row_of, done, nxt, start_pos = row_of[kept_slots], done[kept_slots], nxt[kept_slots], start_pos[kept_slots]
            ck, cv, bias = ck[:, keep], cv[:, keep], bias[keep]
        g, n = ck.shape[1], len(row_of)
        end = width + (t + 1) * k
        pos = start_pos + 1 + t
        cos, sin = cos_t[pos], sin_t[pos]
        x = w.embed[nxt]
        b = bias[..., :end]
        for i, (w_in, w_qkv, b_qkv, w_o, b_o, w_post, w_gu, b_gu, w_down, b_down) in enumerate(w.layers):
            qkv = F.linear(F.rms_norm(x, (w.hidden,), w_in, w.eps), w_qkv, b_qkv)
            qk = _rotate(qkv[:, : (H + Hkv) * d].view(g, k, H + Hkv, d), cos.view(g, k, 1, d), sin.view(g, k, 1, d))
            ck[i, :, :, end - k : end] = qk[:, :, H:].transpose(1, 2)
            cv[i, :, :, end - k : end] = qkv[:, (H + Hkv) * d :].view(g, k, Hkv, d).transpose(1, 2)
            q = qk[:, :, :H].reshape(g, k, Hkv, rep, d).transpose(1, 2).reshape(g, Hkv, k * rep, d)
            p = torch.softmax(torch.matmul(q, ck[i, :, :, :end].transpose(-1, -2)).float() + b, -1).to(dtype)
            o = torch.matmul(p, cv[i, :, :, :end]).view(g, Hkv, k, rep, d).transpose(1, 2).reshape(n, H * d)
            x = x + F.linear(o, w_o, b_o)
            gate, up = F.linear(F.rms_norm(x, (w.hidden,), w_post, w.eps), w_gu, b_gu).chunk(2, -1)
            x = x + F.linear(F.silu(gate) * up, w_down, b_down)
        logits = F.linear(F.rms_norm(x, (w.hidden,), w.norm, w.eps), w.lm_head, w.lm_bias).float()
    return Rollout.from_buffers(prompt_ids, prompt_mask, tokens, mask, finished, steps, logprobs, calls)
