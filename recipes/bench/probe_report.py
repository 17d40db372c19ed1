"""Tables of `scripts/probe_step.py`: counts per region, sync sites, side-by-side times."""

from __future__ import annotations

import statistics
from typing import Any

from recipes.bench.probe_step import REGIONS
from recipes.tables import markdown_table

#: (header prefix, region) of the counts table
_REGION_HEADERS = (("opt.step", REGIONS[0]), ("optimizer part", REGIONS[1]), ("step", REGIONS[2]))


def count_row(label: str, tree: str, layers: dict[str, int], rank: dict[str, Any]) -> dict:
    """One row of the counts table: a case on a tree, one rank's counts."""
    row = {
        "case": label,
        "code": tree,
        "layers": _layers(layers),
        "optimizer": rank["optimizer"],
    }
    planned = rank.get("batches")
    row["muon params / batches"] = f"{planned['params']} / {planned['batches']}" if planned else ""
    for short, region in _REGION_HEADERS:
        c = rank.get(region, {})
        row[f"{short} syncs"] = c.get("syncs")
        row[f"{short} ops"] = c.get("ops")
        row[f"{short} aten"] = c.get("aten_events")
    step = rank.get(REGIONS[2], {})
    row["step collectives"] = ", ".join(
        f"{k.split('::')[-1]} {n}" for k, n in sorted(step.get("collectives", {}).items())
    )
    return row


def _layers(layers: dict[str, int]) -> str:
    """`6 (5 MoE)`, `3 + 1 MTP (3 MoE)`."""
    mtp = f" + {layers['mtp_layers']} MTP" if layers["mtp_layers"] else ""
    return f"{layers['layers']}{mtp} ({layers['moe_layers']} MoE)"


def counts_table(rows: list[dict]) -> str:
    """Syncs, dispatched ops and profiler kernels of every region, one row per case."""
    columns = [("case", "case", ""), ("code", "code", ""), ("layers", "layers", "")]
    columns.append(("Muon params / batches", "muon params / batches", ""))
    for short, _ in _REGION_HEADERS:
        columns += [
            (f"{short} syncs", f"{short} syncs", ""),
            (f"{short} ops", f"{short} ops", ""),
            (f"{short} aten kernels", f"{short} aten", ""),
        ]
    columns.append(("step collectives", "step collectives", ""))
    return markdown_table(rows, columns)


def sites_table(rank: dict[str, Any], region: str = REGIONS[2]) -> str:
    """Where one region's syncs come from: site, kind, count (most first)."""
    rows = rank.get(region, {}).get("syncs_by_site", [])
    columns = [("site", "site", ""), ("kind", "kind", ""), ("count", "count", "")]
    return markdown_table(rows, columns)


def ops_sites_table(rank: dict[str, Any], region: str = REGIONS[0], top: int = 25) -> str:
    """Where one region's dispatched ops come from: per file, then the `top` lines (most
    first; the rest summed in one row)."""
    by_site = rank.get(region, {}).get("ops_by_site", {})
    by_file: dict[str, int] = {}
    for site, n in by_site.items():
        path = site.rsplit(":", 1)[0]
        by_file[path] = by_file.get(path, 0) + n
    files = [{"site": f, "count": n} for f, n in sorted(by_file.items(), key=lambda kv: -kv[1])]
    lines = [{"site": s, "count": n} for s, n in list(by_site.items())[:top]]
    rest = sum(list(by_site.values())[top:])
    if rest:
        lines.append({"site": f"{len(by_site) - top} other lines", "count": rest})
    columns = [("site", "site", ""), ("ops", "count", "")]
    return markdown_table(files, columns) + "\n\n" + markdown_table(lines, columns)


def timing_summary(times: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float]]:
    """Per tree, the median slowest-rank seconds of the train step and the optimizer step."""
    return {
        tree: {key: statistics.median(values) for key, values in by_key.items()}
        for tree, by_key in times.items()
    }


def timing_table(label: str, summary: dict[str, dict[str, float]], steps: int) -> str:
    """Median milliseconds of this tree and the baseline, and their ratio (wall: the
    slowest rank's; CPU: the busiest rank's process time)."""
    after, before = summary["after"], summary.get("before")
    rows = []
    names = {
        "opt_s": "optimizer step, wall",
        "step_s": "train step, wall",
        "opt_cpu_s": "optimizer step, CPU",
        "step_cpu_s": "train step, CPU",
    }
    for key, name in names.items():
        row = {"case": label, "what": name, "after ms": 1e3 * after[key], "n": steps}
        if before is not None:
            row["before ms"] = 1e3 * before[key]
            row["after / before"] = after[key] / before[key]
        rows.append(row)
    columns = [
        ("case", "case", ""),
        ("what", "what", ""),
        ("before ms", "before ms", ".1f"),
        ("after ms", "after ms", ".1f"),
        ("after / before", "after / before", ".3f"),
        ("steps per tree", "n", ""),
    ]
    return markdown_table(rows, columns)
