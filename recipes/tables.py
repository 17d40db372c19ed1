"""One writer of the tables scripts print and save: markdown for docs, CSV for tools."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def cell(value: Any, fmt: str = "") -> str:
    """A table cell: floats through `fmt` (e.g. ".2f"), None as an empty cell."""
    if value is None:
        return ""
    return format(value, fmt) if isinstance(value, float) and fmt else str(value)


def as_shown(value: float, fmt: str) -> float:
    """`value` as a table prints it through `fmt` (e.g. ".2f", ".1%"): a verdict printed next
    to a figure is computed from this, so it follows from the number the reader sees."""
    text = format(value, fmt)
    return float(text[:-1]) / 100 if text.endswith("%") else float(text)


def markdown_table(rows: Sequence[dict], columns: Sequence[tuple[str, str, str]]) -> str:
    """A markdown table of `rows`; `columns` are (header, key, float format) triples."""
    head = "| " + " | ".join(h for h, _, _ in columns) + " |"
    sep = "|" + "---|" * len(columns)
    body = ["| " + " | ".join(cell(r.get(k), f) for _, k, f in columns) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def write_csv(rows: Sequence[dict], path: Path, fields: Sequence[str] | None = None) -> Path:
    """`rows` as CSV (the columns: `fields`, else every key in first-seen order)."""
    if fields is None:
        fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(fields), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return Path(path)


def machine_description(backend: str, world_size: int) -> str:
    """One sentence naming the machine a measurement ran on (cores, CPU model, torch, GPUs)."""
    import os
    import platform

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    desc = f"Machine: {os.cpu_count()} CPU cores ({cpu}), torch {torch.__version__}"
    if backend == "nccl":
        desc += f", {world_size}x {torch.cuda.get_device_name(0)}"
    else:
        desc += ", 1 thread per rank"
    return desc + "."
