"""Dry-run Muon planner: per-rank bytes moved and peak buffers at cluster scale, on one CPU.

Builds the model on the meta device inside torch's fake process group of `--world-size` ranks,
parallelizes it with the real `models.glm.parallelize` (EP + FSDP2; both by
`recipes.parallel.planning_model`, as the whole-step estimate does), and constructs the real
`muon.Muon` once per remainder strategy. The optimizer's own plans (`opt.plans`) are then read
through the cost model's functions of a `muon.plan.BatchPlan` (`muon.cost`); nothing here
re-models the planning and no parameter memory is allocated.

    python scripts/plan_memory.py --model glm52 --world-size 512 --ep 8
    python scripts/plan_memory.py --model glm52 --world-size 512 --ep 8 --no-expert-aware \
        --budget-gib 80 --json plan.json

Per shape group (one bucket of same-shape matrices on one mesh) it prints the parameter count,
the path(s), the batch sizes and the remainder size, then for each remainder strategy, on a busy
rank (one that orthogonalizes a matrix of the group's remainder batch, or of the group when it
has none) and an idle rank (one that does not) of the FSDP group:

- sent:   bytes the rank sends for all the group's batches, both directions (`bytes_sent`)
- coll:   the largest receive buffer of one collective (`collective_buffer_bytes`); for AGRS
          the all-gather output, the buffer of the GLM-5.2 out-of-memory
- peak:   the largest per-batch peak (`peak_bytes`): exchange buffers alive at once, NS inputs
          included (`exchange_buffer_bytes`) + on the local path one parameter's Nesterov
          input + Newton-Schulz temporaries (`ns_workspace_bytes`)

The footer adds, for the `--rank` view, the resident parameter + gradient + optimizer-state
bytes of the rank's shards and a step bound: the largest sum of per-batch peaks over
`max_inflight` consecutive batches (`window_peak_bytes`: the runtime keeps that many alive).
`--budget-gib` marks every figure above the budget with "!".
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from models.glm import get_preset
from muon import cost
from muon.plan import PATHS, REMAINDER_CHOICES, REMAINDER_STRATEGIES, BatchPlan, MeshCommPlan
from recipes.bench.fixtures import DTYPES
from recipes.parallel import join_fake_world, planning_model

GiB = 1 << 30
TOKENS_PER_STEP = 4 << 20


def fmt_bytes(n: float | None) -> str:
    """Human-readable binary units: 0 B, 512 KiB, 9.00 GiB."""
    if n is None:
        return "-"
    for unit, size in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


# ------------------------------------------------------------------------- building the plans
def build_optimizer(
    model, strategy: str, expert_aware: bool, router: str, ns_dtype, muon_split=False, **kw
):
    """`muon.Muon` over `muon.param_groups(model)`, exactly as the recipe builds it."""
    import muon

    groups = muon.param_groups(model, router=router, muon_split=muon_split)
    return muon.Muon(
        groups,
        remainder_strategy=strategy,
        expert_aware=expert_aware,
        ns_dtype=ns_dtype,
        **kw,
    )


def muon_names(opt) -> list[str]:
    """Muon parameter names in the optimizer's planning order (index = ParamMeta.index)."""
    names = []
    for g in opt.param_groups:
        if g["algorithm"] == "muon":
            names += list(g.get("param_names") or [f"{tuple(p.shape)}" for p in g["params"]])
    return names


def resident_bytes(opt) -> int:
    """This rank's local parameter + gradient + optimizer-state bytes (shards only)."""
    total = 0
    for g in opt.param_groups:
        copies = 3 if g["algorithm"] == "muon" else 4  # param, grad, momentum | exp_avg, _sq
        for p in g["params"]:
            local = p.to_local() if hasattr(p, "to_local") else p
            total += copies * local.numel() * local.element_size()
    return total


# --------------------------------------------------------------------------- reading the plans
def _pattern(name: str) -> str:
    return re.sub(r"\.\d+\.", ".*.", name)


