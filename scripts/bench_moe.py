"""Benchmark one MoE layer's forward + backward by expert kernel: the per-expert loop, one
grouped matmul (torch._grouped_mm) and the padded batched matmul.

    python scripts/bench_moe.py                              # small's MoE layer, 16 and 64 experts
    python scripts/bench_moe.py --device cuda --dtype bf16 --preset glm52 --experts 32 \\
        --tokens 8192 --out /tmp/moe

Per number of routed experts and kernel: ms per forward + backward (median of interleaved
rounds), dispatched ops and host reads (counted, recipes.bench.probe.all_on_device), and the largest
difference from the loop's output and input gradient. Writes results.json, results.csv and
tables.md into --out and prints the table with the command that made it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from recipes.bench.cli import command_line
from recipes.bench.moe import KERNELS, measure
from recipes.dtypes import DTYPES
from recipes.tables import machine_description, markdown_table, write_csv

COLUMNS = (
    ("routed experts", "experts", ""),
    ("tokens", "tokens", ""),
    ("kernel", "kernel", ""),
    ("ms / fwd+bwd", "ms", ".1f"),
    ("vs loop", "vs_loop", ".2f"),
    ("dispatched ops", "ops", ""),
    ("host reads", "host_reads", ""),
    ("max rel. diff vs loop", "max_rel_diff", ".1e"),
)


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 16,64, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _positive(text: str) -> int:
    value = _ints(text)
    if len(value) != 1:
        raise argparse.ArgumentTypeError(f"expected one positive integer, got {text!r}")
    return value[0]


def _kernels(text: str) -> list[str]:
    kernels = text.split(",")
    bad = [k for k in kernels if k not in KERNELS]
    if bad or kernels[0] != "loop":
        raise argparse.ArgumentTypeError(f"{text!r}: allowed {KERNELS}, the reference 'loop' first")
    return kernels


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small", help="model preset whose MoE layer is timed")
    p.add_argument("--experts", type=_ints, default=[16, 64], help="routed experts, e.g. 16,64")
    p.add_argument("--tokens", type=_positive, default=1024, help="rows into the layer (8 x 128)")
    p.add_argument("--kernels", type=_kernels, default=list(KERNELS), help="loop first")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--rounds", type=_positive, default=20, help="timed rounds per kernel")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per kernel first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_moe_out", help="output directory")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    cfg = {k: v for k, v in vars(args).items() if k != "out"}
    rows = measure(cfg)
    backend = "nccl" if args.device == "cuda" else "gloo"
    text = "\n\n".join(
        [
            f"    {command_line('bench_moe.py', argv)}",
            markdown_table(rows, COLUMNS),
            f"{args.preset}'s MoE layer, {args.dtype} on {args.device}. "
            + machine_description(backend, 1),
        ]
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(dict(config=cfg, rows=rows), indent=1))
    write_csv(rows, out / "results.csv")
    (out / "tables.md").write_text(text + "\n")
    print(text)
    return rows


if __name__ == "__main__":
    main()
