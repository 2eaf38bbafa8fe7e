"""Peak memory and step time of the RLOO stage under each memory / parallelism setting, measured.

One SFT policy (the embedded Llama at a size set here, larger than the micro one so that the model
state is visible above the interpreter's own memory), one data folder, then `rloo train` once per
variant, each in fresh processes: single process, DDP x2, FSDP x2, LoRA, gradient checkpointing
(and the last two under FSDP x2). Every variant trains the same prompts from the same weights for the
same steps, in float32 (no autocast), on this machine; each round uses its own seed and runs the
variants in another order. Peak memory is the stage's own record (<work>/timings.json: peak RSS of
rank 0 on a CPU, CUDA max allocated on a GPU); seconds per step likewise. On a CPU the runs set glibc's
MALLOC_MMAP_THRESHOLD_ (64 KiB): large blocks are then mapped and unmapped one by one, so the peak RSS
counts the tensors a setting holds rather than how fragmented the heap grew (with glibc's default, LoRA's
many short-lived adapter temporaries made its peak RSS exceed full fine-tuning's, while holding less).

    python bench/memory.py --json docs/figures/memory.json

`--rows`: peak memory against the step's size. A random model of Qwen2.5-0.5B's shape (hidden 896, the
real vocabulary of 151,936, tied embeddings; 2 decoder layers instead of 24, which changes the model
state, not the logits) takes one RLOO update (the reference pass, the policy's passes, the backward
and the optimizer step) on 16, 64 and 256 sampled rows (k = 4; random prompt and completion tokens of
fixed lengths; distinct tokens per row count and round), each in a fresh process, under bf16 autocast:
`bounded` with rloo.micro_batch_tokens and model.logits_chunk_tokens set, `today` with both 0 (the
whole step in one pass with full-vocabulary logits, the path before them). The peak is the process's
peak RSS (model state included) with MALLOC_MMAP_THRESHOLD_ as above.

    python bench/memory.py --rows 16 64 256 --json docs/figures/memory_rows.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.record import provenance  # noqa: E402

MICRO = str(ROOT / "config" / "micro.yaml")

# name -> (processes, --set overrides)
VARIANTS: dict[str, tuple[int, list[str]]] = {
    "none": (1, []),
    "ddp x2": (2, ["distributed.strategy=ddp"]),
    "fsdp x2": (2, ["distributed.strategy=fsdp"]),
    "lora": (1, ["model.lora.enabled=true"]),
    "gradient checkpointing": (1, ["model.gradient_checkpointing=true"]),
    "fsdp x2 + lora": (2, ["distributed.strategy=fsdp", "model.lora.enabled=true"]),
    "fsdp x2 + gradient checkpointing": (2, ["distributed.strategy=fsdp", "model.gradient_checkpointing=true"]),
}


def _rloo(*args: str, env: dict) -> None:
    cmd = [sys.executable, "-m", "rloo_workflow.cli", *args]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"{' '.join(cmd)} exited {res.returncode}:\n{res.stderr[-3000:]}")


QWEN05 = {"hidden_size": 896, "num_attention_heads": 14, "num_key_value_heads": 2, "intermediate_size": 4864,
          "vocab_size": 151_936, "tie_word_embeddings": True}
ROW_PATHS = {"bounded": None, "today": ["rloo.micro_batch_tokens=0", "model.logits_chunk_tokens=0"]}


def _qwen_folder(folder: Path, layers: int) -> None:
    """A random Qwen2 of Qwen2.5-0.5B's widths and `layers` layers, with the embedded tokenizer (the
    update never decodes: its token ids need not be the tokenizer's)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rloo.model import models

    tok = models.train_tokenizer((f"question {i} answer {i * 7}" for i in range(200)), 320)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=layers, max_position_embeddings=512, **QWEN05))
    models.save_pretrained(model, tok, folder)


