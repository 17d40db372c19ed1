"""The dry-run planner's report as text, and its budget check (`recipes.planning.plan`).

`format_report` prints per mesh group a table of the shape groups (busy, idle and viewed rank's
bytes sent, largest collective buffer and per-batch peak per strategy), the viewed rank's step
totals, the Newton-Schulz balance and the attention knobs' costs; `over_budget` lists every
figure above a budget; `fmt_bytes` writes bytes in binary units. The whole-step section
(`--step`) is `recipes.planning_step`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from recipes.units import GiB, KiB, MiB, TiB


def fmt_bytes(n: float | None) -> str:
    """Human-readable binary units: 0 B, 512 KiB, 9.00 GiB."""
    if n is None:
        return "-"
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _over(n: int | None, budget: float | None) -> str:
    return "!" if budget is not None and n is not None and n > budget else ""


def _cell(fig: dict | None, key: str, budget: float | None = None) -> str:
    if fig is None:
        return "-"
    return fmt_bytes(fig[key]) + _over(fig[key], budget)


def _render(header: list[str], rows: list[list[str]], left: set[int]) -> list[str]:
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]

    def line(r):
        return "  ".join(
            r[c].ljust(widths[c]) if c in left else r[c].rjust(widths[c]) for c in range(len(r))
        ).rstrip()

    return [line(header), "-" * len(line(header)), *map(line, rows)]


def _blocks(g: dict) -> str:
    """The group's block count; blocks of unequal heights (Muon Split) as count + distinct rows."""
    if not g.get("split_sizes"):
        return str(g["num_blocks"])
    return f"{g['num_blocks']} ({'/'.join(map(str, sorted(set(g['split_sizes']))))} rows)"


def _merge(batches: list) -> str:
    """[[full, 64], [agrs, 12]] -> "full:64 agrs:12"; runs of one path: "subgroup:64+12"."""
    out: list[tuple[str, list[int]]] = []
    for path, n in batches:
        if out and out[-1][0] == path:
            out[-1][1].append(n)
        else:
            out.append((path, [n]))
    return " ".join(
        f"{p}:{'+'.join(map(str, ns)) if len(ns) < 4 else f'{len(ns)}x{ns[0]}'}" for p, ns in out
    )


class _Row(NamedTuple):
    """One strategy of one shape group in the mesh group's table."""

    index: int
    group: dict
    strategy: str
    plan: dict  # the group's figures under `strategy`
    first: bool  # the group's first row: it names the group
    budget: float | None

    @property
    def figs(self) -> dict:
        """The remainder batch's figures, or the whole group's when it has none."""
        return self.plan["remainder_batch"] or self.plan["group"]


def _first(cell: Callable[[_Row], str]) -> Callable[[_Row], str]:
    return lambda r: cell(r) if r.first else ""


#: the mesh group's table, a column each: (header, cell of a `_Row`); left-aligned: LEFT
_GROUP_COLUMNS: list[tuple[str, Callable[[_Row], str]]] = [
    ("#", _first(lambda r: str(r.index))),
    ("shape", _first(lambda r: "x".join(map(str, r.group["shape"])))),
    ("blocks", _first(lambda r: _blocks(r.group))),
    ("params", _first(lambda r: str(r.group["params"]))),
    ("batches", lambda r: _merge(r.plan["batches"])),
    ("rem", lambda r: str(r.plan["remainder"])),
    ("strategy", lambda r: r.strategy if r.plan["remainder"] else "(no remainder)"),
    ("busy sent", lambda r: _cell(r.figs["busy"], "bytes_sent")),
    ("busy coll", lambda r: _cell(r.figs["busy"], "collective_buffer_bytes", r.budget)),
    ("busy peak", lambda r: _cell(r.figs["busy"], "peak_bytes", r.budget)),
    ("idle sent", lambda r: _cell(r.figs["idle"], "bytes_sent")),
    ("idle coll", lambda r: _cell(r.figs["idle"], "collective_buffer_bytes", r.budget)),
    ("idle peak", lambda r: _cell(r.figs["idle"], "peak_bytes", r.budget)),
    ("rank {view} sent", lambda r: _cell(r.plan["group"]["view"], "bytes_sent")),
    ("rank {view} peak", lambda r: _cell(r.plan["group"]["view"], "peak_bytes", r.budget)),
]
_GROUP_LEFT = {"batches", "strategy"}


def _share(ns: dict) -> str:
    return f"{ns['ns_share_of_step']:.2%}" if ns["ns_share_of_step"] is not None else "-"


def _comm_range(ns: dict) -> str:
    group = ns.get("ns_flops_per_rank") or [0]
    return f"{min(group) / 1e12:.2f}..{max(group) / 1e12:.2f}"


