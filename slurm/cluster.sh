#!/usr/bin/env bash
# slurm/cluster.sh — a real multi-node Slurm cluster on one Linux machine, for rl-launch development and CI.
#
# Nothing is mocked: slurmctld, slurmdbd (accounting in MariaDB) and one slurmd per node, each node living
# in its own set of Linux namespaces so that it looks like a separate machine to Slurm, Ray and vLLM:
#
#   hub namespace  "<prefix>-login"   hostname `login`, 10.77.0.1: slurmctld + slurmdbd, and every client
#                                     (sinfo, sbatch, srun, submitit, pytest) — the cluster's login node.
#                                     It owns a bridge; each node is attached to it by a veth pair.
#   node namespace "<prefix>-nodeK"   hostname `nodeK`, 10.77.0.(10+K): slurmd and everything a job starts
#                                     there. Own network, UTS (hostname), mount (node-local /tmp/ray and
#                                     /dev/shm) and PID namespace (`ps`, `ray stop` see only that node).
#
# Everything else is shared like NFS on a real cluster: the filesystem (venvs, job folders, /tmp), the
# munge socket, MariaDB's unix socket. The private /24 exists only inside these namespaces; nothing is added
# to the root namespace's network and the nodes have no route out. Requires root; Debian 12 (Slurm 22.05).
#
# Usage:
#   slurm/cluster.sh install        apt-get the packages (skipped when present)
#   slurm/cluster.sh start          start the cluster and wait until every node is idle (no-op when up)
#   slurm/cluster.sh exec CMD...    run CMD on the login node, e.g. `slurm/cluster.sh exec sinfo`
#   slurm/cluster.sh status         nodes, jobs, daemons; exit 1 when the cluster is not running
#   slurm/cluster.sh env            shell `export` lines describing the running cluster
#   slurm/cluster.sh stop           cancel jobs, end every process of the cluster (by PID), remove namespaces
#
# Knobs (environment; read by `start`, the running cluster's values are kept in $RL_SLURM_STATE/run):
#   RL_SLURM_NODES=3          compute nodes (1..200)
#   RL_SLURM_CPUS=4           CPUs advertised per node (may exceed the real cores; SlurmdParameters=config_overrides)
#   RL_SLURM_MEM=4000         RealMemory per node, MB (not a consumable resource)
#   RL_SLURM_GPUS=2           fake GPUs per node: gres/gpu backed by character devices, so --gpus-per-node sets
#                             CUDA_VISIBLE_DEVICES per step; there is no GPU behind them. 0 = no gres.
#   RL_SLURM_PROCTRACK=linuxproc|cgroup   cgroup: a step's leftover background processes are killed when the
#                             step ends, as on most production clusters (needs a cgroup v1 host).
#   RL_SLURM_ACCOUNTING=1     slurmdbd + MariaDB (over its unix socket). submitit reads job states with sacct.
#   RL_SLURM_STATE=/var/lib/rl-slurm   configs, controller state, spool, logs, node-local dirs
#   RL_SLURM_PREFIX=rls       namespace names: <prefix>-login, <prefix>-node1..N
#   RL_SLURM_NET=10.77.0      the private /24 used inside the namespaces
#   RL_SLURM_FRESH=0          1: wipe controller state and accounting DB (job ids restart at 1). By default ids
#                             continue across restarts, so folders keyed on the job id never see an old run.
set -euo pipefail

STATE=${RL_SLURM_STATE:-/var/lib/rl-slurm}
RUN=$STATE/run
ETC=$STATE/etc
LOGS=$STATE/log

# The knobs of a running cluster win over the environment for every command but `start`.
if [[ ${1:-} != start && -f $RUN/cluster.env ]]; then
  # shellcheck source=/dev/null
  source "$RUN/cluster.env"
