"""What a saved state dict may hold and how it loads: the state kept per block, per parameter
and at its own dtype, the group keys the step plan is built from, and the check of a state
dict against the optimizer's groups before anything is loaded (`muon.Muon.load_state_dict`)."""

from __future__ import annotations

import math

import torch

from muon.normuon import state_len
from muon.validate import MUON_ONLY_KEYS, check_group_keys, group_algorithm, validate_group

#: optimizer state kept per block rather than per element (`muon.normuon`)
PER_BLOCK_STATE: tuple[str, ...] = ("normuon_v",)
#: optimizer state of one value per parameter: whether its batch was demoted from Gram
#: Newton-Schulz to the standard iteration (`muon.blowups`)
SCALAR_STATE: tuple[str, ...] = ("gram_demoted",)
#: state whose dtype is its own, not the parameter's (torch's load would cast it): its dtype
OWN_DTYPE_STATE: dict[str, torch.dtype] = {"normuon_v": torch.float32, "gram_demoted": torch.bool}
#: group keys the step plan is built from (`muon.planner.build_step_plan`)
PLAN_KEYS: tuple[str, ...] = (
    "algorithm",
    "num_blocks",
    "split_sizes",
    "ns_steps",
    "ns_coefficients",
    "ns_dtype",
    "ns_algorithm",
    "eps",
    "param_names",
)


def plan_keys(groups: list[dict]) -> list[tuple]:
    """The planning keys of every group, comparable before and after a change."""
    return [tuple(repr(g.get(k)) for k in PLAN_KEYS) for g in groups]


def normuon_state_shape(shape: tuple[int, ...], g: dict) -> tuple[int, int]:
    """The global shape of NorMuon's moments of a parameter of `shape` in the validated Muon
    group `g`: one row per block, as long as the longest block's `muon.normuon.state_len`."""
    cols = math.prod(shape[1:])
    if len(shape) > 2:  # one [d1, d2 * ...] block per dim-0 slice
        return shape[0], state_len(shape[1], math.prod(shape[2:]))
    heights = g.get("split_sizes") or (shape[0] // g["num_blocks"],)
    return g["num_blocks"], max(state_len(h, cols) for h in heights)


def check_loaded_groups(groups: list[dict], state_dict: dict) -> list[dict]:
    """Validate a state dict against the optimizer's current `groups` before anything is loaded:
    every saved group's keys and values (as if added with its current parameters), its
    algorithm and its `normuon` (each keeps its own state: build the optimizer for them), and
    the shape of every saved state tensor (the parameter's, or for per-block state such as
    NorMuon's moments the one the loaded group's blocks give). Raises ValueError naming the
    group and key. Returns the groups to load: each saved group over the current one (keys an older
    state dict lacks keep their current values), normalized as `validate_group` leaves a group
    added with them, with the current parameters."""
    saved = state_dict.get("param_groups")
    if not isinstance(saved, list) or len(saved) != len(groups):
        n = len(saved) if isinstance(saved, list) else saved
        raise ValueError(f"load_state_dict: {n} saved param groups for {len(groups)} groups")
    state = state_dict.get("state", {})
    loaded = []
    for i, (g, s) in enumerate(zip(groups, saved, strict=True)):
        where = f"load_state_dict: param group {i}"
        s = dict(s)
        if group_algorithm(s) == "adamw":
            # earlier versions stored every Muon default here too (their momentum was never
            # read); without them, a momentum is a scheduler's beta1 (`fold_adamw_momentum`)
            old = any(k in s for k in MUON_ONLY_KEYS if k != "momentum")
            for key in MUON_ONLY_KEYS:
                if old or key != "momentum":
                    s.pop(key, None)
        check_group_keys({k: v for k, v in s.items() if k != "momentum"}, where)
        for key, value in (("algorithm", group_algorithm(s)), ("normuon", s.get("normuon"))):
            if value is not None and value != g.get(key, False):
                raise ValueError(
                    f"{where}: {key} {value!r} differs from this optimizer's "
                    f"{g.get(key, False)!r}; their states differ, so build the optimizer with "
                    f"{key}={value!r} to load it"
                )
        if len(s["params"]) != len(g["params"]):
            raise ValueError(
                f"{where}: {len(s['params'])} saved parameters for {len(g['params'])} here"
            )
        group = {**g, **s, "params": g["params"]}
        if group.get("param_names", ()) is None:  # no names: the key absent, as torch keeps it
            del group["param_names"]
        try:
            validate_group(group, loaded=True)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from e
        loaded.append(group)
        for j, (idx, p) in enumerate(zip(s["params"], g["params"], strict=True)):
            saved_state = state.get(idx, {})
            if group.get("normuon") and saved_state and "normuon_v" not in saved_state:
                raise ValueError(f"{where} param {j}: normuon is on, its state 'normuon_v' missing")
            for key, value in saved_state.items():
                if key == "step" or not torch.is_tensor(value):
                    continue
                expected, what = tuple(p.shape), "the parameter"
                if key in SCALAR_STATE:
                    expected, what = (), "one value per parameter"
                if key in PER_BLOCK_STATE:  # one row per block, not the parameter's shape
                    expected = normuon_state_shape(tuple(p.shape), group)
                    what = (
                        f"NorMuon's one row per block of num_blocks={group['num_blocks']}, "
                        f"split_sizes={group['split_sizes']}"
                    )
                if tuple(value.shape) != expected:
                    raise ValueError(
                        f"{where} param {j}: state {key!r} has shape {tuple(value.shape)}, "
                        f"{what} {tuple(expected)}"
                    )
    named = ["param_names" in group for group in loaded]
    if any(named) and not all(named):  # torch's rule, which a later add_param_group enforces
        raise ValueError(
            f"load_state_dict: param_names given for groups {[i for i, n in enumerate(named) if n]}"
            " only; torch.optim needs them in every group or in none"
        )
    return loaded


def without_own_dtype_state(state_dict: dict) -> tuple[dict, dict]:
    """`state_dict` without its state tensors of their own dtype (`muon.validate.
    OWN_DTYPE_STATE`), and those tensors by saved parameter id; the input is not changed."""
    kept: dict = {}
    state = {}
    for i, st in state_dict.get("state", {}).items():
        kept[i] = {k: v for k, v in st.items() if k in OWN_DTYPE_STATE and torch.is_tensor(v)}
        state[i] = {k: v for k, v in st.items() if k not in kept[i]}
    return {**state_dict, "state": state}, kept
