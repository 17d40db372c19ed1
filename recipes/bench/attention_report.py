"""Tables, targets and plot of the attention benchmark (recipes/bench/attention.py)."""

from __future__ import annotations

from pathlib import Path

from recipes.tables import markdown_table

SPARSE = "latent"  # the sparse dsa_impl the targets are about (the default)


def _find(rows: list[dict], T: int, dsa_impl: str, mode: str) -> dict | None:
    for r in rows:
        if r["T"] == T and r["dsa_impl"] == dsa_impl and r["mode"] == mode and "skipped" not in r:
            return r
    return None


def wide_rows(rows: list[dict]) -> list[dict]:
    """One row per (T, dsa_impl) that ran, with both modes' seconds and peaks."""
    out = []
    for T in sorted({r["T"] for r in rows}):
        for dsa_impl in dict.fromkeys(r["dsa_impl"] for r in rows):
            row: dict = {"T": T, "dsa_impl": dsa_impl}
            for r in rows:
                if r["T"] == T and r["dsa_impl"] == dsa_impl and "skipped" not in r:
                    row[f"{r['mode']}_s"], row[f"{r['mode']}_peak"] = r["seconds"], r["peak_mib"]
            if len(row) > 2:
                out.append(row)
    return out


def skipped_note(rows: list[dict]) -> str:
    """One line naming the (dsa_impl, T) runs that did not run and why ('' when none)."""
    why: dict[tuple[str, str], list[int]] = {}
    for r in rows:
        if "skipped" in r:
            Ts = why.setdefault((r["dsa_impl"], r["skipped"]), [])
            Ts += [] if r["T"] in Ts else [r["T"]]
    parts = [f"{p} at T = {', '.join(map(str, Ts))} ({reason})" for (p, reason), Ts in why.items()]
    return "Not run: " + "; ".join(parts) + "." if parts else ""


def targets(rows: list[dict]) -> list[dict]:
    """The acceptance targets, each with its measured value and PASS / MISS (None: not run)."""
    out = []

    def add(name: str, value: float | None, limit: float) -> None:
        ok = None if value is None else value <= limit
        out.append({"target": name, "value": value, "limit": limit, "ok": ok})

    for mode in ("frozen", "kl"):
        s, d = _find(rows, 4096, SPARSE, mode), _find(rows, 4096, "masked", mode)
        both = s is not None and d is not None
        add(
            f"T=4096 {mode}: sparse / masked time",
            s["seconds"] / d["seconds"] if both else None,
            0.35,
        )
        add(
            f"T=4096 {mode}: sparse / masked peak",
            s["peak_mib"] / d["peak_mib"] if both else None,
            0.25,
        )
        a, b = _find(rows, 4096, SPARSE, mode), _find(rows, 8192, SPARSE, mode)
        add(
            f"{mode}: sparse peak 8192 / 4096",
            b["peak_mib"] / a["peak_mib"] if a and b else None,
            2.3,
        )
        a = _find(rows, 2048, SPARSE, mode)
        add(
            f"{mode}: sparse time 8192 / 2048",
            b["seconds"] / a["seconds"] if a and b else None,
            10.0,
        )
    return out


def markdown(rows: list[dict], command: str, machine: str) -> str:
    """The results table, the targets table, the command and the machine."""
    table = markdown_table(
        wide_rows(rows),
        [
            ("T", "T", ""),
            ("dsa_impl", "dsa_impl", ""),
            ("frozen s", "frozen_s", ".2f"),
            ("frozen peak MiB", "frozen_peak", ".0f"),
            ("kl s", "kl_s", ".2f"),
            ("kl peak MiB", "kl_peak", ".0f"),
        ],
    )
    verdicts = [
        {**t, "verdict": {True: "PASS", False: "MISS", None: "not run"}[t["ok"]]}
        for t in targets(rows)
    ]
    target_table = markdown_table(
        verdicts,
        [
            ("target", "target", ""),
            ("measured", "value", ".3f"),
            ("limit", "limit", ""),
            ("", "verdict", ""),
        ],
    )
    note = skipped_note(rows)
    table += f"\n\n{note}" if note else ""
    return f"    {command}\n\n{table}\n\n{target_table}\n\n{machine}\n"


def plot(rows: list[dict], path: Path) -> None:
    """Seconds and peak MiB against T (log-log), one line per (dsa_impl, mode)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    for impl in dict.fromkeys(r["dsa_impl"] for r in rows):
        for mode, style in (("frozen", "-"), ("kl", "--")):
            done = sorted(
                (
                    r
                    for r in rows
                    if r["dsa_impl"] == impl and r["mode"] == mode and "skipped" not in r
                ),
                key=lambda r: r["T"],
            )
            if not done:
                continue
            Ts = [r["T"] for r in done]
            (line,) = ax_t.plot(
                Ts, [r["seconds"] for r in done], style, marker="o", label=f"{impl} {mode}"
            )
            ax_m.plot(
                Ts,
                [r["peak_mib"] for r in done],
                style,
                marker="o",
                color=line.get_color(),
                label=f"{impl} {mode}",
            )
    ax_t.set(
        xlabel="sequence length T", ylabel="seconds (forward + backward, 1 thread)", title="time"
    )
    ax_m.set(xlabel="sequence length T", ylabel="peak MiB", title="peak memory")
    for ax in (ax_t, ax_m):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle("One MLA + DSA layer (hidden 512, 16 heads, index_topk 256): masked vs sparse")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
