#!/usr/bin/env bash
# The tests that hold the workflow to Snakemake, with the oldest Snakemake the project allows: the lower
# bound of pyproject.toml's `snakemake>=9.N,<10` (the Snakefile's min_version says the same), its first
# release, in a venv of its own (.venv-snakemake-oldest; the main .venv has the newest of the range).
# What runs: the Snakemake-internals canary (tests/integration/test_snakemake_api.py: what sets the oldest),
# the rules' jobs held to the declaration dvc.yaml is built from (tests/e2e/test_dvc.py, seconds), and the
# micro DAG's dry run with a real rerun of a changed key's stage (tests/e2e/test_every_key.py's test
# that needs no shared chain: about a minute, where the micro chain would cost several). .ci/run runs it in
# the background beside the main suite; the main suite runs the same tests with the newest Snakemake.
#   bash scripts/test_oldest_snakemake.sh            build the venv if needed, then run those tests
#   bash scripts/test_oldest_snakemake.sh --setup    build the venv and stop
#   bash scripts/test_oldest_snakemake.sh ARGS       extra pytest arguments (-x, --basetemp DIR)
set -euo pipefail
cd "$(dirname "$0")/.."
setup_only=0
if [ "${1:-}" = "--setup" ]; then
  setup_only=1
  shift
fi
PY=${PYTHON:-python3}
VENV=${RLOO_OLDEST_SNAKEMAKE_VENV:-.venv-snakemake-oldest}
TORCH=${RLOO_TORCH_VERSION:-2.13.0}
# the range's lower bound, read from the one place it is declared: "9.15" -> its first release, 9.15.0
bound=$("$PY" - <<'EOF'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
(spec,) = [d for d in deps if re.match(r"snakemake\s*[<>=]", d)]
print(re.search(r">=\s*([0-9.]+)", spec).group(1))
EOF
)
oldest="$bound"
case "$bound" in *.*.*) ;; *) oldest="$bound.0" ;; esac

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
. "$VENV/bin/activate"
stamp="$VENV/.rloo-oldest-snakemake-installed"
want="snakemake==$oldest torch==$TORCH $(sha256sum pyproject.toml scripts/test_oldest_snakemake.sh | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  t0=$(date +%s)
  . scripts/install.sh  # pkg_install: uv if it can be had, else pip
  # one editable install of this tree at a time (.ci/run builds three venvs at once: rloo.egg-info)
  (
    flock 9
    pkg_install "torch==$TORCH" -e ".[dev]" "snakemake==$oldest"
  ) 9>"${TMPDIR:-/tmp}/rloo-editable-install.lock"
  python -c "import rloo, snakemake, dvc; from importlib.metadata import version; print('snakemake', version('snakemake'))"
  echo "$want" > "$stamp"
  echo "test_oldest_snakemake.sh: venv $VENV (snakemake $oldest) ready in $(( $(date +%s) - t0 )) s"
fi
if [ "$setup_only" = 1 ]; then
  exit 0
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
python -m pytest -n 0 -ra -p no:cacheprovider tests/integration/test_snakemake_api.py \
  "tests/e2e/test_every_key.py::test_the_micro_dag_plans_every_stage_and_a_key_of_prepare_reruns_it_for_real" \
  "tests/e2e/test_dvc.py::test_the_declared_jobs_are_the_rules_jobs" "$@"
