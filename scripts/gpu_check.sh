#!/usr/bin/env bash
# Prove the repository's CUDA paths on one GPU, in one command, within 8 minutes.
#
#   scripts/gpu_check.sh OUT_DIR [--only PART[,PART...]] [--budget SECONDS] [--dry-run]
#
# Parts, in the order they run (each one a function below, runnable alone with --only):
#   pytest  `pytest -m gpu` over tests/ (junit XML), but for the graph part's test; among them
#           tests/gpu/test_muon_decay_cuda.py: Muon's weight decay exact in bf16/fp16 on CUDA
#   graph   tests/gpu/test_muon_graph.py: the Muon step (local path + AdamW groups) captured
#           in a CUDA graph and replayed equals the eager step
#   bench   scripts/bench_newton_schulz.py on GLM-4.5-Air, GLM-5.2 and 8192x6144 blocks, bf16:
#           ms per block and TFLOP/s against the device's dense bf16 peak, standard vs Gram
#   memory  scripts/check_memory_meter.py: the MemoryMeter against max_memory_allocated
#   train   train.py on one GPU (world 1, ep 1, NCCL, bf16 compute) for 50 steps, per preset
#           (`small`, and the smallest MLA+DSA preset of conf/model/ when there is one), without
#           and with train.compile; a copy of the eager run is resumed from its step-25
#           checkpoint and compared with the uninterrupted run (scripts/check_resume.py)
#   moe     scripts/bench_moe.py: one GLM-5.2 MoE layer with the 32 experts a rank holds at ep 8,
#           bf16 forward + backward by expert kernel (per-expert loop, grouped matmul, padded bmm)
# Everything goes under OUT_DIR: one folder per part with each step's log (its first line is
# the command) and artefacts, the caches (token file, Inductor, Triton), env.txt and
# summary.txt. The summary (also printed) has one row per step:
#   PART STATUS SECONDS WHERE   with STATUS one of PASS, FAIL, TIMEOUT, SKIPPED, DRY
# Exit status: 0 when every step passed, 1 when one failed, timed out or was skipped (the other
# steps still run) or when $PYTHON cannot be asked for a device, 2 when there is no CUDA device
# (nothing runs), 64 on a usage error, 130 when interrupted (the summary so far is printed).
# --budget (default 450 s, counted from the start) bounds the whole run: each step's timeout is
# cut to what is left, and steps that no longer fit are SKIPPED. --dry-run prints every step
# with its exact command and exits 0, without a GPU. PYTHON chooses the interpreter (default:
# python); GPU_PEAK_TFLOPS gives the bf16 peak of a device bf16_peak_tflops does not know.
# The parts are called by name ("part_$part"), which shellcheck cannot follow:
# shellcheck disable=SC2329
set -u

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PARTS=(pytest graph bench memory train moe)
PYTHON=${PYTHON:-python}
BUDGET=450
MIN_STEP_S=20 # a step with less time left than this is not started
DRY_RUN=0
ONLY=""
OUT=""

# GLM block shapes as orthogonalized, LABEL=ROWSxCOLSxBATCH. GLM-4.5-Air: hidden 4096, expert
# intermediate 1408, 96 query heads and 8 KV heads of 128. GLM-5.2: hidden 6144, expert
# intermediate 2048, MLA with q_lora 2048, kv_lora 512, qk_nope 192, qk_rope 64, v 256, 64 heads
# (whole projections). The upstream benchmark's 8192x6144.
NS_SHAPES="air_expert_gate_up=1408x4096x8,air_expert_down=4096x1408x8,air_q_proj=12288x4096x2"
NS_SHAPES+=",air_kv_proj=1024x4096x4,air_o_proj=4096x12288x2"
NS_SHAPES+=",glm52_expert_gate_up=2048x6144x8,glm52_expert_down=6144x2048x8"
NS_SHAPES+=",glm52_q_a_proj=2048x6144x4,glm52_q_b_proj=16384x2048x2"
NS_SHAPES+=",glm52_kv_a_proj=576x6144x4,glm52_kv_b_proj=28672x512x2,glm52_o_proj=6144x16384x2"
NS_SHAPES+=",upstream=8192x6144x2"
NS_VARIANTS="fixed,polar_express,polar_express gram"

