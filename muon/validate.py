"""What a Muon / AdamW parameter group may hold, and the checks its values must pass.

Every key of every group is checked against one constant per algorithm (`GROUP_KEYS`): a key
that is not listed is an error naming it and the accepted ones, never silently ignored. Keys
that torch's learning-rate schedulers write into groups (`SCHEDULER_KEYS`) are accepted too.
"""

from __future__ import annotations

import math

import torch

from muon.newton_schulz import check_algorithm, resolve_coefficients

ADJUST_LR = ("match_rms_adamw", "original", "none")
ALGORITHMS = ("muon", "adamw")
NS_DTYPES = ("bfloat16", "float32", "float16")

#: keys of an algorithm="muon" group (extend here, in one place, when a group learns a key)
MUON_GROUP_KEYS: tuple[str, ...] = (
    "params",
    "param_names",
    "algorithm",
    "lr",
    "momentum",
    "nesterov",
    "weight_decay",
    "ns_steps",
    "ns_coefficients",
    "ns_dtype",
    "ns_algorithm",
    "eps",
    "adjust_lr",
    "num_blocks",
    "split_sizes",
    "normuon",
    "normuon_beta2",
)
#: keys of an algorithm="adamw" group
ADAMW_GROUP_KEYS: tuple[str, ...] = (
    "params",
    "param_names",
    "algorithm",
    "lr",
    "weight_decay",
    "betas",
    "eps",
)
#: Muon keys that torch's `add_param_group` copies from the defaults into every group; removed
#: again from AdamW groups, which do not use them
MUON_ONLY_KEYS: tuple[str, ...] = tuple(k for k in MUON_GROUP_KEYS if k not in ADAMW_GROUP_KEYS)
GROUP_KEYS: dict[str, tuple[str, ...]] = {"muon": MUON_GROUP_KEYS, "adamw": ADAMW_GROUP_KEYS}
#: written into groups by torch.optim.lr_scheduler (LambdaLR, OneCycleLR, CyclicLR, ...)
SCHEDULER_KEYS: tuple[str, ...] = (
    "initial_lr",
    "max_lr",
    "min_lr",
    "base_momentum",
    "max_momentum",
)
#: former names of group keys -> their current name
RENAMED_KEYS: dict[str, str] = {"num_experts": "num_blocks"}


def group_algorithm(group: dict) -> str:
    """The group's `algorithm` ("muon" when absent), validated."""
    algorithm = group.get("algorithm", "muon")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm: {algorithm!r} is not one of {ALGORITHMS}")
    return algorithm


def check_group_keys(group: dict, where: str = "param group") -> None:
    """Raise a ValueError naming the first key of `group` its algorithm does not accept."""
    algorithm = group_algorithm(group)
    accepted = GROUP_KEYS[algorithm]
    for key in group:
        if key in accepted or key in SCHEDULER_KEYS:
            continue
        if key in RENAMED_KEYS:
            hint = f"; it was renamed to {RENAMED_KEYS[key]!r}"
        elif key in MUON_GROUP_KEYS:
            hint = "; it is a Muon key, unused by algorithm='adamw' groups"
        elif key in ADAMW_GROUP_KEYS:
            hint = "; it is an AdamW key, unused by algorithm='muon' groups"
        else:
            hint = ""
        raise ValueError(
            f"{where}: unknown key {key!r} for an algorithm={algorithm!r} group{hint}; "
            f"accepted keys: {', '.join(accepted)}"
        )


def dtype_name(dtype: torch.dtype | str) -> str:
    """`ns_dtype` as a name ("bfloat16", ...), validated."""
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in NS_DTYPES:
        raise ValueError(f"ns_dtype: expected one of {sorted(NS_DTYPES)}, got {dtype!r}")
    return name