@dataclass
class ShapeGroup:
    """Consecutive batches of one shape bucket on one mesh group."""

    mesh_index: int
    mesh: MeshCommPlan
    batches: list[BatchPlan] = field(default_factory=list)

    @property
    def key(self) -> tuple:
        b = self.batches[0]
        return (self.mesh_index, b.global_shape, b.num_blocks, b.split_sizes, b.itemsize)

    @property
    def params(self) -> int:
        return sum(b.size for b in self.batches)

    @property
    def remainder(self) -> BatchPlan | None:
        rem = [b for b in self.batches if b.path in REMAINDER_STRATEGIES and b.size < b.fsdp_size]
        return rem[0] if rem else None

    def roles(self, batches: list[BatchPlan]) -> dict[str, int | None]:
        """FSDP ranks that orthogonalize something of `batches` (busy) and that do not (idle)."""
        work = [sum(cost.blocks_on(b, r) for b in batches) for r in range(self.mesh.fsdp_size)]
        busy = next((r for r, n in enumerate(work) if n), None)
        idle = next((r for r, n in enumerate(work) if not n), None)
        return {"busy": busy, "idle": idle}


def shape_groups(plans: list[tuple[MeshCommPlan, list[BatchPlan]]]) -> list[ShapeGroup]:
    out: list[ShapeGroup] = []
    for i, (mp, batches) in enumerate(plans):
        for b in batches:
            key = (i, b.global_shape, b.num_blocks, b.split_sizes, b.itemsize)
            if out and out[-1].key == key:
                out[-1].batches.append(b)
            else:
                out.append(ShapeGroup(i, mp, [b]))
    return out


def rank_figures(
    g: ShapeGroup, batches: list[BatchPlan], r: int | None, ns_itemsize: int, nesterov: bool
) -> dict | None:
    """Figures of FSDP rank `r` over `batches`: bytes summed, buffers and peaks maxed."""
    if r is None:
        return None
    return {
        "fsdp_rank": r,
        "global_rank": g.mesh.group_ranks[r] if g.mesh.group_ranks else r,
        "matrices": sum(cost.blocks_on(b, r) for b in batches),
        "bytes_sent": sum(cost.bytes_sent(b, r) for b in batches),
        "collective_buffer_bytes": max(cost.collective_buffer_bytes(b, r) for b in batches),
        "exchange_buffer_bytes": max(cost.exchange_buffer_bytes(b, r) for b in batches),
        "ns_workspace_bytes": max(cost.ns_workspace_bytes(b, r, ns_itemsize) for b in batches),
        "input_bytes": max(cost.nesterov_input_bytes(b, r, nesterov) for b in batches),
        "peak_bytes": max(cost.peak_bytes(b, r, ns_itemsize, nesterov=nesterov) for b in batches),
    }


