"""A script's output directory: never overwritten unless asked.

`export_hf.py`, `compare_strategies.py`, `compare_optimizers.py` and `prepare_data.py` refuse an
`--out` (or positional out) that exists and is not an empty directory, before any work starts;
`--force` replaces it: the old directory goes whole, so no file of the previous output (a shard
of an export with more shards, a plot of a group no longer there) is left beside the new ones.
Imports only the standard library."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

FORCE_HELP = "replace an existing non-empty output directory (default: refuse it)"


class OutputExists(ValueError):
    """The output exists and is not empty; the message names it and the flag that replaces it."""


def add_force_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--force", action="store_true", help=FORCE_HELP)


def is_taken(path: Path) -> bool:
    """Whether `path` exists as anything but an empty directory."""
    return path.exists() and (not path.is_dir() or any(path.iterdir()))


def check_output(path: Path, force: bool, what: str = "--out", inputs=()) -> None:
    """Raise `OutputExists` when `path` is taken and `force` is not given, or when `force`
    would remove one of `inputs` (the paths the command reads) with it."""
    if not is_taken(path):
        return
    if not force:
        kind = "a non-empty directory" if path.is_dir() else "a file"
        raise OutputExists(
            f"{what} {path}: exists and is {kind}; pass --force to replace it, or pick another"
        )
    inside = [p for p in map(Path, inputs) if p.resolve().is_relative_to(path.resolve())]
    if inside:
        raise OutputExists(f"{what} {path}: holds the input {inside[0]}; --force would delete it")


def replace_output(path: Path, force: bool, inputs=(), what: str = "--out") -> None:
    """`check_output`, then (`force` given) the taken `path` removed."""
    check_output(path, force, what, inputs)
    if is_taken(path):
        clear_output(path)


def clear_output(path: Path) -> None:
    """Remove `path` (a directory with its content, or a file) if it exists: `--force`'s
    replacement, done once the inputs have been read and checked."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
