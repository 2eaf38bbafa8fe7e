#!/usr/bin/env bash
# Run the whole pipeline on the embedded default (CPU, no hub access): installs, then `snakemake`.
# Extra arguments go to snakemake, e.g. `bash scripts/pipeline.sh --configfile config/micro.yaml`.
set -euo pipefail
cd "$(dirname "$0")/.."
# A config file that is not there: one line here, before the install. Snakemake opens --configfile
# before it reads the Snakefile, and prints a 27-line traceback for it (docs/failure-modes.md, docs/upstream/).
files=0
for arg in "$@"; do
  case "$arg" in
    --configfile|--configfiles) files=1; continue ;;
    --configfile=*|--configfiles=*) arg="${arg#*=}"; files=1 ;;
    -*) files=0; continue ;;
  esac
  if [ "$files" = 1 ] && [ ! -f "$arg" ]; then
    echo "pipeline.sh: error: config file $arg: no such file" >&2
    exit 2
  fi
done
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
snakemake --cores all "$@"