usage() {
	echo "usage: scripts/gpu_check.sh OUT_DIR [--only PART[,PART...]] [--budget SECONDS] [--dry-run]" >&2
	echo "       PART: ${PARTS[*]}" >&2
	[ -n "${1:-}" ] && echo "gpu_check.sh: $1" >&2
	exit 64
}

parse_args() {
	while [ $# -gt 0 ]; do
		case "$1" in
		--dry-run) DRY_RUN=1 ;;
		--only)
			[ $# -ge 2 ] || usage "--only needs a PART list"
			ONLY=$2
			shift
			;;
		--only=*) ONLY=${1#--only=} ;;
		--budget)
			[ $# -ge 2 ] || usage "--budget needs SECONDS"
			BUDGET=$2
			shift
			;;
		--budget=*) BUDGET=${1#--budget=} ;;
		-h | --help) usage ;;
		-*) usage "unknown option $1" ;;
		*)
			[ -z "$OUT" ] || usage "one OUT_DIR only (got $OUT and $1)"
			OUT=$1
			;;
		esac
		shift
	done
	[ -n "$OUT" ] || usage "OUT_DIR is required"
	[[ $BUDGET =~ ^[0-9]+$ ]] && [ "$BUDGET" -ge "$MIN_STEP_S" ] ||
		usage "--budget must be an integer >= $MIN_STEP_S, got $BUDGET"
	local part
	for part in ${ONLY//,/ }; do
		[[ " ${PARTS[*]} " == *" $part "* ]] || usage "--only: unknown part '$part'; allowed: ${PARTS[*]}"
	done
}

# ---------------------------------------------------------------------------- the step runner
NAMES=()
STATUSES=()
TIMES=()
WHERES=()

record() { # NAME STATUS SECONDS WHERE
	NAMES+=("$1")
	STATUSES+=("$2")
	TIMES+=("$3")
	WHERES+=("$4")
}

quoted() { # the command as one line a shell reads back the same
	local out
	printf -v out '%q ' "$@"
	echo "${out% }"
}

# run_step NAME LIMIT_S LOG CMD...: run CMD (in the repository root) under a timeout cut to the
# budget left, its output in LOG; one summary row. Returns CMD's status (1 when not started).
run_step() {
	local name=$1 limit=$2 log=$3
	shift 3
	if [ "$DRY_RUN" = 1 ]; then
		printf '[dry-run] %-24s $ %s\n' "$name" "$(quoted "$@")"
		record "$name" DRY 0 "$log"
		return 0
	fi
	local left=$((DEADLINE - SECONDS))
	if [ "$left" -lt "$MIN_STEP_S" ]; then
		echo "== $name: SKIPPED (budget spent)"
		record "$name" SKIPPED 0 "$log"
		return 1
	fi
	[ "$limit" -le "$left" ] || limit=$left
	mkdir -p "$(dirname "$log")"
	echo "\$ $(quoted "$@")" >"$log"
	echo "== $name (limit ${limit}s): $log"
	local start=$SECONDS rc=0
	# In the background, so that a signal to this script runs its trap at once (on_signal);
	# timeout puts the step in its own process group and stops all of it.
	timeout --kill-after=15 "$limit" "$@" >>"$log" 2>&1 </dev/null &
	CHILD=$!
	CURRENT=("$name" "$start" "$log")
	wait "$CHILD" || rc=$?
	CHILD=""
	local status=PASS
	if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
		status=TIMEOUT
	elif [ "$rc" != 0 ]; then
		status=FAIL
	fi
	record "$name" "$status" $((SECONDS - start)) "$log"
	echo "   $status (exit $rc, $((SECONDS - start))s)"
	return "$rc"
}

# SIGINT / SIGTERM: stop the running step (timeout passes the signal on to its process group),
# print the summary so far, exit 130.
CHILD=""
CURRENT=()
on_signal() {
	trap - INT TERM
	echo "gpu_check.sh: interrupted; stopping the running step" >&2
	if [ -n "$CHILD" ]; then
		kill -TERM "$CHILD" 2>/dev/null
		wait "$CHILD"
		record "${CURRENT[0]}" FAIL $((SECONDS - CURRENT[1])) "${CURRENT[2]}"
	fi
	summary
	exit 130
}

# A preparation command (no row of its own): printed in a dry run, else run.
prepare() {
	if [ "$DRY_RUN" = 1 ]; then
		printf '[dry-run] %-24s $ %s\n' "(prepare)" "$(quoted "$@")"
		return 0
	fi
	"$@"
}

