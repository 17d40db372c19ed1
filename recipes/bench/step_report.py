"""The tables and targets of `scripts/bench_step.py`: per strategy, and before / after a
baseline checkout, judged on the figures as the tables print them."""

from __future__ import annotations

from recipes.bench.step import BAG
from recipes.tables import as_shown


def markdown(after: dict, before: dict | None, cfg: dict, command: str) -> str:
    bag = ", ".join(f"{c}x {r}x{k}" + (f"/{b} blocks" if b > 1 else "") for r, k, b, c in BAG)
    lines = [
        f"`{command}`",
        "",
        f"W={cfg['world_size']} ({cfg['backend']}), {cfg['dtype']} params, NS {cfg['ns_dtype']} "
        f"{cfg['ns_variant'] or 'default variant'}; "
        f"bag: {bag}; step = slowest rank, mean of {cfg['steps']} steps; peak = MemoryMeter peak "
        "of the step, max over ranks; NS max/mean = `muon/ns_s` of the slowest rank over the mean",
        "",
        "| strategy | ms/step | peak MiB | NS max/mean | planned NS max/mean | bytes == plan |",
        "|---|---|---|---|---|---|",
    ]
    for s, r in after.items():
        pm = r["planned_max_over_mean"]
        lines.append(
            f"| {s} | {r['step_ms']:.1f} | {r['peak_mib']:.2f} | {r['ns_max_over_mean']:.2f} | "
            f"{'-' if pm is None else f'{pm:.3f}'} | {'yes' if r['bytes_match_plan'] else 'NO'} |"
        )
    if before:
        lines += [
            "",
            f"Before ({cfg['baseline']}) and after, same bag, same machine, one invocation:",
            "",
            "| strategy | before ms/step | after ms/step | before peak MiB | after peak MiB "
            "| before NS max/mean | after NS max/mean |",
            "|---|---|---|---|---|---|---|",
        ]
        for s, r in after.items():
            b = before.get(s)
            cells = (
                [f"{b['step_ms']:.1f}", f"{r['step_ms']:.1f}", f"{b['peak_mib']:.2f}"]
                if b
                else ["-", f"{r['step_ms']:.1f}", "-"]
            )
            cells += [f"{r['peak_mib']:.2f}", f"{b['ns_max_over_mean']:.2f}" if b else "-"]
            cells.append(f"{r['ns_max_over_mean']:.2f}")
            lines.append(f"| {s} | " + " | ".join(cells) + " |")
    lines += ["", "Targets:"]
    for name, ok in targets(after):
        lines.append(f"- {'PASS' if ok else 'MISS'}: {name}")
    return "\n".join(lines) + "\n"


def targets(after: dict) -> list[tuple[str, bool]]:
    """(target, met) per strategy, judged on the figures as the tables print them."""
    out = []
    for s, r in after.items():
        balance = as_shown(r["ns_max_over_mean"], ".2f")
        out.append((f"{s}: NS time max/mean <= 1.2 ({balance:.2f})", balance <= 1.2))
        out.append((f"{s}: measured bytes == plan on every rank", r["bytes_match_plan"]))
    return out
