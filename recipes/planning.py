"""The dry-run planner's report as plain data: Muon's plans at cluster scale, on one CPU.

`plan(...)` builds the model on the meta device inside torch's fake process group of
`world_size` ranks, parallelizes it with `models.glm.infra.parallelize` (EP + FSDP2; both by
`recipes.build.planning_model`, as the whole-step estimate does), and constructs the real
`muon.Muon` once per remainder strategy. The optimizer's own plans (`opt.plans`) are then read
through the path objects' figures of a `muon.plan.BatchPlan` (`muon.paths`); nothing here
re-models the planning and no parameter memory is allocated. The report: per shape group (one
bucket of same-shape matrices on one mesh) and strategy the figures of a busy, an idle and the
viewed rank; per strategy the viewed rank's step totals and the Newton-Schulz balance; the
attention knobs' costs. `recipes.planning_report` prints it and checks it against a budget;
scripts/plan_memory.py is the command line.
"""

from __future__ import annotations

import re
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch.distributed as dist

from models.glm import get_preset
from muon import batch_cost
from muon.paths import PATHS
from muon.plan import REMAINDER_CHOICES, REMAINDER_STRATEGIES, BatchPlan, MeshCommPlan
from recipes.build import join_fake_world, planning_model
from recipes.dtypes import DTYPES
from recipes.planning_report import GiB, over_budget
from recipes.ranks import local_tensor

TOKENS_PER_STEP = 4 << 20


# ------------------------------------------------------------------------- building the plans
def build_optimizer(
    model,
    strategy: str,
    expert_aware: bool,
    router: str,
    ns_dtype: str,
    muon_split: bool = False,
    *,
    normuon: bool = False,
    nesterov: bool = True,
    max_inflight: int = 3,
    ns_algorithm: str = "auto",
    memory_budget_gib: float | None = None,
):
    """`muon.Muon` exactly as the recipe builds it (`recipes.build.build_optimizer` over the
    default `optim=muon` config with the planner's knobs set; lr, betas, eps and the rest are
    the recipe's defaults). `ns_dtype`: "bf16", "fp32" or "fp16"."""
    from omegaconf import OmegaConf

    from recipes.build import build_optimizer as recipe_optimizer
    from recipes.config import Config

    knobs = dict(
        remainder_strategy=strategy,
        router=router,
        ns_dtype=str(DTYPES[ns_dtype]).removeprefix("torch."),
        muon_split="on" if muon_split else "off",
        normuon=normuon,
        nesterov=nesterov,
        max_inflight=max_inflight,
        ns_algorithm=ns_algorithm,
        memory_budget_gib=memory_budget_gib,
    )
    cfg = OmegaConf.merge(OmegaConf.structured(Config), {"optim": knobs})
    return recipe_optimizer(cfg.optim, model, expert_aware=expert_aware)


def build_optimizers(model, strategies: tuple[str, ...], *args, **knobs) -> dict[str, object]:
    """`build_optimizer` once per remainder strategy, by strategy (`args`, `knobs`: its other
    arguments)."""
    return {s: build_optimizer(model, s, *args, **knobs) for s in strategies}


@contextmanager
def fake_world(world_size: int, rank: int):
    """Inside torch's fake process group of `world_size` ranks as `rank`
    (`recipes.build.join_fake_world`), left on exit when it was joined here."""
    created = join_fake_world(world_size, rank)
    try:
        yield
    finally:
        if created:
            dist.destroy_process_group()


def plan_from_args(args, *, strategies: tuple[str, ...], **overrides) -> dict:
    """`plan` of scripts/plan_memory.py's parsed arguments (`overrides`: the GLMConfig fields
    its options set)."""
    return plan(
        model=args.model,
        dtype=args.dtype,
        ns_dtype=args.ns_dtype,
        ns_algorithm=args.ns_algorithm,
        expert_aware=args.expert_aware,
        router=args.router,
        nesterov=args.nesterov,
        max_inflight=args.max_inflight,
        strategies=strategies,
        tokens_per_step=args.tokens_per_step,
        muon_split=args.muon_split,
        normuon=args.normuon,
        overrides=overrides,
        **world_options(args),
    )


#: the keywords `plan` and `recipes.planning_step.step_report` both take, and the options of
#: scripts/plan_memory.py that set them: the world, the viewed rank, the sequence, the budget
WORLD_OPTIONS = ("world_size", "ep", "rank", "seq_len", "budget_gib", "cp")


def world_options(args) -> dict:
    """`WORLD_OPTIONS` of scripts/plan_memory.py's parsed arguments, by keyword."""
    return {k: getattr(args, k) for k in WORLD_OPTIONS}


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
            local = local_tensor(p)
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
        work = [
            sum(batch_cost.blocks_on(b, r) for b in batches) for r in range(self.mesh.fsdp_size)
        ]
        busy = next((r for r, n in enumerate(work) if n), None)
        idle = next((r for r, n in enumerate(work) if not n), None)
        return {"busy": busy, "idle": idle}


