"""Rollout throughput of the HF sampling loop, the lean decode loop and vLLM on the same prompts: completion tokens per second.

    python bench/rollout_backends.py                      # default config's tiny model (see --policy)
    python bench/rollout_backends.py -c config/micro.yaml --prompts 16 --k 4

The policy is `--policy DIR` if given, else the pipeline's SFT model (results/models/sft) when it exists,
else an untrained model of the config's tiny architecture built in a temporary folder (throughput does
not depend on training, except through completion lengths: both backends get the same prompts, T = 1,
and the count is of generated tokens, so the ratio compares like with like). vLLM runs in-process,
`enforce_eager` on a CPU, once with per-token log-probabilities (what training uses, for the
`rollout/logprob_gap` diagnostic) and once without. Needs vLLM (see scripts/test_vllm.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.record import command_line, provenance  # noqa: E402
from rloo.data import synthetic  # noqa: E402
from rloo.data.gsm8k import format_completion, format_prompt  # noqa: E402
from rloo.data.prompting import PromptFormat  # noqa: E402
from rloo.model import models  # noqa: E402
from rloo.rollout.hf import generate as hf_generate  # noqa: E402
from rloo.runtime import decode_dtype, resolve_device  # noqa: E402
from rloo.settings import Config  # noqa: E402
from rloo_workflow.config import load_config  # noqa: E402


def policy_folder(cfg: dict, given: str | None, tmp: Path) -> tuple[Path, str]:
    if given:
        return Path(given), str(given)
    sections = Config.from_config(cfg)
    sft = ROOT / "results" / "models" / "sft"
    if sections.name != "micro" and (sft / "config.json").exists():
        return sft, "pipeline SFT model"
    train, _, _ = synthetic.generate(2000, 10, seed=sections.seed)
    tmpl, tiny = sections.prompt.template, sections.model.tiny
    tok = models.train_tokenizer(
        (format_prompt(r["question"], tmpl) + format_completion(r["answer"]) for r in train), tiny.vocab_size)
    model = models.build_tiny_model(tok, tiny, sections.model.max_length, sections.seed)
    models.save_pretrained(model, tok, tmp / "policy")
    return tmp / "policy", f"untrained {sections.name} architecture"


def timed(fn, repeats: int) -> tuple[float, int]:
    """Median seconds over `repeats` runs, and the completion tokens of one run."""
    times, tokens = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        ro = fn()
        times.append(time.perf_counter() - t0)
        tokens = int(ro.completion_mask.sum())
    return statistics.median(times), tokens


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-c", "--config", default=None, help="config file (default: the embedded default)")
    ap.add_argument("--policy", default=None, help="a save_pretrained model folder")
    ap.add_argument("--prompts", type=int, default=16, help="distinct prompts")
    ap.add_argument("--k", type=int, default=4, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default: rloo.max_new_tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for both backends")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3,
                    help="vLLM's GPU memory fraction (on a CPU the KV cache is sized for the batch instead)")
    ap.add_argument("--json", default=None, help="also write the numbers here")
    args = ap.parse_args(argv)

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config)
    max_new = args.max_new_tokens or cfg["rloo"]["max_new_tokens"]
    with tempfile.TemporaryDirectory() as tmp:
        policy, origin = policy_folder(cfg, args.policy, Path(tmp))
        tok = models.load_tokenizer(policy)
        model = models.load_causal_lm(policy, cfg["model"]["dtype"])
        _, test, _ = synthetic.generate(10, args.prompts, seed=cfg["seed"] + 1)
        ids = [PromptFormat(tok, cfg["prompt"]).prompt_ids(r["question"]) for r in test]
        prompts = [p for p in ids for _ in range(args.k)]
        # every backend decodes in model.inference_dtype (else the weights' dtype), as the stages do
        dtype = decode_dtype(cfg["model"]["inference_dtype"], cfg["model"]["dtype"], resolve_device(cfg["model"]["device"]))
        kw = {"max_new_tokens": max_new, "eos_id": tok.eos_token_id, "pad_id": tok.pad_token_id}
        hf_kw = {**kw, "dtype": getattr(torch, dtype)}

        from rloo.rollout.vllm import VLLMRollout, kv_cache_bytes

        engine_kw = {"gpu_memory_utilization": args.gpu_memory_utilization}
        if not torch.cuda.is_available():  # as the trainer does on a CPU: a KV cache sized for the batch
            engine_kw["kv_cache_memory_bytes"] = kv_cache_bytes(policy, len(prompts) * cfg["model"]["max_length"],
                                                                dtype)
        t0 = time.perf_counter()
        engines = {
            lp: VLLMRollout(policy, dtype=dtype, max_model_len=cfg["model"]["max_length"],
                            seed=cfg["seed"], logprobs=lp, **engine_kw)
            for lp in (True, False)
        }
        startup = (time.perf_counter() - t0) / 2
        torch.set_num_threads(args.threads)

        def hf():
            return hf_generate(model, prompts, generator=torch.Generator().manual_seed(0), lean=False, **hf_kw)

        def lean():
            return hf_generate(model, prompts, generator=torch.Generator().manual_seed(0), lean=True, **hf_kw)

        for e in engines.values():  # warm-up
            e.generate(prompts[: args.k], generator=torch.Generator().manual_seed(0), **kw)
        hf_generate(model, prompts[: args.k], lean=False, **hf_kw)
        hf_s, hf_tok = timed(hf, args.repeats)
        lean_s, lean_tok = timed(lean, args.repeats)
        res = {}
        for lp, e in engines.items():
            res[lp] = timed(lambda e=e: e.generate(prompts, generator=torch.Generator().manual_seed(0), **kw),
                            args.repeats)
        t0 = time.perf_counter()
        for _ in range(5):
            engines[True].sync_weights(model)
        sync_s = (time.perf_counter() - t0) / 5

    out = {
        **provenance(None if argv is None else command_line(["bench/rollout_backends.py", *argv])),
        "policy": origin,
        "parameters": models.count_parameters(model),
        "sequences": len(prompts),
        "max_new_tokens": max_new,
        "threads": args.threads,
        "dtype": dtype,
        "hf_tokens_per_s": hf_tok / hf_s,
        "lean_tokens_per_s": lean_tok / lean_s,
        "vllm_tokens_per_s": res[True][1] / res[True][0],
        "vllm_no_logprobs_tokens_per_s": res[False][1] / res[False][0],
        "hf_seconds": hf_s,
        "vllm_seconds": res[True][0],
        "vllm_engine_start_s": startup,
        "vllm_sync_weights_s": sync_s,
    }
    out["ratio_vllm_over_hf"] = out["vllm_tokens_per_s"] / out["hf_tokens_per_s"]
    out["ratio_vllm_over_lean"] = out["vllm_tokens_per_s"] / out["lean_tokens_per_s"]
    out["ratio_vllm_no_logprobs_over_hf"] = out["vllm_no_logprobs_tokens_per_s"] / out["hf_tokens_per_s"]
    print(f"policy: {origin} ({out['parameters']:,} parameters); {len(prompts)} sequences "
          f"({args.prompts} prompts x k={args.k}), up to {max_new} new tokens, T=1, {args.threads} thread(s), {dtype}")
    print(f"HF    {out['hf_tokens_per_s']:10.0f} tokens/s  ({hf_tok} tokens in {hf_s:.2f} s)")
    print(f"lean  {out['lean_tokens_per_s']:10.0f} tokens/s  ({lean_tok} tokens in {lean_s:.2f} s; rloo/rollout/decode.py)")
    print(f"vLLM  {out['vllm_tokens_per_s']:10.0f} tokens/s  ({res[True][1]} tokens in {res[True][0]:.2f} s, "
          "with log-probs)")
    print(f"vLLM  {out['vllm_no_logprobs_tokens_per_s']:10.0f} tokens/s  (without log-probs)")
    print(f"ratio vLLM/HF: {out['ratio_vllm_over_hf']:.2f}x (without log-probs "
          f"{out['ratio_vllm_no_logprobs_over_hf']:.2f}x); engine start {startup:.1f} s, "
          f"weight sync {1000 * sync_s:.1f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
