"""Benchmark one MLA + DSA attention layer: masked (dense SDPA under the kept-key mask) against
the sparse dsa_impls (gathered kept keys: latent / per_head), frozen and kl indexer, forward +
backward, seconds and peak memory, one fresh single-thread process per (T, dsa_impl, mode).

    python scripts/bench_attention.py                                  # T = 1k..16k
    python scripts/bench_attention.py --lengths 2048,4096,8192 --out /tmp/attn

What is measured and how: recipes/bench/attention.py. Writes results.json, results.csv,
tables.md and attention.png into `--out` (and the plot to `--plot` if given); prints the
tables and a PASS / MISS line per target (sparse at T = 4096 <= 0.35x the masked time and
<= 0.25x its peak; sparse peak 8192 / 4096 <= 2.3; sparse time 8192 / 2048 <= 10).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from recipes.bench.attention import DSA_IMPLS, MODES, sweep
from recipes.bench.attention_report import markdown, plot, targets
from recipes.bench.cli import command_line, positive_ints_arg, write_results
from recipes.tables import machine_description


def _choices(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    items = [t for t in text.split(",") if t]
    bad = [t for t in items if t not in allowed]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"{flag}: {bad or text!r}; allowed: {','.join(allowed)}")
    return items


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--lengths",
        type=positive_ints_arg("--lengths", "1024,2048"),
        default=[1024, 2048, 4096, 8192, 16384],
        help="T values",
    )
    p.add_argument(
        "--dsa-impls",
        type=lambda t: _choices(t, DSA_IMPLS, "--dsa-impls"),
        default=list(DSA_IMPLS),
        help="dsa_impl values",
    )
    p.add_argument(
        "--modes",
        type=lambda t: _choices(t, MODES, "--modes"),
        default=list(MODES),
        help="indexer_training values",
    )
    p.add_argument("--repeats", type=int, default=2, help="timed steps per process (median)")
    p.add_argument(
        "--masked-max-t", type=int, default=4096, help="longest T the masked dsa_impl runs"
    )
    p.add_argument(
        "--per-head-max-t", type=int, default=4096, help="longest T the per_head dsa_impl runs"
    )
    p.add_argument("--paths", help=argparse.SUPPRESS)  # the former name of --dsa-impls
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per process")
    p.add_argument("--out", default="bench_out/attention", help="output directory")
    p.add_argument("--plot", default=None, help="also write the plot here (e.g. docs/img/...)")
    args = p.parse_args(argv)
    if args.paths is not None:
        p.error(f"--paths is now --dsa-impls (of {', '.join(DSA_IMPLS)})")
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = command_line("bench_attention.py", argv)
    rows = sweep(
        args.lengths,
        args.dsa_impls,
        args.modes,
        repeats=args.repeats,
        max_t={"masked": args.masked_max_t, "per_head": args.per_head_max_t},
        timeout=args.timeout,
    )
    machine = machine_description("gloo", 1)
    text = markdown(rows, command, machine)
    checks = targets(rows)
    write_results(
        out,
        text=text,
        rows=rows,
        fields=["T", "dsa_impl", "mode", "seconds", "peak_mib", "repeats", "skipped"],
        result={"command": command, "machine": machine, "rows": rows, "targets": checks},
        plot=lambda path: plot(rows, path),
        image="attention.png",
        also_plot=args.plot,
    )
    print(text)
    return 0 if all(t["ok"] is not False for t in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
