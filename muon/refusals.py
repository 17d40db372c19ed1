"""Refused updates across ranks and steps (`muon.guard` defines them): the process groups whose
ranks agree on each parameter's verdict, the warning that names refused parameters, learning
them from the census's flags, and the state a load must keep at its own dtype."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from muon.blowups import param_name
from muon.validate import OWN_DTYPE_STATE
from muon.wire import collectives_move_data


def without_own_dtype_state(state_dict: dict) -> tuple[dict, dict]:
    """`state_dict` without its state tensors of their own dtype (`muon.validate.
    OWN_DTYPE_STATE`), and those tensors by saved parameter id; the input is not changed."""
    kept: dict = {}
    state = {}
    for i, st in state_dict.get("state", {}).items():
        kept[i] = {k: v for k, v in st.items() if k in OWN_DTYPE_STATE and torch.is_tensor(v)}
        state[i] = {k: v for k, v in st.items() if k not in kept[i]}
    return {**state_dict, "state": state}, kept


def warn_refused(names: list[str], why: str) -> None:
    """One warning for one step's refused updates (`muon.guard`: what a refusal leaves)."""
    warnings.warn(
        f"Muon: the update of {', '.join(names)} {why} and was refused on every rank: the "
        "parameter kept its value, its optimizer state moved; the step is marked skipped",
        RuntimeWarning,
        stacklevel=2,
    )


def verdict_groups(plan) -> dict:
    """Per sharded mesh plan, the process group whose ranks hold every shard of its parameters
    and agree on their verdicts (`muon.phases.check`): the FSDP group, or with an EP dim the
    whole mesh, which is the default group (every rank is in every parameter's mesh,
    `muon.planner`). None (no agreement needed: every rank holds the whole parameter) for
    unsharded meshes and a single process."""
    if not collectives_move_data():
        return {}
    return {
        mp: dist.group.WORLD if mp.ep_mesh_dim is not None else plan.groups[(mp, 0)]
        for mp, _ in plan.plans
        if mp.sharded
    }


def refusals_learnt(opt, refusals: list, written: list[int], ranks: int) -> int:
    """How many parameter updates `opt`'s previous update refused, named in one warning:
    `refusals` its (batch, chunk, verdicts) in step order, `written` one count per position of
    each chunk, how many of `ranks` wrote it (the census's sum of the agreed verdicts: all of
    them, or none)."""
    names, flat = [], iter(written)
    for b, chunk, _ in refusals:
        for j in chunk.positions:
            if next(flat) < ranks:
                p, gi = opt.plan.params[b.param_indices[j]]
                names.append(param_name(p, gi, opt.param_groups))
    if names:
        why = "could not be written in its dtype, or a Gram Newton-Schulz block left its band"
        warn_refused(names, why)
    return len(names)
