#!/usr/bin/env bash
# Make sure `prometheus` and `promtool` are on PATH: the observability tests run a real Prometheus against the gateway
# and evaluate every dashboard and alert expression through it. Debian's package ships both binaries; installing it
# can start a system service, which is stopped at once (the tests start their own, on a loopback port, in a temp dir).
# Idempotent and quiet on success; on failure the tail of the apt log goes to stderr.
set -euo pipefail

have() { command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; }
have && exit 0

LOG="$(mktemp -t m3gate-prometheus-install.XXXXXX.log)"
fail() { echo "install-prometheus: $1 (log: $LOG)" >&2; tail -n 30 "$LOG" >&2 || true; exit 1; }

SUDO=""
[[ "$(id -u)" -eq 0 ]] || SUDO="sudo"
# Two `make test` runs at once must not run apt concurrently.
exec 9>"${TMPDIR:-/tmp}/m3gate-install-prometheus.lock"
flock 9
have && exit 0

export DEBIAN_FRONTEND=noninteractive
# policy-rc.d 101 keeps the package's post-install from starting a system-wide Prometheus on :9090.
POLICY=/usr/sbin/policy-rc.d
ADDED_POLICY=""
if [[ ! -e "$POLICY" ]]; then
  printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$POLICY" >/dev/null && $SUDO chmod +x "$POLICY" && ADDED_POLICY=1
fi
cleanup() { [[ -n "$ADDED_POLICY" ]] && $SUDO rm -f "$POLICY"; true; }
trap cleanup EXIT

$SUDO apt-get -o DPkg::Lock::Timeout=600 update -qq >>"$LOG" 2>&1 || fail "apt-get update failed"
$SUDO apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends prometheus >>"$LOG" 2>&1 || fail "apt-get install prometheus failed"
have || fail "prometheus/promtool still missing after the install"
rm -f "$LOG"