#: the Newton-Schulz table, a column each: (header, cell of (strategy, its `ns` totals))
_NS_COLUMNS: list[tuple[str, Callable[[str, dict], str]]] = [
    ("strategy", lambda s, ns: s),
    ("busiest", lambda s, ns: f"{ns['ns_flops_busiest'] / 1e12:.2f}"),
    ("mean", lambda s, ns: f"{ns['ns_flops_mean'] / 1e12:.2f}"),
    ("ideal", lambda s, ns: f"{ns['ns_flops_ideal'] / 1e12:.2f}"),
    ("busiest/ideal", lambda s, ns: f"{ns['busiest_over_ideal']:.3f}"),
    ("NS share", lambda s, ns: _share(ns)),
    ("comm group min..max", lambda s, ns: _comm_range(ns)),
    ("busiest sent", lambda s, ns: fmt_bytes(ns.get("bytes_sent_busiest"))),
]


def _table(columns: list, rows: list[tuple], left: set[str], **header) -> list[str]:
    """`columns` (header, cell) rendered over `rows` (the arguments of every cell)."""
    heads = [h.format(**header) for h, _ in columns]
    cells = [[cell(*row) for _, cell in columns] for row in rows]
    return _render(heads, cells, left={i for i, (h, _) in enumerate(columns) if h in left})


def _cp(meta: dict) -> str:
    """The context-parallel degree, when above 1: the plans do not change with it."""
    cp = meta.get("cp", 1)
    return f", cp {cp} (parameters still sharded over every rank)" if cp > 1 else ""


def _preamble(meta: dict, budget: float | None) -> list[str]:
    lines = [
        f"model {meta['model']} on {meta['world_size']} ranks, ep {meta['ep']} "
        f"(expert FSDP group {meta['efsdp']}){_cp(meta)}, view of rank {meta['rank']}; "
        f"params {meta['dtype']}, NS {meta['ns_dtype']} {meta['ns_algorithm']}, "
        f"nesterov {meta['nesterov']}, "
        f"expert-aware {'on' if meta['expert_aware'] else 'off'}, "
        f"max_inflight {meta['max_inflight']}; plans built in {meta['build_s']:.1f} s",
        f"optimizer: {meta['param_tensors']} parameter tensors (the gradient census all-reduces "
        f"{meta['param_tensors'] + 1} int32 flags, {fmt_bytes(4 * (meta['param_tensors'] + 1))})",
        "busy/idle: a rank of the FSDP group that orthogonalizes a matrix of the remainder batch "
        "(of the whole group when it has none) / one that does not.",
        "sent: bytes sent, both directions; coll: largest collective receive buffer; peak: one "
        "batch's largest stretch (buffers held + Newton-Schulz workspace, muon.batch_cost).",
    ]
    if budget is not None:
        lines.append(f"budget {fmt_bytes(budget)}: '!' marks figures above it.")
    return lines


def _mesh_groups(report: dict) -> list[str]:
    """Per mesh group, its table of shape groups (a row per strategy that changes something)
    and the parameter names of each."""
    meta, groups, lines = report["meta"], report["groups"], []
    by_mesh: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        by_mesh.setdefault(g["mesh_group"], []).append(i)
    for mesh_index, members in by_mesh.items():
        rows = []
        for i in members:
            for j, s in enumerate(meta["strategies"]):
                plan = groups[i]["strategies"][s]
                if j and not plan["remainder"]:
                    break  # no remainder batch: the strategy changes nothing
                rows.append((_Row(i, groups[i], s, plan, j == 0, meta["budget_bytes"]),))
        g0 = groups[members[0]]
        lines += [
            "",
            f"mesh group {mesh_index}: FSDP group of {g0['fsdp_size']} ranks, non-FSDP (EP) shard "
            f"factor {g0['non_fsdp_shard_factor']}",
            *_table(_GROUP_COLUMNS, rows, _GROUP_LEFT, view=meta["rank"]),
        ]
        lines += [f"  {i}: {', '.join(groups[i]['names'])}" for i in members]
    return lines


def _step_totals(report: dict) -> list[str]:
    meta, budget = report["meta"], report["meta"]["budget_bytes"]
    lines = ["", f"rank {meta['rank']}, whole step, per strategy:"]
    for s in meta["strategies"]:
        t = report["totals"][s]
        bound, peak = t["view_step_bound_bytes"], t["view_max_batch_peak_bytes"]
        need = t["resident_bytes"] + bound
        lines.append(
            f"  {s:<17}  sent {fmt_bytes(t['view_bytes_sent'])}, largest batch peak "
            f"{fmt_bytes(peak)}{_over(peak, budget)}, {meta['max_inflight']} batches in flight "
            f"<= {fmt_bytes(bound)}{_over(bound, budget)}; + resident params/grads/state "
            f"{fmt_bytes(t['resident_bytes'])} = {fmt_bytes(need)}{_over(need, budget)}"
        )
    return lines


