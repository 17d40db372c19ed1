"""Tables, targets and plot of the context-parallel benchmark (recipes/bench/context.py)."""

from __future__ import annotations

from pathlib import Path

from recipes.tables import as_shown, markdown_table

#: the top-k scoring's busiest / mean FLOPs the head-tail layout must stay within
HEAD_TAIL_LIMIT = 1.02
#: ... and the contiguous layout must exceed at cp >= CONTIGUOUS_CP: its busiest rank scores
#: (2 cp - 1) / cp times the mean (1.75 at cp = 4)
CONTIGUOUS_LIMIT, CONTIGUOUS_CP = 1.5, 4
#: the head-tail layout's busiest / mean CPU time (a timing: noise on a shared machine)
TIME_LIMIT = 1.10


OPS = {"<=": float.__le__, "<": float.__lt__, ">": float.__gt__}


def _ran(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "skipped" not in r]


def _ratio(values: list[float]) -> float:
    """busiest / mean."""
    return max(values) / (sum(values) / len(values))


def summary_rows(rows: list[dict]) -> list[dict]:
    """One row per (cp, variant) that ran: the busiest / mean of each per-rank figure, the
    slowest rank's wall time, the largest peak and saved bytes."""
    out = []
    for cp in sorted({r["cp"] for r in rows}):
        for variant in dict.fromkeys(r["variant"] for r in rows if r["cp"] == cp):
            ranks = [r for r in _ran(rows) if r["cp"] == cp and r["variant"] == variant]
            if not ranks:
                continue
            out.append(
                {
                    "cp": cp,
                    "variant": variant,
                    "layout": ranks[0]["layout"],
                    "keep_gathered": ranks[0]["keep_gathered"],
                    "tokens": ranks[0]["tokens"],
                    "topk_ratio": _ratio([r["topk_gflop"] for r in ranks]),
                    "causal_ratio": _ratio([r["causal_keys"] for r in ranks]),
                    "indexer_ratio": _ratio([r["indexer_gflop"] for r in ranks]),
                    "layer_ratio": _ratio([r["layer_gflop"] for r in ranks]),
                    "cpu_ratio": _ratio([r["cpu_s"] for r in ranks]),
                    "cpu_s_max": max(r["cpu_s"] for r in ranks),
                    "wall_s_max": max(r["wall_s"] for r in ranks),
                    "peak_mib_max": max(r["peak_mib"] for r in ranks),
                    "saved_mib_max": max(r["saved_mib"] for r in ranks),
                }
            )
    return out


def _find(summary: list[dict], cp: int, layout: str, keep: bool) -> dict | None:
    for s in summary:
        if (s["cp"], s["layout"], s["keep_gathered"]) == (cp, layout, keep):
            return s
    return None


def targets(rows: list[dict]) -> list[dict]:
    """The targets, each with its measured value, its limit and ok: True (PASS), False (MISS)
    or None (not run); verdicts from the values as the tables print them (3 decimals)."""
    summary = summary_rows(rows)
    out = []

    def add(name: str, value: float | None, op: str, limit: float) -> None:
        shown = None if value is None else as_shown(value, ".3f")
        ok = None if shown is None else OPS[op](shown, limit)
        out.append({"target": name, "value": value, "limit": f"{op} {limit}", "ok": ok})

    for cp in sorted({r["cp"] for r in rows}):
        head, cont = _find(summary, cp, "head_tail", True), _find(summary, cp, "contiguous", True)
        name = f"cp={cp} head_tail: top-k score FLOPs busiest / mean"
        add(name, head and head["topk_ratio"], "<=", HEAD_TAIL_LIMIT)
        if cp >= CONTIGUOUS_CP:
            name = f"cp={cp} contiguous: top-k score FLOPs busiest / mean"
            add(name, cont and cont["topk_ratio"], ">", CONTIGUOUS_LIMIT)
        name = f"cp={cp} head_tail: CPU time busiest / mean"
        add(name, head and head["cpu_ratio"], "<=", TIME_LIMIT)
        regathered = {r["layout"] for r in rows if r["cp"] == cp and not r["keep_gathered"]}
        for layout in sorted(regathered):
            keep, again = _find(summary, cp, layout, True), _find(summary, cp, layout, False)
            value = again["saved_mib_max"] / keep["saved_mib_max"] if keep and again else None
            add(f"cp={cp} {layout}: re-gather / keep, MiB saved for backward", value, "<", 1.0)
    return out


