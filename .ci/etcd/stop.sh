#!/usr/bin/env bash
# Stops the etcd that .ci/etcd/start.sh DIR started and removes DIR.
set -uo pipefail
dir=${1:?usage: stop.sh DIR}
if [ -f "$dir/etcd.pid" ]; then
  pid=$(cat "$dir/etcd.pid")
  kill "$pid" 2>/dev/null
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null
fi
rm -rf "$dir"
