#!/usr/bin/env bash
# Run the whole pipeline on the embedded default (CPU, no hub access): installs, then `snakemake`.
# Extra arguments go to snakemake, e.g. `bash scripts/pipeline.sh --configfile config/micro.yaml`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
snakemake --cores all "$@"
