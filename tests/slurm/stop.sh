#!/usr/bin/env bash
# Stop the one-node test Slurm started by start.sh: cancel jobs, then stop slurmd, slurmctld,
# slurmdbd, mariadbd and munged by the pids recorded under $SLURM_TEST_DIR.
# Only when a pid file is missing does it look the daemon up by exact name (slurm daemons) or
# by a command line naming $SLURM_TEST_DIR (mariadbd, munged: never someone else's instance).
#   --purge   also delete $SLURM_TEST_DIR (database, state, logs) and the configs in /etc/slurm
#   --quiet   print nothing unless something goes wrong
set -uo pipefail

if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1; then exec sudo -E bash "$0" "$@"; fi
  echo "stop.sh: must run as root" >&2; exit 1
fi

# default: the directory the running configuration points at, else start.sh's default
conf_dir=$(sed -n 's|^StateSaveLocation=\(.*\)/slurmctld$|\1|p' /etc/slurm/slurm.conf 2>/dev/null)
DIR=${SLURM_TEST_DIR:-${conf_dir:-/var/lib/rloo-slurm}}
export SLURM_CONF=/etc/slurm/slurm.conf
PURGE=0 QUIET=0
for a in "$@"; do
  case $a in
    --purge) PURGE=1 ;;
    --quiet) QUIET=1 ;;
    *) echo "usage: $0 [--purge] [--quiet]" >&2; exit 2 ;;
  esac
done
T0=${EPOCHREALTIME/./}
log() { [ $QUIET = 1 ] || printf '[stop.sh %6.1fs] %s\n' "$(awk "BEGIN{print (${EPOCHREALTIME/./}-$T0)/1000000}")" "$*"; }

# pid_of PIDFILE COMM: the pid in PIDFILE if that process is alive and named COMM
pid_of() {
  local pid; [ -s "$1" ] || return 1; pid=$(tr -dc 0-9 <"$1"); [ -n "$pid" ] || return 1
  [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ] && echo "$pid"
}

# alive PID: running and not a zombie (daemons are reparented to PID 1, which may reap late)
alive() { local st; st=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1); [ -n "$st" ] && [ "$st" != Z ]; }

# stop_pids NAME TIMEOUT PID...: SIGTERM, wait up to TIMEOUT s, then SIGKILL
stop_pids() {
  local name=$1 timeout=$2; shift 2
  [ $# -gt 0 ] || return 0
  kill -TERM "$@" 2>/dev/null
  local end=$(( ${EPOCHREALTIME/./} + timeout * 1000000 )) p left
  while :; do
    left=(); for p in "$@"; do alive "$p" && left+=("$p"); done
    [ ${#left[@]} -eq 0 ] && { log "stopped $name ($*)"; return 0; }
    [ "${EPOCHREALTIME/./}" -lt "$end" ] || break
    sleep 0.1
  done
  log "$name did not exit within ${timeout}s: SIGKILL ${left[*]}"
  kill -KILL "${left[@]}" 2>/dev/null
  sleep 0.2
}

# stop NAME PIDFILE TIMEOUT [FALLBACK_PATTERN]
stop() {
  local name=$1 pidfile=$2 timeout=$3 pattern=${4:-} pids
  pids=$(pid_of "$pidfile" "$name")
  if [ -z "$pids" ] && [ ! -s "$pidfile" ]; then
    # no pid file: fall back to a lookup by name
    if [ -n "$pattern" ]; then pids=$(pgrep -f -- "$pattern" | while read -r p; do
        [ "$(cat /proc/$p/comm 2>/dev/null)" = "$name" ] && alive "$p" && echo "$p"; done)
    else pids=$(pgrep -x "$name" | while read -r p; do alive "$p" && echo "$p"; done); fi
    [ -n "$pids" ] && log "no pid file for $name, found by name: $(echo $pids)"
  fi
  # shellcheck disable=SC2086
  stop_pids "$name" "$timeout" $pids
  rm -f "$pidfile"
}

# 1. cancel jobs so that no slurmstepd outlives slurmd
if pid_of "$DIR/run/slurmctld.pid" slurmctld >/dev/null && [ -f "$SLURM_CONF" ]; then
  jobs=$(timeout 10 squeue -h -o %A 2>/dev/null | tr '\n' ' ')
  if [ -n "${jobs// /}" ]; then
    log "cancelling jobs: $jobs"
    # shellcheck disable=SC2086
    timeout 10 scancel $jobs 2>/dev/null
    for _ in $(seq 1 100); do
      [ -z "$(timeout 5 squeue -h -t R,CG,PD -o %A 2>/dev/null)" ] && break; sleep 0.2
    done
  fi
fi

# 2. daemons, in reverse start order
stop slurmd    "$DIR/run/slurmd.pid"       15
stop slurmctld "$DIR/run/slurmctld.pid"    15
stop slurmdbd  "$DIR/run/slurmdbd.pid"     15
stop mariadbd  "$DIR/mysql/mariadbd.pid"   60 "--datadir=$DIR/mysql"
stop munged    "$DIR/munge/munged.pid"     10 "--socket=$DIR/munge/"

# 3. step daemons left over from jobs that ignored the cancel (they belong to our slurmd)
steps=$(pgrep -x slurmstepd | tr '\n' ' ')
# shellcheck disable=SC2086
[ -n "${steps// /}" ] && stop_pids slurmstepd 5 $steps

if [ $PURGE = 1 ]; then
  rm -rf -- "$DIR"
  rm -f /etc/slurm/slurm.conf /etc/slurm/gres.conf /etc/slurm/slurmdbd.conf
  log "purged $DIR and /etc/slurm/{slurm,gres,slurmdbd}.conf"
fi
log "done"
exit 0
