"""Benchmark Muon's remainder strategies: step time, per-rank peak memory and bytes per rank.

Reproduces the shape of the upstream pull request's tables (agrs / padded all-to-all / ragged
all-to-all on one remainder batch of R < W matrices) on whatever machine it runs on: a CPU gloo
world by default, CUDA + NCCL (one GPU per rank) when there are at least W GPUs.

    python scripts/bench_remainder.py                       # W=8, 1024x768 bf16, R=1..7
    python scripts/bench_remainder.py --world-size 4 --shape 256x192 --steps 3 --out /tmp/b

For every R and strategy one rank world (spawned once for the whole sweep) builds R matrices,
shards them with FSDP2 `fully_shard` over a 1-D mesh of W ranks and steps a `muon.Muon` on them:
- time: mean over `--steps` steps (after `--warmup`) of the slowest rank's wall time of
  `opt.step()`, unprofiled; the three strategies' steps are interleaved so background load hits
  them alike.
- Newton-Schulz-only time: right after each timed step every rank orthogonalizes, without any
  communication, as many matrices as it did in the step (`step_stats["muon/matrices"]`, so the
  idle ranks of the padded exchange orthogonalize their zero matrix too, and CPU contention is
  the step's); the busiest rank's mean is the overlap reference (`step / NS-only <= 1.2`).
- memory: `--mem-steps` further steps inside `recipes.memory.MemoryMeter`, the peak of
  `peak_delta_bytes` of the optimizer-step region on each rank (measured, never computed). A
  "busy" rank assembles at least one real matrix (`BatchPlan.matrices_on`), an "idle" one none.
- bytes: `opt.step_stats["muon/bytes_sent"]` per rank next to the plan's `bytes_sent(rank)`, and
  the plan's `collective_buffer_bytes`, `exchange_buffer_bytes`, `ns_workspace_bytes`.

Writes `results.json` (configuration, machine, per-rank raw figures, rows, targets),
`results.csv` (one row per strategy and R), `remainder.png` (time and memory vs R) and
`tables.md` into `--out`, and prints the markdown tables and a PASS/MISS line per target.
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

STRATEGIES = ("agrs", "pad_all2all", "ragged_all_to_all")
LABELS = {
    "agrs": "agrs",
    "pad_all2all": "padded all-to-all",
    "ragged_all_to_all": "ragged all-to-all",
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
MiB = 1 << 20
HOST = "127.0.0.1"


# ------------------------------------------------------------------------------ arguments
def _ns_variant(text: str) -> dict[str, str]:
    """`--ns-variant`; muon is imported here, not at the top, so that ranks that import
    another checkout's packages have not loaded this tree's first."""
    from muon.newton_schulz import parse_variant

    try:
        return parse_variant(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--world-size", "-W", type=int, default=None, help="ranks (default 8 on CPU)")
    p.add_argument("--shape", default="1024x768", help="matrix ROWSxCOLS (default 1024x768)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="parameter dtype")
    p.add_argument(
        "--ns-dtype", choices=sorted(DTYPES), default="bf16", help="Newton-Schulz compute dtype"
    )
    p.add_argument(
        "--ns-variant",
        type=_ns_variant,
        metavar="COEFFICIENTS,ALGORITHM",
        help="Muon's ns_coefficients,ns_algorithm, e.g. fixed,standard (default: Muon's own)",
    )
    p.add_argument("--remainders", default=None, help="R values, e.g. 1,2,7 (default 1..W-1)")
    p.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated")
    p.add_argument("--steps", type=int, default=10, help="timed steps per strategy and R")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--mem-steps", type=int, default=2, help="profiled steps for memory")
    p.add_argument(
        "--backend", choices=("auto", "gloo", "nccl"), default="auto", help="auto: nccl if W GPUs"
    )
    p.add_argument("--out", default="bench_out", help="output directory (default bench_out/)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before giving up")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = p.parse_args(argv)
    if args.backend == "auto":
        n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
        want = args.world_size or n_gpu
        args.backend = "nccl" if n_gpu >= 2 and want <= n_gpu else "gloo"
    if args.world_size is None:
        args.world_size = torch.cuda.device_count() if args.backend == "nccl" else 8
    if args.world_size < 2:
        raise SystemExit("--world-size must be >= 2 (a remainder needs R < W)")
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
    return args


# -------------------------------------------------------------------------------- workers
def _worker(rank: int, cfg: dict, port: int, raw_path: str) -> None:
    """One rank: the whole sweep; rank 0 writes every rank's figures to `raw_path`."""
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)  # gloo's deprecated collectives
    torch.set_num_threads(1)
    W = cfg["world_size"]
    store = dist.TCPStore(HOST, port, W + 1, is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group(
        cfg["backend"], store=store, rank=rank, world_size=W, timeout=timedelta(seconds=900)
    )
    try:
        records = _sweep(rank, cfg)
        gathered: list[Any] = [None] * W
        dist.all_gather_object(gathered, records)
        if rank == 0:
            with open(raw_path, "w") as f:
                json.dump(gathered, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _sweep(rank: int, cfg: dict) -> list[dict]:
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from muon import Muon
    from muon.newton_schulz import orthogonalize_blocks
    from recipes.memory import MemoryMeter

    cuda = cfg["backend"] == "nccl"
    if cuda:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    mesh = init_device_mesh(device.type, (cfg["world_size"],), mesh_dim_names=("fsdp",))
    meter = MemoryMeter(device)  # before any parameter: cross-thread tracking from the start
    dtype, ns_dtype = DTYPES[cfg["dtype"]], DTYPES[cfg["ns_dtype"]]
    rows, cols = cfg["rows"], cfg["cols"]
    strategies = cfg["strategies"]

    def build(strategy: str, count: int, seed: int) -> Muon:
        gen = torch.Generator().manual_seed(seed)
        holder = nn.ParameterList(
            [
                nn.Parameter(torch.randn(rows, cols, generator=gen).to(device, dtype))
                for _ in range(count)
            ]
        )
        fully_shard(holder, mesh=mesh)
        for p in holder:
            local = p.to_local()
            grad = torch.randn(local.shape, generator=gen).to(device, dtype)
            p.grad = DTensor.from_local(
                grad, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
            )
        return Muon(
            list(holder), ns_dtype=ns_dtype, remainder_strategy=strategy, **cfg["ns_variant"]
        )

    def timed(fn) -> float:
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    records = []
    for R in cfg["r_values"]:
        opts = {s: build(s, R, cfg["seed"] + R) for s in strategies}
        for _ in range(cfg["warmup"]):
            for s in strategies:
                opts[s].step()
        # Newton-Schulz work of the step, without communication: as many matrices as this rank
        # orthogonalized in the step (padded: idle ranks too, on their zero matrix).
        ns_inputs = {}
        for s in strategies:
            count = int(opts[s].step_stats["muon/matrices"])
            gen = torch.Generator().manual_seed(cfg["seed"] + 1000 + rank)
            ns_inputs[s] = [
                torch.randn(rows, cols, generator=gen).to(device, dtype) for _ in range(count)
            ]

        g = opts[strategies[0]].param_groups[0]  # the optimizer's own Newton-Schulz settings

        def ns_only(mats, g=g):
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

        for s in strategies:
            ns_only(ns_inputs[s])  # warm-up
        step_s = {s: [] for s in strategies}
        ns_only_s = {s: [] for s in strategies}
        ns_in_step_s = {s: [] for s in strategies}
        wait_s = {s: [] for s in strategies}
        for i in range(cfg["steps"]):
            k = i % len(strategies)
            for s in strategies[k:] + strategies[:k]:  # rotate the order: fair background load
                step_s[s].append(timed(opts[s].step))
                ns_in_step_s[s].append(opts[s].step_stats["muon/ns_s"])
                wait_s[s].append(opts[s].step_stats["muon/wait_s"])
                ns_only_s[s].append(timed(lambda m=ns_inputs[s]: ns_only(m)))
        for s in strategies:
            opt = opts[s]
            stats = dict(opt.step_stats)
            peak = 0
            for _ in range(cfg["mem_steps"]):
                dist.barrier()
                sync()
                with meter.measure() as m, m.region("optim"):
                    opt.step()
                    sync()
                peak = max(peak, m.peak_delta_bytes("optim"))
            (mesh_plan, batches) = opt.plans[0]
            assert len(opt.plans) == 1 and len(batches) == 1, "one remainder batch expected"
            b = batches[0]
            assert b.path == s, (b.path, s)
            me = mesh_plan.fsdp_rank
            records.append(
                dict(
                    rank=rank,
                    strategy=s,
                    R=R,
                    step_s=step_s[s],
                    ns_in_step_s=ns_in_step_s[s],
                    ns_only_s=ns_only_s[s],
                    wait_s=wait_s[s],
                    peak_delta_bytes=int(peak),
                    bytes_sent=stats["muon/bytes_sent"],
                    bytes_recv=stats["muon/bytes_recv"],
                    ns_matrices=stats["muon/matrices"],
                    owned=b.matrices_on(me),
                    matrix_bytes=b.matrix_bytes,
                    plan_bytes_sent=b.bytes_sent(me),
                    plan_collective_buffer_bytes=b.collective_buffer_bytes(me),
                    plan_exchange_buffer_bytes=b.exchange_buffer_bytes(me),
                    plan_ns_workspace_bytes=b.ns_workspace_bytes(
                        me, torch.empty(0, dtype=ns_dtype).element_size()
                    ),
                )
            )
        del opts, ns_inputs
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return records


# -------------------------------------------------------------------------------- launching
def run_world(cfg: dict, raw_path: Path, timeout: float) -> list[list[dict]]:
    """Spawn the W ranks once (OMP_NUM_THREADS=1 each) and return their records by rank."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    W = cfg["world_size"]
    store = dist.TCPStore(
        HOST, 0, W + 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120)
    )
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    ctx = mp.start_processes(
        _worker, args=(cfg, store.port, str(raw_path)), nprocs=W, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"benchmark world did not finish within {timeout:.0f} s")
    with open(raw_path) as f:
        return json.load(f)


# ------------------------------------------------------------------------------ reporting
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


def _row(rows: list[dict], s: str, R: int) -> dict | None:
    return next((r for r in rows if r["strategy"] == s and r["R"] == R), None)


def _fmt(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def evaluate_targets(rows: list[dict], cfg: dict) -> list[dict]:
    """The benchmark's targets, each with its measured figures and PASS/MISS."""
    rs = cfg["r_values"]
    strategies = cfg["strategies"]
    out = []

    def add(name: str, ok: bool | None, detail: str) -> None:
        out.append(
            dict(
                target=name,
                status="n/a" if ok is None else ("PASS" if ok else "MISS"),
                detail=detail,
            )
        )

    # 1. ragged idle-rank peak <= 10% of its busy-rank peak (upstream GPU figures, R=2: 48 / 648 MB)
    if "ragged_all_to_all" in strategies:
        r_eval = 2 if 2 in rs else rs[0]
        row = _row(rows, "ragged_all_to_all", r_eval)
        ratios = {
            r["R"]: r["idle_peak_mib"] / r["busy_peak_mib"]
            for r in rows
            if r["strategy"] == "ragged_all_to_all" and r["idle_peak_mib"] is not None
        }
        ratio = ratios.get(r_eval)
        span = ", ".join(f"R={k}: {v:.1%}" for k, v in sorted(ratios.items()))
        add(
            "ragged idle-rank peak <= 10% of busy-rank peak",
            None if ratio is None else ratio <= 0.10,
            f"R={r_eval}: idle {_fmt(row and row['idle_peak_mib'], 2)} MiB / busy "
            f"{_fmt(row and row['busy_peak_mib'], 2)} MiB = "
            f"{'-' if ratio is None else f'{ratio:.1%}'} (all R: {span})",
        )
    # 2. padded peak flat in R
    if "pad_all2all" in strategies and len(rs) > 1:
        peaks = [_row(rows, "pad_all2all", R)["peak_mib"] for R in rs]
        ratio = max(peaks) / min(peaks)
        add(
            "padded all-to-all peak flat in R (max/min <= 1.1)",
            ratio <= 1.1,
            f"max {max(peaks):.2f} / min {min(peaks):.2f} MiB = {ratio:.3f}x",
        )
    # 3. agrs peak grows with R
    if "agrs" in strategies and len(rs) > 1:
        lo, hi = _row(rows, "agrs", rs[0]), _row(rows, "agrs", rs[-1])
        ratio = hi["peak_mib"] / lo["peak_mib"]
        add(
            f"agrs peak at R={rs[-1]} >= 2.5x its peak at R={rs[0]}",
            ratio >= 2.5,
            f"{hi['peak_mib']:.2f} / {lo['peak_mib']:.2f} MiB = {ratio:.2f}x "
            "(upstream GPU figures: 3.2x)",
        )
    # 4. ragged step time <= padded step time
    if {"pad_all2all", "ragged_all_to_all"} <= set(strategies):
        pairs = [(R, _row(rows, "ragged_all_to_all", R), _row(rows, "pad_all2all", R)) for R in rs]
        worse = [(R, a, b) for R, a, b in pairs if a["step_ms"] > b["step_ms"]]
        detail = ", ".join(f"R={R}: {a['step_ms']:.1f} vs {b['step_ms']:.1f}" for R, a, b in pairs)
        add("ragged step time <= padded step time (every R)", not worse, f"ms {detail}")
    # 5. measured bytes == plan; ragged at the lower bound
    mism = [f"{r['strategy']} R={r['R']}" for r in rows if not r["bytes_match_plan"]]
    add(
        "measured bytes per rank == plan.bytes_sent (every rank, strategy, R)",
        not mism,
        "all equal" if not mism else "differ: " + ", ".join(mism),
    )
    if "ragged_all_to_all" in strategies:
        rag = [r for r in rows if r["strategy"] == "ragged_all_to_all"]
        off = [r for r in rag if r["bytes_sent_total"] != r["bytes_lower_bound_total"]]
        detail = ", ".join(
            f"R={r['R']}: {r['bytes_sent_total'] / MiB:.3f} MiB" for r in rag[:3]
        ) + (" ..." if len(rag) > 3 else "")
        add(
            "ragged total bytes == 2*R*S*(W-1)/W",
            not off,
            detail if not off else "off at " + ", ".join(f"R={r['R']}" for r in off),
        )
    # 6. overlap: step <= 1.2x the busiest rank's NS-only time
    for s in strategies:
        srows = [r for r in rows if r["strategy"] == s]
        worst = max(srows, key=lambda r: r["step_over_ns_only"])
        add(
            f"{s}: step <= 1.2x NS-only time of busiest rank (every R)",
            worst["step_over_ns_only"] <= 1.2,
            f"worst R={worst['R']}: {worst['step_ms']:.1f} / {worst['ns_only_ms']:.1f} ms = "
            f"{worst['step_over_ns_only']:.2f}x; all R: "
            + ", ".join(f"{r['step_over_ns_only']:.2f}" for r in srows),
        )
    return out


def markdown(rows: list[dict], targets: list[dict], cfg: dict, machine: str) -> str:
    strategies = cfg["strategies"]
    W = cfg["world_size"]
    lines = [
        f"World size {W} ({cfg['backend']}), {cfg['rows']}x{cfg['cols']} {cfg['dtype']} matrices "
        f"({rows[0]['matrix_mib']:.2f} MiB each), one remainder batch of R, NS "
        f"{cfg['ns_dtype']} 5 steps {cfg['ns_variant'] or 'default variant'}, mean of "
        f"{cfg['steps']} steps (slowest rank) after "
        f"{cfg['warmup']} warm-up; peak = MemoryMeter peak_delta of the optimizer step, max over "
        f"ranks. {machine}",
        "",
        "| R | " + " | ".join(f"{s} ms / peak MiB" for s in strategies) + " |",
        "|---|" + "---|" * len(strategies),
    ]
    for R in cfg["r_values"]:
        cells = []
        for s in strategies:
            r = _row(rows, s, R)
            cells.append(f"{r['step_ms']:.2f} / {r['peak_mib']:.2f}")
        lines.append(f"| {R} | " + " | ".join(cells) + " |")
    r2 = 2 if 2 in cfg["r_values"] else cfg["r_values"][0]
    lines += [
        "",
        f"| R={r2} | ms/step | busy rank MiB | idle rank MiB |",
        "|---|---|---|---|",
    ]
    for s in strategies:
        r = _row(rows, s, r2)
        lines.append(
            f"| {LABELS[s]} | {r['step_ms']:.2f} | {r['busy_peak_mib']:.2f} | "
            f"{_fmt(r['idle_peak_mib'], 2)} |"
        )
    lines += [
        "",
        "Measured vs plan (bytes per rank = max over ranks; plan buffers for the busiest rank:"
        " collective receive buffer, exchange buffers alive at once, NS workspace; NS-only ="
        " the busiest rank's NS without communication, NS in step / wait = its"
        " step_stats muon/ns_s / muon/wait_s; step/NS = step ms / NS-only ms):",
        "",
        "| strategy | R | sent KiB/rank | plan KiB/rank | total KiB | = plan | coll. buf MiB "
        "| exch. buf MiB | NS ws MiB | busy peak MiB | idle peak MiB | NS-only ms "
        "| NS in step ms | wait ms | step/NS |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in strategies:
        for R in cfg["r_values"]:
            r = _row(rows, s, R)
            lines.append(
                f"| {s} | {R} | {r['bytes_sent_max'] / 1024:.0f} | "
                f"{r['plan_bytes_sent_max'] / 1024:.0f} | {r['bytes_sent_total'] / 1024:.0f} | "
                f"{'yes' if r['bytes_match_plan'] else 'NO'} | "
                f"{r['plan_collective_buffer_mib_busy']:.2f} | "
                f"{r['plan_exchange_buffer_mib_busy']:.2f} | "
                f"{r['plan_ns_workspace_mib_busy']:.2f} | {r['busy_peak_mib']:.2f} | "
                f"{_fmt(r['idle_peak_mib'], 2)} | {r['ns_only_ms']:.1f} | "
                f"{r['ns_in_step_ms']:.1f} | {r['wait_ms']:.1f} | "
                f"{r['step_over_ns_only']:.2f} |"
            )
    lines += ["", "Targets:", ""]
    for t in targets:
        lines.append(f"- {t['status']}: {t['target']}: {t['detail']}")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], cfg: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    for s in cfg["strategies"]:
        srows = sorted((r for r in rows if r["strategy"] == s), key=lambda r: r["R"])
        rs = [r["R"] for r in srows]
        (line,) = ax_t.plot(rs, [r["step_ms"] for r in srows], marker="o", label=LABELS[s])
        ax_m.plot(
            rs,
            [r["busy_peak_mib"] for r in srows],
            marker="o",
            color=line.get_color(),
            label=f"{LABELS[s]} (busy rank)",
        )
        idle = [(r["R"], r["idle_peak_mib"]) for r in srows if r["idle_peak_mib"] is not None]
        if idle:
            ax_m.plot(
                *zip(*idle, strict=True),
                marker="x",
                linestyle="--",
                color=line.get_color(),
                label=f"{LABELS[s]} (idle rank)",
            )
    ax_t.set(xlabel="remainder size R", ylabel="ms per optimizer step", title="step time")
    ax_m.set(xlabel="remainder size R", ylabel="peak MiB in the step", title="peak memory")
    for ax in (ax_t, ax_m):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"Muon remainder strategies: W={cfg['world_size']} ({cfg['backend']}), "
        f"{cfg['rows']}x{cfg['cols']} {cfg['dtype']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def machine_description(cfg: dict) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    desc = f"Machine: {os.cpu_count()} CPU cores ({cpu}), torch {torch.__version__}"
    if cfg["backend"] == "nccl":
        desc += f", {cfg['world_size']}x {torch.cuda.get_device_name(0)}"
    else:
        desc += ", 1 thread per rank"
    return desc + "."


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(
        world_size=args.world_size,
        backend=args.backend,
        rows=args.rows,
        cols=args.cols,
        dtype=args.dtype,
        ns_dtype=args.ns_dtype,
        ns_variant=args.ns_variant or {},
        r_values=args.r_values,
        strategies=args.strategy_list,
        steps=args.steps,
        warmup=args.warmup,
        mem_steps=args.mem_steps,
        seed=args.seed,
    )
    machine = machine_description(cfg)
    print(f"bench_remainder: {json.dumps(cfg)}", flush=True)
    t0 = time.monotonic()
    per_rank = run_world(cfg, out / "raw_ranks.json", args.timeout)
    wall = time.monotonic() - t0
    rows = aggregate(per_rank, cfg)
    targets = evaluate_targets(rows, cfg)
    text = markdown(rows, targets, cfg, machine)
    command = "python scripts/bench_remainder.py" + (" " + " ".join(argv) if argv else "")
    if argv is None:
        command = "python scripts/bench_remainder.py " + " ".join(sys.argv[1:])
    result = dict(
        command=command.strip(),
        config=cfg,
        machine=machine,
        wall_s=wall,
        rows=rows,
        targets=targets,
        per_rank=per_rank,
    )
    (out / "results.json").write_text(json.dumps(result, indent=1))
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (out / "tables.md").write_text(text)
    plot(rows, cfg, out / "remainder.png")
    print(text)
    print(f"wrote {out}/results.json, results.csv, tables.md, remainder.png ({wall:.0f} s)")
    if args.strict and any(t["status"] == "MISS" for t in targets):
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main()
