#!/usr/bin/env bash
# Start a real one-node Slurm on 127.0.0.1 for the test suite:
#   munged (private socket) -> mariadbd (private datadir, 127.0.0.1:$SLURM_TEST_DB_PORT)
#   -> slurmdbd -> sacctmgr (cluster/account/users) -> slurmctld -> slurmd
# with one fake GPU (gres gpu:1 backed by /dev/null) and a Default partition "gpu".
#
# Idempotent: if every daemon is alive, the configuration is unchanged and the node is
# usable, it does nothing; otherwise it stops whatever is left (stop.sh) and starts afresh.
# Needs root (re-executes itself with sudo when it can).
#
# Environment (all optional):
#   SLURM_TEST_DIR        state, logs, pids, database        [/var/lib/rloo-slurm]
#   SLURM_TEST_CLUSTER    cluster name                        [rloo]
#   SLURM_TEST_ACCOUNT    account registered via sacctmgr     [rloo]
#   SLURM_TEST_PARTITION  partition name (Default=YES)        [gpu]
#   SLURM_TEST_USERS      extra users to register (space/comma separated); root and
#                         $SUDO_USER are always registered
#   SLURM_TEST_DB_PORT    TCP port of the private mariadbd    [3307]
#   SLURM_TEST_KILLWAIT   seconds between SIGTERM and SIGKILL at time limit/scancel [5]
#   SLURM_TEST_FORCE=1    restart even when everything looks healthy
# Writes $SLURM_TEST_DIR/env (KEY=VALUE lines, shell-sourceable) for the tests.
set -euo pipefail

if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1; then exec sudo -E bash "$0" "$@"; fi
  echo "start.sh: must run as root" >&2; exit 1
fi

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
DIR=${SLURM_TEST_DIR:-/var/lib/rloo-slurm}
CLUSTER=${SLURM_TEST_CLUSTER:-rloo}
ACCOUNT=${SLURM_TEST_ACCOUNT:-rloo}
PARTITION=${SLURM_TEST_PARTITION:-gpu}
DB_PORT=${SLURM_TEST_DB_PORT:-3307}
KILLWAIT=${SLURM_TEST_KILLWAIT:-5}
CONF=/etc/slurm
HOST=$(hostname -s)
PKGS=(munge slurm-client slurmctld slurmd slurmdbd mariadb-server)
export SLURM_CONF=$CONF/slurm.conf
export DEBIAN_FRONTEND=noninteractive