def _one_update(folder: str, rows: int, prompt: int, completion: int, seed: int, sets: list[str],
                configs: list[str] | None = None) -> dict:
    """One RLOO update on `rows` random samples in this process; its peak memory before and after (peak
    RSS on a CPU, CUDA's max allocated on a GPU). `configs`: the config files (default: the micro one,
    its max_length raised for the rows); with them, the plan's prediction of the update comes along."""
    import torch

    from rloo.reward.rewards import VerifierReward
    from rloo.rollout import Rollout
    from rloo.rollout.collect import Collected
    from rloo.runtime import peak_memory_mb, setup
    from rloo.train.rloo_trainer import RlooTrainer
    from rloo_workflow.config import load_config, parse_set

    k = 4
    # plan.host_memory_gb: validation's host-memory check counts every row at model.max_length, so it
    # refuses the unbounded path at the larger steps; this bench measures that path on shorter rows.
    base = [] if configs else ["model.autocast=bfloat16", "model.max_length=256", "plan.host_memory_gb=1000"]
    cfg = load_config(configs or MICRO, parse_set([
        *base, f"model.name_or_path={folder}", "tracking.enabled=false", "rollout.backend=hf",
        "reward.source=verifier", f"rloo.k={k}", f"rloo.prompts_per_step={rows // k}",
        f"rloo.max_new_tokens={completion}", *sets]))
    setup(2, seed)
    train = [{"question": f"q{i}", "answer": "#### 1"} for i in range(rows // k)]
    trainer = RlooTrainer(cfg, folder, VerifierReward(), train)
    g = torch.Generator().manual_seed(seed)
    vocab = QWEN05["vocab_size"]
    prompts = torch.randint(10, vocab, (rows // k, prompt), generator=g).repeat_interleave(k, 0)
    done = torch.randint(1, completion + 1, (rows,), generator=g)  # completion lengths, EOS included
    done[0] = completion  # one row as long as the budget of new tokens
    cmask = torch.arange(completion)[None, :] < done[:, None]
    comps = torch.randint(10, vocab, (rows, completion), generator=g) * cmask
    ro = Rollout(prompt_ids=prompts, prompt_mask=torch.ones_like(prompts), completions=comps,
                 completion_mask=cmask, finished=torch.ones(rows, dtype=torch.bool))
    scores = torch.randint(0, 2, (rows,), generator=g).float()
    got = Collected(idx=np.arange(rows // k), rollout=ro, scores=scores,
                    timings={"generation_s": 0.0})
    got.rollout = got.rollout.to(trainer.device)
    got.scores = got.scores.to(trainer.device)
    before = peak_memory_mb(trainer.device)
    t0 = time.perf_counter()
    m = trainer.update(0, got)
    out = {"rows": rows, "peak_mb": peak_memory_mb(trainer.device), "peak_before_update_mb": before,
           "update_s": time.perf_counter() - t0, "loss": m["train/loss"], "device": str(trainer.device),
           "micro_batch_tokens": cfg["rloo"]["micro_batch_tokens"],
           "logits_chunk_tokens": cfg["model"]["logits_chunk_tokens"]}
    if configs:  # what `rloo plan` predicts for this update (the model's shape read from its folder)
        from rloo.settings import Config
        from rloo_workflow import memory_plan

        sections = Config.from_config(cfg)
        shape, _ = memory_plan.model_shape(sections.model)
        rloo_plan = next(p for p in memory_plan.plan(sections, shape) if p.stage.startswith("rloo"))
        update = next(p for p in rloo_plan.phases if p.name == "update")
        out["planned_update_mb"] = update.total / 2**20
    return out


def rows_main(a) -> None:
    env = {**os.environ, "MLFLOW_TRACKING_URI": "", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT),
           "MALLOC_MMAP_THRESHOLD_": str(a.mmap_threshold)}
    work = Path(tempfile.mkdtemp(prefix="rloo-memory-rows-"))
    t0 = time.time()
    figures: dict[str, dict[str, list[dict]]] = {p: {str(n): [] for n in a.rows} for p in ROW_PATHS}
    try:
        _qwen_folder(work / "model", a.layers)
        for r in range(a.rounds):
            for i, n in enumerate(a.rows if r % 2 == 0 else a.rows[::-1]):
                for path in (ROW_PATHS if (r + i) % 2 == 0 else list(ROW_PATHS)[::-1]):
                    sets = ROW_PATHS[path] or [f"rloo.micro_batch_tokens={a.budget}",
                                                f"model.logits_chunk_tokens={a.logits_chunk}"]
                    job = json.dumps([str(work / "model"), n, a.prompt_tokens, a.completion_tokens, 1000 * r + n, sets])
                    res = subprocess.run([sys.executable, __file__, "--one", job], env=env, capture_output=True, text=True)
                    if res.returncode:
                        raise SystemExit(f"{path} at {n} rows exited {res.returncode}:\n{res.stderr[-3000:]}")
                    got = json.loads(res.stdout.strip().splitlines()[-1])
                    figures[path][str(n)].append(got)
                    print(f"round {r} {path:8s} {n:4d} rows: peak {got['peak_mb']:8.0f} MiB (before the update "
                          f"{got['peak_before_update_mb']:.0f}), update {got['update_s']:.1f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    peak = {p: {n: round(float(np.mean([x["peak_mb"] for x in runs])), 1) for n, runs in by.items()}
            for p, by in figures.items()}
    lo, hi = str(min(a.rows)), str(max(a.rows))
    result = {
        **provenance(), "measured": "peak RSS of the process",
        "model": {**QWEN05, "num_hidden_layers": a.layers, "random": True},
        "work": {"k": 4, "prompt_tokens": a.prompt_tokens, "max_completion_tokens": a.completion_tokens,
                 "autocast": "bfloat16", "bounded": {"rloo.micro_batch_tokens": a.budget,
                                                     "model.logits_chunk_tokens": a.logits_chunk},
                 "today": {"rloo.micro_batch_tokens": 0, "model.logits_chunk_tokens": 0}},
        "bounded": peak["bounded"], "today": peak["today"],
        "ratio_bounded": round(peak["bounded"][hi] / peak["bounded"][lo], 3),
        "ratio_today": round(peak["today"][hi] / peak["today"][lo], 3),
        "rounds": a.rounds, "malloc_mmap_threshold": a.mmap_threshold, "wall_seconds": round(time.time() - t0, 1),
        "per_round": figures,
    }
    print(json.dumps({k: result[k] for k in ("bounded", "today", "ratio_bounded", "ratio_today")}, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")


def gpu_check(config: str, layers: int, rows: int, prompt: int, completion: int, out: Path | None = None) -> None:
    """scripts/gpu_check.sh: one RLOO update of a Qwen2.5-0.5B-shaped random model at `config`'s budgets,
    the peak measured beside the plan's (a CPU dry run: small sizes, peak RSS, which counts everything);
    with `out`, both written there for `python -m rloo_workflow.gpu_check` to compare."""
    work = Path(tempfile.mkdtemp(prefix="rloo-gpu-check-"))
    try:
        _qwen_folder(work / "model", layers)
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        # The rows are made up, not sampled, so they carry no sampler log-probabilities for gpu.yaml's
        # rollout correction to read (its weights, one float a token, are no part of the peak).
        got = _one_update(str(work / "model"), rows, prompt, completion, 0,
                          [f"model.device={device}", "prompt.chat_template=false", "rloo.rollout_correction.mode=none"],
                          [config])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"  one RLOO update, {rows} rows x ({prompt} + up to {completion}) tokens, {layers} layers, {config} "
          f"budgets (rloo.micro_batch_tokens {got['micro_batch_tokens']}, model.logits_chunk_tokens "
          f"{got['logits_chunk_tokens']}) on {got['device']}: measured peak {got['peak_mb'] / 1024:.2f} GB, "
          f"planned {got['planned_update_mb'] / 1024:.2f} GB ({got['update_s']:.1f} s)")
    if out is not None:
        out.write_text(json.dumps({**provenance(), "config": config, "layers": layers, "rows": rows, "prompt_tokens": prompt,
                                   "completion_tokens": completion, **got}, indent=1) + "\n")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--one":  # a child process of --rows: one measurement
        print(json.dumps(_one_update(*json.loads(sys.argv[2]))))
        return
    if len(sys.argv) >= 3 and sys.argv[1] == "--gpu-check":  # CONFIG [LAYERS ROWS PROMPT COMPLETION] [--json F]
        rest, out = sys.argv[3:], None
        if "--json" in rest:
            i = rest.index("--json")
            out, rest = Path(rest[i + 1]), rest[:i] + rest[i + 2:]
        sizes = [int(x) for x in rest] or [24, 256, 256, 512]
        gpu_check(sys.argv[2], *sizes, out=out)
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="*", default=None,
                    help="peak memory of one RLOO update at these row counts, bounded against today (see above)")
    ap.add_argument("--budget", type=int, default=2048, help="--rows: rloo.micro_batch_tokens of the bounded path")
    ap.add_argument("--logits-chunk", type=int, default=1024, help="--rows: model.logits_chunk_tokens of the bounded path")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--completion-tokens", type=int, default=48)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step (k = 4 samples each)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), help=f"of {list(VARIANTS)}")
    ap.add_argument("--mmap-threshold", type=int, default=65536,
                    help="glibc MALLOC_MMAP_THRESHOLD_ of the runs (bytes; 0: glibc's default): allocations above it "
                         "are mapped and unmapped on their own, so the peak RSS counts the tensors held, not heap fragments")
    ap.add_argument("--json", default=None, help="also write the figures here")
    a = ap.parse_args()
    if a.rows:
        a.rounds = a.rounds if "--rounds" in sys.argv else 1
        a.layers = a.layers if "--layers" in sys.argv else 2
        a.mmap_threshold = a.mmap_threshold or 65536
        rows_main(a)
        return

    env = {**os.environ, "MLFLOW_TRACKING_URI": "", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    if a.mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(a.mmap_threshold)
    model = [f"model.tiny.hidden_size={a.hidden}", f"model.tiny.num_layers={a.layers}",
             f"model.tiny.num_heads={a.heads}", f"model.tiny.intermediate_size={a.intermediate}",
             f"model.max_length={128 + a.max_new_tokens}", "model.autocast=none", "tracking.enabled=false", "reward.source=verifier"]
    sets = [x for s in model for x in ("--set", s)]
    work = Path(tempfile.mkdtemp(prefix="rloo-memory-"))
    t0 = time.time()
    try:
        _rloo("prepare", "-c", MICRO, "--out", str(work / "data"), env=env)
        # the bench's own base model, at the size set here (without --base, SFT would read the project's
        # results/models/base, whatever size that one is: SFT now refuses a base of another shape)
        _rloo("base", "-c", MICRO, *sets, "--data", str(work / "data"), "--out", str(work / "base"), env=env)
        # one step, only to have a policy folder: nothing is learned, so the check for that is off
        _rloo("sft", "-c", MICRO, *sets, "--set", "sft.steps=1", "--set", "sft.min_loss_drop_nats=0", "--set", "sft.eval_examples=1",
              "--data", str(work / "data"), "--base", str(work / "base"), "--out", str(work / "sft"),
              "--work", str(work / "sft-work"), env=env)
        rloo = ["--set", "rloo.k=4", "--set", f"rloo.prompts_per_step={a.prompts}", "--set", f"rloo.steps={a.steps}",
                "--set", "rloo.eval_every=0", "--set", f"rloo.checkpoint_every={a.steps + 1}",
                "--set", f"rloo.max_new_tokens={a.max_new_tokens}", "--set", "rloo.select=last"]
        figures: dict[str, list[dict]] = {v: [] for v in a.variants}
        for r in range(a.rounds):
            order = a.variants if r % 2 == 0 else a.variants[::-1]
            for name in order:
                nproc, extra = VARIANTS[name]
                out, w = work / f"out-{r}", work / f"work-{r}"
                shutil.rmtree(out, ignore_errors=True)
                shutil.rmtree(w, ignore_errors=True)
                # every variant uses all the machine's cores: one process all of them, two half each
                threads = max(1, len(os.sched_getaffinity(0)) // nproc)
                args = ["train", "-c", MICRO, *sets, *rloo, "--set", f"seed={r}", "--set", f"threads={threads}",
                        *[x for s in extra for x in ("--set", s)],
                        "--data", str(work / "data"), "--policy", str(work / "sft"), "--out", str(out), "--work", str(w)]
                if nproc > 1:
                    args += ["--nproc", str(nproc)]
                _rloo(*args, env=env)
                t = json.loads((w / "timings.json").read_text())
                m = json.loads((out / "metrics.json").read_text())
                figures[name].append({"peak_memory_mb": t["peak_memory_mb"], "seconds_per_step": t["seconds_per_step"],
                                      "parameters": m["networks"]["policy"]})
                print(f"round {r} {name:34s} peak {t['peak_memory_mb']:8.0f} MiB  {t['seconds_per_step']:6.2f} s/step",
                      flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = {name: {"processes": VARIANTS[name][0],
                      "peak_memory_mb": float(np.mean([x["peak_memory_mb"] for x in rows])),
                      "seconds_per_step": float(np.mean([x["seconds_per_step"] for x in rows])),
                      "policy_parameters": rows[0]["parameters"]}
               for name, rows in figures.items()}
    result = {
        **provenance(), "measured": "peak RSS of rank 0",
        "model": {"hidden_size": a.hidden, "num_layers": a.layers, "intermediate_size": a.intermediate},
        "work": {"prompts_per_step": a.prompts, "k": 4, "steps": a.steps, "max_new_tokens": a.max_new_tokens, "dtype": "float32"},
        "rounds": a.rounds, "malloc_mmap_threshold": a.mmap_threshold or None, "wall_seconds": round(time.time() - t0, 1),
        "variants": summary, "per_round": figures,
    }
    print(json.dumps(summary, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
