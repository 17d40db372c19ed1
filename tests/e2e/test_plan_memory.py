"""scripts/plan_memory.py: the dry-run planner at GLM-5 scale, and planned vs measured peaks
(the report: recipes/planning.py, its text and budget check: recipes/planning_report.py).

GLM-5 on 512 fake ranks, ep 8: expert-aware, the fused gate+up weights
are local and all 76 down weights take the sub-group path; with `--no-expert-aware` the down
weights make a full batch of 64 and an AGRS remainder of 12 whose all-gather buffer is 9 GiB
(FSDP-visible rows), not the 72 GiB of the global rows.

Planned vs measured, on a 4-rank gloo world with two [1024, 512] fp32 matrices (a remainder of
R=2 on W=4; nesterov=False and ns_dtype float32, so the step allocates no input copies and no
dtype casts). Each rank measures the optimizer step's `peak_delta_bytes` with
`recipes.memory.MemoryMeter` (the median of 3 steps after a warm-up, each started after a
barrier) on the ranks that own a remainder matrix (busy) and those that own none (idle):

- exchange only: Newton-Schulz replaced by a same-size copy (the plan's exchange accounting
  includes the NS output), compared with `muon.batch_cost.exchange_buffer_bytes`. Tolerance: 5% + 64
  KiB, plus, for AGRS only, a gloo slack of twice its slab (W*n padded shards) + send buffer
  (n padded shards): gloo stages a flat copy of the all-gather output and of the
  reduce-scatter input (4 MiB here, measured on bare collectives; NCCL does not), a gloo
  worker thread can free the all-gather's send buffer and slab only after the reduce-scatter
  buffers exist.
- the real step, compared with the planner's per-batch peak (`muon.batch_cost.peak_bytes`:
  `exchange_buffer_bytes + ns_workspace_bytes`): the plan must be an upper bound within 10%
  (+ the AGRS gloo slack) and not more than 1.6x the measured peak (the NS workspace is a
  rough, conservative estimate).

Any gap between the path objects' accounting and their allocations (muon/paths.py) fails here.
"""

from __future__ import annotations

import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from muon.plan import REMAINDER_STRATEGIES as STRATEGIES
from recipes.planning_report import fmt_bytes, over_budget
from tests.harness import run_world

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "plan_memory.py"
GiB = 1 << 30
MiB = 1 << 20
W = 4
SHAPE = (1024, 512)
COUNT = 2


