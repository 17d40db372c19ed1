"""Planning a Muon step from the optimizer's parameter groups, once, at construction.

1. Muon parameters are grouped by (device_mesh, placements); each group gets a `MeshCommPlan`.
2. Each group's parameters are bucketed and cut into `BatchPlan`s (`muon.plan.plan_batches`),
   `remainder_strategy="auto"` choosing per remainder batch from a `LinkModel`.
3. Owners are assigned over the whole step by Newton-Schulz cost (`muon.owners`).
4. Every rank checks that all ranks planned the same (a fingerprint all-gather), and only then
   creates the sub-group process groups (collective calls that would hang on a mismatch).
Nothing here runs during a step; `muon.optimizer` steps the `StepPlan` this returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from muon.cost import DEFAULT_LINKS, LinkModel, measure_link
from muon.owners import assign_owners
from muon.plan import (
    BATCH_BYTES,
    LOCAL_MESH_PLAN,
    BatchPlan,
    MeshCommPlan,
    ParamMeta,
    fingerprint,
    plan_batches,
    resolve_mesh_comm_plan,
)
from muon.validate import param_blocks
from muon.wire import collectives_move_data, comm_device, wire_dtype, world_size


@dataclass
class StepPlan:
    """Everything a step needs that does not change between steps."""

    #: (mesh comm plan, its batches), in step order
    plans: list[tuple[MeshCommPlan, list[BatchPlan]]]
    #: (parameter, index of its group) for every Muon parameter; `ParamMeta.index` points here
    params: list[tuple[torch.Tensor, int]]
    #: Newton-Schulz FLOPs of one step on every global rank, as the owner assignment balanced it
    ns_flops_per_rank: list[int]
    fingerprint: int
    link: LinkModel
    #: (mesh comm plan, sub-group size or 0 for the FSDP group) -> process group
    groups: dict = field(default_factory=dict)


def resolve_link(link: LinkModel | tuple | None, *, needed: bool) -> LinkModel:
    """The given link model, or one measured on the default group when `needed` (collective)."""
    if isinstance(link, LinkModel):
        return link
    if link is not None:
        latency_s, bytes_per_s, *rest = link
        flops = rest[0] if rest else DEFAULT_LINKS["nccl"].flops_per_s
        return LinkModel(latency_s=latency_s, bytes_per_s=bytes_per_s, flops_per_s=flops)
    if world_size() == 1:
        return DEFAULT_LINKS["gloo"]
    if not needed:
        return DEFAULT_LINKS.get(dist.get_backend(), DEFAULT_LINKS["gloo"])
    return measure_link(None, comm_device())


def build_step_plan(
    param_groups: list[dict],
    *,
    remainder_strategy: str,
    enable_all2all: bool,
    expert_aware: bool,
    memory_budget: int | None,
    link: LinkModel,
    batch_bytes: int | None = None,
) -> StepPlan:
    """Plan every Muon batch of `param_groups` (see the module docstring); collective when the
    default process group has more than one rank. Every batch is sized to `batch_bytes` on a
    rank (None: `memory_budget` when given, else `muon.paths.BATCH_BYTES`): its planned peak
    (`muon.batch_cost.sizing_peak`, every buffer of its stretches), one unit at least."""
    params: list[tuple[torch.Tensor, int]] = []
    names: list[str] = []
    by_mesh: dict[tuple, list[ParamMeta]] = {}
    mesh_of: dict[tuple, tuple | None] = {}
    for gi, g in enumerate(param_groups):
        if g["algorithm"] != "muon":
            continue
        ns_dtype = getattr(torch, g["ns_dtype"])
        pnames = g.get("param_names") or [None] * len(g["params"])
        for p, name in zip(g["params"], pnames, strict=True):
            key = _mesh_key(p)
            mesh_of[key] = (p.device_mesh, tuple(p.placements)) if isinstance(p, DTensor) else None
            by_mesh.setdefault(key, []).append(
                ParamMeta(
                    index=len(params),
                    global_shape=tuple(p.shape),
                    num_blocks=param_blocks(
                        tuple(p.shape), g["num_blocks"], name or "", g.get("split_sizes")
                    ),
                    split_sizes=g.get("split_sizes") or (),
                    dtype=str(p.dtype).removeprefix("torch."),
                    itemsize=p.element_size(),
                    wire_dtype=str(wire_dtype(p.dtype, ns_dtype)).removeprefix("torch."),
                    ns_steps=g["ns_steps"],
                    ns_algorithm=g.get("ns_algorithm", "standard"),
                    ns_settings=_ns_settings(g),
                )
            )
            params.append((p, gi))
            names.append(name or f"{tuple(p.shape)}")

    def cut(budget: int) -> list:
        return [
            (mp, plan_batches(metas, mesh_plan=mp, batch_bytes=budget, **options))
            for mp, metas in zip(meshes, by_mesh.values(), strict=True)
        ]

    meshes = [_mesh_plan(mesh_of[key]) for key in by_mesh]
    options = dict(
        remainder_strategy=remainder_strategy,
        enable_all2all=enable_all2all,
        expert_aware=expert_aware,
        link=link,
        memory_budget=memory_budget,
    )
    plans = cut(batch_bytes or memory_budget or BATCH_BYTES)
    plans, loads, digest = assign_owners(plans, world_size=world_size())
    step = StepPlan(plans, params, loads, fingerprint(plans, names, digest), link)
    _check_fingerprint(step.fingerprint)
    cache: dict[tuple[int, ...], object] = {}
    for key, (mp, batches) in zip(by_mesh, plans, strict=True):
        if mp.sharded:
            step.groups[(mp, 0)] = mesh_of[key][0].get_group(mp.fsdp_mesh_dim)
        for k in sorted({b.subgroup_size for b in batches if b.path == "subgroup"}):
            step.groups[(mp, k)] = _subgroups(mp, k, cache)
    return step


def _ns_settings(g: dict) -> tuple:
    """Settings that must agree within one batch, which shares one Newton-Schulz call."""
    coefficients = g["ns_coefficients"]
    if not isinstance(coefficients, str):
        coefficients = tuple(map(tuple, coefficients))
    return (g["ns_steps"], coefficients, g["ns_dtype"], g["eps"], g.get("ns_algorithm"))


def _mesh_key(p: torch.Tensor) -> tuple:
    if not isinstance(p, DTensor):
        return ("local",)
    mesh = p.device_mesh
    return (tuple(mesh.mesh.flatten().tolist()), tuple(mesh.shape), tuple(p.placements))


def _mesh_plan(mesh_and_placements) -> MeshCommPlan:
    if mesh_and_placements is None:
        return LOCAL_MESH_PLAN
    mesh, placements = mesh_and_placements
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError("Muon: this rank is not part of a parameter's device mesh")
    return resolve_mesh_comm_plan(
        tuple(mesh.shape), mesh.mesh.tolist(), tuple(placements), tuple(coordinate)
    )


def _subgroups(mp: MeshCommPlan, k: int, cache: dict):
    """Create every k-rank sub-group of every FSDP group (collective, same order on every rank;
    `cache` shares them between mesh groups of one plan); return this rank's."""
    mine = None
    for ranks in mp.all_groups:
        for i in range(0, len(ranks), k):
            chunk = tuple(ranks[i : i + k])
            if chunk not in cache:
                cache[chunk] = dist.new_group(list(chunk))
            if dist.get_rank() in chunk:
                mine = cache[chunk]
    return mine


def _check_fingerprint(value: int) -> None:
    """Fail fast, on every rank, if ranks planned different parameter lists.

    Done before any sub-group is created, so a mismatch is an error instead of a collective that
    never matches up.
    """
    if not collectives_move_data():
        return
    device = comm_device()
    mine = torch.tensor([value], dtype=torch.int64, device=device)
    every = torch.empty(dist.get_world_size(), dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(every, mine)
    values = every.tolist()
    if len(set(values)) > 1:
        groups: dict[int, list[int]] = {}
        for r, v in enumerate(values):
            groups.setdefault(v, []).append(r)
        raise RuntimeError(
            "Muon: ranks built different optimizer plans (different parameter order, names or "
            f"shapes); ranks grouped by plan fingerprint: {sorted(groups.values())}. "
            f"This is rank {dist.get_rank()}."
        )
