#!/usr/bin/env bash
# Make sure a Redis answers on 127.0.0.1:6379 (the tests' shared-state backend); start one if absent.
set -euo pipefail
ping() { (exec 3<>/dev/tcp/127.0.0.1/6379 && printf 'PING\r\n' >&3 && head -c 5 <&3 | grep -q PONG) 2>/dev/null; }
ping && exit 0
if ! command -v redis-server >/dev/null; then
  apt-get -o DPkg::Lock::Timeout=600 update -qq && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq redis-server >/dev/null
fi
mkdir -p /var/lib/redis /var/log/redis
redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
  --dir /var/lib/redis --logfile /var/log/redis/ci.log
for _ in $(seq 50); do ping && exit 0; sleep 0.1; done
echo "redis did not start" >&2; exit 1
