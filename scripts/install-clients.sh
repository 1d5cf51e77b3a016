#!/usr/bin/env bash
# Make sure each client of the client matrix (tests/clients) lives in its own virtualenv under the cache folder.
#
# Why separate venvs: the clients (the OpenAI Agents SDK, LangChain, LiteLLM, GuideLLM, inference-perf) pin their own
# openai, pydantic, httpx and transformers ranges and drag in dozens of packages the gateway must never depend on; the
# tests run each client (its check script or its CLI) with that venv and only read its JSON. Why a stamp per venv: it
# holds the pinned requirements (tests/clients/requirements-NAME.txt) it was built from, so a bumped pin reinstalls and
# an unchanged one costs nothing. A file's "# python: X.Y" line picks the interpreter (inference-perf needs 3.12; the
# rest run on 3.11, the only Python torch's local CPU wheel is built for). Quiet on success; on failure the tail of
# that client's install log goes to stderr.
# Usage: install-clients.sh [NAME...]   (default: every tests/clients/requirements-*.txt)
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CACHE="${M3GATE_CACHE:-$HOME/.cache/m3gate}"
PY_FOR_VENV="${PY:-python3.11}"
# Bump when the recipe below changes, so old venvs are rebuilt.
RECIPE="v1"

if [[ $# -eq 0 ]]; then
  set -- $(cd "$ROOT/tests/clients" && ls requirements-*.txt | sed 's/^requirements-//; s/\.txt$//')
fi

# The interpreter for a requirements file: its "# python: X.Y" line (pythonX.Y on PATH, else pyenv's), else $PY.
python_for() {
  local want candidate; want="$(sed -n 's/^# python: *//p' "$1")"
  if [[ -z "$want" ]]; then echo "$PY_FOR_VENV"; return 0; fi
  for candidate in "python$want" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$want".*/bin/"python$want"; do
    # A pyenv shim is on PATH for every installed version but fails unless that version is selected: run it.
    if "$candidate" -c "import sys; assert sys.version.startswith('$want.')" >/dev/null 2>&1; then
      echo "$candidate"; return 0
    fi
  done
  return 1
}

install_one() {
  local name="$1" req="$ROOT/tests/clients/requirements-$1.txt"
  local venv="$CACHE/clients/$name" log="$CACHE/clients/$name-install.log"
  [[ -f "$req" ]] || { echo "install-clients: no $req" >&2; return 1; }
  local want; want="$RECIPE $(grep -v '^\s*#' "$req" | grep -v '^\s*$' | tr '\n' ' ')"
  local stamp="$venv/.m3gate-client-ok"
  stamp_ok() { [[ -x "$venv/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; }
  fail() {
    echo "install-clients: $name: $1 (log: $log)" >&2
    [[ -f "$log" ]] && grep -v "^WARNING: Location" "$log" | tail -n 30 >&2
    exit 1
  }
  stamp_ok && return 0
  mkdir -p "$CACHE/clients"
  # Two `make test` runs at once must not install into the same venv concurrently.
  exec 9>"$CACHE/clients/.$name.lock"
  flock 9
  stamp_ok && return 0
  echo "install-clients: setting up $name in $venv (log in $log)" >&2
  : >"$log"
  # A bumped pin installs over the existing venv (pip moves the pinned packages; the rest is reused).
  if [[ ! -x "$venv/bin/python" ]]; then
    local python; python="$(python_for "$req")" || fail "no Python $(sed -n 's/^# python: *//p' "$req") found"
    "$python" -m venv "$venv" >>"$log" 2>&1 || fail "could not create the virtualenv"
  fi
  "$venv/bin/python" -m pip install -q --upgrade pip >>"$log" 2>&1 || fail "could not upgrade pip"
  "$venv/bin/python" -m pip install -q -r "$req" >>"$log" 2>&1 || fail "pip install -r $req failed"
  "$venv/bin/python" -m pip freeze >>"$log" 2>&1
  # The module the check script needs (the file's "# import:" line) must import (LiteLLM: offline price map).
  local module; module="$(sed -n 's/^# import: *//p' "$req")"
  if [[ -n "$module" ]]; then
    LITELLM_LOCAL_MODEL_COST_MAP=True "$venv/bin/python" -c "import $module" >>"$log" 2>&1 \
      || fail "$module does not import"
  fi
  echo "$want" >"$stamp"
  exec 9>&-
  echo "install-clients: $name ok" >&2
}

for name in "$@"; do
  install_one "$name"
done
