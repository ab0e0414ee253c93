#!/usr/bin/env bash
# A throwaway Slurm on this machine, for tests/test_slurm.py: munged,
# slurmctld and one slurmd, all under DIR (their keys, state, sockets,
# logs), CPU-only and cgroup-free (proctrack/linuxproc, task/none), so it
# runs in a container. Installs Debian's packages first if missing (root).
#
#   .ci/slurm/start.sh DIR      # then: export SLURM_CONF=DIR/slurm.conf
#   .ci/slurm/stop.sh DIR       # kills the daemons, removes DIR
#
# Running it again with the same DIR while it is up does nothing. Ports:
# SLURMCTLD_PORT (default 16817), SLURMD_PORT and the next (16818, 16819).
set -euo pipefail
dir=${1:?usage: start.sh DIR}
ctld_port=${SLURMCTLD_PORT:-16817}
slurmd_port=${SLURMD_PORT:-16818}
packages=(slurmctld slurmd slurm-client munge)

if ! command -v slurmctld slurmd sbatch munged >/dev/null ||
  [ "$(command -v slurmctld slurmd sbatch munged | wc -l)" != 4 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq --no-install-recommends "${packages[@]}" \
    >/dev/null 2>&1 ||
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends \
      "${packages[@]}" >/dev/null; }
fi

mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
export SLURM_CONF=$dir/slurm.conf
if [ -f "$dir/slurmctld.pid" ] && kill -0 "$(cat "$dir/slurmctld.pid")" \
  2>/dev/null && scontrol ping >/dev/null 2>&1; then
  exit 0  # already up
fi

# munged wants its socket's directory open to all, its key's to no one.
chmod 755 "$dir"
mkdir -p "$dir/munge" "$dir/key" "$dir/state" "$dir/spool" "$dir/log"
chmod 755 "$dir/munge"
chmod 700 "$dir/key"
[ -f "$dir/key/munge.key" ] ||
  { head -c 1024 /dev/urandom >"$dir/key/munge.key" &&
    chmod 400 "$dir/key/munge.key"; }
socket=$dir/munge/munge.socket
munged --key-file="$dir/key/munge.key" --socket="$socket" \
  --pid-file="$dir/munge/munged.pid" --log-file="$dir/log/munged.log" \
  --seed-file="$dir/key/munged.seed"

host=$(hostname -s)
# Two nodes on this host, one slurmd each (Debian builds Slurm with
# multiple-slurmd support): `a100node` (partition a100) and `t4node`
# (partition t4), both at 127.0.0.1 on their own ports, named and sized as
# examples/slurm/train.sbatch asks: more CPUs than this host has
# (config_overrides), and no GPUs (the test submits with SBATCH_GRES=none).
cat >"$dir/slurm.conf" <<CONF
ClusterName=keras-hetero-ci
SlurmctldHost=$host
SlurmctldPort=$ctld_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$socket
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
MailProg=/bin/true
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# Heterogeneous jobs are scheduled by the backfill scheduler only.
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
ReturnToService=2
MinJobAge=600
KillWait=10
NodeName=a100node NodeHostname=$host NodeAddr=127.0.0.1 Port=$slurmd_port CPUs=16 RealMemory=4000 Features=a100
NodeName=t4node NodeHostname=$host NodeAddr=127.0.0.1 Port=$((slurmd_port + 1)) CPUs=8 RealMemory=4000 Features=t4
PartitionName=a100 Nodes=a100node Default=YES MaxTime=INFINITE State=UP
PartitionName=t4 Nodes=t4node MaxTime=INFINITE State=UP
CONF
slurmctld -i -f "$SLURM_CONF"
for node in a100node t4node; do
  mkdir -p "$dir/spool/$node"
  slurmd -f "$SLURM_CONF" -N "$node"
done
for _ in $(seq 100); do
  if [ "$(sinfo -h -N -t idle -o %N 2>/dev/null | wc -l)" = 2 ]; then
    exit 0
  fi
  sleep 0.1
done
echo "slurm did not come up; logs in $dir/log:" >&2
tail -n 20 "$dir"/log/*.log >&2
exit 1