def _run_planner(tmp_path: Path, *flags: str, world: int = 512) -> dict:
    out = tmp_path / "plan.json"
    cmd = [sys.executable, str(SCRIPT), "--model", "glm5", "--world-size", str(world), "--ep", "8"]
    proc = subprocess.run(
        [*cmd, *flags, "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    report["stdout"] = proc.stdout
    return report


def _expert_groups(report: dict) -> dict[tuple, dict]:
    return {tuple(g["shape"]): g for g in report["groups"] if g["non_fsdp_shard_factor"] == 8}


GATE_UP, DOWN = (256 * 2 * 2048, 6144), (256 * 6144, 2048)


def _largest_unit(report: dict) -> float:
    """NS FLOPs of the largest matrix owned whole. Owners are balanced by cost over such units,
    so a greedy assignment ends within one unit of the ideal: GLM-5's o_proj [6144, 16384]
    (11.4 TFLOP, ~21% of a rank's ideal share at 512 ranks; measured busiest/ideal 1.06, and
    1.07 at 1024). The 1.1 guards are regression checks on those measurements."""
    from muon.cost import effective_algorithm, ns_flops

    return max(
        ns_flops(*g["shape"], algorithm=effective_algorithm(*g["shape"], algorithm="auto"))
        for g in report["groups"]
        if g["num_blocks"] == 1
    )


@pytest.fixture(scope="module")
def glm5_512(tmp_path_factory):
    return _run_planner(tmp_path_factory.mktemp("plan512"))


def test_glm5_expert_aware_paths(glm5_512):
    report = glm5_512
    assert report["meta"]["build_s"] < 60
    experts = _expert_groups(report)
    for s in STRATEGIES:
        gate_up, down = experts[GATE_UP]["strategies"][s], experts[DOWN]["strategies"][s]
        assert gate_up["paths"] == ["local"] and experts[GATE_UP]["params"] == 76
        # no parameter-count guard: all 76 down weights take the sub-group path
        assert down["paths"] == ["subgroup"] and experts[DOWN]["params"] == 76
        assert down["remainder"] == 0 and sum(n for _, n in down["batches"]) == 76
        assert gate_up["group"]["view"]["bytes_sent"] == 0
    assert experts[DOWN]["fsdp_visible_rows"] == 196608
    # sub-group batches sized by their planned peak within the 256 MiB batch budget (2.34 GiB
    # once, when a rank assembled every block of its sub-group's 64 parameters at once): all 76
    # in one batch, 132 MiB on the busiest rank
    down = experts[DOWN]["strategies"]["ragged_all_to_all"]["group"]["busy"]
    assert down["peak_bytes"] < 0.5 * GiB, down
    assert "local:76" in report["stdout"] and "subgroup(4):76x1" in report["stdout"]
    largest = _largest_unit(report)
    for s in (*STRATEGIES, "auto"):
        ns = report["totals"][s]["ns"]
        # every block orthogonalized once (no padding NS, no duplicated sub-group blocks)
        assert ns["ns_flops_mean"] == pytest.approx(ns["ns_flops_ideal"], rel=1e-12)
        assert ns["ns_flops_busiest"] <= ns["ns_flops_ideal"] + largest, (s, largest)
        assert ns["ns_flops_busiest"] <= 1.1 * ns["ns_flops_ideal"], (s, ns["busiest_over_ideal"])
        assert len(ns["ns_flops_per_rank"]) == 64 == len(ns["bytes_sent_per_rank"])
        assert max(ns["ns_flops_per_rank"]) <= ns["ns_flops_busiest"]
        assert 0 < ns["ns_share_of_step"] < 0.05
    # auto: the ragged exchange, lowest modelled time and lowest peak at this scale
    assert (
        report["totals"]["auto"]["ns"]["bytes_sent_busiest"]
        == (report["totals"]["ragged_all_to_all"]["ns"]["bytes_sent_busiest"])
    )


def test_glm5_busiest_rank_work_halves_from_512_to_1024_ranks(glm5_512, tmp_path):
    """Strong scaling of the optimizer step: doubling the ranks shrinks the busiest rank's
    Newton-Schulz work by at least 1.8x (sub-group blocks of k = 2 and 4 once each)."""
    at_1024 = _run_planner(tmp_path, "--strategy", "auto", world=1024)["totals"]["auto"]["ns"]
    assert at_1024["ns_flops_busiest"] <= at_1024["ns_flops_ideal"] + _largest_unit(glm5_512)
    assert at_1024["ns_flops_busiest"] <= 1.1 * at_1024["ns_flops_ideal"], at_1024
    at_512 = glm5_512["totals"]["auto"]["ns"]
    ratio = at_512["ns_flops_busiest"] / at_1024["ns_flops_busiest"]
    assert ratio >= 1.8, (at_512["ns_flops_busiest"], at_1024["ns_flops_busiest"])


def test_glm5_without_expert_paths_agrs_remainder_is_9_gib(tmp_path):
    report = _run_planner(tmp_path, "--no-expert-aware", "--budget-gib", "80")
    down = _expert_groups(report)[DOWN]
    assert down["fsdp_visible_rows"] == 1572864 // 8
    agrs = down["strategies"]["agrs"]
    assert agrs["batches"] == [["full", 64], ["agrs", 12]] and agrs["remainder"] == 12
    rem = agrs["remainder_batch"]
    for role in ("busy", "idle"):
        buf = rem[role]["collective_buffer_bytes"]
        assert buf == 12 * 196608 * 2048 * 2  # all 12 FSDP-visible matrices, bf16
        assert 8.9 * GiB < buf < 9.1 * GiB, buf  # FSDP-visible rows: 9 GiB, not 72 GiB
    # the other strategies keep the busy rank at one matrix and the idle ranks near nothing
    ragged = down["strategies"]["ragged_all_to_all"]["remainder_batch"]
    pad = down["strategies"]["pad_all2all"]["remainder_batch"]
    assert ragged["busy"]["collective_buffer_bytes"] == 196608 * 2048 * 2
    assert ragged["idle"]["exchange_buffer_bytes"] < 0.2 * GiB
    assert pad["idle"]["collective_buffer_bytes"] == 64 * 3072 * 2048 * 2
    assert report["over_budget"] == []
    assert "9.00 GiB" in report["stdout"]


def test_budget_flags_what_does_not_fit():
    """The budget check on a hand-made report (no world needed)."""
    fig = {"global_rank": 3, "collective_buffer_bytes": 9 * GiB, "peak_bytes": 10 * GiB}
    small = {"global_rank": 5, "collective_buffer_bytes": MiB, "peak_bytes": 2 * MiB}
    report = {
        "meta": {"rank": 0, "max_inflight": 3},
        "groups": [
            {
                "shape": [8, 4],
                "strategies": {
                    "agrs": {
                        "remainder_batch": {"busy": fig, "idle": small},
                        "group": {"view": small},
                    },
                    "ragged_all_to_all": {
                        "remainder_batch": {"busy": small, "idle": None},
                        "group": {"view": small},
                    },
                },
            }
        ],
        "totals": {
            "agrs": {"resident_bytes": 4 * GiB, "view_step_bound_bytes": 5 * GiB},
            "ragged_all_to_all": {"resident_bytes": 4 * GiB, "view_step_bound_bytes": GiB},
        },
    }
    over = over_budget(report, 8 * GiB)
    assert len(over) == 3, over
    assert all("agrs" in o and "ragged" not in o for o in over)
    assert over_budget(report, None) == []
    assert fmt_bytes(9 * GiB) == "9.00 GiB" and fmt_bytes(512) == "512 B"


# --------------------------------------------------------------- planned vs measured, 4 ranks
def _measured_world() -> dict:
    """Per strategy: plan figures and measured optimizer-step peaks of this rank."""
    import torch.distributed as dist

    import muon.task as muon_task
    from muon import Muon, batch_cost
    from recipes.bench.fixtures import sharded_matrices
    from recipes.memory import MemoryMeter
    from tests.harness import init_mesh

    mesh = init_mesh((W,), ("fsdp",))
    meter = MemoryMeter("cpu")
    real_orthogonalize = muon_task.orthogonalize
    out: dict[str, dict] = {}
    for strategy in STRATEGIES:
        params = sharded_matrices([SHAPE] * COUNT, mesh, generator=torch.Generator().manual_seed(0))
        opt = Muon(params, ns_dtype=torch.float32, nesterov=False, remainder_strategy=strategy)
        ((mp, (batch,)),) = opt.plans
        r = mp.fsdp_rank
        send_bytes = batch.size * batch.padded_shard_rows * batch.other_numel * batch.wire_itemsize
        row = {
            "path": batch.path,
            "matrices": batch_cost.blocks_on(batch, r),
            "planned_exchange": batch_cost.exchange_buffer_bytes(batch, r),
            "planned_peak": batch_cost.peak_bytes(batch, r, 4),
            # gloo-only AGRS slack (seen: +4, +5 and +10 MiB over the plan): gloo's flat staging
            # copy of the slab; the all-gather's send + slab, which a gloo worker thread can
            # release after the reduce-scatter buffers exist; and the output-shard gap (below)
            "staging": (
                2 * (batch_cost.collective_buffer_bytes(batch, r) + send_bytes)
                if strategy == "agrs"
                else 0
            ),
            "planned_sent": batch_cost.bytes_sent(batch, r),
        }
        for mode in ("exchange", "step"):
            # exchange only: NS becomes a same-size copy (its output is in the exchange count)
            muon_task.orthogonalize = (
                (lambda m, **_: m.clone()) if mode == "exchange" else real_orthogonalize
            )
            try:
                opt.step()  # warm-up
                peaks = []
                for _ in range(3):
                    # let gloo's worker threads free the previous step's buffers first, so they
                    # are not in the baseline (they would lower the measured delta)
                    dist.barrier()
                    gc.collect()
                    time.sleep(0.05)
                    with meter.measure() as m, m.region("optim"):
                        opt.step()
                    peaks.append(m.peak_delta_bytes("optim"))
            finally:
                muon_task.orthogonalize = real_orthogonalize
            # gloo worker threads free buffers a little late, now and then: the median step
            row[f"measured_{mode}"] = statistics.median(peaks)
            row[f"measured_{mode}_all"] = peaks
        row["measured_sent"] = opt.step_stats["muon/bytes_sent"]
        out[strategy] = row
    return out


@pytest.fixture(scope="module")
def measured():
    ranks = run_world(_measured_world, W, timeout_s=300)
    table = []
    for s in STRATEGIES:
        for r, res in enumerate(ranks):
            row = res[s]
            table.append(
                f"{s:<18} rank {r} {'busy' if row['matrices'] else 'idle'}: exchange planned "
                f"{row['planned_exchange'] / MiB:.2f} measured {row['measured_exchange'] / MiB:.2f}"
                f"; step planned {row['planned_peak'] / MiB:.2f} measured "
                f"{row['measured_step'] / MiB:.2f} MiB"
            )
    print("\n".join(table))
    return ranks


def _by_role(ranks, strategy):
    rows = [res[strategy] for res in ranks]
    busy = [row for row in rows if row["matrices"]]
    idle = [row for row in rows if not row["matrices"]]
    assert len(busy) == COUNT and len(idle) == W - COUNT
    return busy + idle


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_planned_exchange_buffers_match_measured(measured, strategy):
    for row in _by_role(measured, strategy):
        assert row["planned_sent"] == row["measured_sent"]
        expected = row["planned_exchange"] + row["staging"]
        tolerance = 0.05 * expected + 64 * 1024
        # gloo's staging copy is timing-dependent on the measuring thread: allow 0..staging
        lo, hi = row["planned_exchange"] - tolerance, expected + tolerance
        assert lo <= row["measured_exchange"] <= hi, row


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_planned_step_peak_bounds_measured(measured, strategy):
    for row in _by_role(measured, strategy):
        planned, got = row["planned_peak"], row["measured_step"]
        assert got <= 1.10 * planned + row["staging"] + 64 * 1024, row
        assert planned <= 1.6 * got + 64 * 1024, row


def test_indexer_training_flag_frozen_vs_kl():
    """`--indexer-training`: a frozen indexer leaves the optimizer (fewer parameter tensors:
    5 per indexer, 3 indexers in mla_tiny: layers 0 and 2 and the MTP layer) and the step
    estimate (no indexer gradients, state or KL activations); a model without one refuses it."""
    base = [sys.executable, str(SCRIPT), "--model", "mla_tiny", "--world-size", "8", "--ep", "2"]
    base += ["--strategy", "auto", "--step", "--seq-len", "512", "--micro-batch", "2"]
    out = {}
    for mode in ("kl", "frozen"):
        proc = subprocess.run([*base, "--indexer-training", mode], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        tensors = int(proc.stdout.split("optimizer: ")[1].split()[0])
        peaks = [
            float(line.split()[4])
            for line in proc.stdout.splitlines()
            if "step peak per rank" in line
        ]
        out[mode] = tensors, peaks
    assert out["kl"][0] - out["frozen"][0] == 15, out
    # Without checkpointing every layer keeps its KL terms; with it, one recomputed layer's
    # kept-key KL terms (O(index_topk) bytes per token) are below the printed 0.001 GiB.
    (frozen_none, frozen_full), (kl_none, kl_full) = out["frozen"][1], out["kl"][1]
    assert frozen_none < kl_none and frozen_full <= kl_full, out
    bad = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", "small", "--indexer-training", "frozen"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "has no sparse-attention indexer" in bad.stderr


def test_glm5_muon_split_and_normuon(tmp_path, glm5_512):
    """Muon Split on GLM-5's MLA: q_b_proj / kv_b_proj / kv_a_proj_with_mqa plan as blocks
    of unequal heights, their Newton-Schulz work is below whole-matrix Muon's, and the
    attention knobs' costs are reported."""
    split = _run_planner(tmp_path, "--strategy", "pad_all2all", "--muon-split", "--normuon")
    whole = glm5_512  # the default plan: whole matrices, no NorMuon
    groups = {tuple(g["shape"]): g for g in split["groups"]}
    assert groups[(64 * 256, 2048)]["split_sizes"][:2] == [192, 64]  # q_b_proj (nope, rope)
    assert groups[(512 + 64, 6144)]["split_sizes"] == [512, 64]  # kv_a_proj_with_mqa
    assert not any(g["split_sizes"] for g in whole["groups"])
    ideal = [r["totals"]["pad_all2all"]["ns"]["ns_flops_ideal"] for r in (split, whole)]
    assert ideal[0] < ideal[1]  # per-head blocks: fewer FLOPs than the whole matrices
    att = split["attention"]
    assert att["normuon_state_bytes"] > 0 and whole["attention"]["normuon_state_bytes"] == 0
    # 78 layers + the MTP layer, 64 heads, one float32 each; DSA's sparse attention keeps each
    # head's largest kept-key logit as it goes, so the recording costs nothing extra
    assert att["qk_clip_record_flops"] == 0 and att["qk_clip_record_path"] == "sparse"
    assert att["qk_clip_allreduce_bytes"] == 79 * 64 * 4
    # the owners balance the per-head blocks as well as the whole matrices (widened sub-groups)
    assert split["totals"]["pad_all2all"]["ns"]["busiest_over_ideal"] <= 1.05
    assert "128 (64/192 rows)" in split["stdout"]  # the planner prints the blocks' heights


def test_planner_prints_the_whole_step_estimate_against_a_budget():
    """`scripts/plan_memory.py --step` (fake 8-rank world): both checkpointing modes, the
    verdict against --budget-gib, and the exit status 1 when any mode does not fit."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "plan_memory.py"
    args = [sys.executable, str(script), "--model", "small", "--world-size", "8", "--ep", "2"]
    args += ["--step", "--seq-len", "256", "--micro-batch", "2", "--strategy", "pad_all2all"]
    fits = subprocess.run([*args, "--budget-gib", "8"], capture_output=True, text=True)
    assert fits.returncode == 0, fits.stderr[-2000:]
    text = fits.stdout[fits.stdout.index("whole step per rank") :]
    peaks = [float(line.split()[4]) for line in text.splitlines() if "step peak per rank" in line]
    assert len(peaks) == 2 and 0 < peaks[1] < peaks[0], text  # checkpointing saves memory
    assert text.count("fits in 8 GiB") == 2
    tight = subprocess.run([*args, "--budget-gib", "0.001"], capture_output=True, text=True)
    assert tight.returncode == 1 and "DOES NOT FIT in 0.001 GiB" in tight.stdout
    # between the two peaks: checkpointing fits, the report shows the other over it: exit 1
    budget = f"{round((peaks[0] + peaks[1]) / 2, 3):g}"
    half = subprocess.run([*args, "--budget-gib", budget], capture_output=True, text=True)
    assert half.stdout.count(f"DOES NOT FIT in {budget} GiB") == 1, half.stdout[-2000:]
    assert half.stdout.count(f"fits in {budget} GiB") == 1 and half.returncode == 1


def test_planner_step_under_context_parallelism():
    """`--cp 4 --step` (mla_tiny, fake 8-rank world): a rank's quarter of each sequence, the
    key side's parts and collectives, the indexer's balance per layout; the smallest cp that
    fits is named, and `--cp-keep-gathered` keeps every layer's key side without checkpointing."""
    base = [sys.executable, str(SCRIPT), "--model", "mla_tiny", "--world-size", "8", "--ep", "2"]
    base += ["--strategy", "auto", "--step", "--seq-len", "512", "--micro-batch", "2"]
    base += ["--cp", "4", "--budget-gib", "1"]
    out = {}
    for keep in ((), ("--cp-keep-gathered",)):
        proc = subprocess.run([*base, *keep], capture_output=True, text=True, cwd=ROOT)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        out[keep] = proc.stdout
    text = out[()]
    assert "cp 4 (head-tail: 128 tokens of each sequence)" in text
    assert "gathered key side (one layer)" in text and "gathered key side (recomputed)" in text
    assert "attention   4 layers x 24 values/token" in text  # L + R = 16 + 8, 3 + the MTP layer
    assert text.count("smallest mesh.cp within 1 GiB: 1 ") == 2
    assert "head_tail" in text and "contiguous" in text
    assert "gathered key side (all layers)" in out[("--cp-keep-gathered",)]
