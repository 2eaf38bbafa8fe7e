#!/usr/bin/env bash
# The project's test command: installs what the tests need, then runs the whole suite on three workers
# (pytest-xdist, one file per worker at a time, the Slurm files together: tests/conftest.py; three on
# two cores, because much of the suite waits on servers, queues and process start-up).
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
can_install=0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then can_install=1; fi
if [ "$fast" = 1 ]; then
  export RLOO_SLURM=0 RLOO_UI=0  # the fast tier has no Slurm or browser test
fi
want_slurm=0
if [ "${RLOO_SLURM:-auto}" != "0" ] && [ "$can_install" = 1 ]; then want_slurm=1; fi
want_ui=0
if [ "${RLOO_UI:-auto}" != "0" ]; then want_ui=1; fi
# The Slurm cluster and the UI test's browser come up while the venv installs (apt beside pip; the two
# apt users one after the other, dpkg has one lock). Each writes its verdict to a file of its own.
deps_dir=$(mktemp -d)
started_slurm=0
cleanup() {
  if [ "$started_slurm" = 1 ] || [ -f "$deps_dir/slurm.ok" ]; then bash tests/slurm/stop.sh || true; fi
  rm -rf "$deps_dir"
}
trap cleanup EXIT
(
  if [ "$want_slurm" = 1 ]; then
    if bash tests/slurm/start.sh >"$deps_dir/slurm.log" 2>&1; then touch "$deps_dir/slurm.ok"; fi
  fi
  if [ "$want_ui" = 1 ]; then
    if bash scripts/ui-test-deps.sh >"$deps_dir/ui.log" 2>&1; then touch "$deps_dir/ui.ok"; fi
  fi
) &
deps=$!
t0=$SECONDS
bash scripts/setup.sh
echo "test.sh: .venv ready at $((SECONDS - t0)) s"
wait "$deps" || true
echo "test.sh: Slurm and browser steps done at $((SECONDS - t0)) s"
. .venv/bin/activate
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
if [ "$want_slurm" = 1 ]; then
  cat "$deps_dir/slurm.log"
  if [ -f "$deps_dir/slurm.ok" ]; then
    started_slurm=1
    export RLOO_SLURM=1
  else
    echo "test.sh: could not start the test Slurm cluster (tests/slurm/start.sh); set RLOO_SLURM=0 to skip its tests" >&2
    exit 1
  fi
fi
if [ "$want_ui" = 1 ]; then
  if [ -f "$deps_dir/ui.ok" ]; then
    export RLOO_UI=1
  elif [ "$can_install" = 1 ]; then
    cat "$deps_dir/ui.log" >&2
    echo "test.sh: could not install Chromium/playwright-core (scripts/ui-test-deps.sh); set RLOO_UI=0 to skip the UI test" >&2
    exit 1
  else
    cat "$deps_dir/ui.log" >&2
    echo "test.sh: Chromium/playwright-core unavailable (not root with apt); the MLflow UI test will be skipped" >&2
  fi
fi
ruff check rloo rloo_workflow snakemake_logger_plugin_rloo tests bench
# pytest-xdist workers (RLOO_TEST_WORKERS; -n 0 in ARGS for one process)
workers=${RLOO_TEST_WORKERS:-3}
if [ "$fast" = 1 ]; then
  python -m pytest -m "not slow" -n "$workers" --dist loadgroup -q "$@"
else
  python -m pytest -n "$workers" --dist loadgroup --durations=25 "$@"
fi