def _number(g: dict, key: str) -> float:
    value = g[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{key}: expected a number, got {value!r}")
    return value


def validate_group(g: dict) -> None:
    """Check the values of a group whose defaults are filled in; raises ValueError naming the key.

    Normalizes `ns_dtype` to its name (the only change it makes)."""
    if not _number(g, "lr") > 0:
        raise ValueError(f"lr: must be > 0, got {g['lr']}")
    if _number(g, "weight_decay") < 0:
        raise ValueError(f"weight_decay: must be >= 0, got {g['weight_decay']}")
    names = g.get("param_names")
    if names is not None and len(names) != len(g["params"]):
        raise ValueError(
            f"param_names: {len(names)} names for {len(g['params'])} parameters in one group"
        )
    if g["algorithm"] == "adamw":
        b1, b2 = g["betas"]
        if not (0 <= b1 < 1 and 0 <= b2 < 1):
            raise ValueError(f"betas: each must be in [0, 1), got {g['betas']}")
        if not _number(g, "eps") > 0:
            raise ValueError(f"eps: must be > 0, got {g['eps']}")
        return
    if not 0 <= _number(g, "momentum") < 1:
        raise ValueError(f"momentum: must be in [0, 1), got {g['momentum']}")
    if not (isinstance(g["ns_steps"], int) and g["ns_steps"] > 0):
        raise ValueError(f"ns_steps: must be a positive int, got {g['ns_steps']}")
    if g["adjust_lr"] not in ADJUST_LR:
        raise ValueError(f"adjust_lr: {g['adjust_lr']!r} is not one of {ADJUST_LR}")
    if not isinstance(g["normuon"], bool):
        raise ValueError(f"normuon: must be a bool, got {g['normuon']!r}")
    if not 0 <= _number(g, "normuon_beta2") < 1:
        raise ValueError(f"normuon_beta2: must be in [0, 1), got {g['normuon_beta2']}")
    if not _number(g, "eps") > 0:
        raise ValueError(f"eps: must be > 0, got {g['eps']}")
    resolve_coefficients(g["ns_coefficients"])
    check_algorithm(g["ns_algorithm"])
    g["ns_dtype"] = dtype_name(g["ns_dtype"])
    _normalize_splits(g)
    blocks = g["num_blocks"]
    names = names or [None] * len(g["params"])
    for p, name in zip(g["params"], names, strict=True):
        label = name or f"shape {tuple(p.shape)}"
        if p.ndim < 2:
            raise ValueError(
                f"Muon group holds a {p.ndim}-D parameter ({label}); Muon needs matrices, "
                "put vectors in an algorithm='adamw' group"
            )
        splits = g["split_sizes"]
        if splits is not None:
            if p.ndim != 2 or sum(splits) != p.shape[0]:
                raise ValueError(
                    f"split_sizes: {len(splits)} blocks of {sum(splits)} rows in all; {label} "
                    f"has {p.shape[0]} rows (dim 0) and must be 2-D"
                )
            continue
        param_blocks(tuple(p.shape), blocks, label)


def param_blocks(shape: tuple[int, ...], num_blocks, label: str) -> int:
    """The number of independent blocks of a Muon parameter, validated.

    2-D `[rows, cols]`: `num_blocks` runs of rows (fused experts), which must divide the rows.
    More dims, `[E, out, in, ...]` (the transformers v5 / torchtitan expert layout): each slice
    along dim 0 is one block, a `[out, in * ...]` matrix, so the parameter has E blocks;
    `num_blocks` must be 1 (the group's default) or E."""
    if not (isinstance(num_blocks, int) and not isinstance(num_blocks, bool) and num_blocks >= 1):
        raise ValueError(f"num_blocks: must be a positive int, got {num_blocks!r} ({label})")
    if len(shape) == 2:
        if shape[0] % num_blocks:
            raise ValueError(
                f"num_blocks: {num_blocks} must be a positive divisor of the {shape[0]} rows "
                f"of {label}"
            )
        return num_blocks
    slice_shape = f"[{shape[1]}, {math.prod(shape[2:])}]"
    if num_blocks not in (1, shape[0]):
        raise ValueError(
            f"num_blocks: {num_blocks} for the {len(shape)}-D parameter {label}: each "
            f"{slice_shape} slice along dim 0 is one block, {shape[0]} blocks; leave num_blocks "
            f"at 1 or set it to {shape[0]}, or declare other blocks on a 2-D "
            f"[{shape[0] * shape[1]}, {math.prod(shape[2:])}] view of the weight"
        )
    return shape[0]


def _normalize_splits(g: dict) -> None:
    """`split_sizes` (row counts of blocks of unequal heights along dim 0) as a tuple, or None;
    equal sizes become `num_blocks`, their special case. `num_blocks` then counts the blocks."""
    splits = g.get("split_sizes")
    if splits is None:
        g["split_sizes"] = None
        return
    if isinstance(splits, (str, bytes)) or not all(
        isinstance(h, int) and not isinstance(h, bool) and h > 0 for h in splits
    ):
        raise ValueError(f"split_sizes: expected a sequence of positive ints, got {splits!r}")
    splits = tuple(splits)
    if g["num_blocks"] not in (1, len(splits)):
        raise ValueError(
            f"num_blocks: {g['num_blocks']} disagrees with split_sizes ({len(splits)} blocks); "
            "give one of them"
        )
    if len(set(splits)) == 1:  # equal blocks: the num_blocks path (local, sub-group, ...)
        g["split_sizes"], g["num_blocks"] = None, len(splits)
    else:
        g["split_sizes"], g["num_blocks"] = splits, len(splits)


#: optimizer state kept per block rather than per element (`muon.normuon`)
PER_BLOCK_STATE: tuple[str, ...] = ("normuon_v",)
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


def check_loaded_groups(groups: list[dict], state_dict: dict, current: dict | None = None) -> None:
    """Validate a state dict against the optimizer's current `groups` before anything is loaded:
    every saved group's keys and values (as if added with its current parameters), its
    algorithm (a Muon and an AdamW parameter keep different state), and the shape of every
    saved state tensor (the parameter's, or for per-block state such as NorMuon's moments that of
    the `current` optimizer state). Raises ValueError naming the group and key."""
    saved = state_dict.get("param_groups")
    if not isinstance(saved, list) or len(saved) != len(groups):
        n = len(saved) if isinstance(saved, list) else saved
        raise ValueError(f"load_state_dict: {n} saved param groups for {len(groups)} groups")
    state = state_dict.get("state", {})
    for i, (g, s) in enumerate(zip(groups, saved, strict=True)):
        where = f"load_state_dict: param group {i}"
        s = dict(s)
        if group_algorithm(s) == "adamw":  # earlier versions stored Muon's defaults here too
            for key in MUON_ONLY_KEYS:
                s.pop(key, None)
        check_group_keys(s, where)
        if s.get("algorithm", "muon") != g["algorithm"]:
            raise ValueError(
                f"{where}: algorithm {s.get('algorithm')!r} differs from this optimizer's "
                f"{g['algorithm']!r}; their states differ, so build the optimizer for it instead"
            )
        if len(s["params"]) != len(g["params"]):
            raise ValueError(
                f"{where}: {len(s['params'])} saved parameters for {len(g['params'])} here"
            )
        try:
            # keys an older state dict lacks keep their current values (torch loads as saved)
            validate_group({**g, **s, "params": g["params"]})
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from e
        for j, (idx, p) in enumerate(zip(s["params"], g["params"], strict=True)):
            for key, value in state.get(idx, {}).items():
                if key == "step" or not torch.is_tensor(value):
                    continue
                expected, what = p.shape, "the parameter"
                if key in PER_BLOCK_STATE:  # one row per block, not the parameter's shape
                    here = (current or {}).get(p, {}).get(key)
                    if here is None:
                        continue
                    expected, what = here.shape, "this optimizer's"
                if value.shape != expected:
                    raise ValueError(
                        f"{where} param {j}: state {key!r} has shape {tuple(value.shape)}, "
                        f"{what} {tuple(expected)}"
                    )
