"""The dry-run planner's report as text, and its budget check (`recipes.planning.plan`).

`format_report` prints per mesh group a table of the shape groups (busy, idle and viewed rank's
bytes sent, largest collective buffer and per-batch peak per strategy), the viewed rank's step
totals, the Newton-Schulz balance and the attention knobs' costs; `over_budget` lists every
figure above a budget; `fmt_bytes` writes bytes in binary units.
"""

from __future__ import annotations

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


def format_report(report: dict) -> str:
    """Plain-text tables of a `plan()` report."""
    meta, budget = report["meta"], report["meta"]["budget_bytes"]
    view = meta["rank"]
    lines = [
        f"model {meta['model']} on {meta['world_size']} ranks, ep {meta['ep']} "
        f"(expert FSDP group {meta['efsdp']}), view of rank {view}; "
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
    header = ["#", "shape", "blocks", "params", "batches", "rem", "strategy"]
    header += ["busy sent", "busy coll", "busy peak", "idle sent", "idle coll", "idle peak"]
    header += [f"rank {view} sent", f"rank {view} peak"]
    by_mesh: dict[int, list[int]] = {}
    for i, g in enumerate(report["groups"]):
        by_mesh.setdefault(g["mesh_group"], []).append(i)
    for mesh_index, members in by_mesh.items():
        g0 = report["groups"][members[0]]
        rows = []
        for i in members:
            g = report["groups"][i]
            for j, s in enumerate(meta["strategies"]):
                st = g["strategies"][s]
                if j and not st["remainder"]:
                    break  # no remainder batch: the strategy changes nothing
                figs = st["remainder_batch"] or st["group"]
                busy, idle, me = figs["busy"], figs["idle"], st["group"]["view"]
                first = j == 0
                rows.append(
                    [
                        str(i) if first else "",
                        "x".join(map(str, g["shape"])) if first else "",
                        _blocks(g) if first else "",
                        str(g["params"]) if first else "",
                        _merge(st["batches"]),
                        str(st["remainder"]),
                        s if st["remainder"] else "(no remainder)",
                        _cell(busy, "bytes_sent"),
                        _cell(busy, "collective_buffer_bytes", budget),
                        _cell(busy, "peak_bytes", budget),
                        _cell(idle, "bytes_sent"),
                        _cell(idle, "collective_buffer_bytes", budget),
                        _cell(idle, "peak_bytes", budget),
                        _cell(me, "bytes_sent"),
                        _cell(me, "peak_bytes", budget),
                    ]
                )
        lines += [
            "",
            f"mesh group {mesh_index}: FSDP group of {g0['fsdp_size']} ranks, non-FSDP (EP) shard "
            f"factor {g0['non_fsdp_shard_factor']}",
            *_render(header, rows, left={4, 6}),
        ]
        lines += [f"  {i}: {', '.join(report['groups'][i]['names'])}" for i in members]
    lines += ["", f"rank {view}, whole step, per strategy:"]
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
    lines += [
        "",
        f"Newton-Schulz work per rank, whole step: busiest / mean rank and ideal (useful work / "
        f"{meta['world_size']} ranks), TFLOP; NS share = busiest / (busiest + 6 x "
        f"{meta['active_parameters'] / 1e9:.1f}B active params x {meta['tokens_per_step']} tokens "
        f"/ ranks); sent = bytes the busiest rank of comm group g sends (whole step)",
    ]
    rows = []
    for s in meta["strategies"]:
        ns = report["totals"][s]["ns"]
        group = ns.get("ns_flops_per_rank") or [0]
        rows.append(
            [
                s,
                f"{ns['ns_flops_busiest'] / 1e12:.2f}",
                f"{ns['ns_flops_mean'] / 1e12:.2f}",
                f"{ns['ns_flops_ideal'] / 1e12:.2f}",
                f"{ns['busiest_over_ideal']:.3f}",
                f"{ns['ns_share_of_step']:.2%}" if ns["ns_share_of_step"] is not None else "-",
                f"{min(group) / 1e12:.2f}..{max(group) / 1e12:.2f}",
                fmt_bytes(ns.get("bytes_sent_busiest")),
            ]
        )
    header = ["strategy", "busiest", "mean", "ideal", "busiest/ideal", "NS share"]
    header += ["comm group min..max", "busiest sent"]
    lines += _render(header, rows, left={0})
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
    att = report.get("attention")
    if att:
        share = att["qk_clip_record_share"]
        lines += [
            "",
            f"attention knobs, rank {meta['rank']}: NorMuon moments "
            f"{fmt_bytes(att['normuon_state_bytes'])} (with --normuon); QK-clip / attn/max_logit "
            f"recording {att['qk_clip_record_flops'] / 1e12:.2f} TFLOP per step at sequences of "
            f"{att['seq_len']} ({share:.2%} of forward+backward), one MAX all-reduce of "
            f"{fmt_bytes(att['qk_clip_allreduce_bytes'])}",
        ]
    if budget is not None:
        over = report["over_budget"]
        lines.append(f"over budget ({fmt_bytes(budget)}): {len(over)}")
        lines += [f"  {o}" for o in over]
    return "\n".join(lines)


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


def step_report(
    *,
    preset: str,
    world_size: int,
    ep: int,
    rank: int = 0,
    seq_len: int,
    micro_batch: int,
    budget_gib: float | None = None,
    extra: tuple[str, ...] = (),
) -> tuple[str, bool]:
    """Text of the whole-step estimate of `preset` on `world_size` CUDA ranks (bf16 compute,
    the recipe's defaults otherwise), without and with activation checkpointing, and whether
    both fit `budget_gib` (a figure the report shows over the budget is a failed check, as
    everywhere in the planner; the text says which one fits)."""
    from models.glm import get_preset
    from recipes.step_memory import compose_train_config, estimate_for_config

    vocab = get_preset(preset).vocab_size
    lines = [
        f"whole step per rank: {preset}, {world_size} ranks, ep {ep}, rank {rank}, "
        f"micro-batch {micro_batch} x {seq_len} tokens"
    ]
    estimates = []
    for mode in ("none", "full"):
        cfg = compose_train_config(
            [
                f"model={preset}",
                f"mesh.world_size={world_size}",
                f"mesh.ep={ep}",
                f"data.vocab_size={vocab}",
                "data.dtype=uint32",
                f"data.seq_len={seq_len}",
                f"data.batch_size={micro_batch}",
                f"train.activation_checkpointing={mode}",
                *extra,
            ]
        )
        est = estimate_for_config(cfg, world_size=world_size, rank=rank, device_type="cuda")
        estimates.append(est)
        lines += [f" train.activation_checkpointing={mode}:", est.format(budget_gib)]
    fits = budget_gib is None or all(est.fits(budget_gib) for est in estimates)
    return "\n".join(lines), fits
