"""The report of scripts/bench_remainder.py: targets (PASS/MISS), markdown tables, plot."""

from __future__ import annotations

from pathlib import Path

from recipes.tables import as_shown
from recipes.units import MiB

LABELS = {
    "agrs": "agrs",
    "pad_all2all": "padded all-to-all",
    "ragged_all_to_all": "ragged all-to-all",
}


def _row(rows: list[dict], s: str, R: int) -> dict | None:
    return next((r for r in rows if r["strategy"] == s and r["R"] == R), None)


def _fmt(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


#: a target: its name, PASS (True), MISS (False) or not judged (None), and the figures
Target = tuple[str, bool | None, str]


def _ragged_idle_peak(rows: list[dict], rs: list[int], strategies: list[str]) -> list[Target]:
    """Ragged idle-rank peak <= 10% of its busy-rank peak (upstream GPU figures, R=2: 48 / 648
    MB), judged at the R it names (R=2 when measured, else the smallest R) on the printed
    ratio."""
    if "ragged_all_to_all" not in strategies:
        return []
    r_eval = 2 if 2 in rs else rs[0]
    row = _row(rows, "ragged_all_to_all", r_eval)
    ratios = {
        r["R"]: r["idle_peak_mib"] / r["busy_peak_mib"]
        for r in rows
        if r["strategy"] == "ragged_all_to_all" and r["idle_peak_mib"] is not None
    }
    ratio = ratios.get(r_eval)
    others = ", ".join(f"R={k}: {v:.1%}" for k, v in sorted(ratios.items()) if k != r_eval)
    return [
        (
            f"ragged idle-rank peak <= 10% of busy-rank peak at R={r_eval}",
            None if ratio is None else as_shown(ratio, ".1%") <= 0.10,
            f"idle {_fmt(row and row['idle_peak_mib'], 2)} MiB / busy "
            f"{_fmt(row and row['busy_peak_mib'], 2)} MiB = "
            f"{'-' if ratio is None else f'{ratio:.1%}'}"
            + (f" (not judged, other R: {others})" if others else ""),
        )
    ]


def _padded_flat(rows: list[dict], rs: list[int], strategies: list[str]) -> list[Target]:
    """The padded all-to-all's peak is flat in R."""
    if "pad_all2all" not in strategies or len(rs) < 2:
        return []
    peaks = [_row(rows, "pad_all2all", R)["peak_mib"] for R in rs]
    ratio = max(peaks) / min(peaks)
    return [
        (
            "padded all-to-all peak flat in R (max/min <= 1.1)",
            as_shown(ratio, ".3f") <= 1.1,
            f"max {max(peaks):.2f} / min {min(peaks):.2f} MiB = {ratio:.3f}x",
        )
    ]


def _agrs_grows(rows: list[dict], rs: list[int], strategies: list[str]) -> list[Target]:
    """The agrs peak grows with R."""
    if "agrs" not in strategies or len(rs) < 2:
        return []
    lo, hi = _row(rows, "agrs", rs[0]), _row(rows, "agrs", rs[-1])
    ratio = hi["peak_mib"] / lo["peak_mib"]
    return [
        (
            f"agrs peak at R={rs[-1]} >= 2.5x its peak at R={rs[0]}",
            as_shown(ratio, ".2f") >= 2.5,
            f"{hi['peak_mib']:.2f} / {lo['peak_mib']:.2f} MiB = {ratio:.2f}x "
            "(upstream GPU figures: 3.2x)",
        )
    ]


def _ragged_time(rows: list[dict], rs: list[int], strategies: list[str]) -> list[Target]:
    """The ragged step time is at most the padded one, at every R."""
    if not {"pad_all2all", "ragged_all_to_all"} <= set(strategies):
        return []
    pairs = [(R, _row(rows, "ragged_all_to_all", R), _row(rows, "pad_all2all", R)) for R in rs]
    worse = [
        (R, a, b)
        for R, a, b in pairs
        if as_shown(a["step_ms"], ".1f") > as_shown(b["step_ms"], ".1f")
    ]
    detail = ", ".join(f"R={R}: {a['step_ms']:.1f} vs {b['step_ms']:.1f}" for R, a, b in pairs)
    return [("ragged step time <= padded step time (every R)", not worse, f"ms {detail}")]


def _bytes(rows: list[dict], rs: list[int], strategies: list[str]) -> list[Target]:
    """The measured bytes equal the plan's; ragged sends the lower bound."""
    mism = [f"{r['strategy']} R={r['R']}" for r in rows if not r["bytes_match_plan"]]
    out: list[Target] = [
        (
            "measured bytes per rank == plan.bytes_sent (every rank, strategy, R)",
            not mism,
            "all equal" if not mism else "differ: " + ", ".join(mism),
        )
    ]
    if "ragged_all_to_all" in strategies:
        rag = [r for r in rows if r["strategy"] == "ragged_all_to_all"]
        off = [r for r in rag if r["bytes_sent_total"] != r["bytes_lower_bound_total"]]
        detail = ", ".join(
            f"R={r['R']}: {r['bytes_sent_total'] / MiB:.3f} MiB" for r in rag[:3]
        ) + (" ..." if len(rag) > 3 else "")
        out.append(
            (
                "ragged total bytes == 2*R*S*(W-1)/W",
                not off,
                detail if not off else "off at " + ", ".join(f"R={r['R']}" for r in off),
            )
        )
    return out


def _overlap(rows: list[dict], rs: list[int], strategies: list[str]) -> list[Target]:
    """Overlap: each strategy's step is at most 1.2x the busiest rank's NS-only time."""
    out: list[Target] = []
    for s in strategies:
        srows = [r for r in rows if r["strategy"] == s]
        worst = max(srows, key=lambda r: r["step_over_ns_only"])
        out.append(
            (
                f"{s}: step <= 1.2x NS-only time of busiest rank (every R)",
                as_shown(worst["step_over_ns_only"], ".2f") <= 1.2,
                f"worst R={worst['R']}: {worst['step_ms']:.1f} / {worst['ns_only_ms']:.1f} ms = "
                f"{worst['step_over_ns_only']:.2f}x; all R: "
                + ", ".join(f"{r['step_over_ns_only']:.2f}" for r in srows),
            )
        )
    return out


#: the benchmark's targets in the order the report lists them
_TARGETS = (_ragged_idle_peak, _padded_flat, _agrs_grows, _ragged_time, _bytes, _overlap)


def evaluate_targets(rows: list[dict], cfg: dict) -> list[dict]:
    """The benchmark's targets, each with its measured figures and PASS/MISS."""
    found = [t for target in _TARGETS for t in target(rows, cfg["r_values"], cfg["strategies"])]
    return [
        dict(target=name, status="n/a" if ok is None else ("PASS" if ok else "MISS"), detail=d)
        for name, ok, d in found
    ]


def markdown(rows: list[dict], targets: list[dict], cfg: dict, machine: str) -> str:
    strategies = cfg["strategies"]
    W = cfg["world_size"]
    lines = [
        f"World size {W} ({cfg['backend']}), {cfg['rows']}x{cfg['cols']} {cfg['dtype']} matrices "
        f"({rows[0]['matrix_mib']:.2f} MiB each), one remainder batch of R, NS "
        f"{cfg['ns_dtype']} 5 steps {cfg['ns_variant'] or 'default variant'}, mean of "
        f"{cfg['steps']} steps (slowest rank) after "
        f"{cfg['warmup']} warm-up; peak = MemoryMeter peak_delta of the optimizer step, max over "
        f"ranks. {machine}",
        "",
        "| R | " + " | ".join(f"{s} ms / peak MiB" for s in strategies) + " |",
        "|---|" + "---|" * len(strategies),
    ]
    for R in cfg["r_values"]:
        cells = []
        for s in strategies:
            r = _row(rows, s, R)
            cells.append(f"{r['step_ms']:.2f} / {r['peak_mib']:.2f}")
        lines.append(f"| {R} | " + " | ".join(cells) + " |")
    r2 = 2 if 2 in cfg["r_values"] else cfg["r_values"][0]
    lines += [
        "",
        f"| R={r2} | ms/step | busy rank MiB | idle rank MiB |",
        "|---|---|---|---|",
    ]
    for s in strategies:
        r = _row(rows, s, r2)
        lines.append(
            f"| {LABELS[s]} | {r['step_ms']:.2f} | {r['busy_peak_mib']:.2f} | "
            f"{_fmt(r['idle_peak_mib'], 2)} |"
        )
    lines += [
        "",
        "Measured vs plan (bytes per rank = max over ranks; plan buffers for the busiest rank:"
        " collective receive buffer, exchange buffers alive at once, NS workspace; NS-only ="
        " the busiest rank's NS without communication, NS in step / wait = its"
        " step_stats muon/ns_s / muon/wait_s; step/NS = step ms / NS-only ms):",
        "",
        "| strategy | R | sent KiB/rank | plan KiB/rank | total KiB | = plan | coll. buf MiB "
        "| exch. buf MiB | NS ws MiB | busy peak MiB | idle peak MiB | NS-only ms "
        "| NS in step ms | wait ms | step/NS |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in strategies:
        for R in cfg["r_values"]:
            r = _row(rows, s, R)
            lines.append(
                f"| {s} | {R} | {r['bytes_sent_max'] / 1024:.0f} | "
                f"{r['plan_bytes_sent_max'] / 1024:.0f} | {r['bytes_sent_total'] / 1024:.0f} | "
                f"{'yes' if r['bytes_match_plan'] else 'NO'} | "
                f"{r['plan_collective_buffer_mib_busy']:.2f} | "
                f"{r['plan_exchange_buffer_mib_busy']:.2f} | "
                f"{r['plan_ns_workspace_mib_busy']:.2f} | {r['busy_peak_mib']:.2f} | "
                f"{_fmt(r['idle_peak_mib'], 2)} | {r['ns_only_ms']:.1f} | "
                f"{r['ns_in_step_ms']:.1f} | {r['wait_ms']:.1f} | "
                f"{r['step_over_ns_only']:.2f} |"
            )
    lines += ["", "Targets:", ""]
    for t in targets:
        lines.append(f"- {t['status']}: {t['target']}: {t['detail']}")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], cfg: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(13, 4.2))
    for s in cfg["strategies"]:
        srows = sorted((r for r in rows if r["strategy"] == s), key=lambda r: r["R"])
        rs = [r["R"] for r in srows]
        (line,) = ax_t.plot(rs, [r["step_ms"] for r in srows], marker="o", label=LABELS[s])
        ax_m.plot(
            rs,
            [r["busy_peak_mib"] for r in srows],
            marker="o",
            color=line.get_color(),
            label=f"{LABELS[s]} (busy rank)",
        )
        idle = [(r["R"], r["idle_peak_mib"]) for r in srows if r["idle_peak_mib"] is not None]
        if idle:
            ax_m.plot(
                *zip(*idle, strict=True),
                marker="x",
                linestyle="--",
                color=line.get_color(),
                label=f"{LABELS[s]} (idle rank)",
            )
    ax_t.set(xlabel="remainder size R", ylabel="ms per optimizer step", title="step time")
    ax_m.set(xlabel="remainder size R", ylabel="peak MiB in the step", title="peak memory")
    from matplotlib.ticker import MaxNLocator

    for ax in (ax_t, ax_m):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # R counts matrices
    ax_t.legend(fontsize=8)
    # outside the axes: inside, the six memory lines leave it no free corner
    ax_m.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    fig.suptitle(
        f"Muon remainder strategies: W={cfg['world_size']} ({cfg['backend']}), "
        f"{cfg['rows']}x{cfg['cols']} {cfg['dtype']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