def _newton_schulz(report: dict) -> list[str]:
    meta = report["meta"]
    lines = [
        "",
        f"Newton-Schulz work per rank, whole step: busiest / mean rank and ideal (useful work / "
        f"{meta['world_size']} ranks), TFLOP; NS share = busiest / (busiest + 6 x "
        f"{meta['active_parameters'] / 1e9:.1f}B active params x {meta['tokens_per_step']} tokens "
        f"/ ranks); sent = bytes the busiest rank of comm group g sends (whole step)",
    ]
    rows = [(s, report["totals"][s]["ns"]) for s in meta["strategies"]]
    lines += _table(_NS_COLUMNS, rows, {"strategy"})
    first = report["totals"][meta["strategies"][0]]["ns"]
    if first.get("subgroup_widening", 1) > 1:
        narrow = first["ns_flops_busiest_unwidened"]
        lines.append(
            f"  sub-groups widened {first['subgroup_widening']}x (muon.owners): without, the "
            f"busiest rank would do {narrow / 1e12:.2f} TFLOP "
            f"({narrow / first['ns_flops_ideal']:.3f} of ideal)"
        )
    if "comm_group" in first:
        g = first["comm_group"]
        lines.append(
            f"  comm group g (per-rank lists in --json): ranks {g[:4]}... ({len(g)} ranks)"
        )
    return lines


def _recording(att: dict) -> str:
    """What QK-clip's max-logit recording costs the rank per step."""
    if att.get("qk_clip_record_path") == "sparse":
        return "nothing extra (DSA's sparse attention keeps each head's kept-key maximum)"
    cp = att.get("cp", 1)
    where = f" (cp {cp}: this rank's {att['seq_len'] // cp} tokens of each)" if cp > 1 else ""
    return (
        f"{att['qk_clip_record_flops'] / 1e12:.2f} TFLOP per step at sequences of "
        f"{att['seq_len']}{where} ({att['qk_clip_record_share']:.2%} of forward+backward)"
    )


def _attention_and_budget(report: dict) -> list[str]:
    meta, budget, lines = report["meta"], report["meta"]["budget_bytes"], []
    att = report.get("attention")
    if att:
        lines += [
            "",
            f"attention knobs, rank {meta['rank']}: NorMuon moments "
            f"{fmt_bytes(att['normuon_state_bytes'])} (with --normuon); QK-clip / attn/max_logit "
            f"recording {_recording(att)}, one MAX all-reduce of "
            f"{fmt_bytes(att['qk_clip_allreduce_bytes'])}",
        ]
    if budget is not None:
        over = report["over_budget"]
        lines.append(f"over budget ({fmt_bytes(budget)}): {len(over)}")
        lines += [f"  {o}" for o in over]
    return lines


def format_report(report: dict) -> str:
    """Plain-text tables of a `plan()` report: the run, the mesh groups' tables, the viewed
    rank's step totals, the Newton-Schulz balance, the attention knobs and the budget."""
    meta = report["meta"]
    parts = [_preamble(meta, meta["budget_bytes"]), _mesh_groups(report), _step_totals(report)]
    parts += [_newton_schulz(report), _attention_and_budget(report)]
    return "\n".join(line for part in parts for line in part)


def over_budget(report: dict, budget: float | None) -> list[str]:
    """Every (group, strategy, rank role) and step total whose planned bytes exceed the budget."""
    if budget is None:
        return []
    out = []
    for i, g in enumerate(report["groups"]):
        shape = "x".join(map(str, g["shape"]))
        for s, st in g["strategies"].items():
            figs = {**(st["remainder_batch"] or {}), "view": st["group"]["view"]}
            for role, fig in figs.items():
                for key in ("collective_buffer_bytes", "peak_bytes"):
                    if fig and fig[key] > budget:
                        out.append(
                            f"group {i} ({shape}) {s}: {role} rank {fig['global_rank']} "
                            f"{key} {fmt_bytes(fig[key])}"
                        )
    for s, t in report["totals"].items():
        need = t["resident_bytes"] + t["view_step_bound_bytes"]
        if need > budget:
            out.append(
                f"{s}: rank {report['meta']['rank']} resident + {report['meta']['max_inflight']}"
                f" batches in flight {fmt_bytes(need)}"
            )
    return out
