"""The optimizer step's planned transient (`muon.batch_cost.window_peak_bytes`: the runtime's
window replayed on every buffer a batch holds) against the memory meter's peak of a warm step,
per rank, on one 4-rank gloo world: each remainder strategy, NorMuon on, Muon Split on, bf16
parameters, float32 Newton-Schulz, one batch in flight, and a ragged remainder whose idle ranks
assemble nothing.

The bag has full batches (stacked k per rank), remainders of 1 and 3, tall and wide blocks, and
blocks of unequal heights. Float32 Newton-Schulz (bf16 parameters: a narrower wire, the
widened apply and the Nesterov input) and one bf16 case. Tolerance 5% of the measured peak:
what the plan leaves out is a few KiB of flags and norms per batch (`TOLERANCE`: bf16 on CPU).
"""

import torch

from tests.harness import run_world

W = 4
#: (rows, cols) x count: a full batch of 8 and remainders of 3 and 1, tall and wide
BAG = [(256, 256)] * 8 + [(512, 192)] * 3 + [(192, 512)]
SPLIT = ((384, 256), (64, 256, 64))  # Muon Split: [q; k; v] of unequal heights, 3 of them
F32 = {"ns_dtype": torch.float32}
CASES = {
    "pad_all2all": F32,
    "agrs": {"remainder_strategy": "agrs", **F32},
    "ragged_all_to_all": {"remainder_strategy": "ragged_all_to_all", **F32},
    "normuon": {"normuon": True, **F32},
    "muon_split": {"split": True, **F32},
    "bf16 params": {"dtype": torch.bfloat16, **F32},
    "one in flight": {"max_inflight": 1, **F32},
    "bf16 NS": {},
}
#: bf16 Newton-Schulz on CPU: each bf16 matmul also allocates a packing buffer of about 13% of
#: its output (measured on 640 x 640: 1.13x the output), which the plan (written for the
#: device, whose GEMMs allocate none) leaves out: 6.6% of these small steps' peak, 0.7% on
#: 2048 x 640 blocks
TOLERANCE = {"bf16 NS": 0.08}


def _world() -> dict:

    from muon import Muon
    from muon.batch_cost import blocks_on, collective_buffer_bytes, window_peak_bytes
    from muon.paths import PATHS
    from recipes.bench.fixtures import optimizer_step_peak, sharded_matrices
    from recipes.memory import MemoryMeter
    from tests.harness import init_mesh

    mesh = init_mesh((W,), ("fsdp",))
    meter = MemoryMeter("cpu")
    out = {}
    for name, case in CASES.items():
        kw = dict(case)
        dtype, split = kw.pop("dtype", torch.float32), kw.pop("split", False)
        gen = torch.Generator().manual_seed(0)
        groups = [{"params": sharded_matrices(BAG, mesh, generator=gen, dtype=dtype)}]
        if split:
            shape, sizes = SPLIT
            params = sharded_matrices([shape] * 3, mesh, generator=gen, dtype=dtype)
            groups.append({"params": params, "split_sizes": sizes})
        opt = Muon(groups, remainder_strategy=kw.pop("remainder_strategy", "pad_all2all"), **kw)
        opt.step()  # warm: state and plans made
        measured = optimizer_step_peak(meter, opt, 2)
        g = opt.param_groups[0]
        planned = window_peak_bytes(
            opt.plans,
            ns_itemsize=getattr(torch, g["ns_dtype"]).itemsize,
            nesterov=g["nesterov"],
            max_inflight=opt.max_inflight,
            normuon=g["normuon"],
            gloo=True,
        )
        batches = [(b, mp.fsdp_rank) for mp, bs in opt.plans for b in bs]
        # remainder batches in which this rank assembles nothing (the ragged idle rank)
        idle = sum(b.size < b.fsdp_size and not blocks_on(b, r) for b, r in batches)
        # gloo frees an AGRS collective's staging copies (of the slab and of the send buffer,
        # for the all-gather and the reduce-scatter) on its worker when the collective is done,
        # which may be after the measuring thread's next allocation: up to twice both more
        # (tests/e2e/test_plan_memory.py sees the same on one AGRS batch)
        slack = max(
            (
                2 * (collective_buffer_bytes(b, r) + PATHS[b.path].buffer_figures(b, r)["send"])
                for b, r in batches
                if b.path == "agrs"
            ),
            default=0,
        )
        out[name] = dict(planned=planned, measured=measured, idle=idle, slack=slack)
        del opt, groups
    return out


def test_planned_transient_within_5_percent_of_measured():
    ranks = run_world(_world, W, timeout_s=600)
    lines, bad = [], []
    for name in CASES:
        for r, res in enumerate(ranks):
            row = res[name]
            ratio = row["planned"] / row["measured"]
            lines.append(f"{name} rank {r}: planned/measured {ratio:.3f} {row}")
            tol = TOLERANCE.get(name, 0.05)
            low = (1 - tol) * row["measured"] - row["slack"]
            if not low <= row["planned"] <= (1 + tol) * row["measured"]:
                bad.append(lines[-1])
    print("\n".join(lines))
    assert not bad, "\n".join(bad)
    # the ragged remainders leave ranks idle (nothing of theirs assembled): checked there too
    assert any(res["ragged_all_to_all"]["idle"] for res in ranks), ranks