def summarize(opts: dict[str, object], ns_itemsize: int, nesterov: bool, fwd_bwd: float) -> dict:
    """Shape groups with per-strategy figures for the busy, idle and view ranks, and the
    Newton-Schulz balance of the whole step (`fwd_bwd`: a training step's FLOPs per rank)."""
    first = next(iter(opts.values()))
    names = muon_names(first)
    per_strategy = {s: shape_groups(o.plans) for s, o in opts.items()}
    groups = []
    for gi, base in enumerate(per_strategy[next(iter(opts))]):
        b0 = base.batches[0]
        pnames = sorted({_pattern(names[i]) for b in base.batches for i in b.param_indices})
        entry = {
            "mesh_group": base.mesh_index,
            "fsdp_size": base.mesh.fsdp_size,
            "non_fsdp_shard_factor": base.mesh.non_fsdp_shard_factor,
            "shape": list(b0.global_shape),
            "num_blocks": b0.num_blocks,
            "split_sizes": list(b0.split_sizes),
            "fsdp_visible_rows": b0.fsdp_visible_rows,
            "itemsize": b0.itemsize,
            "params": base.params,
            "names": pnames,
            "strategies": {},
        }
        for s, groups_s in per_strategy.items():
            g = groups_s[gi]
            assert g.key == base.key and g.params == base.params, "strategies planned differently"
            rem = g.remainder

            def figures(batches, roles, g=g):
                return {
                    role: rank_figures(g, batches, r, ns_itemsize, nesterov)
                    for role, r in roles.items()
                }

            entry["strategies"][s] = {
                "paths": sorted({b.path for b in g.batches}, key=PATHS.index),
                "batches": [[b.path, b.size] for b in g.batches],
                "remainder": rem.size if rem else 0,
                "remainder_path": rem.path if rem else None,
                # the remainder batch alone, on a rank that owns one of its matrices and one that
                # owns none; None when the group has no remainder batch
                "remainder_batch": figures([rem], g.roles([rem])) if rem else None,
                # every batch of the group: busy / idle over the group, and the --rank view
                "group": figures(g.batches, {**g.roles(g.batches), "view": g.mesh.fsdp_rank}),
            }
        groups.append(entry)
    totals = {}
    for s, o in opts.items():
        peaks = [
            cost.peak_bytes(b, mp.fsdp_rank, ns_itemsize, nesterov=nesterov)
            for mp, bs in o.plans
            for b in bs
        ]
        sent = sum(cost.bytes_sent(b, mp.fsdp_rank) for mp, bs in o.plans for b in bs)
        totals[s] = {
            "view_bytes_sent": sent,
            "view_max_batch_peak_bytes": max(peaks, default=0),
            "view_step_bound_bytes": cost.window_peak_bytes(
                o.plans, ns_itemsize=ns_itemsize, nesterov=nesterov, max_inflight=o.max_inflight
            ),
            "busy_max_peak_bytes": max(
                (g["strategies"][s]["group"]["busy"] or {}).get("peak_bytes", 0) for g in groups
            ),
            "resident_bytes": resident_bytes(o),
            "ns": ns_figures(o, fwd_bwd),
        }
    return {"groups": groups, "totals": totals}


def ns_figures(opt, fwd_bwd: float) -> dict:
    """`muon.owners.balance_figures` of the optimizer's plan, plus the modelled Newton-Schulz
    share of a training step: busiest-rank NS FLOPs against forward+backward FLOPs per rank, at
    the same FLOP rate."""
    from muon.owners import balance_figures

    fig = balance_figures(opt.plans, opt.plan.ns_flops_per_rank)
    busiest = fig["ns_flops_busiest"]
    fig["fwd_bwd_flops_per_rank"] = fwd_bwd
    fig["ns_share_of_step"] = busiest / (busiest + fwd_bwd) if fwd_bwd else None
    return fig


def attention_figures(opt, config, tokens_per_rank: int, seq_len: int, fwd_bwd: float) -> dict:
    """This rank's cost of the attention knobs: NorMuon's moments (bytes of `normuon_v` state),
    QK-clip's recording (one more causal Q K^T per layer and sequence, no backward)
    and its one MAX all-reduce of [layers, heads] float32 per step."""
    state = sum(
        st["normuon_v"].to_local().numel() * 4
        if hasattr(st["normuon_v"], "to_local")
        else st["normuon_v"].numel() * 4
        for st in opt.state.values()
        if "normuon_v" in st
    )
    if config.attention == "mla":
        qk = config.qk_nope_head_dim + config.qk_rope_head_dim
    else:
        qk = config.head_dim_resolved
    heads, layers = config.num_attention_heads, config.num_hidden_layers
    from models.glm.qk_clip import recording_flops

    record = layers * tokens_per_rank / seq_len * recording_flops(seq_len, heads, qk)
    return {
        "normuon_state_bytes": state,
        "qk_clip_record_flops": record,
        "qk_clip_record_share": record / fwd_bwd if fwd_bwd else None,
        "qk_clip_allreduce_bytes": layers * heads * 4,
        "seq_len": seq_len,
    }


