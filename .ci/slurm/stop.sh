#!/usr/bin/env bash
# Stops what .ci/slurm/start.sh DIR started (the jobs' processes with their
# slurmd) and removes DIR. Safe to run again, or when nothing runs.
set -uo pipefail
dir=${1:?usage: stop.sh DIR}
[ -d "$dir" ] || exit 0
export SLURM_CONF=$dir/slurm.conf
# Jobs first: their processes outlive slurmd.
if [ -f "$dir/slurmctld.pid" ] && kill -0 "$(cat "$dir/slurmctld.pid")" \
  2>/dev/null; then
  squeue -h -o %A 2>/dev/null | xargs -r scancel 2>/dev/null
  for _ in $(seq 150); do
    [ -z "$(squeue -h -t running,completing -o %A 2>/dev/null)" ] && break
    sleep 0.1
  done
fi
pids=()
for file in slurmd-a100node.pid slurmd-t4node.pid slurmctld.pid \
  munge/munged.pid; do
  [ -f "$dir/$file" ] && pids+=("$(cat "$dir/$file")")
done
for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null; done
for _ in $(seq 50); do
  alive=0
  for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
  [ $alive = 0 ] && break
  sleep 0.1
done
for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null; done
rm -rf "$dir"