# ---------------------------------------------------------------------------- the parts
GRAPH_TEST=tests/gpu/test_muon_graph.py

part_pytest() {
	run_step pytest 180 "$OUT/pytest/pytest.log" \
		"$PYTHON" -m pytest -m gpu -q -p no:cacheprovider -o "junit_family=xunit2" \
		--junitxml "$OUT/pytest/junit.xml" --ignore "$GRAPH_TEST" tests
}

part_graph() {
	run_step graph 90 "$OUT/graph/graph.log" \
		"$PYTHON" -m pytest -m gpu -q -p no:cacheprovider -o "junit_family=xunit2" \
		--junitxml "$OUT/graph/junit.xml" "$GRAPH_TEST"
}

part_bench() {
	local peak=()
	[ -n "$PEAK_TFLOPS" ] && peak=(--peak-tflops "$PEAK_TFLOPS")
	run_step bench 120 "$OUT/bench/bench.log" \
		"$PYTHON" scripts/bench_newton_schulz.py --device cuda --scale 1 \
		--shapes "$NS_SHAPES" --variants "$NS_VARIANTS" --skip train,step,crossover,quality \
		"${peak[@]}" --out "$OUT/bench"
}

part_memory() {
	run_step memory 90 "$OUT/memory/memory.log" \
		"$PYTHON" scripts/check_memory_meter.py --out "$OUT/memory"
}