def target_lines(checks: list[dict]) -> str:
    """`- PASS: name: value (limit)` per target (MISS, or `not run`)."""
    lines = []
    for t in checks:
        verdict = {True: "PASS", False: "MISS", None: "not run"}[t["ok"]]
        value = "-" if t["value"] is None else f"{t['value']:.3f}"
        lines.append(f"- {verdict}: {t['target']} {t['limit']}: {value}")
    return "\n".join(lines)


SUMMARY_COLUMNS = [
    ("cp", "cp", ""),
    ("variant", "variant", ""),
    ("tokens / rank", "tokens", ""),
    ("top-k score FLOPs busiest/mean", "topk_ratio", ".3f"),
    ("causal keys busiest/mean", "causal_ratio", ".3f"),
    ("indexer FLOPs busiest/mean", "indexer_ratio", ".3f"),
    ("layer FLOPs busiest/mean", "layer_ratio", ".3f"),
    ("CPU s busiest/mean", "cpu_ratio", ".3f"),
    ("busiest CPU s", "cpu_s_max", ".3f"),
    ("slowest wall s", "wall_s_max", ".3f"),
    ("peak MiB", "peak_mib_max", ".1f"),
    ("saved MiB", "saved_mib_max", ".1f"),
]
RANK_COLUMNS = [
    ("cp", "cp", ""),
    ("variant", "variant", ""),
    ("rank", "rank", ""),
    ("positions", "runs", ""),
    ("CPU s", "cpu_s", ".3f"),
    ("wall s", "wall_s", ".3f"),
    ("peak MiB", "peak_mib", ".1f"),
    ("saved MiB", "saved_mib", ".1f"),
    ("top-k score GFLOP", "topk_gflop", ".3f"),
    ("indexer GFLOP", "indexer_gflop", ".3f"),
    ("layer GFLOP", "layer_gflop", ".3f"),
]


def skipped_note(rows: list[dict]) -> str:
    """One line naming the variants that did not run and why ('' when none)."""
    why: dict[tuple[str, str], list[int]] = {}
    for r in rows:
        if "skipped" in r:
            why.setdefault((r["variant"], r["skipped"]), []).append(r["cp"])
    parts = [f"{v} at cp = {', '.join(map(str, cps))} ({w})" for (v, w), cps in why.items()]
    return "Not run: " + "; ".join(parts) + "." if parts else ""


def markdown(rows: list[dict], command: str, setup: str, machine: str) -> str:
    """The command, the setup line, the summary and per-rank tables, the targets, the machine."""
    summary = markdown_table(summary_rows(rows), SUMMARY_COLUMNS)
    note = skipped_note(rows)
    summary += f"\n\n{note}" if note else ""
    per_rank = markdown_table(_ran(rows), RANK_COLUMNS)
    lines = target_lines(targets(rows))
    return f"    {command}\n\n{setup}\n\n{summary}\n\n{per_rank}\n\n{lines}\n\n{machine}\n"


def plot(rows: list[dict], path: Path) -> None:
    """Per rank, one panel row per cp: top-k score GFLOP, CPU seconds and peak MiB, one bar
    per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = _ran(rows)
    cps = sorted({r["cp"] for r in ran})
    figures = (("topk_gflop", "top-k score GFLOP"), ("cpu_s", "CPU s"), ("peak_mib", "peak MiB"))
    fig, axes = plt.subplots(len(cps), 3, figsize=(13, 3.4 * len(cps)), squeeze=False)
    for row_axes, cp in zip(axes, cps, strict=True):
        variants = list(dict.fromkeys(r["variant"] for r in ran if r["cp"] == cp))
        width = 0.8 / len(variants)
        for ax, (key, label) in zip(row_axes, figures, strict=True):
            for i, variant in enumerate(variants):
                mine = sorted(
                    (r for r in ran if r["cp"] == cp and r["variant"] == variant),
                    key=lambda r: r["rank"],
                )
                xs = [r["rank"] + (i - (len(variants) - 1) / 2) * width for r in mine]
                ax.bar(xs, [r[key] for r in mine], width, label=variant)
            ax.set(xlabel="rank", ylabel=label, title=f"cp={cp}: {label}")
            ax.set_xticks(range(cp))
            ax.grid(alpha=0.3, axis="y")
        row_axes[0].legend(fontsize=8)
    fig.suptitle("One MLA + DSA layer under context parallelism: per-rank work, time and memory")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
