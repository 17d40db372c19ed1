"""The whole Muon step `scripts/bench_step.py` measures on W ranks: the bag of FSDP2-sharded
matrices, every strategy stepped in turn on each rank (time, Newton-Schulz time, bytes against
the plan, peak memory), the ranks' records summarized per strategy; a baseline checkout's
`muon` runs the same worker (its doc: the figures)."""

from __future__ import annotations

import statistics

import torch

from recipes.bench.fixtures import sharded_matrices
from recipes.bench.timing import peak_bytes, rotations, timed
from recipes.dtypes import DTYPES
from recipes.units import MiB
from recipes.world import run_world as _run_world

#: (rows, cols, blocks, count) at W = 8, rows chunked 8 ways: dense full batches and remainders
#: of R = 1, 3 and 5; experts with blocks of 2 and 4 chunks (sub-groups k = 2, 4) and of one
BAG = (
    (512, 384, 1, 11),
    (384, 384, 1, 9),
    (256, 768, 1, 5),
    (768, 256, 1, 3),
    (1024, 256, 4, 3),
    (1024, 128, 2, 2),
    (1024, 128, 8, 2),
)


def _blocks_key() -> str:
    """The group key for the block count that the `muon` this rank imported accepts: this
    version checks its keys (`muon.validate`, which rejects the former `num_experts`); a
    baseline checkout from before that module still reads `num_experts`."""
    try:
        from muon.validate import MUON_GROUP_KEYS
    except ImportError:
        return "num_experts"
    return "num_blocks" if "num_blocks" in MUON_GROUP_KEYS else "num_experts"


def _planned_bytes_sent(opt) -> int:
    """What `opt`'s plans say this rank sends in a step: a baseline from before `muon.cost`
    asks its plans' own `bytes_sent` method, one from before `muon.paths` its cost model, this
    version its path objects."""
    plans = [(mp.fsdp_rank, b) for mp, bs in opt.plans for b in bs]
    if plans and hasattr(plans[0][1], "bytes_sent"):
        return sum(b.bytes_sent(rank) for rank, b in plans)
    try:
        from muon.batch_cost import bytes_sent
    except ImportError:  # a baseline whose paths' costs live in muon.cost
        from muon.cost import bytes_sent

    return sum(bytes_sent(b, rank) for rank, b in plans)


def _worker(cfg: dict) -> list[dict]:
    """One rank: every strategy on the bag; returns this rank's records."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from muon import Muon  # the baseline's, when the world runs another checkout's packages
    from recipes.memory import MemoryMeter

    torch.set_num_threads(1)
    dist.init_process_group(cfg["backend"])
    rank, W = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank) if cfg["backend"] == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    mesh = init_device_mesh(device.type, (W,), mesh_dim_names=("fsdp",))
    meter = MemoryMeter(device)
    dtype = DTYPES[cfg["dtype"]]

    blocks_key = _blocks_key()

    def build(strategy: str) -> Muon:
        gen = torch.Generator().manual_seed(cfg["seed"])
        groups = []
        for rows, cols, blocks, count in cfg["bag"]:
            params = sharded_matrices(
                [(rows, cols)] * count, mesh, generator=gen, dtype=dtype, device=device
            )
            groups.append({"params": params, blocks_key: blocks})
        return Muon(
            groups,
            ns_dtype=DTYPES[cfg["ns_dtype"]],
            remainder_strategy=strategy,
            **cfg.get("ns_variant", {}),
        )

    strategies = cfg["strategies"]
    opts = {s: build(s) for s in strategies}
    for _ in range(cfg["warmup"]):
        for s in strategies:
            opts[s].step()
    step_s = {s: [] for s in strategies}
    ns_s = {s: [] for s in strategies}
    for s in rotations(strategies, cfg["steps"]):  # fair background load
        step_s[s].append(timed(opts[s].step, sync=sync))
        ns_s[s].append(opts[s].step_stats["muon/ns_s"])
    records = []
    for s in strategies:
        opt = opts[s]
        stats = dict(opt.step_stats)
        peak = peak_bytes(meter, opt.step, cfg["mem_steps"], sync=sync)
        plan = getattr(opt, "plan", None)  # the per-rank NS work only this version plans
        records.append(
            dict(
                rank=rank,
                strategy=s,
                step_s=step_s[s],
                ns_s=ns_s[s],
                peak_bytes=int(peak),
                bytes_sent=stats["muon/bytes_sent"],
                plan_bytes_sent=_planned_bytes_sent(opt),
                matrices=stats["muon/matrices"],
                planned_ns_flops=plan.ns_flops_per_rank[rank] if plan else None,
                batches={k: v for k, v in stats.items() if k.endswith("/batches")},
            )
        )
    dist.barrier()
    dist.destroy_process_group()
    return records


def run_world(cfg: dict) -> list[dict]:
    """The W ranks (recipes.world; `cfg["code"]`: another checkout's packages); the
    records of every rank."""
    by_rank = _run_world(
        _worker, cfg["world_size"], cfg, backend=None, timeout_s=3600, pythonpath=cfg["code"]
    )
    return [rec for recs in by_rank for rec in recs]


def summarize(records: list[dict]) -> dict[str, dict]:
    """Per strategy: step time, peak, NS balance, bytes against the plan."""
    out = {}
    for s in dict.fromkeys(r["strategy"] for r in records):
        recs = sorted((r for r in records if r["strategy"] == s), key=lambda r: r["rank"])
        n = len(recs[0]["step_s"])
        ns_mean = [statistics.mean(r["ns_s"]) for r in recs]
        planned = [r["planned_ns_flops"] for r in recs]
        out[s] = dict(
            step_ms=statistics.mean(max(r["step_s"][i] for r in recs) for i in range(n)) * 1e3,
            peak_mib=max(r["peak_bytes"] for r in recs) / MiB,
            ns_ms_per_rank=[t * 1e3 for t in ns_mean],
            ns_max_over_mean=max(ns_mean) / statistics.mean(ns_mean),
            planned_ns_flops_per_rank=planned,
            planned_max_over_mean=(
                max(planned) / statistics.mean(planned) if None not in planned else None
            ),
            matrices_per_rank=[r["matrices"] for r in recs],
            bytes_sent_per_rank=[r["bytes_sent"] for r in recs],
            plan_bytes_sent_per_rank=[r["plan_bytes_sent"] for r in recs],
            bytes_match_plan=all(r["bytes_sent"] == r["plan_bytes_sent"] for r in recs),
            batches=recs[0]["batches"],
        )
    return out
