#!/usr/bin/env bash
# Does every stage run on the GPU? The micro chain stage by stage with model.device=cuda (float32, then
# RLOO under bf16 autocast, LoRA with gradient checkpointing, FSDP in a process group of one), one RLOO
# update of a Qwen2.5-0.5B-shaped model at config/gpu.yaml's batch (its peak beside the plan's), then the
# model, training and LoRA tests, which put their models on the GPU when
# torch sees one, then (with vLLM installed) the GPU configuration's chain on a tiny hub-style model:
# vLLM rollouts and the served judge. Needs a CUDA build of torch; tracking off, so MLflow is not needed.
# It ends with rloo_workflow.gpu_check's verdicts: the measured memory against the plan (±20 %), the results
# regraded from the evaluations' records, the served judge; a check not run fails it (DEVICE=cpu excepted).
#   bash scripts/gpu_check.sh                 # PYTHON=... for another interpreter
#   DEVICE=cpu bash scripts/gpu_check.sh      # the same commands on the CPU (a dry run of this script)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
if [ "$DEVICE" = cuda ]; then
  $PY -c "import torch; assert torch.cuda.is_available(), 'torch sees no GPU'; print(torch.cuda.get_device_name())"
fi
stage() {
  echo "+ rloo $*"
  local t0=$SECONDS
  $PY -m rloo_workflow.cli "$@" --config config/micro.yaml --set tracking.enabled=false --set model.device="$DEVICE"
  echo "  ($((SECONDS - t0)) s)"
}
stage prepare --out "$W/data"
stage base --data "$W/data" --out "$W/base"
stage sft --data "$W/data" --base "$W/base" --out "$W/sft" --work "$W/sft_w"
stage reward --data "$W/data" --policy "$W/sft" --out "$W/rm"
stage train --data "$W/data" --policy "$W/sft" --reward-model "$W/rm" --out "$W/rl" --work "$W/rl_w"
stage train --data "$W/data" --policy "$W/sft" --reward-model "$W/rm" --out "$W/rl16" --work "$W/rl16_w" \
  --set model.autocast=bfloat16
# Memory-lean training on the GPU: LoRA adapters with gradient checkpointing, under bf16 autocast.
stage train --data "$W/data" --policy "$W/sft" --reward-model "$W/rm" --out "$W/rl_lora" --work "$W/rl_lora_w" \
  --set model.lora.enabled=true --set model.gradient_checkpointing=true --set model.autocast=bfloat16 --set rloo.lr=1.0e-3
# FSDP2's code path (fully_shard, gathered sampling, gathered checkpoints) on one GPU: a process group of
# one, started by torchrun (nccl); with 2+ GPUs, `--nproc 2` instead runs 2 ranks.
echo "+ torchrun --nproc-per-node 1 rloo train (fsdp)"
$PY -m torch.distributed.run --standalone --nproc-per-node 1 -m rloo_workflow.cli train --config config/micro.yaml \
  --set tracking.enabled=false --set model.device="$DEVICE" --set distributed.strategy=fsdp \
  --data "$W/data" --policy "$W/sft" --reward-model "$W/rm" --out "$W/rl_fsdp" --work "$W/rl_fsdp_w" 2> "$W/fsdp.log" \
  || { tail -30 "$W/fsdp.log"; exit 1; }
grep -q "distributed: fsdp on 1 processes" "$W/fsdp.log" || { tail -30 "$W/fsdp.log"; echo "FSDP did not start"; exit 1; }
# Every RLOO run trained on the micro reward model (the micro policy earns 0 from the verifier, and an
# update on rewards that are all 0 changes nothing): their weights must have moved away from SFT's.
for rl in rl rl16 rl_lora rl_fsdp; do
  $PY - "$W/sft" "$W/$rl" <<'PY'
