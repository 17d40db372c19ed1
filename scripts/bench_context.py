"""Benchmark one MLA + DSA layer under context parallelism: per cp rank, forward + backward
seconds, peak memory and the DSA indexer's FLOPs, for the head-tail and the contiguous
sequence layouts, with the gathered key side kept for backward or gathered again there; one
gloo world of cp ranks (one thread each) per cp.

    python scripts/bench_context.py                                  # cp = 2, 4; S = 8192
    python scripts/bench_context.py --cp 2 --seq-len 2048 --topk 64 --out /tmp/cp

What is measured and how: recipes/bench/context.py. Writes results.json, results.csv,
tables.md and context.png into `--out` (and the plot to `--plot` if given); prints the tables
and a PASS / MISS line per target (head-tail top-k score FLOPs busiest / mean <= 1.02 at every
cp; contiguous > 1.5 at cp >= 4; head-tail CPU time busiest / mean <= 1.10; re-gather saves
fewer bytes for backward than keep); `--strict` exits 1 on a MISS.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from recipes.bench.cli import command_line, names_arg, positive_ints_arg, write_results
from recipes.bench.context import FIELDS, GATHERS, sweep
from recipes.bench.context_report import markdown, plot, targets
from recipes.tables import machine_description

LAYOUTS = ("head_tail", "contiguous")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--cp", type=positive_ints_arg("--cp", "2,4"), default=[2, 4], help="cp world sizes"
    )
    p.add_argument("--seq-len", type=int, default=8192, help="tokens of the whole sequence (S)")
    p.add_argument("--topk", type=int, default=128, help="index_topk (K)")
    p.add_argument("--mode", choices=("kl", "frozen"), default="kl", help="indexer_training")
    p.add_argument("--chunk-mib", type=int, default=64, help="dsa_chunk_mib (query chunks)")
    p.add_argument(
        "--layouts", type=names_arg(LAYOUTS, "--layouts"), default=list(LAYOUTS), help="layouts"
    )
    p.add_argument(
        "--gather",
        type=names_arg(tuple(GATHERS), "--gather"),
        default=list(GATHERS),
        help="keep: the gathered key side kept for backward; regather: gathered again there",
    )
    p.add_argument("--repeats", type=int, default=2, help="timed steps per variant (median)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per world")
    p.add_argument("--out", default="bench_out/context", help="output directory")
    p.add_argument("--plot", default=None, help="also write the plot here (e.g. docs/img/...)")
    p.add_argument("--strict", action="store_true", help="exit 1 if a target is missed")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.topk < 1 or args.chunk_mib < 1:
        p.error("--topk and --chunk-mib must be >= 1")
    bad = [cp for cp in args.cp if args.seq_len % (2 * cp)]
    if bad:
        p.error(f"--seq-len {args.seq_len} must be a multiple of 2 x cp (head_tail) for cp {bad}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = command_line("bench_context.py", argv)
    spec = dict(
        seq_len=args.seq_len,
        topk=args.topk,
        mode=args.mode,
        chunk_mib=args.chunk_mib,
        repeats=args.repeats,
    )
    variants = [(layout, GATHERS[g]) for layout in args.layouts for g in args.gather]
    rows = sweep(args.cp, variants, spec, timeout=args.timeout)
    setup = (
        f"One MLA + DSA layer (hidden 512, 16 heads, q/kv ranks 128, indexer 4 x 32, "
        f"latent path), S = {args.seq_len} tokens, index_topk {args.topk}, indexer "
        f"{args.mode}, dsa_chunk_mib {args.chunk_mib}; gloo, 1 thread per rank; seconds: "
        f"median of {args.repeats} steps of the rank's process CPU time (and wall time)."
    )
    machine = machine_description("gloo", 1)
    text = markdown(rows, command, setup, machine)
    checks = targets(rows)
    result = {"command": command, "machine": machine, "spec": spec, "rows": rows}
    write_results(
        out,
        text=text,
        rows=rows,
        fields=FIELDS,
        result={**result, "targets": checks},
        plot=lambda path: plot(rows, path),
        image="context.png",
        also_plot=args.plot,
    )
    print(text)
    return 1 if args.strict and any(t["ok"] is False for t in checks) else 0


if __name__ == "__main__":
    raise SystemExit(main())
