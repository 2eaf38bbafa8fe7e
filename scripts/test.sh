#!/usr/bin/env bash
# The project's test command: installs what the tests need, then runs the whole suite.
# As root on Debian it also brings up the one-node Slurm cluster the Slurm tests run against
# (tests/slurm/start.sh) and stops it afterwards; elsewhere those tests are skipped with a reason.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
started_slurm=0
if [ "${RLOO_SLURM:-auto}" != "0" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null \
   && [ -x tests/slurm/start.sh ]; then
  if bash tests/slurm/start.sh; then
    started_slurm=1
    export RLOO_SLURM=1
  else
    echo "test.sh: could not start the test Slurm cluster; Slurm tests will be skipped" >&2
  fi
fi
cleanup() { if [ "$started_slurm" = 1 ]; then bash tests/slurm/stop.sh || true; fi; }
trap cleanup EXIT
if bash scripts/ui-test-deps.sh; then
  export RLOO_UI=1
else
  echo "test.sh: Chromium/playwright-core unavailable; the MLflow UI test will be skipped" >&2
fi
ruff check rloo tests bench
python -m pytest "$@"
