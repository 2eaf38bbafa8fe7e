#!/usr/bin/env bash
# What the MLflow UI test (tests/e2e/test_tracking.py::test_mlflow_ui_lists_pipeline_and_stage_runs) needs:
# Debian's Chromium (apt, as root) and playwright-core from npm (tests/ui/node_modules; it downloads no
# browser). Idempotent and quick when both are there. Exits non-zero, saying what is missing, when it
# could not provide them; the test then skips with that reason (or fails when RLOO_UI=1).
set -uo pipefail
cd "$(dirname "$0")/.."
ok=1
if ! command -v chromium >/dev/null 2>&1 && [ ! -x /usr/bin/chromium ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium; } >/dev/null 2>&1 \
      || { echo "ui-test-deps: apt-get install chromium failed" >&2; ok=0; }
  else
    echo "ui-test-deps: chromium missing (install Debian's chromium package as root)" >&2
    ok=0
  fi
fi
if [ ! -f tests/ui/node_modules/playwright-core/package.json ] \
   || [ tests/ui/package-lock.json -nt tests/ui/node_modules/.package-lock.json ]; then
  if command -v npm >/dev/null 2>&1; then
    (cd tests/ui && npm ci --no-audit --no-fund --loglevel=error >/dev/null) \
      || { echo "ui-test-deps: npm ci in tests/ui failed" >&2; ok=0; }
  else
    echo "ui-test-deps: npm missing (Node.js >= 20 is needed for playwright-core)" >&2
    ok=0
  fi
fi
[ "$ok" = 1 ]
