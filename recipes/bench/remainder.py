"""Muon's remainder strategies measured on one world: the sweep each rank runs and its rows.

`sweep(cfg)` runs on every rank of a `recipes.world.run_world` world: for every R and
strategy it builds R FSDP2-sharded matrices (`fixtures.sharded_matrices`) and steps a
`muon.Muon` on them, strategies interleaved (`timing.rotations`); after each timed step every
rank orthogonalizes, without communication, as many matrices as it did in the step (the
overlap reference). Memory: `mem_steps` further steps inside `recipes.memory.MemoryMeter`.
`aggregate` turns every rank's records into one row per (strategy, R). scripts/bench_remainder.py
is the command line; `remainder_report` writes the tables, targets and plot.
"""

from __future__ import annotations

import gc
import math
import statistics

import torch

from muon import batch_cost
from muon.plan import REMAINDER_STRATEGIES as STRATEGIES
from recipes.bench.fixtures import sharded_matrices
from recipes.bench.timing import peak_bytes, rotations, timed
from recipes.dtypes import DTYPES
from recipes.units import MiB

__all__ = ["STRATEGIES", "aggregate", "sweep"]


def sweep(cfg: dict) -> list[dict]:
    """One rank of the benchmark world: every R and strategy; this rank's records."""
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)  # gloo's deprecated collectives
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from recipes.memory import MemoryMeter

    rank = dist.get_rank()
    cuda = cfg["backend"] == "nccl"
    if cuda:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    mesh = init_device_mesh(device.type, (cfg["world_size"],), mesh_dim_names=("fsdp",))
    meter = MemoryMeter(device)  # before any parameter: cross-thread tracking from the start
    strategies = cfg["strategies"]
    records = []
    for R in cfg["r_values"]:
        opts = {s: _muon(cfg, mesh, device, s, R) for s in strategies}
        for _ in range(cfg["warmup"]):
            for s in strategies:
                opts[s].step()
        # Newton-Schulz work of the step, without communication: as many matrices as this rank
        # orthogonalized in the step (padded: idle ranks too, on their zero matrix).
        ns_inputs = {s: _ns_inputs(cfg, opts[s], rank, device) for s in strategies}
        ns_only = _ns_only(opts[strategies[0]].param_groups[0], DTYPES[cfg["ns_dtype"]])
        for s in strategies:
            ns_only(ns_inputs[s])  # warm-up
        keys = ("step_s", "ns_in_step_s", "wait_s", "ns_only_s")
        times = {s: {k: [] for k in keys} for s in strategies}
        for s in rotations(strategies, cfg["steps"]):  # fair background load
            t = times[s]
            t["step_s"].append(timed(opts[s].step, sync=sync))
            t["ns_in_step_s"].append(opts[s].step_stats["muon/ns_s"])
            t["wait_s"].append(opts[s].step_stats["muon/wait_s"])
            t["ns_only_s"].append(timed(lambda m=ns_inputs[s], f=ns_only: f(m), sync=sync))
        for s in strategies:
            stats = dict(opts[s].step_stats)  # the last timed step's, before the memory steps
            peak = peak_bytes(meter, opts[s].step, cfg["mem_steps"], sync=sync)
            records.append(_record(cfg, opts[s], stats, s, R, rank, times[s], peak))
        del opts, ns_inputs
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return records


def _muon(cfg: dict, mesh, device: torch.device, strategy: str, count: int):
    """A `muon.Muon` over `count` fresh FSDP2-sharded matrices of the configured shape."""
    from muon import Muon

    gen = torch.Generator().manual_seed(cfg["seed"] + count)
    params = sharded_matrices(
        [(cfg["rows"], cfg["cols"])] * count,
        mesh,
        generator=gen,
        dtype=DTYPES[cfg["dtype"]],
        device=device,
    )
    return Muon(
        params,
        ns_dtype=DTYPES[cfg["ns_dtype"]],
        remainder_strategy=strategy,
        **cfg["ns_variant"],
    )


def _ns_inputs(cfg: dict, opt, rank: int, device: torch.device) -> list[torch.Tensor]:
    """As many random matrices as this rank orthogonalized in `opt`'s last step."""
    count = int(opt.step_stats["muon/matrices"])
    gen = torch.Generator().manual_seed(cfg["seed"] + 1000 + rank)
    dtype = DTYPES[cfg["dtype"]]
    return [
        torch.randn(cfg["rows"], cfg["cols"], generator=gen).to(device, dtype) for _ in range(count)
    ]


def _ns_only(g: dict, ns_dtype: torch.dtype):
    """Orthogonalize matrices one by one with the optimizer's own Newton-Schulz settings."""
    from muon.newton_schulz import orthogonalize_blocks

    def ns_only(mats):
        for m in mats:
            orthogonalize_blocks(
                m,
                1,
                g["ns_steps"],
                g["ns_coefficients"],
                ns_dtype,
                g["eps"],
                algorithm=g["ns_algorithm"],
            )

    return ns_only