def active_parameters(model, config) -> int:
    """Parameters one token passes through: all, less the routed experts it is not sent to."""
    routed = sum(
        p.numel()
        for m in model.modules()
        if getattr(m, "orthogonal_blocks", None)
        for p in m.parameters(recurse=False)
    )
    unused = routed * (config.n_routed_experts - config.num_experts_per_tok)
    return model.num_parameters() - unused // config.n_routed_experts


# ------------------------------------------------------------------------------------ output
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
        "sent: bytes sent, both directions; coll: largest collective receive buffer; peak: NS "
        "inputs + exchange buffers + NS workspace of one batch.",
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


def plan(
    model: str = "glm52",
    world_size: int = 512,
    ep: int = 8,
    rank: int = 0,
    dtype: str = "bf16",
    ns_dtype: str = "bf16",
    ns_algorithm: str = "auto",
    expert_aware: bool = True,
    router: str = "adamw",
    nesterov: bool = True,
    max_inflight: int = 3,
    budget_gib: float | None = None,
    strategies: tuple[str, ...] = REMAINDER_CHOICES,
    tokens_per_step: int = TOKENS_PER_STEP,
    muon_split: bool = False,
    normuon: bool = False,
    seq_len: int = 4096,
    overrides: dict | None = None,
) -> dict:
    """Build the optimizer plans in a fake world and return the report as plain data
    (`overrides`: GLMConfig fields replacing the preset's)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"--rank {rank} is outside the world of {world_size}")
    t0 = time.perf_counter()
    created = join_fake_world(world_size, rank)
    try:
        config = get_preset(model, **(overrides or {}))
        net, meshes = planning_model(config, ep=ep, dtype=DTYPES[dtype])
        active = active_parameters(net, config)
        fwd_bwd = 6 * active * tokens_per_step / world_size
        budget = None if budget_gib is None else budget_gib * GiB
        opts = {
            s: build_optimizer(
                net,
                s,
                expert_aware,
                router,
                DTYPES[ns_dtype],
                muon_split=muon_split,
                normuon=normuon,
                nesterov=nesterov,
                max_inflight=max_inflight,
                ns_algorithm=ns_algorithm,
                memory_budget=None if budget is None else int(budget),
            )
            for s in strategies
        }
        build_s = time.perf_counter() - t0
        first = next(iter(opts.values()))
        param_tensors = sum(len(g["params"]) for g in first.param_groups)
        ns_itemsize = DTYPES[ns_dtype].itemsize
        report = summarize(opts, ns_itemsize, nesterov, fwd_bwd)
        report["attention"] = attention_figures(
            next(iter(opts.values())), config, tokens_per_step // world_size, seq_len, fwd_bwd
        )
        efsdp = meshes.efsdp
    finally:
        if created:
            dist.destroy_process_group()
    report["meta"] = dict(
        model=model,
        world_size=world_size,
        ep=ep,
        efsdp=efsdp,
        rank=rank,
        dtype=dtype,
        ns_dtype=ns_dtype,
        ns_algorithm=ns_algorithm,
        expert_aware=expert_aware,
        router=router,
        nesterov=nesterov,
        max_inflight=max_inflight,
        strategies=list(strategies),
        budget_bytes=budget,
        build_s=build_s,
        tokens_per_step=tokens_per_step,
        active_parameters=active,
        muon_split=muon_split,
        normuon=normuon,
        param_tensors=param_tensors,
        overrides=dict(overrides or {}),
    )
    report["over_budget"] = over_budget(report, budget)
    return report


def main(argv: list[str] | None = None) -> int:
    """CLI entry; returns 0, or 1 when `--budget-gib` is given and something does not fit."""
    from models.glm.config import PRESET_NAMES

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="glm52", choices=PRESET_NAMES, help="model preset")
    ap.add_argument("--world-size", type=int, default=512, help="ranks in the (fake) world")
    ap.add_argument("--ep", type=int, default=8, help="expert-parallel degree")
    ap.add_argument("--rank", type=int, default=0, help="which rank's view (default 0)")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="parameter dtype")
    ap.add_argument("--ns-dtype", default="bf16", choices=sorted(DTYPES), help="Newton-Schulz")
    ap.add_argument(
        "--ns-algorithm",
        default="auto",
        choices=("auto", "gram", "standard"),
        help="Muon(ns_algorithm=...): the iteration whose FLOPs and temporaries are counted",
    )
    ap.add_argument(
        "--no-expert-aware",
        dest="expert_aware",
        action="store_false",
        help="Muon(expert_aware=False): exchange fused experts as whole matrices",
    )
    ap.add_argument("--router", default="adamw", choices=("adamw", "muon"), help="router group")
    ap.add_argument(
        "--no-nesterov", dest="nesterov", action="store_false", help="no Nesterov input copies"
    )
    ap.add_argument("--max-inflight", type=int, default=3, help="Muon(max_inflight=...)")
    ap.add_argument("--budget-gib", type=float, default=None, help="flag what exceeds this")
    ap.add_argument(
        "--strategy",
        action="append",
        choices=REMAINDER_CHOICES,
        help="remainder strategies to plan (repeatable; default all and auto)",
    )
    ap.add_argument(
        "--tokens-per-step",
        type=int,
        default=TOKENS_PER_STEP,
        help="tokens per training step, for the NS share of a step (default 4M)",
    )
    ap.add_argument(
        "--muon-split",
        action="store_true",
        help="Muon Split: attention projections per head block (optim.muon_split=on)",
    )
    ap.add_argument("--normuon", action="store_true", help="NorMuon on (its moments as state)")
    ap.add_argument("--json", type=Path, default=None, help="also write the report as JSON")
    ap.add_argument(
        "--step", action="store_true", help="also the whole-step per-rank memory estimate"
    )
    ap.add_argument("--seq-len", type=int, default=4096, help="--step: tokens per sequence")
    ap.add_argument("--micro-batch", type=int, default=1, help="--step: sequences per rank")
    ap.add_argument(
        "--indexer-training",
        choices=("kl", "frozen"),
        default=None,
        help="DSA models: the indexer trained by its KL loss or frozen (no gradient, not in "
        "the optimizer); default: the preset's",
    )
    args = ap.parse_args(argv)
    overrides = {}
    if args.indexer_training is not None:
        if not get_preset(args.model).uses_dsa:
            ap.error(f"--indexer-training: --model {args.model} has no sparse-attention indexer")
        overrides["indexer_training"] = args.indexer_training
    report = plan(
        model=args.model,
        world_size=args.world_size,
        ep=args.ep,
        rank=args.rank,
        dtype=args.dtype,
        ns_dtype=args.ns_dtype,
        ns_algorithm=args.ns_algorithm,
        expert_aware=args.expert_aware,
        router=args.router,
        nesterov=args.nesterov,
        max_inflight=args.max_inflight,
        budget_gib=args.budget_gib,
        strategies=tuple(args.strategy or REMAINDER_CHOICES),
        tokens_per_step=args.tokens_per_step,
        muon_split=args.muon_split,
        normuon=args.normuon,
        seq_len=args.seq_len,
        overrides=overrides,
    )
    print(format_report(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    fits = True
    if args.step:  # recipes.step_memory: params, grads, state, activations, FSDP2 buffers
        from recipes.step_memory import step_report

        text, fits = step_report(
            preset=args.model,
            world_size=args.world_size,
            ep=args.ep,
            rank=args.rank,
            seq_len=args.seq_len,
            micro_batch=args.micro_batch,
            budget_gib=args.budget_gib,
            extra=(
                f"optim.max_inflight={args.max_inflight}",
                *(f"train.{k}={v}" for k, v in overrides.items()),
            ),
        )
        print(text)
    return 1 if report["over_budget"] or not fits else 0


if __name__ == "__main__":
    sys.exit(main())
