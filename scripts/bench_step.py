"""Benchmark a whole Muon step on a model of several shapes: balance, bytes, time and memory.

One world of W ranks (gloo on CPU by default, NCCL with one GPU per rank when there are W GPUs)
shards a bag of matrices with FSDP2 `fully_shard` over a 1-D mesh and steps `muon.Muon` on it
once per remainder strategy and `auto`. The bag mixes what a MoE model has: full batches,
remainders of several sizes, fused experts whole on a rank, and experts whose blocks span k = 2
and k = 4 ranks. Per strategy and rank it records:

- `muon/ns_s` of `step_stats` (time in Newton-Schulz), averaged over the timed steps: the
  target is max / mean over ranks <= 1.2 (owners balanced by `muon.cost.ns_flops`);
- bytes sent (`step_stats["muon/bytes_sent"]`) against the plan's `bytes_sent` on every rank;
- step time (slowest rank, mean of `--steps`, strategies interleaved step by step) and peak
  memory of the step (`recipes.memory.MemoryMeter`, max over ranks and `--mem-steps`).

`--baseline DIR` runs the same bag, in the same invocation and on the same machine, with the
`muon` and `recipes` packages of another checkout (e.g. `git worktree add /tmp/before <commit>`)
for a before/after table; only figures both versions report are compared there. The baseline
runs its own default Newton-Schulz; `--ns-variant fixed,standard` gives this tree
torch.optim.Muon's iteration (the default before Polar Express + Gram), for a like-for-like table.

    python scripts/bench_step.py --out bench_step_out
    python scripts/bench_step.py --baseline /tmp/before --out bench_step_out

Writes `results.json` and `tables.md` into `--out` and prints the tables and targets.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from muon.plan import REMAINDER_CHOICES as STRATEGIES
from recipes.bench.cli import command_line, ns_variant_arg
from recipes.bench.fixtures import DTYPES, sharded_matrices
from recipes.bench.report import as_shown
from recipes.bench.timing import peak_bytes, rotations, timed
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


def markdown(after: dict, before: dict | None, cfg: dict, command: str) -> str:
    bag = ", ".join(f"{c}x {r}x{k}" + (f"/{b} blocks" if b > 1 else "") for r, k, b, c in BAG)
    lines = [
        f"`{command}`",
        "",
        f"W={cfg['world_size']} ({cfg['backend']}), {cfg['dtype']} params, NS {cfg['ns_dtype']} "
        f"{cfg['ns_variant'] or 'default variant'}; "
        f"bag: {bag}; step = slowest rank, mean of {cfg['steps']} steps; peak = MemoryMeter peak "
        "of the step, max over ranks; NS max/mean = `muon/ns_s` of the slowest rank over the mean",
        "",
        "| strategy | ms/step | peak MiB | NS max/mean | planned NS max/mean | bytes == plan |",
        "|---|---|---|---|---|---|",
    ]
    for s, r in after.items():
        pm = r["planned_max_over_mean"]
        lines.append(
            f"| {s} | {r['step_ms']:.1f} | {r['peak_mib']:.2f} | {r['ns_max_over_mean']:.2f} | "
            f"{'-' if pm is None else f'{pm:.3f}'} | {'yes' if r['bytes_match_plan'] else 'NO'} |"
        )
    if before:
        lines += [
            "",
            f"Before ({cfg['baseline']}) and after, same bag, same machine, one invocation:",
            "",
            "| strategy | before ms/step | after ms/step | before peak MiB | after peak MiB "
            "| before NS max/mean | after NS max/mean |",
            "|---|---|---|---|---|---|---|",
        ]
        for s, r in after.items():
            b = before.get(s)
            cells = (
                [f"{b['step_ms']:.1f}", f"{r['step_ms']:.1f}", f"{b['peak_mib']:.2f}"]
                if b
                else ["-", f"{r['step_ms']:.1f}", "-"]
            )
            cells += [f"{r['peak_mib']:.2f}", f"{b['ns_max_over_mean']:.2f}" if b else "-"]
            cells.append(f"{r['ns_max_over_mean']:.2f}")
            lines.append(f"| {s} | " + " | ".join(cells) + " |")
    lines += ["", "Targets:"]
    for name, ok in targets(after):
        lines.append(f"- {'PASS' if ok else 'MISS'}: {name}")
    return "\n".join(lines) + "\n"


def targets(after: dict) -> list[tuple[str, bool]]:
    """(target, met) per strategy, judged on the figures as the tables print them."""
    out = []
    for s, r in after.items():
        balance = as_shown(r["ns_max_over_mean"], ".2f")
        out.append((f"{s}: NS time max/mean <= 1.2 ({balance:.2f})", balance <= 1.2))
        out.append((f"{s}: measured bytes == plan on every rank", r["bytes_match_plan"]))
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world-size", "-W", type=int, default=8, help="ranks (default 8)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="parameter dtype")
    ap.add_argument("--ns-dtype", choices=sorted(DTYPES), default="bf16", help="NS dtype")
    ap.add_argument(
        "--ns-variant",
        type=ns_variant_arg,
        metavar="COEFFICIENTS,ALGORITHM",
        help="Muon's ns_coefficients,ns_algorithm, e.g. fixed,standard (default: Muon's own)",
    )
    ap.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per strategy")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    ap.add_argument("--mem-steps", type=int, default=1, help="profiled steps for memory")
    ap.add_argument(
        "--backend", choices=("gloo", "nccl"), default=None, help="default: nccl if W GPUs"
    )
    ap.add_argument("--baseline", default=None, help="another checkout to compare against")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench_step_out", help="output directory")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = ap.parse_args(argv)
    if args.world_size != 8:
        raise SystemExit("--world-size: the bag is laid out for 8 ranks (sub-groups of 2 and 4)")
    strategies = [s for s in args.strategies.split(",") if s]
    bad = set(strategies) - set(STRATEGIES)
    if bad:
        raise SystemExit(f"--strategies: unknown {sorted(bad)}; allowed {STRATEGIES}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = args.backend or ("nccl" if gpus >= args.world_size else "gloo")
    cfg = dict(
        world_size=args.world_size,
        backend=backend,
        dtype=args.dtype,
        ns_dtype=args.ns_dtype,
        ns_variant=args.ns_variant or {},
        strategies=strategies,
        steps=args.steps,
        warmup=args.warmup,
        mem_steps=args.mem_steps,
        seed=args.seed,
        bag=[list(b) for b in BAG],
        code=None,
        baseline=args.baseline,
    )
    command = command_line("bench_step.py", argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    after = summarize(run_world(cfg))
    before = None
    if args.baseline:
        base = dict(cfg, code=str(Path(args.baseline).resolve()))
        base["strategies"] = [s for s in strategies if s != "auto"]  # the baseline has no auto
        base["ns_variant"] = {}  # the baseline runs its own default Newton-Schulz
        before = summarize(run_world(base))
    text = markdown(after, before, cfg, command.strip())
    result = dict(command=command.strip(), config=cfg, after=after, before=before)
    result["wall_s"] = time.monotonic() - t0
    (out / "results.json").write_text(json.dumps(result, indent=1))
    (out / "tables.md").write_text(text)
    print(text)
    if args.strict and not all(ok for _, ok in targets(after)):
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main()
