# Sourced by scripts/setup.sh and scripts/test_vllm.sh (inside an activated venv): `pkg_install ARGS...`
# installs packages into that venv with uv when uv can be had, and with pip otherwise.
# Why uv: on two cores pip spends about two minutes of CPU resolving and unpacking the dev install
# (torch, mlflow, dvc, snakemake) and three for vLLM's; uv does either in 10-20 s, which CI pays twice.
# uv reads none of pip's configuration, so it is handed pip's: find-links, index and extra indexes,
# constraints (from PIP_* variables or pip's config files), and pip's index strategy (the best match
# across every index, not the first index that has the package).
# RLOO_INSTALLER=pip forces pip.

_pip_setting() {  # the value pip would use for one option: its environment variable, else its config
  local var="PIP_$(echo "$1" | tr 'a-z-' 'A-Z_')"
  if [ -n "${!var:-}" ]; then echo "${!var}"; return; fi
  python -m pip config get "global.$1" 2>/dev/null || true
}

_uv_args=()
_use_uv=0
if [ "${RLOO_INSTALLER:-uv}" = uv ] && python -m pip install -q uv 2>/dev/null && [ -x "$VIRTUAL_ENV/bin/uv" ]; then
  _use_uv=1
  # --compile-bytecode: pip writes .pyc files at install and uv does not; the stages run with
  # PYTHONDONTWRITEBYTECODE under Snakemake, so without them every job compiles torch and transformers
  # again (measured: twice the CPU time per import, the whole suite twice as long)
  _uv_args=(--python "$VIRTUAL_ENV/bin/python" --index-strategy unsafe-best-match --compile-bytecode)
  for _value in $(_pip_setting index-url); do _uv_args+=(--default-index "$_value"); done
  for _value in $(_pip_setting extra-index-url); do _uv_args+=(--extra-index-url "$_value"); done
  for _value in $(_pip_setting find-links); do _uv_args+=(--find-links "$_value"); done
  for _value in $(_pip_setting constraint); do _uv_args+=(--constraint "$_value"); done
fi

pkg_install() {
  if [ "$_use_uv" = 1 ]; then
    "$VIRTUAL_ENV/bin/uv" pip install -q "${_uv_args[@]}" "$@"
  else
    local log rc=0
    log=$(python -m pip install -q "$@" 2>&1) || rc=$?
    printf '%s\n' "$log" | grep -v -i "^warning: location" || true
    return "$rc"
  fi
}

pkg_uninstall() {
  if [ "$_use_uv" = 1 ]; then
    "$VIRTUAL_ENV/bin/uv" pip uninstall -q --python "$VIRTUAL_ENV/bin/python" "$@" || true
  else
    python -m pip uninstall -y -q "$@" 2>&1 | grep -v -i "^warning: location" || true
  fi
}