# The presets to train: `small`, then the smallest conf/model/ preset with multi-head latent
# attention and the DSA indexer (found from the GLMConfig it builds, whatever its file is named).
train_presets() {
	"$PYTHON" - "$ROOT"/conf/model/*.yaml <<'PY'
import sys
from pathlib import Path

from omegaconf import OmegaConf

from models.glm import get_preset

found = []
for path in map(Path, sys.argv[1:]):
    name = OmegaConf.load(path).get("preset")
    if path.stem == "small":
        print(path.stem)
        continue
    try:
        config = get_preset(str(name)).to_dict()
    except Exception:  # a preset that needs more than its name (a checkpoint directory, say)
        continue
    values = {str(v) for v in config.values()}
    mla = any(v for k, v in config.items() if "lora" in k) or values & {"mla", "glm_moe_dsa"}
    if mla and any(v for k, v in config.items() if "index" in k and "topk" in k):
        found.append((config["hidden_size"] * config["num_hidden_layers"], path.stem))
if found:
    print(min(found)[1])
PY
}

part_train() {
	local presets preset mode dir
	presets=$(train_presets) || presets=""
	if [ -z "$presets" ]; then
		record "train (presets)" FAIL 0 "conf/model/"
		echo "== train: no preset found in conf/model/"
		return
	fi
	echo "== train presets: $(echo "$presets" | tr '\n' ' ')"
	for preset in $presets; do
		for mode in eager compile; do
			dir=$OUT/train/$preset-$mode
			local args=(
				"model=$preset" mesh.world_size=1 mesh.ep=1 mesh.device=cuda
				train.steps=50 train.param_dtype=bfloat16
				"train.compile=$([ "$mode" = compile ] && echo true || echo false)"
				checkpoint.every=25 checkpoint.keep=2 logger=none metrics.progress=false
				"data.cache_dir=$OUT/cache/data"
			)
			# A fresh run dir: a ref/ left by an earlier check would be resumed, not trained.
			prepare rm -rf "$dir" || continue
			run_step "train $preset $mode" 200 "$dir/ref.log" \
				"$PYTHON" train.py "${args[@]}" "hydra.run.dir=$dir/ref" || continue
			[ "$mode" = eager ] || continue
			# The resumed copy: the reference cut back to its step-25 checkpoint.
			if ! { prepare rm -rf "$dir/resumed" && prepare cp -r "$dir/ref" "$dir/resumed" &&
				prepare rm -rf "$dir/resumed/checkpoints/step_00000050" "$dir/resumed/hf"; }; then
				record "resume $preset $mode" FAIL 0 "$dir/resumed (could not copy the run)"
				continue
			fi
			run_step "resume $preset $mode" 150 "$dir/resumed.log" \
				"$PYTHON" train.py "${args[@]}" "hydra.run.dir=$dir/resumed" || continue
			run_step "resume-check $preset" 30 "$dir/check.log" \
				"$PYTHON" scripts/check_resume.py "$dir/ref" "$dir/resumed" --from-step 25
		done
	done
}

part_moe() {
	run_step moe 60 "$OUT/moe/moe.log" \
		"$PYTHON" scripts/bench_moe.py --device cuda --dtype bf16 --preset glm52 --experts 32 \
		--tokens 8192 --rounds 10 --out "$OUT/moe"
}

# ---------------------------------------------------------------------------- the device
# Dense (no sparsity) bf16 tensor-core peaks from NVIDIA's datasheets, TFLOP/s; GPU_PEAK_TFLOPS
# overrides, and an unknown device gets no share-of-peak column.
bf16_peak_tflops() {
	case "$1" in
	*H200*NVL* | *H100*NVL*) echo 835 ;;
	*H200* | *H100*SXM* | *"H100 80GB HBM3"*) echo 989 ;;
	*H100*PCIe*) echo 756 ;;
	*A100*) echo 312 ;;
	*) echo "" ;;
	esac
}

check_cuda() {
	local name rc=0 err
	err=$(mktemp)
	name=$(timeout 30 "$PYTHON" -c '
import sys
import torch
if not torch.cuda.is_available():
    sys.exit(2)
print(torch.cuda.get_device_name(0))
' 2>"$err") || rc=$?
	if [ "$rc" = 2 ]; then
		echo "gpu_check.sh: no CUDA device (torch.cuda.is_available() is false under" \
			"$PYTHON); nothing was run" >&2
	elif [ "$rc" != 0 ]; then
		echo "gpu_check.sh: could not ask $PYTHON for a CUDA device (exit $rc); nothing was run:" >&2
		tail -n 5 "$err" >&2
	fi
	rm -f "$err"
	[ "$rc" = 0 ] || exit "$([ "$rc" = 2 ] && echo 2 || echo 1)"
	DEVICE_NAME=$name
}

summary() {
	local i failed=0 n=${#NAMES[@]}
	for ((i = 0; i < n; i++)); do
		case "${STATUSES[i]}" in PASS | DRY) ;; *) failed=$((failed + 1)) ;; esac
	done
	{
		printf '%-24s %-8s %7s  %s\n' PART STATUS SECONDS WHERE
		for ((i = 0; i < n; i++)); do
			printf '%-24s %-8s %7s  %s\n' "${NAMES[i]}" "${STATUSES[i]}" "${TIMES[i]}" "${WHERES[i]}"
		done
		if [ "$DRY_RUN" = 1 ]; then
			echo "gpu_check: dry run: $n steps listed, none run (no GPU used, nothing checked)"
		else
			echo "gpu_check: $((n - failed)) of $n steps passed in ${SECONDS}s (budget ${BUDGET}s);" \
				"device: ${DEVICE_NAME}"
		fi
	} | tee "$OUT/summary.txt"
	[ "$failed" = 0 ]
}

main() {
	parse_args "$@"
	cd "$ROOT" || exit 1
	DEADLINE=$((SECONDS + BUDGET))
	DEVICE_NAME="none (dry run)"
	[ "$DRY_RUN" = 1 ] || check_cuda
	PEAK_TFLOPS=${GPU_PEAK_TFLOPS:-$(bf16_peak_tflops "$DEVICE_NAME")}
	mkdir -p "$OUT"
	OUT=$(cd "$OUT" && pwd)
	trap on_signal INT TERM
	export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
	export WANDB_MODE=offline WANDB_SILENT=true MPLCONFIGDIR=$OUT/cache/matplotlib
	export TORCHINDUCTOR_CACHE_DIR=$OUT/cache/inductor TRITON_CACHE_DIR=$OUT/cache/triton
	if [ "$DRY_RUN" = 0 ]; then
		{
			echo "device: $DEVICE_NAME (bf16 dense peak: ${PEAK_TFLOPS:-unknown} TFLOP/s)"
			echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
			"$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
			nvidia-smi 2>&1 || true
		} >"$OUT/env.txt" 2>&1
	fi
	local part
	for part in "${PARTS[@]}"; do
		if [ -z "$ONLY" ] || [[ ",$ONLY," == *",$part,"* ]]; then
			"part_$part"
		fi
	done
	if summary; then
		exit 0
	fi
	exit 1
}

main "$@"