fi
NODES=${RL_SLURM_NODES:-3}
CPUS=${RL_SLURM_CPUS:-4}
MEM=${RL_SLURM_MEM:-4000}
GPUS=${RL_SLURM_GPUS:-2}
PROCTRACK=${RL_SLURM_PROCTRACK:-linuxproc}
ACCOUNTING=${RL_SLURM_ACCOUNTING:-1}
NET=${RL_SLURM_NET:-10.77.0}
PREFIX=${RL_SLURM_PREFIX:-rls}
FRESH=${RL_SLURM_FRESH:-0}
HUB_NS=$PREFIX-login
HUB_HOST=login
DB_NAME=${PREFIX//-/_}_slurm_acct
CLUSTER_NAME=rllocal

log() { printf '[cluster.sh %s] %s\n' "$(date +%T)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

node_name() { echo "node$1"; }
node_ns() { echo "$PREFIX-node$1"; }
node_ip() { echo "$NET.$((10 + $1))"; }
# Node namespaces that exist now (whatever RL_SLURM_NODES says): stop must find every one of them.
existing_node_ns() { ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$PREFIX-node[0-9]+$" || true; }
ns_exists() { [[ -e /run/netns/$1 ]]; }
pid_of() { if [[ -s $1 ]]; then cat "$1"; fi; }
# /proc/PID/stat after the command name (which may contain spaces): "STATE PPID ..."
proc_stat() { local s; s=$(cat "/proc/$1/stat" 2>/dev/null) || return 1; echo "${s##*) }"; }
# A zombie is not alive: a killed daemon whose parent is gone can wait a while for PID 1 to reap it.
alive() { local st; [[ -n $1 ]] && st=$(proc_stat "$1") && [[ ${st%% *} != Z ]]; }

check_knobs() {
  local k
  for k in NODES CPUS MEM GPUS; do [[ ${!k} =~ ^[0-9]+$ ]] || die "RL_SLURM_$k must be a number, got '${!k}'"; done
  ((NODES >= 1 && NODES <= 200)) || die "RL_SLURM_NODES must be within 1..200, got $NODES"
  ((CPUS >= 1)) || die "RL_SLURM_CPUS must be >= 1"
  [[ $PROCTRACK == linuxproc || $PROCTRACK == cgroup ]] || die "RL_SLURM_PROCTRACK must be linuxproc or cgroup, got '$PROCTRACK'"
  [[ $ACCOUNTING == 0 || $ACCOUNTING == 1 ]] || die "RL_SLURM_ACCOUNTING must be 0 or 1"
  [[ $NET =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "RL_SLURM_NET must be the first three octets of a /24, e.g. 10.77.0"
  [[ $PREFIX =~ ^[a-z][a-z0-9-]{0,5}$ ]] || die "RL_SLURM_PREFIX must be 1-6 of [a-z0-9-] (interface names are short)"
  if [[ $PROCTRACK == cgroup && ! -d /sys/fs/cgroup/freezer ]]; then
    die "RL_SLURM_PROCTRACK=cgroup needs a cgroup v1 host (no /sys/fs/cgroup/freezer here); use linuxproc"
  fi
}

# ------------------------------------------------------------------------------------------------- install

PACKAGES=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server iproute2 util-linux mount procps hostname)

cmd_install() {
  [[ $EUID -eq 0 ]] || die "install must run as root"
  if dpkg -s "${PACKAGES[@]}" >/dev/null 2>&1; then log "packages already installed"; return 0; fi
  # The packages' maintainer scripts would start the daemons (half-configured, outside our control): a
  # policy-rc.d that answers 101 forbids it. Docker images ship one; otherwise use ours for the install only.
  local own_policy=0
  if [[ ! -e /usr/sbin/policy-rc.d ]]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && own_policy=1
  fi
  local rc=0
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${PACKAGES[@]}"; } || rc=$?
  ((own_policy)) && rm -f /usr/sbin/policy-rc.d
  ((rc == 0)) || die "apt-get failed (exit $rc)"
  log "installed: ${PACKAGES[*]}"
}

# ------------------------------------------------------------------------------------------------- configs

write_configs() {
  mkdir -p "$ETC" "$RUN" "$LOGS" "$STATE/ctld" "$STATE/spool" "$STATE/nodes"
  local k gres=""
  ((GPUS > 0)) && gres="Gres=gpu:$GPUS"
  {
    cat <<EOF
# Written by slurm/cluster.sh: $NODES nodes in network namespaces, daemons run by the script (no systemd).
ClusterName=$CLUSTER_NAME
# The controller's hostname (its UTS namespace) must equal this name, or slurmctld/slurmdbd refuse to start.
SlurmctldHost=$HUB_HOST($NET.1)
SlurmctldPort=6817
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
MailProg=/bin/true
ProctrackType=proctrack/$PROCTRACK
TaskPlugin=task/none
# Trust the node lines below over the detected hardware, so a 2-core machine can offer 4 CPUs per node.
SlurmdParameters=config_overrides
SelectType=select/cons_tres
# Cores are consumable, memory is not (else a job without --mem would take a whole node).
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# Heterogeneous jobs are only started by the backfill scheduler: run it every second, not every 30 s.
SchedulerParameters=bf_interval=1
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=300
Waittime=0
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd-%n.log
GresTypes=gpu
EOF
    if ((ACCOUNTING)); then
      cat <<EOF
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=$HUB_HOST
AccountingStoragePort=6819
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30
EOF
    else
      printf 'AccountingStorageType=accounting_storage/none\nJobAcctGatherType=jobacct_gather/none\n'
    fi
    for ((k = 1; k <= NODES; k++)); do
      echo "NodeName=$(node_name "$k") NodeHostname=$(node_name "$k") NodeAddr=$(node_ip "$k") CPUs=$CPUS RealMemory=$MEM $gres State=UNKNOWN"
    done
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
  } >"$ETC/slurm.conf"

  # Fake GPUs. A count-only gres leaves CUDA_VISIBLE_DEVICES unset, and File= must name character or block
  # devices, so make char devices with major 240 (reserved for local/experimental use). Nothing opens them.
  : >"$ETC/gres.conf"
  if ((GPUS > 0)); then
    mkdir -p "$STATE/dev"
    for ((k = 0; k < GPUS; k++)); do
      [[ -c $STATE/dev/gpu$k ]] || mknod "$STATE/dev/gpu$k" c 240 "$k" || die "mknod $STATE/dev/gpu$k failed (no CAP_MKNOD?); set RL_SLURM_GPUS=0"
    done
    echo "Name=gpu File=$STATE/dev/gpu[0-$((GPUS - 1))]" >"$ETC/gres.conf"
  fi

  if [[ $PROCTRACK == cgroup ]]; then
    printf '%s\n' CgroupPlugin=autodetect CgroupMountpoint=/sys/fs/cgroup ConstrainCores=no \
      ConstrainRAMSpace=no ConstrainDevices=no >"$ETC/cgroup.conf"
  else
    : >"$ETC/cgroup.conf"
  fi

  if ((ACCOUNTING)); then
    cat >"$ETC/slurmdbd.conf" <<EOF
AuthType=auth/munge
DbdHost=$HUB_HOST
DbdAddr=$NET.1
DbdPort=6819
SlurmUser=root
StorageType=accounting_storage/mysql
# "localhost" makes the MySQL client use MariaDB's unix socket; root authenticates by unix_socket.
StorageHost=localhost
StorageUser=root
StorageLoc=$DB_NAME
PidFile=$RUN/slurmdbd.pid
LogFile=$LOGS/slurmdbd.log
EOF
    chmod 600 "$ETC/slurmdbd.conf"
  fi

  # One /etc/hosts for every namespace: Ray and the engines find each node's address by its hostname.
  {
    echo "127.0.0.1 localhost"
    echo "$NET.1 $HUB_HOST"
    for ((k = 1; k <= NODES; k++)); do echo "$(node_ip "$k") $(node_name "$k")"; done
  } >"$ETC/hosts"

  # Inside the namespaces $ETC is bind-mounted on /etc/slurm, so every client and job (even one started
  # with --export=NONE, which drops SLURM_CONF) reads this cluster's config; the host's /etc/slurm is untouched.
  mkdir -p /etc/slurm
}

# ----------------------------------------------------------------------------- host services (shared)

start_munge() {
  if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then log "munged: already running, using it"; return 0; fi
  if [[ ! -s /etc/munge/munge.key ]]; then
    mungekey --create --keyfile=/etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
  fi
  install -d -o munge -g munge -m 0755 /run/munge
  runuser -u munge -- /usr/sbin/munged || die "munged failed to start"
  local i
  for ((i = 0; i < 50; i++)); do
    if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
      cp /run/munge/munged.pid "$RUN/munged.ours"   # stop ends munged only when this file says we started it
      return 0
    fi
    sleep 0.1
  done
  die "munged did not answer within 5 s"
}

mariadb_up() { mariadb -uroot -e 'select 1' >/dev/null 2>&1; }

start_mariadb() {
  if mariadb_up; then log "MariaDB: already running, using it"; return 0; fi
  [[ -d /var/lib/mysql/mysql ]] || mariadb-install-db --user=mysql --datadir=/var/lib/mysql >"$LOGS/mariadb-install.log" 2>&1 ||
    die "mariadb-install-db failed (see $LOGS/mariadb-install.log)"
  install -d -o mysql -g root /run/mysqld
  # No TCP listener at all: slurmdbd reaches it through /run/mysqld/mysqld.sock.
  setsid /usr/sbin/mariadbd --user=mysql --skip-networking --innodb-buffer-pool-size=64M \
    --log-error="$LOGS/mariadb.log" </dev/null >/dev/null 2>&1 &
  local i
  for ((i = 0; i < 150; i++)); do
    if mariadb_up; then cp /run/mysqld/mysqld.pid "$RUN/mariadb.ours"; return 0; fi
    sleep 0.1
  done
  die "MariaDB did not come up within 15 s (see $LOGS/mariadb.log)"
}

# ------------------------------------------------------------------------------------------- namespaces

make_network() {
  local k ns
  ip netns add "$HUB_NS"
  ip -n "$HUB_NS" link set lo up
  ip -n "$HUB_NS" link add br0 type bridge
  ip -n "$HUB_NS" addr add "$NET.1/24" dev br0
  ip -n "$HUB_NS" link set br0 up
  for ((k = 1; k <= NODES; k++)); do
    ns=$(node_ns "$k")
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    # The veth pair is created straight between two of our namespaces: the root namespace never sees it.
    ip -n "$HUB_NS" link add "veth$k" type veth peer name eth0 netns "$ns"
    ip -n "$HUB_NS" link set "veth$k" master br0 up
    ip -n "$ns" addr add "$(node_ip "$k")/24" dev eth0
    ip -n "$ns" link set eth0 up
  done
}

# Shell run first in every namespace we enter: own hostname, this cluster's /etc/hosts and /etc/slurm.
# Arguments: HOSTNAME then the command. (nsenter, not `ip netns exec`: the latter remounts /sys, and
# slurmd 22.05 then cannot initialise.)
# shellcheck disable=SC2016  # expanded by the sh inside the namespace, not here
ENTER='set -e; hostname "$1"; mount --bind "$RLS_ETC/hosts" /etc/hosts; mount --bind "$RLS_ETC" /etc/slurm
  unset RLS_ETC; shift'

# The command prefix that runs something on the login node. Clients get the cluster's description in
# their environment (the tests use RL_SLURM_NODE_NETNS to look for leftover processes).
hub_prefix() {
  ns_exists "$HUB_NS" || die "the cluster is not running (no namespace $HUB_NS): run 'slurm/cluster.sh start'"
  HUB_PREFIX=(env RLS_ETC="$ETC" SLURM_CONF=/etc/slurm/slurm.conf RL_SLURM_STATE="$STATE"
    RL_SLURM_HUB_NETNS="$HUB_NS" RL_SLURM_NODE_NETNS="$(existing_node_ns | xargs)"
    nsenter --net="/run/netns/$HUB_NS" unshare --uts --mount --propagation private
    sh -c "$ENTER; exec \"\$@\"" sh "$HUB_HOST")
}

# Run CMD on the login node, in the foreground; its exit status is CMD's.
in_hub() { hub_prefix; "${HUB_PREFIX[@]}" "$@"; }

# Start a daemon (in its foreground mode) on the login node, detached from this shell.
start_hub_daemon() {
  local name=$1; shift
  hub_prefix
  setsid "${HUB_PREFIX[@]}" "$@" </dev/null >>"$LOGS/$name.console" 2>&1 &
}

# Start slurmd for node K. It also gets a private PID namespace whose init is a small sh that reaps orphans
# and exits when slurmd does (which ends every process left on that node), plus node-local /tmp/ray and
# /dev/shm so that Ray instances of different nodes do not share sockets or the object store.
start_node() {
  local k=$1 name ns dir
  name=$(node_name "$k") ns=$(node_ns "$k") dir=$STATE/nodes/$(node_name "$k")
  mkdir -p "$dir/tmp-ray"
  # the mount point must exist on the shared /tmp; stop removes it again if we made it and it is empty
  if [[ ! -d /tmp/ray ]]; then mkdir /tmp/ray && touch "$RUN/tmp-ray.ours"; fi
  # shellcheck disable=SC2016  # expanded by the node's sh
  RLS_ETC=$ETC RLS_NODE_DIR=$dir setsid nsenter --net="/run/netns/$ns" \
    unshare --uts --mount --pid --fork --mount-proc --propagation private \
    sh -c "$ENTER"'; mount --bind "$RLS_NODE_DIR/tmp-ray" /tmp/ray
           mount -t tmpfs -o size=2g,mode=1777 shm /dev/shm
           unset RLS_NODE_DIR
           "$@" & wait' \
    sh "$name" /usr/sbin/slurmd -D -N "$name" </dev/null >>"$LOGS/node-$name.console" 2>&1 &
}

wait_for() {  # wait_for SECONDS WHAT CMD...: poll CMD every 0.2 s
  local limit=$1 what=$2 deadline=$((SECONDS + $1)); shift 2
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || die "timed out after ${limit} s waiting for $what (logs: $LOGS)"
    sleep 0.2
  done
}

all_nodes_idle() {
  local n
  n=$(in_hub timeout 5 sinfo -h -N -o '%N %T' 2>/dev/null | awk '$2 == "idle" {print $1}' | sort -u | wc -l)
  ((n == NODES))
}

# ------------------------------------------------------------------------------------------- commands

# The PID recorded in FILE, if that process is alive and still is COMM (a stale pid file must never make
# us signal an unrelated process that got the same PID).
daemon_pid() {
  local p; p=$(pid_of "$1")
  if alive "$p" && [[ $(cat "/proc/$p/comm" 2>/dev/null) == "$2" ]]; then echo "$p"; fi
}
controller_pid() { daemon_pid "$RUN/slurmctld.pid" slurmctld; }

cmd_start() {
  [[ $EUID -eq 0 ]] || die "start must run as root"
  check_knobs
  [[ -x /usr/sbin/slurmctld && -x /usr/sbin/slurmd ]] || die "Slurm is not installed: run 'slurm/cluster.sh install'"
  if [[ -n $(controller_pid) ]] && ns_exists "$HUB_NS"; then
    local want=$NODES
    # shellcheck source=/dev/null
    source "$RUN/cluster.env"
    [[ $want == "$RL_SLURM_NODES" ]] || die "already running with $RL_SLURM_NODES nodes (asked for $want): run 'slurm/cluster.sh stop' first"
    NODES=$RL_SLURM_NODES
    wait_for 30 "all $NODES nodes idle" all_nodes_idle
    log "already running ($NODES nodes)"; return 0
  fi
  if ns_exists "$HUB_NS" || [[ -n $(existing_node_ns) ]]; then
    log "leftovers of an earlier cluster found: cleaning them up first"
    cmd_stop
  fi
  local t0=$SECONDS k
  write_configs
  # Controller state and the accounting DB go together: both are wiped on request or when the node set
  # changed, never one without the other (sacct would report an older run's job with the same id).
  local layout="nodes=$NODES accounting=$ACCOUNTING net=$NET"
  [[ -f $STATE/ctld/layout && $(cat "$STATE/ctld/layout") == "$layout" ]] || FRESH=1
  if [[ $FRESH == 1 ]]; then
    rm -rf "$STATE/ctld" "$STATE/spool"; mkdir -p "$STATE/ctld" "$STATE/spool"
  fi
  echo "$layout" >"$STATE/ctld/layout"
  printf 'RL_SLURM_%s\n' "NODES=$NODES" "CPUS=$CPUS" "MEM=$MEM" "GPUS=$GPUS" "PROCTRACK=$PROCTRACK" \
    "ACCOUNTING=$ACCOUNTING" "NET=$NET" "PREFIX=$PREFIX" >"$RUN/cluster.env"

  start_munge
  if ((ACCOUNTING)); then
    start_mariadb
    [[ $FRESH == 1 ]] && mariadb -uroot -e "DROP DATABASE IF EXISTS \`$DB_NAME\`"
  fi
  make_network
  if ((ACCOUNTING)); then
    start_hub_daemon slurmdbd /usr/sbin/slurmdbd -D
    # A slurmctld on a fresh state dir exits ("no TRES from the database") unless slurmdbd already answers.
    wait_for 20 "slurmdbd" in_hub sacctmgr -n list cluster
    in_hub sacctmgr -i add cluster "$CLUSTER_NAME" >/dev/null 2>&1 || true
  fi
  start_hub_daemon slurmctld /usr/sbin/slurmctld -D
  for ((k = 1; k <= NODES; k++)); do start_node "$k"; done
  wait_for 60 "all $NODES nodes idle" all_nodes_idle
  log "cluster up in $((SECONDS - t0)) s: $NODES nodes x ${CPUS} CPUs, ${GPUS} fake GPUs, proctrack/$PROCTRACK"
  in_hub sinfo -N
}

# TERM the given PIDs, wait up to 10 s, then KILL the survivors. (slurmd ignores TERM while it is still
# retrying to register, e.g. when munged is gone.)
end_pids() {
  (($# > 0)) || return 0
  local p i left=()
  kill "$@" 2>/dev/null || true
  for ((i = 0; i < 100; i++)); do
    left=()
    for p in "$@"; do alive "$p" && left+=("$p"); done
    ((${#left[@]} == 0)) && return 0
    sleep 0.1
  done
  log "still alive after 10 s, sending SIGKILL: $(ps -o pid=,comm= -p "$(IFS=,; echo "${left[*]}")" | xargs)"
  kill -9 "${left[@]}" 2>/dev/null || true
  for ((i = 0; i < 50; i++)); do
    left=()
    for p in "$@"; do alive "$p" && left+=("$p"); done
    ((${#left[@]} == 0)) && return 0
    sleep 0.1
  done
}

cmd_stop() {
  [[ $EUID -eq 0 ]] || die "stop must run as root"
  local ns p pids=() t0=$SECONDS
  # 1. Cancel every job and let the steps end through Slurm (epilogs, accounting records).
  if [[ -n $(controller_pid) ]] && ns_exists "$HUB_NS"; then
    in_hub timeout 5 scancel --full --user=root >/dev/null 2>&1 || true
    local i
    for ((i = 0; i < 50; i++)); do
      [[ -z $(in_hub timeout 3 squeue -h -t R,CG,S 2>/dev/null) ]] && break
      sleep 0.2
    done
  fi
  # 2. Every process of every node namespace (slurmd, slurmstepd, job tasks and whatever they left
  #    behind: nothing else ever enters these namespaces), and on the login node slurmctld, slurmdbd and
  #    any client still running there, except our own ancestors (stop may be called from the hub).
  #    All at once: slurmd and slurmctld each need 1-3 s to shut down.
  for ns in $(existing_node_ns); do
    while read -r p; do [[ -n $p ]] && pids+=("$p"); done < <(ip netns pids "$ns" 2>/dev/null)
  done
  local ancestors=" " a=$$
  while ((a > 1)); do ancestors+="$a "; a=$(proc_stat "$a" | cut -d' ' -f2) || a=1; done
  for p in $(controller_pid) $(daemon_pid "$RUN/slurmdbd.pid" slurmdbd); do pids+=("$p"); done
  if ns_exists "$HUB_NS"; then
    for p in $(ip netns pids "$HUB_NS" 2>/dev/null); do
      [[ $ancestors == *" $p "* || " ${pids[*]} " == *" $p "* ]] || pids+=("$p")
    done
  fi
  end_pids "${pids[@]}"
  # proctrack/cgroup leaves one empty hierarchy per node (slurm_nodeK) in every v1 controller: remove them.
  local d
  for d in /sys/fs/cgroup/*/slurm_node[0-9]*; do
    if [[ -d $d ]]; then find "$d" -depth -type d -exec rmdir {} + 2>/dev/null || true; fi
  done
  # 3. The namespaces (the veth pairs and the bridge go with them).
  for ns in $(existing_node_ns) $(ns_exists "$HUB_NS" && echo "$HUB_NS"); do
    ip netns del "$ns" || log "could not delete namespace $ns"
  done
  # 4. MariaDB and munged (after slurmdbd and slurmd, which need them), only when this script started them.
  pids=()
  for p in $(daemon_pid "$RUN/mariadb.ours" mariadbd) $(daemon_pid "$RUN/munged.ours" munged); do pids+=("$p"); done
  rm -f "$RUN/mariadb.ours" "$RUN/munged.ours"
  end_pids "${pids[@]}"
  if [[ -f $RUN/tmp-ray.ours ]]; then rmdir /tmp/ray 2>/dev/null || true; rm -f "$RUN/tmp-ray.ours"; fi
  rm -f "$RUN"/*.pid "$RUN/cluster.env"
  # 5. Check: nothing of ours may remain.
  local left
  left=$(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$PREFIX-(login|node[0-9]+)$" || true)
  [[ -z $left ]] || die "namespaces left after stop: $left"
  log "stopped in $((SECONDS - t0)) s"
}

cmd_status() {
  if ! ns_exists "$HUB_NS" || [[ -z $(controller_pid) ]]; then
    log "not running: namespace $HUB_NS $(ns_exists "$HUB_NS" && echo present || echo absent), slurmctld $([[ -n $(controller_pid) ]] && echo running || echo "not running")"
    [[ -n $(existing_node_ns) ]] && log "leftover node namespaces: $(existing_node_ns | xargs) — run 'slurm/cluster.sh stop'"
    return 1
  fi
  echo "== nodes"; in_hub timeout 5 sinfo -N -o '%N %T %c %m %G' || true
  echo "== jobs"; in_hub timeout 5 squeue || true
  echo "== processes per node namespace"
  local ns
  for ns in $(existing_node_ns); do printf '%s: %s processes\n' "$ns" "$(ip netns pids "$ns" | wc -l)"; done
  echo "== daemons"
  printf 'slurmctld %s, slurmdbd %s, MariaDB %s, munged %s\n' "$(controller_pid)" "$(pid_of "$RUN/slurmdbd.pid")" \
    "$([[ -f $RUN/mariadb.ours ]] && echo "ours" || echo "shared")" "$([[ -f $RUN/munged.ours ]] && echo "ours" || echo "shared")"
}

cmd_env() {
  ns_exists "$HUB_NS" || die "the cluster is not running (no namespace $HUB_NS)"
  cat <<EOF
export RL_SLURM_STATE=$STATE
export RL_SLURM_HUB_NETNS=$HUB_NS
export RL_SLURM_NODE_NETNS="$(existing_node_ns | xargs)"
export SLURM_CONF=$ETC/slurm.conf
# Clients must run inside $HUB_NS: slurm/cluster.sh exec CMD...
EOF
}

case ${1:-} in
  install) cmd_install ;;
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  env) cmd_env ;;
  exec)
    shift
    (($# > 0)) || die "usage: slurm/cluster.sh exec CMD [ARGS...]"
    hub_prefix
    exec "${HUB_PREFIX[@]}" "$@" ;;
  *)
    echo "usage: slurm/cluster.sh install|start|stop|status|env|exec CMD..." >&2
    exit 2 ;;
esac
