"""What `scripts/compare_strategies.py` computes from training runs grouped by a config key
(`optim.remainder_strategy` by default): per-run figures, per-group averages, the markdown and
CSV tables and the plots (the script's doc: which figures, from which logged keys)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

from muon.plan import REMAINDER_STRATEGIES
from recipes.runs import Run
from recipes.runs import fmt as _fmt
from recipes.tables import write_csv
from recipes.units import MiB

DEFAULT_KEY = "optim.remainder_strategy"
STRATEGY_ORDER = REMAINDER_STRATEGIES

#: (column, help) of the per-strategy table, in order
COLUMNS: tuple[tuple[str, str], ...] = (
    ("step_s", "median step time of the slowest rank (s)"),
    ("optim_s", "median optimizer-step time of the slowest rank (s)"),
    ("step_peak_mib_max", "largest per-rank step peak (MiB)"),
    ("step_peak_mib_min", "smallest per-rank step peak (MiB)"),
    ("optim_peak_delta_mib_max", "largest per-rank optimizer-step transient (MiB)"),
    ("optim_peak_delta_mib_min", "smallest per-rank optimizer-step transient (MiB)"),
    ("bytes_sent_mib_max", "Muon bytes sent per step, busiest rank (MiB)"),
    ("bytes_sent_mib_min", "Muon bytes sent per step, least busy rank (MiB)"),
    ("tokens_per_s", "median tokens/s"),
    ("loss_last", "last logged loss"),
    ("val_loss_last", "last held-out loss (val/loss)"),
)
MEMORY_KEYS = ("step_peak_mib", "optim_peak_delta_mib", "optim_peak_mib")


# ---------------------------------------------------------------------------- aggregating
def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(values) if values else None


def _is_profiled(row: dict) -> bool:
    return any(k.startswith("memory/") for k in row)


def _timing_rows(history: list[dict]) -> list[dict]:
    rows = [r for r in history if "step_s" in r or "step_s/max" in r]
    later = [r for r in rows if r.get("step", 0) > 1] or rows  # step 1 builds optimizer state
    return [r for r in later if not _is_profiled(r)] or later


def _get(row: dict, key: str) -> float | None:
    return row.get(f"{key}/max", row.get(key))


def per_rank_peaks(history: list[dict], key: str) -> dict[int, float]:
    """Each rank's largest `memory/rank_<k>/<key>` over the run."""
    peaks: dict[int, float] = {}
    for row in history:
        for k, v in row.items():
            parts = k.split("/")
            is_rank = len(parts) == 3 and parts[0] == "memory" and parts[1].startswith("rank_")
            if is_rank and parts[2] == key and v is not None:
                rank = int(parts[1][len("rank_") :])
                peaks[rank] = max(peaks.get(rank, -math.inf), float(v))
    return peaks


def group_column(key: str) -> str:
    """The column that holds a run's group: `strategy` for the remainder strategy (the
    default), else the key itself (`--by optim.name`: an `optim.name` column)."""
    return "strategy" if key == DEFAULT_KEY else key


def summarize_run(run: Run, key: str = DEFAULT_KEY) -> dict[str, Any]:
    """One row of figures for a run (see the module docstring)."""
    timing = _timing_rows(run.history)
    out: dict[str, Any] = {
        "run": run.name,
        group_column(key): run.config_value(key),
        "source": run.source,
        "steps_logged": len(run.history),
        "step_s": _median([_get(r, "step_s") for r in timing]),
        "optim_s": _median([_get(r, "optim_s") for r in timing]),
        "tokens_per_s": _median([r.get("tokens_per_s") for r in timing]),
        "loss_last": next((r["loss"] for r in reversed(run.history) if "loss" in r), None),
        "val_loss_last": next(
            (r["val/loss"] for r in reversed(run.history) if "val/loss" in r), None
        ),
        "path": run.path,
    }
    for mkey in MEMORY_KEYS:
        peaks = per_rank_peaks(run.history, mkey)
        if not peaks:  # only the over-rank extremes were logged
            hi = [r[f"memory/{mkey}/max"] for r in run.history if f"memory/{mkey}/max" in r]
            lo = [r[f"memory/{mkey}/min"] for r in run.history if f"memory/{mkey}/min" in r]
            out[f"{mkey}_max"] = max(hi) if hi else None
            out[f"{mkey}_min"] = max(lo) if lo else None
        else:
            out[f"{mkey}_max"], out[f"{mkey}_min"] = max(peaks.values()), min(peaks.values())
        out[f"{mkey}_per_rank"] = [peaks[r] for r in sorted(peaks)]
    later = [r for r in run.history if r.get("step", 0) > 1] or run.history
    for side in ("max", "min"):
        values = [r.get(f"muon/bytes_sent/{side}", r.get("muon/bytes_sent")) for r in later]
        value = _median(values)
        out[f"bytes_sent_mib_{side}"] = None if value is None else value / MiB
    return out


