"""Reading `metrics.jsonl` back: one JSON object per line, the last line possibly cut.

Rank 0 writes each row as one line and flushes it (`recipes.metrics.MetricsLog`); a process
killed mid-write or a full disk leaves the last line cut (`{"step": 9, "loss": 4.18`). That
line is the only one a crash can damage, so it is returned apart (`MetricsRows.cut`) for the
caller to drop with a warning; any other line that is not a JSON object with an integer
`step` is an error naming the file and its line number. Imports no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class MetricsRows:
    """The rows of a metrics file, and its cut last line (None: the file ends whole)."""

    rows: list[dict[str, Any]]
    cut: str | None = None
    cut_line: int | None = None  # 1-based


class MetricsFileError(ValueError):
    """A line of metrics.jsonl other than the last one is not a row; names file and line."""


def _row(line: str) -> dict[str, Any] | None:
    try:
        row = json.loads(line)
    except ValueError:
        return None
    ok = isinstance(row, dict) and isinstance(row.get("step"), int)
    return row if ok else None


def read_metrics(path: Path) -> MetricsRows:
    """The rows of `path` (empty when it does not exist); blank lines are skipped."""
    path = Path(path)
    if not path.exists():
        return MetricsRows([])
    lines = path.read_text(errors="replace").splitlines()
    numbered = [(n, line) for n, line in enumerate(lines, start=1) if line.strip()]
    rows = []
    for i, (n, line) in enumerate(numbered):
        row = _row(line)
        if row is not None:
            rows.append(row)
        elif i == len(numbered) - 1:
            return MetricsRows(rows, line, n)
        else:
            shown = line if len(line) <= 80 else line[:77] + "..."
            raise MetricsFileError(
                f"{path}:{n}: not a metrics row (a JSON object with an integer step): {shown!r}; "
                "only the last line may be cut by a crash (it is then dropped): fix or remove "
                f"line {n}"
            )
    return MetricsRows(rows)
