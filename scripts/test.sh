#!/usr/bin/env bash
# The project's test command: installs what the tests need, then runs the whole suite on two workers
# (pytest-xdist, one file per worker at a time, the Slurm files together: tests/conftest.py).
#   bash scripts/test.sh              the full suite (what CI runs), slowest 25 tests listed at the end
#   bash scripts/test.sh --fast       the fast tier: unit and in-process tests (-m "not slow"), ~2 min,
#                                     no Slurm cluster or browser needed
#   bash scripts/test.sh [--fast] ARGS  extra pytest arguments (a file, -k, -x, -n 0 for one process)
# Tiers and what each end-to-end test proves: docs/testing.md.
# As root on Debian (CI) it also brings up the one-node Slurm cluster the Slurm tests run against
# (tests/slurm/start.sh, stopped afterwards) and Chromium for the MLflow UI test, and requires both:
# failing to bring one up fails the run rather than skipping its tests. Elsewhere (no root, no apt)
# those tests are skipped with a reason; RLOO_SLURM=0 / RLOO_UI=0 skip them on purpose.
set -euo pipefail
cd "$(dirname "$0")/.."
fast=0
if [ "${1:-}" = "--fast" ]; then
  fast=1
  shift
fi
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
can_install=0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then can_install=1; fi
started_slurm=0
cleanup() { if [ "$started_slurm" = 1 ]; then bash tests/slurm/stop.sh || true; fi; }
trap cleanup EXIT
if [ "$fast" = 1 ]; then
  export RLOO_SLURM=0 RLOO_UI=0  # the fast tier has no Slurm or browser test
fi
if [ "${RLOO_SLURM:-auto}" != "0" ] && [ "$can_install" = 1 ]; then
  if bash tests/slurm/start.sh; then
    started_slurm=1
    export RLOO_SLURM=1
  else
    echo "test.sh: could not start the test Slurm cluster (tests/slurm/start.sh); set RLOO_SLURM=0 to skip its tests" >&2
    exit 1
  fi
fi
if [ "${RLOO_UI:-auto}" != "0" ]; then
  if bash scripts/ui-test-deps.sh; then
    export RLOO_UI=1
  elif [ "$can_install" = 1 ]; then
    echo "test.sh: could not install Chromium/playwright-core (scripts/ui-test-deps.sh); set RLOO_UI=0 to skip the UI test" >&2
    exit 1
  else
    echo "test.sh: Chromium/playwright-core unavailable (not root with apt); the MLflow UI test will be skipped" >&2
  fi
fi
ruff check rloo tests bench
if [ "$fast" = 1 ]; then
  python -m pytest -m "not slow" -n 2 --dist loadgroup -q "$@"
else
  python -m pytest -n 2 --dist loadgroup --durations=25 "$@"
fi
