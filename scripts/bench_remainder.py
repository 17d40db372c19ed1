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
  "busy" rank assembles at least one real matrix (`muon.batch_cost.blocks_on`), an "idle" one none.
- bytes: `opt.step_stats["muon/bytes_sent"]` per rank next to the plan's `bytes_sent(rank)`, and
  the plan's `collective_buffer_bytes`, `exchange_buffer_bytes`, `ns_workspace_bytes`.

Writes `results.json` (configuration, machine, per-rank raw figures, rows, targets),
`results.csv` (one row per strategy and R), `remainder.png` (time and memory vs R) and
`tables.md` into `--out`, and prints the markdown tables and a PASS/MISS line per target.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from recipes.bench.cli import command_line, ns_variant_arg
from recipes.bench.remainder import STRATEGIES, aggregate, resolve_args, sweep
from recipes.bench.remainder_report import evaluate_targets, markdown, plot
from recipes.dtypes import DTYPES
from recipes.tables import machine_description, write_csv
from recipes.world import run_world


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
        type=ns_variant_arg,
        metavar="COEFFICIENTS,ALGORITHM",
        help="Muon's ns_coefficients,ns_algorithm, e.g. fixed,standard (default: Muon's own)",
    )
    p.add_argument("--remainders", default=None, help="R values, e.g. 1,2,7 (default 1..W-1)")
    p.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated")
    p.add_argument("--steps", type=int, default=10, help="timed steps per strategy and R")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (>= 1)")
    p.add_argument("--mem-steps", type=int, default=2, help="profiled steps for memory")
    p.add_argument(
        "--backend", choices=("auto", "gloo", "nccl"), default="auto", help="auto: nccl if W GPUs"
    )
    p.add_argument("--out", default="bench_out", help="output directory (default bench_out/)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before giving up")
    p.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = p.parse_args(argv)
    resolve_args(args)
    return args


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
    machine = machine_description(cfg["backend"], cfg["world_size"])
    print(f"bench_remainder: {json.dumps(cfg)}", flush=True)
    t0 = time.monotonic()
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the profiler's banner, once per rank
    per_rank = run_world(sweep, args.world_size, cfg, backend=args.backend, timeout_s=args.timeout)
    wall = time.monotonic() - t0
    rows = aggregate(per_rank, cfg)
    targets = evaluate_targets(rows, cfg)
    text = markdown(rows, targets, cfg, machine)
    command = command_line("bench_remainder.py", argv)
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
    write_csv(rows, out / "results.csv")
    (out / "tables.md").write_text(text)
    plot(rows, cfg, out / "remainder.png")
    print(text)
    print(f"wrote {out}/results.json, results.csv, tables.md, remainder.png ({wall:.0f} s)")
    if args.strict and any(t["status"] == "MISS" for t in targets):
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main()
