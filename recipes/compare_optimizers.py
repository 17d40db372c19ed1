"""What `scripts/compare_optimizers.py` computes from training runs: the comparable runs checked
(`SAME_KEYS`), each group's settings averaged over seeds, its best setting against the
reference's target, the markdown and CSV tables and the validation-loss plot (the script's doc:
which figures)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from recipes.runs import Run, markdown_table
from recipes.tables import write_csv

#: config keys every compared run must share
SAME_KEYS = (
    "model.preset",
    "data.source",
    "data.path",
    "data.seq_len",
    "data.batch_size",
    "data.val_fraction",
    "train.steps",
    "train.warmup_steps",
    "train.schedule",
    "train.grad_accum_steps",
    "eval.every",
    "eval.batches",
    "mesh.world_size",
)
#: (column, help) of the best-setting table, in order
COLUMNS: tuple[tuple[str, str], ...] = (
    ("val_loss", "final held-out loss (nats/token), mean over the setting's runs"),
    ("val_bpb", "final held-out bits per byte"),
    ("steps_to_target", "first evaluated step reaching the target (-: not reached)"),
    ("tokens_to_target", "tokens trained by then"),
    ("vs_reference", "steps_to_target over the reference's"),
    ("tokens_per_s", "median tokens/s"),
    ("optim_share", "optimizer share of step time"),
)


def curve(run: Run) -> list[tuple[int, float]]:
    """(step, val/loss) of every evaluation of a run."""
    return [(r["step"], r["val/loss"]) for r in run.history if r.get("val/loss") is not None]


def tokens_per_step(run: Run) -> int:
    """Tokens one optimizer step trains on (all ranks)."""
    c = run.config_value
    return int(
        c("mesh.world_size")
        * c("train.grad_accum_steps")
        * c("data.batch_size")
        * c("data.seq_len")
    )


def _timing(run: Run) -> list[dict]:
    rows = [r for r in run.history if "step_s" in r]
    return [r for r in rows if r["step"] > 1] or rows


def check_comparable(runs: list[Run]) -> None:
    """Every run has a val/loss curve and the same SAME_KEYS values; else ValueError."""
    if not runs:
        raise ValueError("no runs found")
    for run in runs:
        if not curve(run):
            raise ValueError(f"{run.path}: no val/loss logged (train with eval.every > 0)")
    for key in SAME_KEYS:
        values = {str(r.config_value(key)) for r in runs}
        if len(values) > 1:
            raise ValueError(f"runs differ in {key} ({', '.join(sorted(values))}): not comparable")


def settings(runs: list[Run], by: str, setting: str) -> list[dict[str, Any]]:
    """One row per (group, setting): runs averaged, the mean curve over their common steps."""
    groups: dict[tuple[str, str], list[Run]] = {}
    for run in runs:
        key = (str(run.config_value(by)), str(run.config_value(setting)))
        groups.setdefault(key, []).append(run)
    rows = []
    for (group, value), members in sorted(groups.items()):
        curves = [dict(curve(r)) for r in members]
        steps = sorted(set.intersection(*(set(c) for c in curves)))
        mean = [(s, statistics.fmean(c[s] for c in curves)) for s in steps]
        timing = [_timing(r) for r in members]
        last_bpb = [[r["val/bpb"] for r in m.history if "val/bpb" in r][-1:] for m in members]
        bpb = [b[0] for b in last_bpb if b]
        clock, by_step = 0.0, {}  # cumulative step time at each step (the first run's clock)
        for r in members[0].history:
            clock += r.get("step_s", 0.0)
            by_step[r["step"]] = clock
        elapsed = [(by_step.get(s, clock), v) for s, v in mean]
        rows.append(
            {
                "group": group,
                "setting": value,
                "runs": len(members),
                "curve": mean,
                "elapsed": elapsed,
                "tokens_per_step": tokens_per_step(members[0]),
                "val_loss": mean[-1][1],
                "val_bpb": statistics.fmean(bpb) if bpb else None,
                "tokens_per_s": statistics.median(r["tokens_per_s"] for t in timing for r in t),
                "optim_share": sum(r["optim_s"] for t in timing for r in t)
                / sum(r["step_s"] for t in timing for r in t),
                "paths": [m.path for m in members],
            }
        )
    return rows


def best(rows: list[dict], reference: str | None) -> list[dict]:
    """The best setting of each group, with the steps each needs to reach the target."""
    winners: dict[str, dict] = {}
    for row in rows:
        if row["group"] not in winners or row["val_loss"] < winners[row["group"]]["val_loss"]:
            winners[row["group"]] = row
    if reference is None:
        reference = max(winners, key=lambda g: winners[g]["val_loss"])
    if reference not in winners:
        raise ValueError(f"--reference {reference}: no such group ({', '.join(winners)})")
    target = winners[reference]["val_loss"]
    out = []
    for row in winners.values():
        reached = next((s for s, v in row["curve"] if v <= target), None)
        out.append({**row, "target": target, "reference": reference, "steps_to_target": reached})
    ref_steps = next(r["steps_to_target"] for r in out if r["group"] == reference)
    for r in out:
        s = r["steps_to_target"]
        r["tokens_to_target"] = None if s is None else s * r["tokens_per_step"]
        r["vs_reference"] = None if s is None else s / ref_steps
    return sorted(out, key=lambda r: r["val_loss"])


def markdown(table: list[dict], rows: list[dict], by: str, setting: str) -> str:
    ref = table[0]["reference"]
    cols = ["group", "setting", "runs", *(c for c, _ in COLUMNS)]
    lines = [
        f"# Best `{setting}` per `{by}` on held-out loss",
        "",
        f"Target: the best final val_loss of `{ref}` ({table[0]['target']:.4f}).",
        "",
        *markdown_table(table, cols),
    ]
    lines += ["", f"- `setting`: {setting}", *(f"- `{c}`: {h}" for c, h in COLUMNS)]
    lines += ["", "## Every setting", ""]
    cols = ["group", "setting", "runs", "val_loss", "tokens_per_s", "optim_share"]
    lines += markdown_table(rows, cols)
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], table: list[dict], path: Path, by: str, setting: str) -> Path:
    """val/loss of every setting: the best of each group bold, the others thin."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({r["group"] for r in rows})
    colors = {g: f"C{i}" for i, g in enumerate(groups)}
    winners = {(t["group"], t["setting"]) for t in table}
    fig, (ax_s, ax_t) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for r in rows:
        top = (r["group"], r["setting"]) in winners
        style = {"color": colors[r["group"]], "lw": 2.2 if top else 0.9, "alpha": 1 if top else 0.6}
        label = f"{by}={r['group']} {setting}={r['setting']}" + (" (best)" if top else "")
        ax_s.plot(*zip(*r["curve"], strict=True), marker="." if top else None, label=label, **style)
        ax_t.plot(*zip(*r["elapsed"], strict=True), **style)
    target = table[0]["target"]
    for ax in (ax_s, ax_t):
        ax.axhline(target, color="gray", ls=":", lw=1)
        ax.grid(alpha=0.3)
    per_step = rows[0]["tokens_per_step"]
    top = ax_s.secondary_xaxis("top", functions=(lambda s: s * per_step, lambda t: t / per_step))
    top.set_xlabel("tokens")
    ax_s.set(xlabel="step", ylabel="val/loss (nats per token)")
    ax_t.set(xlabel="training time, rank 0 (s, evaluation excluded)")
    ax_s.legend(fontsize=7)
    fig.suptitle(f"held-out loss by {by}; dotted: the reference's best final loss", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def compare(
    runs: list[Run], out: Path, by: str, setting: str, reference: str | None = None
) -> dict[str, Any]:
    """Write the tables and the plot for `runs` into `out`; return the best-setting table."""
    check_comparable(runs)
    for key in (by, setting):
        missing = [r.path for r in runs if r.config_value(key) is None]
        if missing:
            raise ValueError(f"runs without {key} in their config: {missing}")
    out.mkdir(parents=True, exist_ok=True)
    rows = settings(runs, by, setting)
    table = best(rows, reference)
    (out / "optimizers.md").write_text(markdown(table, rows, by, setting))
    cols = ["group", "setting", "runs", *(c for c, _ in COLUMNS), "target", "reference"]
    write_csv(table, out / "best.csv", cols)
    write_csv(rows, out / "settings.csv", ["group", "setting", "runs", *(c for c, _ in COLUMNS)])
    png = plot(rows, table, out / "val_loss.png", by, setting)
    return {"table": table, "settings": rows, "files": [str(png)]}
