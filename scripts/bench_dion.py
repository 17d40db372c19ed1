"""`muon.Muon` against torch.optim.Muon on one rank and, given a microsoft/dion checkout,
against dion's distributed Muon on the same FSDP2-sharded matrices on `--world-size` ranks, in
one world each, the optimizers taking turns step by step (`recipes.bench.vs_dion`): time per
step and peak memory per rank. The matrices: `recipes.bench.transient.MODEL` (19, 13.4 M
parameters), float32, bf16 Newton-Schulz.

    git clone https://github.com/microsoft/dion /tmp/dion
    python scripts/bench_dion.py --dion /tmp/dion --out bench_dion_out

Without `--dion` only the single-rank comparison runs. Writes `results.json` and `tables.md`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from recipes.bench.transient import MODEL
from recipes.bench.vs_dion import ONE_UNIT, bench_rank, summary, table
from recipes.world import run_world

OURS = "muon.Muon"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dion", type=Path, default=None, help="a microsoft/dion checkout")
    ap.add_argument("--world-size", type=int, default=4, help="ranks of the dion world")
    ap.add_argument("--strategy", default="pad_all2all", help="muon.Muon's remainder_strategy")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per optimizer")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    ap.add_argument("--repeats", type=int, default=2, help="measured steps (the least counts)")
    ap.add_argument("--out", type=Path, default=None, help="write results.json and tables.md")
    args = ap.parse_args(argv)
    if args.dion is not None and not (args.dion / "dion" / "__init__.py").is_file():
        raise SystemExit(f"--dion: {args.dion} holds no dion/__init__.py (a dion checkout)")
    cfg = dict(
        shapes=MODEL,
        strategy=args.strategy,
        ns_dtype="bf16",
        steps=args.steps,
        warmup=args.warmup,
        repeats=args.repeats,
    )
    results, text = {}, []
    one = dict(cfg, optimizers=[OURS, ONE_UNIT, "torch.optim.Muon"])
    results["one rank"] = summary(run_world(bench_rank, 1, one, backend=None, timeout_s=1800))
    text += ["One rank, plain tensors for torch.optim.Muon:", ""]
    text += [table(results["one rank"], "torch.optim.Muon"), ""]
    if args.dion is not None:
        world = dict(cfg, optimizers=[OURS, ONE_UNIT, "dion.Muon"])
        by_rank = run_world(
            bench_rank,
            args.world_size,
            world,
            backend=None,
            timeout_s=1800,
            pythonpath=str(args.dion.resolve()),
        )
        results["dion"] = summary(by_rank)
        text += [f"{args.world_size} ranks, FSDP2 over a 1-D mesh, gloo:", ""]
        text += [table(results["dion"], "dion.Muon"), ""]
    print("\n".join(text))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(dict(args=cfg, results=results)))
        (args.out / "tables.md").write_text("\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
