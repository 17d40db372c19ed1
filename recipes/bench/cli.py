"""What the benchmark command lines share: argument types, the command as run and the files a
run writes."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from recipes.tables import write_csv


def ns_variant_arg(text: str) -> dict[str, str]:
    """`--ns-variant COEFFICIENTS,ALGORITHM` (e.g. fixed,standard) as Muon's keyword arguments,
    validated before any rank starts."""
    from muon.coefficients import parse_variant

    try:
        return parse_variant(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def command_line(script: str, argv: list[str] | None) -> str:
    """`python scripts/<script> ARGS`, the command written next to a measurement."""
    args = sys.argv[1:] if argv is None else argv
    return shlex.join(["python", f"scripts/{script}", *args])  # quoted as a shell reads it


def shapes_arg(text: str) -> list[tuple[str, int, int, int]]:
    """`--shapes`: "LABEL=ROWSxCOLS[xBATCH],..." as GLM_SHAPES-like rows (batch default 2)."""
    out = []
    for item in filter(None, text.split(",")):
        label, _, dims = item.rpartition("=")
        parts = dims.split("x")
        if not label or len(parts) not in (2, 3) or not all(p.isdigit() and int(p) for p in parts):
            raise argparse.ArgumentTypeError(
                f"--shapes item {item!r}: expected LABEL=ROWSxCOLS or LABEL=ROWSxCOLSxBATCH "
                "with positive integers, e.g. expert_up=2048x6144x8"
            )
        r, c, b = (int(p) for p in (parts + ["2"])[:3])
        out.append((label, r, c, b))
    if not out:
        raise argparse.ArgumentTypeError("--shapes: give at least one LABEL=ROWSxCOLS[xBATCH]")
    return out


def names_arg(allowed, flag: str):
    """An argparse type: a comma-separated subset of `allowed`, each name checked."""

    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        bad = [n for n in names if n not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(
                f"{flag}: unknown {', '.join(map(repr, bad))}; allowed: {', '.join(allowed)}"
            )
        return names

    return parse


def positive_ints_arg(flag: str, example: str):
    """An argparse type: comma-separated positive ints (`example` shows the form, e.g. 2,4)."""

    def parse(text: str) -> list[int]:
        try:
            values = [int(t) for t in text.split(",") if t]
        except ValueError:
            values = []
        if not values or min(values) < 1:
            raise argparse.ArgumentTypeError(f"{flag}: positive ints, e.g. {example}; got {text!r}")
        return values

    return parse


def write_results(
    out: Path,
    *,
    text: str,
    rows: Sequence[dict],
    fields: Sequence[str],
    result: dict,
    plot: Callable[[Path], None],
    image: str,
    also_plot: str | None = None,
) -> None:
    """A benchmark run's files in `out`: tables.md (`text`), results.csv (`rows`, columns
    `fields`), results.json (`result`) and the plot `image` (also at `also_plot` if given)."""
    (out / "tables.md").write_text(text)
    write_csv(rows, out / "results.csv", fields)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    plot(out / image)
    if also_plot:
        plot(Path(also_plot))
