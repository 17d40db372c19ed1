"""What the benchmark command lines share: argument types and the command as run."""

from __future__ import annotations

import argparse
import shlex
import sys


def ns_variant_arg(text: str) -> dict[str, str]:
    """`--ns-variant COEFFICIENTS,ALGORITHM` (e.g. fixed,standard) as Muon's keyword arguments,
    validated before any rank starts."""
    from muon.newton_schulz import parse_variant

    try:
        return parse_variant(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def command_line(script: str, argv: list[str] | None) -> str:
    """`python scripts/<script> ARGS`, the command written next to a measurement."""
    args = sys.argv[1:] if argv is None else argv
    return shlex.join(["python", f"scripts/{script}", *args])  # quoted as a shell reads it
