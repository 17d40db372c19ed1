#!/usr/bin/env bash
# One node's task of a train.sbatch job: run torchrun, copy its output to a per-node log, and
# turn the preemption signal into a clean stop that srun does not see as a failure.
#
#   srun --ntasks-per-node=1 torchrun_node.sh <log dir> torchrun [torchrun args] train.py ...
#
# The node's log is <log dir>/<short hostname>.log (appended), and its lines go to srun too.
#
# torchrun treats every signal it handles as fatal: it stops its workers and exits 1, and
# `srun --kill-on-bad-exit` would then kill the other nodes' steps, perhaps while their ranks
# still write their share of the checkpoint. So here torchrun ignores SIGUSR1 (inherited
# SIG_IGN; not in its --signals-to-handle) and this script hands USR1 (and TERM) to torchrun's
# workers, the training ranks, itself. The ranks finish their step, commit a checkpoint together
# and exit 0; torchrun sees its workers succeed and exits 0 on every node. The signal is sent
# again every $RESEND_S s (default 15) while torchrun runs: ranks still starting up inherit the
# ignored disposition until the trainer installs its handler, and would miss a single one.
set -uo pipefail

if [[ $# -lt 2 ]]; then
    echo "usage: $0 <log dir> <torchrun command ...>" >&2
    exit 2
fi
mkdir -p "$1"
log=$1/$(hostname -s).log
shift
exec > >(tee -a "$log") 2>&1
tee_pid=$!

trap '' USR1
"$@" &
child=$!
got=""
# shellcheck disable=SC2329 # invoked by the traps below
on_signal() {
    got=$1
    echo "[torchrun_node $(hostname -s)] got SIG$1 at $(date -Is); asking the ranks to stop"
    signal_workers
}
# shellcheck disable=SC2329 # invoked by on_signal and the resend loop
signal_workers() {
    local stat line rest fields pid
    for stat in /proc/[0-9]*/stat; do
        { read -r line <"$stat"; } 2>/dev/null || continue
        # After the comm field "(...)": state, then the parent pid.
        rest=${line##*) }
        read -r -a fields <<<"$rest"
        if [[ ${fields[1]:-} == "$child" ]]; then
            pid=${stat#/proc/}
            kill -USR1 "${pid%/stat}" 2>/dev/null || true
        fi
    done
}
trap 'on_signal USR1' USR1
trap 'on_signal TERM' TERM

resend=${RESEND_S:-15}
waited=0
while kill -0 "$child" 2>/dev/null; do
    if [[ -z $got ]]; then
        wait "$child" # back when torchrun exits, or early for a trapped signal
    else
        sleep 1 &
        wait $! 2>/dev/null || true
        waited=$((waited + 1))
        if ((waited % resend == 0)) && kill -0 "$child" 2>/dev/null; then
            signal_workers
        fi
    fi
done
# torchrun is gone; bash keeps its status until it is waited for.
wait "$child"
rc=$?
echo "[torchrun_node $(hostname -s)] torchrun exited with $rc${got:+ after SIG$got}"
# Let tee write the last lines before srun ends the step.
exec >&- 2>&-
wait "$tee_pid" 2>/dev/null || true
exit "$rc"
