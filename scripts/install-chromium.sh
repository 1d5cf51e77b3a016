#!/usr/bin/env bash
# Make sure Debian's headless-capable `chromium` and its `chromedriver` are installed: the browser tests (tests/ui)
# drive the gateway's /ui page and the contract report through Selenium, with nothing downloaded at run time (no
# Selenium Manager, no Playwright browser fetch). Idempotent and quiet on success; on failure the tail of the apt
# log goes to stderr.
set -euo pipefail

have() { command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; }
have && exit 0

LOG="$(mktemp -t m3gate-chromium-install.XXXXXX.log)"
fail() { echo "install-chromium: $1 (log: $LOG)" >&2; tail -n 30 "$LOG" >&2 || true; exit 1; }

SUDO=""
[[ "$(id -u)" -eq 0 ]] || SUDO="sudo"
# Two `make test` runs at once must not run apt concurrently.
exec 9>"${TMPDIR:-/tmp}/m3gate-install-chromium.lock"
flock 9
have && exit 0

export DEBIAN_FRONTEND=noninteractive
install() { $SUDO apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends chromium chromium-driver >>"$LOG" 2>&1; }
# Update the package lists once, only when the install cannot find the packages with the lists already there.
install || { $SUDO apt-get -o DPkg::Lock::Timeout=600 update -qq >>"$LOG" 2>&1 || fail "apt-get update failed"; install; } \
  || fail "apt-get install chromium chromium-driver failed"
have || fail "chromium/chromedriver still missing after the install"
rm -f "$LOG"