import sys
from safetensors.torch import load_file
a, b = (load_file(f"{d}/model.safetensors") for d in sys.argv[1:])
moved = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
assert moved > 1e-4, f"{sys.argv[2]}: the RLOO update did not change the weights (max change {moved})"
print(f"  {sys.argv[2]}: weights moved (max change {moved:.2e})")
PY
done
# Sized for the cluster: one RLOO update of a random Qwen2.5-0.5B-shaped model (24 layers, vocabulary
# 151,936) at config/gpu.yaml's batch (64 prompts x k = 4, up to 512 new tokens) and its micro-batch and
# logits-chunk budgets; CUDA's measured peak against `rloo plan`'s prediction of that update (no vLLM),
# compared at the end by rloo_workflow.gpu_check (within ±20 %). On the CPU (DEVICE=cpu) a small version: 1
# layer, 8 rows; its peak RSS counts the whole process, so it is reported, not compared.
echo "+ bench/memory.py --gpu-check config/gpu.yaml"
if [ "$DEVICE" = cuda ]; then
  $PY bench/memory.py --gpu-check config/gpu.yaml 24 256 256 512 --json "$W/memory.json" 2>&1 | grep -v "INFO" | tail -3
else
  $PY bench/memory.py --gpu-check config/gpu.yaml 1 8 32 32 --json "$W/memory.json" 2>&1 | grep -v "INFO" | tail -3
fi
for policy in base="$W/base" sft="$W/sft" rloo="$W/rl"; do
  stage evaluate --data "$W/data" --sft "$W/sft" --policy "$policy" --reward-model "$W/rm" \
    --out "$W/eval/${policy%%=*}.jsonl"
done
stage report --data "$W/data" --policy rloo="$W/eval/rloo.jsonl" --sft "$W/eval/sft.jsonl" \
  --base "$W/eval/base.jsonl" --training "$W/rl" --out "$W/eval.json" --plots "$W/plots"
$PY -m pytest -q -p no:cacheprovider tests/integration/test_models.py tests/integration/test_train.py
$PY -m pytest -q -p no:cacheprovider -m "not slow" tests/e2e/test_lora.py
# config/gpu.yaml's chain at micro size: a tiny hub-style model folder (scripts/make_tiny_hub_model.py),
# vLLM rollouts, and the judge served by the judge job on the same GPU (serve.gpus: 0), in a copy
# of the workflow. Needs vLLM in $PY's environment (RLOO_VLLM_PACKAGE=vllm bash scripts/test_vllm.sh);
# without it the check is reported as not run and the script fails (a dry run on the CPU excepted).
JUDGE=(--judge-not-run "the served-judge chain needs CUDA and vLLM ($DEVICE; vLLM $($PY -c 'import vllm' 2>/dev/null && echo present || echo absent))")
if [ "$DEVICE" = cuda ] && $PY -c "import vllm" 2>/dev/null; then
  echo "+ snakemake: qwen2-tiny, vLLM rollouts, served judge"
  C="$W/chain"
  mkdir -p "$C"
  cp -r Snakefile workflow config slurm profiles rloo "$C"/
  $PY scripts/make_tiny_hub_model.py "$C/models/qwen2-tiny" --max-positions 1024
  cat > "$C/config/serve.yaml" <<'YAML'
tracking: {enabled: false}
model: {device: cuda}
rollout: {backend: vllm, gpu_memory_utilization: 0.2}
evaluate:
  judge: llm
  llm_judge:
    serve: {model: models/qwen2-tiny, gpus: 0, args: [--max-model-len, "1024", --gpu-memory-utilization, "0.2"]}
YAML
  (cd "$C" && PYTHONPATH="$C" $PY -m snakemake --cores all results/gsm8k_rloo.json \
    --configfile config/micro.yaml config/qwen2-tiny.yaml config/serve.yaml)
  JUDGE=(--judge "$C/results/gsm8k_rloo.json")
fi
# Every verdict from its file: the memory against the plan, the results regraded from the records,
# the served judge; passed only when every check ran and passed (DEVICE=cpu: a dry run, not a pass).
DRY=()
[ "$DEVICE" = cuda ] || DRY=(--dry-run)
echo "+ python -m rloo_workflow.gpu_check ($DEVICE)"
$PY -m rloo_workflow.gpu_check --memory "$W/memory.json" --results "$W/eval.json" --records "$W/eval" \
  "${JUDGE[@]}" "${DRY[@]}"
