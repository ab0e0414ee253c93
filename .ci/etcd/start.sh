#!/usr/bin/env bash
# A throwaway single-member etcd on this machine, for the launcher's
# `--rdzv-backend etcd` tests: Debian's etcd-server (installed first if
# missing; root), its data and log under DIR.
#
#   .ci/etcd/start.sh DIR [ADDRESS [PORT]]   # prints http://ADDRESS:PORT
#   .ci/etcd/stop.sh DIR                      # kills it, removes DIR
#
# ADDRESS defaults to 127.0.0.1, PORT to 23790 (peer port: PORT + 1).
# Running it again with the same DIR while it is up only prints the URL.
set -euo pipefail
dir=${1:?usage: start.sh DIR [ADDRESS [PORT]]}
address=${2:-127.0.0.1}
port=${3:-23790}
url=http://$address:$port

if ! command -v etcd >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq --no-install-recommends etcd-server >/dev/null 2>&1 ||
    { apt-get update -qq &&
      apt-get install -y -qq --no-install-recommends etcd-server >/dev/null; }
fi

mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
if [ -f "$dir/etcd.pid" ] && kill -0 "$(cat "$dir/etcd.pid")" 2>/dev/null; then
  echo "$url"
  exit 0  # already up
fi
# Debian's package may have started a system etcd on the default ports;
# this one uses its own ports and data directory.
nohup etcd --name keras-hetero-test --data-dir "$dir/data" \
  --listen-client-urls "$url" --advertise-client-urls "$url" \
  --listen-peer-urls "http://$address:$((port + 1))" \
  --initial-advertise-peer-urls "http://$address:$((port + 1))" \
  --initial-cluster "keras-hetero-test=http://$address:$((port + 1))" \
  >"$dir/etcd.log" 2>&1 &
echo $! >"$dir/etcd.pid"
for _ in $(seq 100); do
  if curl -fsS "$url/health" 2>/dev/null | grep -q '"health":"true"'; then
    echo "$url"
    exit 0
  fi
  sleep 0.1
done
echo "etcd did not become healthy at $url; its log:" >&2
tail -20 "$dir/etcd.log" >&2
exit 1
