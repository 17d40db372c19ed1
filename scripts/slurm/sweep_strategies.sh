#!/usr/bin/env bash
# Submit one scripts/slurm/train.sbatch job per Muon remainder strategy, to compare them in W&B.
#
#   scripts/slurm/sweep_strategies.sh [--dry-run] [sbatch options ...] [-- train.py overrides ...]
#   scripts/slurm/sweep_strategies.sh -N 2 --gpus-per-node=8 -- mesh.ep=8 logger=wandb
#
# Each job gets its own name (muon-<sweep>-<strategy>), its own run name (hence its own run and
# checkpoint directory) and the sweep's W&B group, so the runs sit side by side in W&B.
# Arguments before `--` go to sbatch, those after it to train.py; without `--` all go to
# train.py. Prints one "<strategy> <job id>" line per job. Requeued jobs resume by themselves;
# the same command submitted again resumes every run where it stopped (run names and run
# directories come from the sweep name and the overrides, never the time); another SWEEP_NAME
# starts a separate sweep.
#
# Environment: STRATEGIES (default "agrs pad_all2all ragged_all_to_all"), SWEEP_NAME (default
# strategies), DRY_RUN=1 or --dry-run to print the sbatch commands instead of submitting them.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
DRY_RUN=${DRY_RUN:-0}
strategies=${STRATEGIES:-"agrs pad_all2all ragged_all_to_all"}
sweep=${SWEEP_NAME:-strategies}

sbatch_args=()
train_args=()
seen_sep=0
for a in "$@"; do
    if [[ $seen_sep == 0 && $a == --dry-run ]]; then
        DRY_RUN=1
    elif [[ $seen_sep == 0 && $a == -- ]]; then
        seen_sep=1
    elif [[ $seen_sep == 1 ]]; then
        train_args+=("$a")
    else
        sbatch_args+=("$a")
    fi
done
if [[ $seen_sep == 0 ]]; then
    train_args=(${sbatch_args[@]+"${sbatch_args[@]}"})
    sbatch_args=()
fi

# Print a command line, quoting only the words that need it.
show() {
    local w out=()
    for w in "$@"; do
        if [[ $w =~ ^[A-Za-z0-9_,.:=/@%+-]+$ ]]; then
            out+=("$w")
        else
            out+=("$(printf '%q' "$w")")
        fi
    done
    echo "${out[*]}"
}

for strategy in $strategies; do
    cmd=(
        sbatch --parsable --job-name="muon-$sweep-$strategy"
        ${sbatch_args[@]+"${sbatch_args[@]}"}
        "$here/train.sbatch"
        "optim.remainder_strategy=$strategy"
        "run.name=$sweep-$strategy"
        "logger.group=$sweep"
        ${train_args[@]+"${train_args[@]}"}
    )
    if [[ $DRY_RUN == 1 ]]; then
        show "${cmd[@]}"
    else
        job_id=$("${cmd[@]}")
        echo "$strategy ${job_id%%;*}"
    fi
done
