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
import time
from pathlib import Path

import torch

from muon.plan import REMAINDER_CHOICES as STRATEGIES
from recipes.bench.cli import command_line, ns_variant_arg
from recipes.bench.step import BAG, run_world, summarize
from recipes.bench.step_report import markdown, targets
from recipes.dtypes import DTYPES


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
