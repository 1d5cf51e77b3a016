#!/usr/bin/env bash
# Make sure Debian's `haproxy` is installed: tests/unit/test_deploy_compose.py checks the compose stack's load
# balancer config with `haproxy -c`. Idempotent and quiet on success; on failure the tail of the apt log goes to
# stderr.
set -euo pipefail

have() { command -v haproxy >/dev/null 2>&1; }
have && exit 0

LOG="$(mktemp -t m3gate-haproxy-install.XXXXXX.log)"
fail() { echo "install-haproxy: $1 (log: $LOG)" >&2; tail -n 30 "$LOG" >&2 || true; exit 1; }

SUDO=""
[[ "$(id -u)" -eq 0 ]] || SUDO="sudo"
# Two `make test` runs at once must not run apt concurrently.
exec 9>"${TMPDIR:-/tmp}/m3gate-install-haproxy.lock"
flock 9
have && exit 0

export DEBIAN_FRONTEND=noninteractive
install() { $SUDO apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends haproxy >>"$LOG" 2>&1; }
# Update the package lists once, only when the install cannot find the package with the lists already there.
install || { $SUDO apt-get -o DPkg::Lock::Timeout=600 update -qq >>"$LOG" 2>&1 || fail "apt-get update failed"; install; } \
  || fail "apt-get install haproxy failed"
have || fail "haproxy still missing after the install"
rm -f "$LOG"
