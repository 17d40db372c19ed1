"""What one training step would cost the host on a GPU, counted on CPU: per rank, for the
optimizer's `step`, the trainer's optimizer part and the whole train step, the host syncs by
site, the dispatched ops (those of the optimizer's `step` also by the line that dispatched
them), the profiler's aten kernels and the collectives by kind; and the same
on the model with twice the layers, so what grows with the model shows.

    python scripts/probe_step.py mesh.ep=2 --case model=small \\
        --case model=small optim.normuon=true --case model=mla_tiny --out probe_out
    python scripts/probe_step.py mesh.ep=2 --case model=small --baseline-tree /tmp/before \\
        --time-only --time-steps 5 --time-rounds 3 --out probe_time

Every case is `train.py` overrides (the positional ones, written before the options, are
added to every case), run on
`--world-size` local CPU ranks (gloo) by `recipes.bench.probe_step`: train.py's config, model,
optimizer and trainer, one warm-up step, one counted step (`recipes.bench.probe` says what
counts as a sync). `--baseline-tree DIR` runs the same cases with the `muon`, `models` and
`recipes` packages of another checkout (e.g. `git worktree add /tmp/before <commit>`) for a
before/after table; with `--time-steps N` it also times N steps of each case on both trees in
one invocation, alternating the trees round by round (`--time-rounds`), and reports the
median slowest-rank time of the optimizer step and the train step, and their ratio
(`--time-only`: no counts).

Writes `results.json` (every rank's counts and times) and `tables.md` into `--out` and prints
the tables (of `--rank`).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from hydra.errors import HydraException

from recipes.bench.cli import command_line
from recipes.bench.probe_cases import count_cases, time_cases
from recipes.bench.probe_report import counts_table
from recipes.bench.probe_step import compose
from recipes.config import ConfigError


def _tree(path: str) -> str:
    root = Path(path).resolve()
    missing = [p for p in ("muon", "models", "recipes", "conf") if not (root / p).is_dir()]
    if missing:
        raise argparse.ArgumentTypeError(f"--baseline-tree {path}: no {', '.join(missing)} there")
    return str(root)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("overrides", nargs="*", help="train.py overrides added to every case")
    ap.add_argument(
        "--case",
        action="append",
        nargs="+",
        default=None,
        metavar="OVERRIDE",
        help="the train.py overrides of one case (e.g. --case model=small optim.normuon=true); "
        "repeatable (default: one case of the positional overrides alone)",
    )
    ap.add_argument("--world-size", "-W", type=int, default=2, help="ranks (default 2)")
    ap.add_argument("--rank", type=int, default=0, help="the rank the tables show (default 0)")
    ap.add_argument("--no-double", action="store_true", help="skip the twice-the-layers model")
    ap.add_argument("--baseline-tree", type=_tree, default=None, help="another checkout")
    ap.add_argument("--time-steps", type=int, default=0, help="timed steps per tree and round")
    ap.add_argument("--time-rounds", type=int, default=3, help="rounds of the timed trees")
    ap.add_argument("--time-only", action="store_true", help="time, count nothing")
    ap.add_argument("--out", default="probe_out", help="output directory")
    args = ap.parse_args(argv)
    if args.world_size < 1:
        raise SystemExit(f"--world-size must be >= 1, got {args.world_size}")
    if not 0 <= args.rank < args.world_size:
        raise SystemExit(f"--rank must be in [0, {args.world_size}), got {args.rank}")
    if args.time_steps < 0 or args.time_rounds < 1:
        raise SystemExit("--time-steps must be >= 0 and --time-rounds >= 1")
    if args.time_only and not args.time_steps:
        raise SystemExit("--time-only needs --time-steps N (N > 0)")
    cases = [[*c, *args.overrides] for c in args.case or [[]]]
    world = [f"mesh.world_size={args.world_size}"]
    for case in cases:  # a bad override fails here, naming the key, before any rank starts
        try:
            compose([*case, *world])
        except (ConfigError, HydraException) as err:
            raise SystemExit(f"probe_step.py: case {' '.join(case)!r}: {err}") from None
    trees = {"after": None} | ({"before": args.baseline_tree} if args.baseline_tree else {})
    command = command_line("probe_step.py", argv).strip()
    t0 = time.monotonic()
    results, rows, sections = [], [], []
    if not args.time_only:
        results, rows, sections = count_cases(
            cases, args.world_size, args.rank, trees, not args.no_double
        )
    times = []
    if args.time_steps:
        times, timed = time_cases(cases, args.world_size, args.time_steps, args.time_rounds, trees)
        sections += timed
    tables = [counts_table(rows)] if rows else []
    text = "\n\n".join([f"`{command}`", *tables, *sections]) + "\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "command": command,
        "counts": results,
        "times": times,
        "wall_s": time.monotonic() - t0,
    }
    (out / "results.json").write_text(json.dumps(result, indent=1))
    (out / "tables.md").write_text(text)
    print(text)
    return result


if __name__ == "__main__":
    main()
