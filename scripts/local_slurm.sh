#!/usr/bin/env bash
# Install and start a local Slurm cluster of N nodes on THIS host, for CI and tests.
#
#   sudo scripts/local_slurm.sh            # 2 nodes (node1, node2), 2 CPUs and 8 fake GPUs each
#   PFPPO_SLURM_NODES=3 scripts/local_slurm.sh
#   scripts/local_slurm.sh --stop          # stop the daemons this script started
#
# What it does (Debian 12, Slurm 22.05; run as root, no systemd needed):
#   1. apt-get install slurmctld slurmd slurm-client munge (skipped when already installed);
#   2. writes /etc/slurm/slurm.conf and gres.conf: nodes node1..N all at NodeAddr=127.0.0.1 with
#      distinct slurmd ports, per-node (%n) spool / pid / log paths, auth/none (no munge daemon:
#      any local user may act as any uid, acceptable on a throw-away CI machine only),
#      EnforcePartLimits=ALL (a job asking more nodes than exist is rejected at once instead of
#      pending forever under `sbatch --wait`), MinJobAge=4 (`sbatch --wait` polls every ~2 s),
#      jobcomp/filetxt (one line per finished job with its final state: there is no slurmdbd, so
#      no sacct), and gpu gres backed by symlinks to /dev/null so `--gpus-per-node` schedules;
#   3. adds nodeX -> 127.0.0.1 to /etc/hosts (torchrun's rendezvous resolves the first node's name);
#   4. starts slurmctld and one `slurmd -N nodeX` per node by hand and waits until every node is idle.
#
# Idempotent: when the daemons already run with the same config it only waits for idle nodes;
# when the config changed it restarts them. Exit status 0 = cluster ready.
set -euo pipefail

NODES="${PFPPO_SLURM_NODES:-2}"
CPUS="${PFPPO_SLURM_CPUS:-$(nproc)}"         # per node; every node shares this host's cores
GPUS="${PFPPO_SLURM_GPUS:-8}"                 # fake GPUs per node (gres only, /dev/null)
MEM_MB="${PFPPO_SLURM_MEM_MB:-4096}"          # RealMemory per node (config_overrides: not checked)
CTLD_PORT="${PFPPO_SLURM_CTLD_PORT:-6817}"
SLURMD_PORT0="${PFPPO_SLURM_SLURMD_PORT0:-17000}"   # node i listens on SLURMD_PORT0 + i

ETC=/etc/slurm
SPOOL=/var/spool/slurm
LOGS=/var/log/slurm
RUN=/run/slurm
FAKE_GPU_DIR=/run/pfppo-fake-gpus
JOBCOMP="$LOGS/jobcomp.log"

say() { echo "[local_slurm] $*"; }
die() { echo "[local_slurm] error: $*" >&2; exit 1; }

pid_alive() {  # pid_alive PIDFILE -> 0 if the pid in the file is a live process
  local pid
  pid="$(cat "$1" 2>/dev/null)" && [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null
}

stop_daemons() {
  local f
  for f in "$RUN"/slurmd-node*.pid "$RUN/slurmctld.pid"; do
    [[ -e "$f" ]] || continue
    if pid_alive "$f"; then
      local pid
      pid="$(cat "$f" 2>/dev/null)"
      say "stopping $(basename "$f" .pid) (pid $pid)"
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 50); do pid_alive "$f" || break; sleep 0.1; done
    fi
    rm -f "$f"
  done
}

if [[ "${1:-}" == "--stop" ]]; then
  stop_daemons
  exit 0
