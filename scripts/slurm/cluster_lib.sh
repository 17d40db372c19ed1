# shellcheck shell=bash
# Helpers shared by local_cluster.sh (one node) and netns_cluster.sh (N nodes in network
# namespaces). Sourced, never run. Expects DRY_RUN (0/1) to be set by the caller.

# Run a command, or print it in dry-run mode.
run() {
    if [[ $DRY_RUN == 1 ]]; then
        printf '+'
        printf ' %q' "$@"
        printf '\n'
    else
        "$@"
    fi
}

# True when pid $1 is a live process. A zombie counts as stopped: PID 1 may reap orphans only
# every second or two, and `kill -0` still succeeds on them meanwhile.
pid_alive() {
    local state
    [[ $1 =~ ^[0-9]+$ ]] && kill -0 "$1" 2>/dev/null || return 1
    state=$(sed -n 's/^[0-9]* (.*) \([A-Z]\) .*/\1/p' "/proc/$1/stat" 2>/dev/null || true)
    [[ -n $state && $state != Z && $state != X ]]
}

# True when the pid recorded in file $1 is a live process.
alive() {
    [[ -s $1 ]] && pid_alive "$(<"$1")"
}

# TERM the given pids, then KILL whatever is left after a bounded wait (10 s).
stop_pid_list() {
    local pid i
    for pid in "$@"; do
        run kill -TERM "$pid" 2>/dev/null || true
    done
    [[ $DRY_RUN == 1 ]] && return 0
    for pid in "$@"; do
        for ((i = 0; i < 100; i++)); do
            pid_alive "$pid" || break
            sleep 0.1
        done
        if pid_alive "$pid"; then
            kill -KILL "$pid" 2>/dev/null || true
        fi
    done
}

# Stop the daemons recorded in the given pid files and remove the files.
stop_pids() {
    local file pids=()
    for file in "$@"; do
        if alive "$file"; then
            pids+=("$(<"$file")")
        fi
    done
    stop_pid_list ${pids[@]+"${pids[@]}"}
    [[ $DRY_RUN == 1 ]] || rm -f "$@"
}

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# Exit 3 (the "cannot run here" status tests turn into a skip) unless root with the daemons.
require_binaries() {
    local missing=() b
    for b in munged slurmctld slurmd sbatch srun scontrol sinfo squeue scancel "$@"; do
        command -v "$b" >/dev/null || missing+=("$b")
    done
    if [[ ${#missing[@]} -gt 0 ]]; then
        echo "local_cluster: missing ${missing[*]}; install them with:" >&2
        echo "  apt-get update && apt-get install -y slurmctld slurmd slurm-client munge iproute2" >&2
        exit 3
    fi
    if [[ $(id -u) -ne 0 ]]; then
        echo "local_cluster: must run as root (slurmd and munged run as root here)" >&2
        exit 3
    fi
}

# proctrack/cgroup (cgroup v1, nothing constrained) tracks every process of a job and leaves no
# orphans; where no writable v1 freezer hierarchy exists, proctrack/pgid is clean too but slower
# (~3 s per step).
proctrack_type() {
    if [[ -d /sys/fs/cgroup/freezer && -w /sys/fs/cgroup/freezer ]]; then
        echo proctrack/cgroup
    else
        echo proctrack/pgid
    fi
}

# Start munged with its key, socket, pid and log under $1 (the cluster directory).
start_munged() {
    local dir=$1
    mkdir -p "$dir/munge"
    chmod 700 "$dir/munge"
    if [[ ! -s $dir/munge/munge.key ]]; then
        dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
        chmod 400 "$dir/munge/munge.key"
    fi
    alive "$dir/run/munged.pid" || munged --force --socket="$dir/munge/munge.socket" \
        --key-file="$dir/munge/munge.key" --pid-file="$dir/run/munged.pid" \
        --log-file="$dir/log/munged.log" --seed-file="$dir/munge/munged.seed"
}

# The slurm.conf lines both cluster kinds share; $1 is the cluster directory.
common_conf() {
    local dir=$1
    cat <<EOF
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket
StateSaveLocation=$dir/state
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmctldLogFile=$dir/log/slurmctld.log
ProctrackType=$(proctrack_type)
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$dir/log/jobcomp.txt
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
MailProg=/bin/true
KillWait=10
MinJobAge=600
EOF
    cat >"$dir/etc/cgroup.conf" <<EOF
CgroupPlugin=cgroup/v1
CgroupAutomount=no
ConstrainCores=no
ConstrainRAMSpace=no
ConstrainSwapSpace=no
ConstrainDevices=no
EOF
}

# Wait (bounded, $1 s) until sinfo shows $2 nodes, all idle; print the states either way.
wait_nodes_idle() {
    local limit=$1 want=$2 end states="" n
    end=$(($(date +%s%N) / 1000000 + limit * 1000))
    while (($(date +%s%N) / 1000000 < end)); do
        states=$(sinfo -h -N -o %t 2>/dev/null || true)
        n=$(grep -c '^idle' <<<"$states" || true)
        [[ $n -ge $want ]] && break
        sleep 0.05
    done
    echo "${states//$'\n'/ }"
    [[ $n -ge $want ]]
}

# One "name: running (pid N)" / "name: stopped" line per daemon; $1 is the run dir, then the
# names of its pid files (without .pid). False when any is stopped.
report_daemons() {
    local run_dir=$1 name rc=0
    shift
    for name in "$@"; do
        if alive "$run_dir/$name.pid"; then
            echo "$name: running (pid $(<"$run_dir/$name.pid"))"
        else
            echo "$name: stopped"
            rc=1
        fi
    done
    return "$rc"
}