T0=${EPOCHREALTIME/./}
now_ms() { echo $(( (${EPOCHREALTIME/./} - T0) / 1000 )); }
log() { printf '[start.sh %6.1fs] %s\n' "$(awk "BEGIN{print $(now_ms)/1000}")" "$*"; }
die() { log "ERROR: $*"; for f in "$DIR"/log/*.log; do [ -f "$f" ] && { echo "--- tail $f"; tail -n 15 "$f"; }; done; exit 1; }
# wait_for SECONDS DESCRIPTION CMD...: poll CMD every 0.2 s
wait_for() {
  local limit=$1 what=$2; shift 2
  local end=$(( ${EPOCHREALTIME/./} + limit * 1000000 ))
  until "$@" >/dev/null 2>&1; do
    [ "${EPOCHREALTIME/./}" -lt "$end" ] || die "timed out after ${limit}s waiting for $what"
    sleep 0.2
  done
}

# ---------------------------------------------------------------- 1. packages
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "installing ${missing[*]}"
  # keep the packages' own services from starting (we run our own daemons)
  made_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; made_policy=1
  fi
  inst() { apt-get install -y -qq --no-install-recommends "${missing[@]}" >"${TMPDIR:-/tmp}/rloo-slurm-apt.log" 2>&1; }
  if ! inst; then
    log "apt-get install failed; apt-get update and retry"
    apt-get update -qq >/dev/null 2>&1 || true
    inst || { [ $made_policy = 1 ] && rm -f /usr/sbin/policy-rc.d; tail -20 "${TMPDIR:-/tmp}/rloo-slurm-apt.log"; exit 1; }
  fi
  [ $made_policy = 1 ] && rm -f /usr/sbin/policy-rc.d
  log "packages installed"
fi

# On a systemd machine the distro units may be running: they would hold our ports.
if [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
  for u in slurmd slurmctld slurmdbd; do
    if systemctl is-active --quiet "$u" 2>/dev/null; then log "stopping systemd unit $u"; systemctl stop "$u" || true; fi
  done
fi

# ---------------------------------------------------------------- 2. configuration
MUNGE_SOCK=$DIR/munge/munge.socket.2
DB_SOCK=$DIR/mysql/mysqld.sock
DB_PASS=rloo-slurm-test
# slurmd -C prints exactly what slurmd will report; configured values above it drain the node.
NODE_HW=$(slurmd -C 2>/dev/null | head -n1 | sed 's/^NodeName=[^ ]* //')
[ -n "$NODE_HW" ] || die "slurmd -C printed nothing"
NCPUS=$(sed -n 's/.*CPUs=\([0-9]*\).*/\1/p' <<<"$NODE_HW")
MEM=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$NODE_HW")

NEW=$(mktemp -d); trap 'rm -rf "$NEW"' EXIT
cat >"$NEW/slurm.conf" <<EOF
# Written by tests/slurm/start.sh: a one-node test cluster on 127.0.0.1. Do not edit.
ClusterName=$CLUSTER
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCK
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
ReturnToService=2
StateSaveLocation=$DIR/slurmctld
SlurmdSpoolDir=$DIR/slurmd
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# without a default, a job that asks for no memory gets the whole node
DefMemPerCPU=1024
GresTypes=gpu
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=6819
# clients talk to slurmdbd through this munge socket (AuthInfo alone is not enough for sacctmgr)
AccountingStoragePass=$MUNGE_SOCK
AccountingStorageTRES=gres/gpu
AccountingStoreFlags=job_comment
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=10
JobCompType=jobcomp/none
MailProg=/bin/true
# finished jobs leave squeue after a minute (sacct keeps them)
MinJobAge=60
# seconds between SIGTERM and SIGKILL at the time limit / scancel
KillWait=$KILLWAIT
OverTimeLimit=0
InactiveLimit=0
Waittime=0
MessageTimeout=10
SlurmctldTimeout=30
SlurmdTimeout=60
UnkillableStepTimeout=30
NodeName=$HOST NodeAddr=127.0.0.1 $NODE_HW Gres=gpu:1 State=UNKNOWN
PartitionName=$PARTITION Nodes=$HOST Default=YES MaxTime=7-00:00:00 DefaultTime=60 State=UP
EOF
cat >"$NEW/gres.conf" <<EOF
# Written by tests/slurm/start.sh: one fake GPU (File= is required, else the node goes INVAL)
NodeName=$HOST Name=gpu File=/dev/null
EOF
cat >"$NEW/slurmdbd.conf" <<EOF
# Written by tests/slurm/start.sh. Do not edit.
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCK
DbdHost=$HOST
DbdAddr=127.0.0.1
DbdPort=6819
SlurmUser=root
DebugLevel=info
LogFile=$DIR/log/slurmdbd.log
PidFile=$DIR/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
EOF

USERS="root ${SUDO_USER:-} ${SLURM_TEST_USERS:-}"
USERS=$(tr ', ' '\n\n' <<<"$USERS" | awk 'NF && !seen[$0]++' | while read -r u; do id -u "$u" >/dev/null 2>&1 && echo "$u"; done | tr '\n' ' ')
cat >"$NEW/env" <<EOF
SLURM_TEST_DIR=$DIR
SLURM_TEST_CLUSTER=$CLUSTER
SLURM_TEST_ACCOUNT=$ACCOUNT
SLURM_TEST_PARTITION=$PARTITION
SLURM_TEST_HOST=$HOST
SLURM_TEST_CPUS=$NCPUS
SLURM_TEST_MEM_MB=$MEM
SLURM_TEST_GPUS=1
SLURM_TEST_KILLWAIT=$KILLWAIT
SLURM_TEST_USERS="${USERS% }"
SLURM_CONF=$CONF/slurm.conf
EOF

pid_alive() { # pid_alive PIDFILE COMM
  local pid; [ -s "$1" ] || return 1; pid=$(tr -dc 0-9 <"$1"); [ -n "$pid" ] || return 1
  [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ] && [ "$(sed 's/.*) //' "/proc/$pid/stat" | cut -d' ' -f1)" != Z ]
}
all_alive() {
  pid_alive "$DIR/munge/munged.pid" munged && pid_alive "$DIR/mysql/mariadbd.pid" mariadbd &&
    pid_alive "$DIR/run/slurmdbd.pid" slurmdbd && pid_alive "$DIR/run/slurmctld.pid" slurmctld &&
    pid_alive "$DIR/run/slurmd.pid" slurmd
}
same_conf() { for f in slurm.conf gres.conf slurmdbd.conf; do cmp -s "$NEW/$f" "$CONF/$f" || return 1; done; cmp -s "$NEW/env" "$DIR/env"; }
node_usable() { sinfo -h -n "$HOST" -o %T 2>/dev/null | grep -Eq '^(idle|mixed|allocated|completing)$'; }

if [ "${SLURM_TEST_FORCE:-0}" != 1 ] && all_alive && same_conf && node_usable && sacct -n -X -S now >/dev/null 2>&1; then
  log "already running and healthy (sinfo: $(sinfo -h -o '%P %a %D %T' | tr '\n' ' ')); nothing to do"
  exit 0
fi

log "stopping leftovers (if any)"
bash "$HERE/stop.sh" --quiet || true

install -d -m 0755 "$CONF" "$DIR" "$DIR/run" "$DIR/log" "$DIR/slurmctld" "$DIR/slurmd"
install -m 0644 "$NEW/slurm.conf" "$CONF/slurm.conf"
install -m 0644 "$NEW/gres.conf" "$CONF/gres.conf"
install -m 0600 -o root -g root "$NEW/slurmdbd.conf" "$CONF/slurmdbd.conf"
install -m 0644 "$NEW/env" "$DIR/env"
log "configuration written to $CONF (node: $NODE_HW Gres=gpu:1)"

# ---------------------------------------------------------------- 3. munged (private socket)
install -d -m 0755 -o munge -g munge "$DIR/munge"
if [ ! -s /etc/munge/munge.key ]; then
  install -d -m 0700 -o munge -g munge /etc/munge
  runuser -u munge -- mungekey --create --keyfile=/etc/munge/munge.key
fi
# the log file may be left from an earlier run; munged insists on owning it
touch "$DIR/log/munged.log"; chown munge:munge "$DIR/log/munged.log"; chmod 0640 "$DIR/log/munged.log"
runuser -u munge -- /usr/sbin/munged --socket="$MUNGE_SOCK" --pid-file="$DIR/munge/munged.pid" \
  --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munged.seed" --key-file=/etc/munge/munge.key \
  || die "munged did not start"
wait_for 10 munged bash -c "munge -n -S '$MUNGE_SOCK' | unmunge -S '$MUNGE_SOCK'"
log "munged up (socket $MUNGE_SOCK)"

# ---------------------------------------------------------------- 4. mariadbd (private instance)
if [ ! -d "$DIR/mysql/mysql" ]; then
  install -d -m 0750 -o mysql -g mysql "$DIR/mysql"
  mariadb-install-db --no-defaults --user=mysql --datadir="$DIR/mysql" --auth-root-authentication-method=socket \
    --skip-test-db >"$DIR/log/mariadb-install-db.log" 2>&1 || die "mariadb-install-db failed (see $DIR/log/mariadb-install-db.log)"
  log "mariadb datadir initialised"
fi
touch "$DIR/log/mariadbd.log"; chown mysql:mysql "$DIR/log/mariadbd.log"
setsid /usr/sbin/mariadbd --no-defaults --user=mysql --datadir="$DIR/mysql" --socket="$DB_SOCK" \
  --pid-file="$DIR/mysql/mariadbd.pid" --port="$DB_PORT" --bind-address=127.0.0.1 --skip-name-resolve \
  --log-error="$DIR/log/mariadbd.log" --innodb-buffer-pool-size=64M --innodb-log-file-size=48M \
  --performance-schema=OFF --skip-log-bin </dev/null >/dev/null 2>&1 &
wait_for 60 mariadbd mariadb-admin --no-defaults --socket="$DB_SOCK" -u root ping
mariadb --no-defaults --socket="$DB_SOCK" -u root <<EOF || die "could not create the slurm database/user"
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DB_PASS';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
FLUSH PRIVILEGES;
EOF
log "mariadbd up (127.0.0.1:$DB_PORT, socket $DB_SOCK)"

# ---------------------------------------------------------------- 5. slurmdbd + associations
/usr/sbin/slurmdbd || die "slurmdbd did not start"
wait_for 60 slurmdbd sacctmgr -n list cluster
log "slurmdbd up"
sacctmgr -n -P list cluster format=cluster | grep -qx "$CLUSTER" || sacctmgr -i add cluster "$CLUSTER" >/dev/null
sacctmgr -n -P list account format=account | grep -qx "$ACCOUNT" ||
  sacctmgr -i add account "$ACCOUNT" cluster="$CLUSTER" description="rloo tests" organization=rloo >/dev/null
for u in $USERS; do
  sacctmgr -n -P list assoc cluster="$CLUSTER" account="$ACCOUNT" user="$u" format=user | grep -qx "$u" ||
    sacctmgr -i add user "$u" account="$ACCOUNT" defaultaccount="$ACCOUNT" cluster="$CLUSTER" >/dev/null
done
log "sacctmgr: cluster=$CLUSTER account=$ACCOUNT users=$USERS"

# ---------------------------------------------------------------- 6. slurmctld + slurmd
/usr/sbin/slurmctld || die "slurmctld did not start"
wait_for 30 slurmctld scontrol ping
/usr/sbin/slurmd || die "slurmd did not start"
wait_for 60 "node $HOST to be idle" node_usable
wait_for 30 sacct sacct -n -X -S now
log "slurm up: $(sinfo -h -o 'partition=%P avail=%a nodes=%D state=%T gres=%G cpus=%c mem=%m' | tr '\n' ' ')"
log "env file: $DIR/env"