def _record(cfg: dict, opt, stats: dict, s: str, R: int, rank: int, times: dict, peak: int) -> dict:
    """This rank's record of strategy `s` at `R`: its times, measured peak and exchange, and
    what the plan says of its one remainder batch."""
    (mesh_plan, batches) = opt.plans[0]
    assert len(opt.plans) == 1 and len(batches) == 1, "one remainder batch expected"
    b = batches[0]
    assert b.path == s, (b.path, s)
    me = mesh_plan.fsdp_rank
    ns_itemsize = torch.empty(0, dtype=DTYPES[cfg["ns_dtype"]]).element_size()
    return dict(
        rank=rank,
        strategy=s,
        R=R,
        step_s=times["step_s"],
        ns_in_step_s=times["ns_in_step_s"],
        ns_only_s=times["ns_only_s"],
        wait_s=times["wait_s"],
        peak_delta_bytes=int(peak),
        bytes_sent=stats["muon/bytes_sent"],
        bytes_recv=stats["muon/bytes_recv"],
        ns_matrices=stats["muon/matrices"],
        owned=batch_cost.blocks_on(b, me),
        matrix_bytes=b.matrix_bytes,
        plan_bytes_sent=batch_cost.bytes_sent(b, me),
        plan_collective_buffer_bytes=batch_cost.collective_buffer_bytes(b, me),
        plan_exchange_buffer_bytes=batch_cost.exchange_buffer_bytes(b, me),
        plan_ns_workspace_bytes=batch_cost.ns_workspace_bytes(b, me, ns_itemsize),
    )


def aggregate(per_rank: list[list[dict]], cfg: dict) -> list[dict]:
    """One row per (strategy, R) from every rank's records."""
    W = cfg["world_size"]
    by_key: dict[tuple[str, int], list[dict]] = {}
    for records in per_rank:
        for rec in records:
            by_key.setdefault((rec["strategy"], rec["R"]), []).append(rec)
    rows = []
    for (s, R), recs in sorted(by_key.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        recs.sort(key=lambda r: r["rank"])
        n = len(recs[0]["step_s"])
        step_max = [max(r["step_s"][i] for r in recs) for i in range(n)]
        busy = [r for r in recs if r["owned"] > 0]
        idle = [r for r in recs if r["owned"] == 0]
        ns_only_ms = max(statistics.mean(r["ns_only_s"]) for r in recs) * 1e3
        ns_in_step_ms = max(statistics.mean(r["ns_in_step_s"]) for r in recs) * 1e3
        # the rank that spent longest in Newton-Schulz: its wait is the step's exposed comm
        ns_rank = max(recs, key=lambda r: statistics.mean(r["ns_in_step_s"]))
        wait_ms = statistics.mean(ns_rank["wait_s"]) * 1e3
        step_ms = statistics.mean(step_max) * 1e3
        S = recs[0]["matrix_bytes"]
        sent = [r["bytes_sent"] for r in recs]
        plan_sent = [r["plan_bytes_sent"] for r in recs]
        busiest = max(recs, key=lambda r: (r["peak_delta_bytes"], -r["rank"]))
        rows.append(
            dict(
                strategy=s,
                R=R,
                world_size=W,
                step_ms=step_ms,
                step_ms_median=statistics.median(step_max) * 1e3,
                step_ms_stdev=(statistics.stdev(step_max) * 1e3) if n > 1 else 0.0,
                ns_only_ms=ns_only_ms,
                ns_in_step_ms=ns_in_step_ms,
                wait_ms=wait_ms,
                step_over_ns_only=step_ms / ns_only_ms if ns_only_ms else math.inf,
                peak_mib=busiest["peak_delta_bytes"] / MiB,
                busy_peak_mib=max(r["peak_delta_bytes"] for r in busy) / MiB,
                idle_peak_mib=(max(r["peak_delta_bytes"] for r in idle) / MiB) if idle else None,
                busy_ranks=len(busy),
                idle_ranks=len(idle),
                matrix_mib=S / MiB,
                bytes_sent_max=max(sent),
                bytes_sent_total=sum(sent),
                plan_bytes_sent_max=max(plan_sent),
                plan_bytes_sent_total=sum(plan_sent),
                bytes_match_plan=sent == plan_sent,
                bytes_lower_bound_total=2 * R * S * (W - 1) / W,
                plan_collective_buffer_mib_busy=max(r["plan_collective_buffer_bytes"] for r in busy)
                / MiB,
                plan_exchange_buffer_mib_busy=max(r["plan_exchange_buffer_bytes"] for r in busy)
                / MiB,
                plan_ns_workspace_mib_busy=max(r["plan_ns_workspace_bytes"] for r in busy) / MiB,
                plan_exchange_buffer_mib_idle=(
                    max(r["plan_exchange_buffer_bytes"] for r in idle) / MiB if idle else None
                ),
            )
        )
    return rows


def resolve_args(args) -> None:
    """`scripts/bench_remainder.py`'s arguments completed and checked in place: the backend
    (auto: nccl if W GPUs), the world size, `rows` / `cols`, `r_values`, `strategy_list`."""
    if args.backend == "auto":
        n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
        want = args.world_size or n_gpu
        args.backend = "nccl" if n_gpu >= 2 and want <= n_gpu else "gloo"
    if args.world_size is None:
        args.world_size = torch.cuda.device_count() if args.backend == "nccl" else 8
    if args.world_size < 2:
        raise SystemExit("--world-size must be >= 2 (a remainder needs R < W)")
    if args.warmup < 1:
        raise SystemExit(
            f"--warmup {args.warmup}: must be >= 1 (the NS-only reference repeats the matrices "
            "a warm-up step orthogonalized)"
        )
    rows, _, cols = args.shape.lower().partition("x")
    args.rows, args.cols = int(rows), int(cols)
    W = args.world_size
    if args.remainders:
        args.r_values = sorted({int(r) for r in args.remainders.split(",")})
    else:
        args.r_values = list(range(1, W))
    if not all(1 <= r < W for r in args.r_values):
        raise SystemExit(f"--remainders must lie in 1..{W - 1}, got {args.r_values}")
    args.strategy_list = [s for s in args.strategies.split(",") if s]
    bad = set(args.strategy_list) - set(STRATEGIES)
    if bad:
        raise SystemExit(f"--strategies: unknown {sorted(bad)}; allowed {STRATEGIES}")
