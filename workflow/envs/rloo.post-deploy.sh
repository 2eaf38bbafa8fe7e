#!/usr/bin/env bash
# Run by Snakemake inside the new conda environment, once, after it is created: installs the rloo
# package from this repository in editable mode, so the rules run the checked-out code (a code edit
# reruns its stages through their code inputs, not by rebuilding the environment).
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
python -m pip install --no-cache-dir -e "$repo"
