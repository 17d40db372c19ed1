"""What the benchmark command lines share: argument types and the command as run."""

from __future__ import annotations

import argparse
import shlex
import sys


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