def by_strategy(rows: list[dict], key: str = DEFAULT_KEY) -> list[dict]:
    """Rows averaged per group (strategy), in the order agrs, pad_all2all, ragged_all_to_all,
    others."""
    column = group_column(key)
    groups: dict[Any, list[dict]] = {}
    for row in rows:
        groups.setdefault(row[column], []).append(row)

    def order(s):
        return (STRATEGY_ORDER.index(s) if s in STRATEGY_ORDER else len(STRATEGY_ORDER), str(s))

    out = []
    for strategy in sorted(groups, key=order):
        members = groups[strategy]
        agg: dict[str, Any] = {column: strategy, "runs": len(members)}
        for col, _ in COLUMNS:
            values = [m[col] for m in members if m.get(col) is not None]
            agg[col] = statistics.fmean(values) if values else None
        ranks = [
            m["optim_peak_delta_mib_per_rank"]
            for m in members
            if m["optim_peak_delta_mib_per_rank"]
        ]
        agg["optim_peak_delta_mib_per_rank"] = (
            [statistics.fmean(v) for v in zip(*ranks, strict=False)] if ranks else []
        )
        out.append(agg)
    return out


# ------------------------------------------------------------------------------ writing
def markdown(table: list[dict], rows: list[dict], key: str) -> str:
    column = group_column(key)
    cols = [column, "runs", *(c for c, _ in COLUMNS)]
    title = "Muon remainder strategies" if key == DEFAULT_KEY else "Training runs"
    lines = [
        f"# {title}, grouped by `{key}`",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "|".join("---" for _ in cols) + "|",
    ]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in table]
    lines += ["", *(f"- `{c}`: {h}" for c, h in COLUMNS), "", "## Runs", ""]
    run_cols = [column, "run", "source", "steps_logged", "step_s", "optim_s"]
    run_cols += ["optim_peak_delta_mib_max", "optim_peak_delta_mib_min", "bytes_sent_mib_max"]
    lines += ["| " + " | ".join(run_cols) + " |", "|" + "|".join("---" for _ in run_cols) + "|"]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in run_cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def plot(runs: list[Run], rows: list[dict], table: list[dict], out: Path, key: str) -> list[Path]:
    """The PNGs; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    column = group_column(key)
    strategies = [t[column] for t in table]
    colors = {s: f"C{i}" for i, s in enumerate(strategies)}
    written = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        written.append(out / name)

    for metric, name, label in (
        ("step_s", "step_time.png", "step time, slowest rank (s)"),
        ("optim_s", "optim_time.png", "optimizer time, slowest rank (s)"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4))
        seen = set()
        for run, row in zip(runs, rows, strict=True):
            rows_ = [r for r in run.history if r.get("step", 0) > 1] or run.history
            pts = [(r["step"], _get(r, metric)) for r in rows_ if _get(r, metric) is not None]
            if not pts:
                continue
            s = row[column]
            ax.plot(*zip(*pts, strict=True), marker=".", color=colors[s],
                    label=None if s in seen else str(s))  # fmt: skip
            seen.add(s)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set(xlabel="step (from 2: step 1 builds state)", ylabel=label, title=f"by {key}")
        ax.legend()
        save(fig, name)

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(table))
    for i, t in enumerate(table):
        per_rank = t["optim_peak_delta_mib_per_rank"]
        xs = [r + i * width for r in range(len(per_rank))]
        ax.bar(xs, per_rank, width, color=colors[t[column]], label=str(t[column]))
    ranks = max((len(t["optim_peak_delta_mib_per_rank"]) for t in table), default=0)
    ax.set_xticks([r + 0.4 - width / 2 for r in range(ranks)], [str(r) for r in range(ranks)])
    ax.set(xlabel="rank", ylabel="optimizer-step peak delta (MiB)", title="per-rank memory")
    ax.legend()
    save(fig, "memory_per_rank.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(table))
    hi = [t["bytes_sent_mib_max"] or 0 for t in table]
    lo = [t["bytes_sent_mib_min"] or 0 for t in table]
    ax.bar([x - 0.2 for x in xs], hi, 0.4, label="busiest rank", color="C0")
    ax.bar([x + 0.2 for x in xs], lo, 0.4, label="least busy rank", color="C1")
    ax.set_xticks(list(xs), [str(s) for s in strategies])
    ax.set(ylabel="Muon MiB sent per step", title="bytes moved")
    ax.legend()
    save(fig, "bytes_sent.png")
    return written


def compare(runs: list[Run], out: Path, key: str = DEFAULT_KEY) -> dict[str, Any]:
    """Write the tables and plots for `runs` into `out`; return the per-strategy table."""
    if not runs:
        raise ValueError("no runs found")
    missing = [r.path for r in runs if r.config_value(key) is None]
    if missing:
        raise ValueError(f"runs without {key} in their config: {missing}")
    out.mkdir(parents=True, exist_ok=True)
    rows = [summarize_run(r, key) for r in runs]
    column = group_column(key)
    rows_sorted = sorted(rows, key=lambda r: (str(r[column]), r["run"]))
    table = by_strategy(rows, key)
    (out / "comparison.md").write_text(markdown(table, rows_sorted, key))
    write_csv(table, out / "comparison.csv", [column, "runs", *(c for c, _ in COLUMNS)])
    run_cols = [column, "run", "source", "steps_logged", *(c for c, _ in COLUMNS), "path"]
    write_csv(rows_sorted, out / "runs.csv", run_cols)
    pngs = plot(runs, rows, table, out, key)
    return {"table": table, "runs": rows_sorted, "files": [str(p) for p in pngs]}