def _path_label(b: BatchPlan) -> str:
    return f"subgroup({b.subgroup_size})" if b.path == "subgroup" else b.path


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
        "matrices": sum(batch_cost.blocks_on(b, r) for b in batches),
        "bytes_sent": sum(batch_cost.bytes_sent(b, r) for b in batches),
        "collective_buffer_bytes": max(batch_cost.collective_buffer_bytes(b, r) for b in batches),
        "exchange_buffer_bytes": max(batch_cost.exchange_buffer_bytes(b, r) for b in batches),
        "ns_workspace_bytes": max(
            batch_cost.ns_workspace_bytes(b, r, ns_itemsize) for b in batches
        ),
        "input_bytes": max(batch_cost.nesterov_input_bytes(b, r, nesterov) for b in batches),
        "peak_bytes": max(
            batch_cost.peak_bytes(b, r, ns_itemsize, nesterov=nesterov) for b in batches
        ),
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
                "paths": sorted({b.path for b in g.batches}, key=list(PATHS).index),
                # a sub-group batch as "subgroup(s)": s ranks per sub-group (widened when s
                # exceeds the ranks one block spans, see muon.owners)
                "batches": [[_path_label(b), b.size] for b in g.batches],
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
            batch_cost.peak_bytes(b, mp.fsdp_rank, ns_itemsize, nesterov=nesterov)
            for mp, bs in o.plans
            for b in bs
        ]
        sent = sum(batch_cost.bytes_sent(b, mp.fsdp_rank) for mp, bs in o.plans for b in bs)
        totals[s] = {
            "view_bytes_sent": sent,
            "view_max_batch_peak_bytes": max(peaks, default=0),
            "view_step_bound_bytes": batch_cost.window_peak_bytes(
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


def attention_figures(
    opt, config, tokens_per_rank: int, seq_len: int, fwd_bwd: float, *, cp: int = 1, rank: int = 0
) -> dict:
    """This rank's cost of the attention knobs: NorMuon's moments (bytes of `normuon_v` state),
    QK-clip's recording and its one MAX all-reduce of [layers, heads] float32 per step. The
    recording costs nothing extra on DSA's sparse paths ("latent", "per_head": the sparse
    attention keeps each head's largest logit over the kept keys as it goes); elsewhere one
    more causal Q K^T per layer and sequence, no backward: under context parallelism (`cp`)
    this rank's head-tail queries of each sequence against the keys up to each query chunk's
    last."""
    from models.glm.infra.context_parallel import TRAIN_LAYOUT, local_tokens
    from models.glm.model.qk_clip import recording_flops

    state = sum(
        local_tensor(st["normuon_v"]).numel() * 4 for st in opt.state.values() if "normuon_v" in st
    )
    if config.attention == "mla":
        qk = config.qk_nope_head_dim + config.qk_rope_head_dim
    else:
        qk = config.head_dim_resolved
    # every attention trains and is watched, the MTP layers' too
    heads, layers = config.num_attention_heads, config.num_hidden_layers + config.num_mtp_layers
    sparse = config.uses_dsa and config.dsa_impl in ("latent", "per_head")
    record = 0
    if not sparse:
        tokens = local_tokens(TRAIN_LAYOUT, cp, rank % cp, seq_len) if cp > 1 else None
        # each rank computes seq_len / cp tokens of every sequence its cp group reads
        per_sequence = recording_flops(seq_len, heads, qk, tokens)
        record = layers * tokens_per_rank * cp / seq_len * per_sequence
    return {
        "normuon_state_bytes": state,
        "qk_clip_record_flops": record,
        "qk_clip_record_share": record / fwd_bwd if fwd_bwd else None,
        "qk_clip_record_path": "sparse" if sparse else "dense",
        "qk_clip_allreduce_bytes": layers * heads * 4,
        "seq_len": seq_len,
        "cp": cp,
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
    cp: int = 1,
) -> dict:
    """Build the optimizer plans in a fake world and return the report as plain data
    (`overrides`: GLMConfig fields replacing the preset's)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"--rank {rank} is outside the world of {world_size}")
    t0 = time.perf_counter()
    with fake_world(world_size, rank):
        config = get_preset(model, **(overrides or {}))
        net, meshes = planning_model(config, ep=ep, dtype=DTYPES[dtype])
        active = active_parameters(net, config)
        fwd_bwd = 6 * active * tokens_per_step / world_size
        budget = None if budget_gib is None else budget_gib * GiB
        opts = build_optimizers(
            net,
            strategies,
            expert_aware,
            router,
            ns_dtype,
            muon_split=muon_split,
            normuon=normuon,
            nesterov=nesterov,
            max_inflight=max_inflight,
            ns_algorithm=ns_algorithm,
            memory_budget_gib=budget_gib,
        )
        build_s = time.perf_counter() - t0
        first = next(iter(opts.values()))
        param_tensors = sum(len(g["params"]) for g in first.param_groups)
        report = summarize(opts, DTYPES[ns_dtype].itemsize, nesterov, fwd_bwd)
        report["attention"] = attention_figures(
            first, config, tokens_per_step // world_size, seq_len, fwd_bwd, cp=cp, rank=rank
        )
        efsdp = meshes.efsdp
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
        cp=cp,
    )
    report["over_budget"] = over_budget(report, budget)
    return report