fi
[[ $# -eq 0 ]] || die "unknown argument '$1' (usage: $0 [--stop])"
[[ "$(id -u)" -eq 0 ]] || die "must run as root (installs packages, writes /etc/slurm, starts daemons)"
[[ "$NODES" =~ ^[1-9][0-9]*$ ]] || die "PFPPO_SLURM_NODES=$NODES must be an integer >= 1"

# ---------------------------------------------------------------------------- 1. packages
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null; then
  say "installing slurmctld slurmd slurm-client munge"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
fi

# ---------------------------------------------------------------------------- 2. config
mkdir -p "$ETC" "$SPOOL/ctld" "$LOGS" "$RUN" "$FAKE_GPU_DIR"
for i in $(seq 1 "$NODES"); do mkdir -p "$SPOOL/d-node$i"; done
last_gpu=$((GPUS - 1))
for g in $(seq 0 "$last_gpu"); do
  ln -sfn /dev/null "$FAKE_GPU_DIR/nvidia$g"   # gres File= must name character devices
done

node_lines=""
for i in $(seq 1 "$NODES"); do
  node_lines+="NodeName=node$i NodeAddr=127.0.0.1 Port=$((SLURMD_PORT0 + i)) CPUs=$CPUS RealMemory=$MEM_MB Gres=gpu:$GPUS State=UNKNOWN"$'\n'
done

new_conf="$(cat <<EOF
# Written by scripts/local_slurm.sh: a ${NODES}-node cluster on one host (CI / tests only).
ClusterName=pfppo-local
SlurmctldHost=$(hostname -s)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SwitchType=switch/none
ReturnToService=2
SlurmdParameters=config_overrides
EnforcePartLimits=ALL
MinJobAge=4
KillWait=5
InactiveLimit=0
Waittime=0
SchedulerType=sched/backfill
StateSaveLocation=$SPOOL/ctld
SlurmdSpoolDir=$SPOOL/d-%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$JOBCOMP
GresTypes=gpu
${node_lines}PartitionName=debug Nodes=node[1-$NODES] Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
)"
new_gres="NodeName=node[1-$NODES] Name=gpu File=$FAKE_GPU_DIR/nvidia[0-$last_gpu]"

changed=0
if [[ "$(cat "$ETC/slurm.conf" 2>/dev/null)" != "$new_conf" ]]; then changed=1; fi
if [[ "$(cat "$ETC/gres.conf" 2>/dev/null)" != "$new_gres" ]]; then changed=1; fi
if [[ $changed -eq 1 ]]; then
  say "writing $ETC/slurm.conf and $ETC/gres.conf ($NODES nodes, $CPUS CPUs, $GPUS fake GPUs each)"
  printf '%s\n' "$new_conf" > "$ETC/slurm.conf"
  printf '%s\n' "$new_gres" > "$ETC/gres.conf"
fi

# ---------------------------------------------------------------------------- 3. /etc/hosts
for i in $(seq 1 "$NODES"); do
  if ! grep -qE "^[^#]*[[:space:]]node$i([[:space:]]|\$)" /etc/hosts; then
    echo "127.0.0.1 node$i" >> /etc/hosts
  fi
done

# ---------------------------------------------------------------------------- 4. daemons
all_running=1
pid_alive "$RUN/slurmctld.pid" || all_running=0
for i in $(seq 1 "$NODES"); do pid_alive "$RUN/slurmd-node$i.pid" || all_running=0; done

if [[ $changed -eq 1 || $all_running -eq 0 ]]; then
  stop_daemons
  say "starting slurmctld and $NODES slurmd"
  # -i: ignore state-file errors (a changed node list invalidates the saved state)
  slurmctld -i
  for _ in $(seq 100); do scontrol ping >/dev/null 2>&1 && break; sleep 0.1; done
  for i in $(seq 1 "$NODES"); do slurmd -N "node$i"; done
else
  say "already running ($NODES nodes, config unchanged)"
fi

# ---------------------------------------------------------------------------- 5. wait for idle
deadline=$((SECONDS + 60))
while :; do
  states="$(sinfo -h -N -o '%N %t' 2>/dev/null | sort -u || true)"
  not_idle="$(awk '$2 != "idle" && $2 != "mix" && $2 != "alloc"' <<<"$states")"
  if [[ -n "$states" && -z "$not_idle" ]]; then break; fi
  if grep -qE ' (down|drain|drng|inval)\*?$' <<<"$not_idle"; then
    scontrol update NodeName="node[1-$NODES]" State=RESUME >/dev/null 2>&1 || true
  fi
  if (( SECONDS > deadline )); then
    die "nodes not idle after 60 s: $(tr '\n' ';' <<<"$states") (see $LOGS/slurmctld.log, $LOGS/slurmd-node*.log)"
  fi
  sleep 0.5
done
say "ready: $(tr '\n' ' ' <<<"$states")(jobcomp: $JOBCOMP)"
