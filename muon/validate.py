"""What a Muon / AdamW parameter group may hold, and the checks its values must pass.

Every key of every group is checked against one constant per algorithm (`GROUP_KEYS`): a key
that is not listed is an error naming it and the accepted ones, never silently ignored. Keys
that torch's learning-rate schedulers write into groups (`SCHEDULER_KEYS`) are accepted too.
"""

from __future__ import annotations

import math
import warnings

import torch

from muon.coefficients import resolve_coefficients
from muon.newton_schulz import check_algorithm
from muon.normuon import state_len
from muon.paths import REMAINDER_CHOICES

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


#: more Newton-Schulz steps than this is a typo, not a schedule: published schedules use 5-10
#: and every one has converged long before (a count of 10**9 would stall the step, not fail)
MAX_NS_STEPS = 100


#: the largest `eps`: the norm is clamped to it in the Newton-Schulz dtype (bfloat16's largest
#: value, the smallest of the dtypes that clamp; float16 normalizes in float32)
MAX_EPS = torch.finfo(torch.bfloat16).max


def _number(g: dict, key: str) -> float:
    """`g[key]` as a finite real number (a bool, a string, NaN or an infinity is an error)."""
    value = g[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{key}: expected a finite number, got {value!r}")
    return value


def _unit_interval(g: dict, key: str) -> float:
    """`g[key]`, a coefficient in [0, 1) (momentum, a beta), checked like `_number`."""
    value = _number(g, key)
    if not 0 <= value < 1:
        raise ValueError(f"{key}: must be in [0, 1), got {value!r}")
    return value


def _check_bool(g: dict, key: str) -> None:
    if not isinstance(g[key], bool):  # "False" would run as True, 0 / 1 hide a typo
        raise ValueError(f"{key}: must be a bool (True or False), got {g[key]!r}")


def _check_common(g: dict, loaded: bool = False) -> None:
    """lr, weight_decay and param_names, shared by both algorithms. A `loaded` group (a state
    dict's) may hold lr 0: a scheduler writes it (LambdaLR's warm-up from 0, CosineAnnealingLR's
    default eta_min, a decay to `train.min_lr_ratio=0`) and the optimizer saves what it holds;
    a new group's lr must be > 0."""
    lr = _number(g, "lr")
    if not (lr >= 0 if loaded else lr > 0):
        raise ValueError(f"lr: must be {'>= 0' if loaded else '> 0'}, got {g['lr']}")
    if _number(g, "weight_decay") < 0:
        raise ValueError(f"weight_decay: must be >= 0, got {g['weight_decay']}")
    if g["lr"] * g["weight_decay"] > 1:  # the decay factor 1 - lr * wd would flip every sign
        raise ValueError(
            f"weight_decay: lr * weight_decay = {g['lr'] * g['weight_decay']:.3g} > 1 makes the "
            "decay factor 1 - lr * weight_decay negative"
        )
    if not 0 < _number(g, "eps") <= MAX_EPS:
        raise ValueError(f"eps: must be in (0, {MAX_EPS:.4g}], got {g['eps']}")
    names = g.get("param_names")
    if names is not None:
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"param_names: expected a list of str, got {names!r}")
        if len(names) != len(g["params"]):
            raise ValueError(
                f"param_names: {len(names)} names for {len(g['params'])} parameters in one group"
            )


def check_options(
    *, remainder_strategy, enable_all2all, expert_aware, max_inflight, memory_budget
) -> str:
    """The optimizer-wide options of `muon.Muon` (not group keys); raises naming the option.
    Returns the remainder strategy the step runs: "agrs" without all-to-all (`enable_all2all=
    False`; a strategy that needs all-to-all is warned about, "auto" is agrs silently), the
    given one otherwise."""
    if not isinstance(remainder_strategy, str) or remainder_strategy not in REMAINDER_CHOICES:
        raise ValueError(
            f"remainder_strategy: {remainder_strategy!r} is not one of "
            f"{', '.join(REMAINDER_CHOICES)}"
        )
    for key, value in (("enable_all2all", enable_all2all), ("expert_aware", expert_aware)):
        _check_bool({key: value}, key)
    if not (isinstance(max_inflight, int) and not isinstance(max_inflight, bool)) or (
        max_inflight < 1
    ):
        raise ValueError(f"max_inflight: must be an int >= 1, got {max_inflight!r}")
    if (
        memory_budget is not None
        and not _number({"memory_budget": memory_budget}, "memory_budget") > 0
    ):
        raise ValueError(f"memory_budget: must be > 0 bytes or None, got {memory_budget!r}")
    if enable_all2all:
        return remainder_strategy
    if remainder_strategy not in ("agrs", "auto"):
        warnings.warn(
            f"enable_all2all=False: remainder_strategy {remainder_strategy!r} needs "
            "all-to-all; using 'agrs'",
            UserWarning,
            stacklevel=3,
        )
    return "agrs"


def validate_group(g: dict, loaded: bool = False) -> None:
    """Check the values of a group whose defaults are filled in; raises ValueError naming the key
    (`loaded`: a state dict's group, whose lr may be 0, `_check_common`).

    Normalizes `ns_dtype` to its name and `split_sizes` to a tuple (or None, with `num_blocks`
    counting equal blocks); a scheduler's `momentum` in an AdamW group becomes its beta1
    (`fold_adamw_momentum`). These are the only changes it makes."""
    _check_common(g, loaded)
    if g["algorithm"] == "adamw":
        fold_adamw_momentum(g)
        betas = g["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"betas: expected a pair (beta1, beta2), got {betas!r}")
        for key, value in zip(("betas[0]", "betas[1]"), betas, strict=True):
            _unit_interval({key: value}, key)
        g["betas"] = tuple(betas)
        return
    _unit_interval(g, "momentum")
    _check_bool(g, "nesterov")
    steps = g["ns_steps"]
    if not (isinstance(steps, int) and not isinstance(steps, bool) and 0 < steps <= MAX_NS_STEPS):
        raise ValueError(f"ns_steps: must be an int in [1, {MAX_NS_STEPS}], got {steps!r}")
    if not (isinstance(g["adjust_lr"], str) and g["adjust_lr"] in ADJUST_LR):
        raise ValueError(f"adjust_lr: {g['adjust_lr']!r} is not one of {ADJUST_LR}")
    _check_bool(g, "normuon")
    _unit_interval(g, "normuon_beta2")
    resolve_coefficients(g["ns_coefficients"])
    if not isinstance(g["ns_algorithm"], str):
        raise ValueError(f"ns_algorithm: expected a str, got {g['ns_algorithm']!r}")
    check_algorithm(g["ns_algorithm"])
    g["ns_dtype"] = dtype_name(g["ns_dtype"])
    names = g.get("param_names") or [None] * len(g["params"])
    labels = [name or f"shape {tuple(p.shape)}" for p, name in zip(g["params"], names, strict=True)]
    for p, label in zip(g["params"], labels, strict=True):
        if p.ndim < 2:
            raise ValueError(
                f"Muon group holds a {p.ndim}-D parameter ({label}); Muon needs matrices, "
                "put vectors in an algorithm='adamw' group"
            )
        if not p.numel():  # torch.optim.Muon steps it as a no-op; the plan has no block to cut
            raise ValueError(
                f"Muon group holds a zero-sized parameter ({label}, shape {tuple(p.shape)}): "
                "it has no matrix to orthogonalize; leave it out of the optimizer or put it in "
                "an algorithm='adamw' group"
            )
    _normalize_splits(g, labels)
    for p, label in zip(g["params"], labels, strict=True):
        param_blocks(tuple(p.shape), g["num_blocks"], label, g["split_sizes"])


def fold_adamw_momentum(g: dict) -> None:
    """A `momentum` in an AdamW group is beta1: torch's OneCycleLR and CyclicLR
    (`cycle_momentum=True`) write `momentum` into every group of an optimizer whose defaults
    hold `momentum` (Muon's do), where torch's own AdamW gets `betas[0]` cycled. It is folded
    into `betas` (validated), so the cycled value is the one AdamW uses and the one a state
    dict keeps."""
    if "momentum" in g:
        beta1 = _unit_interval(g, "momentum")
        g.pop("momentum")
        g["betas"] = (beta1, *tuple(g["betas"])[1:])


def param_blocks(shape: tuple[int, ...], num_blocks, label: str, split_sizes=None) -> int:
    """The number of independent blocks of a Muon parameter, validated.

    2-D `[rows, cols]`: `num_blocks` runs of rows (fused experts), which must divide the rows,
    or the `split_sizes` (normalized by `validate_group`) runs of unequal heights, which must add
    up to the rows. More dims, `[E, out, in, ...]` (the transformers v5 / torchtitan expert
    layout): each slice along dim 0 is one block, a `[out, in * ...]` matrix, so the parameter
    has E blocks; `num_blocks` must be 1 (the group's default) or E."""
    if not (isinstance(num_blocks, int) and not isinstance(num_blocks, bool) and num_blocks >= 1):
        raise ValueError(f"num_blocks: must be a positive int, got {num_blocks!r} ({label})")
    if split_sizes:
        if len(shape) != 2:
            raise ValueError(
                f"split_sizes: {label} is {len(shape)}-D; blocks of unequal heights need a "
                "2-D parameter"
            )
        if sum(split_sizes) != shape[0]:
            raise ValueError(
                f"split_sizes: {len(split_sizes)} blocks of {sum(split_sizes)} rows in all; "
                f"{label} has {shape[0]} rows (dim 0), which the sizes must add up to"
            )
        return len(split_sizes)
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


def _normalize_splits(g: dict, labels: list[str]) -> None:
    """`split_sizes` (row counts of blocks of unequal heights along dim 0) as a tuple, or None;
    equal sizes become `num_blocks`, their special case. `num_blocks` then counts the blocks.
    The sizes must add up to the rows of every parameter (`labels` name them), checked before
    equal sizes are turned into a block count."""
    splits = g.get("split_sizes")
    if splits is None:
        g["split_sizes"] = None
        return
    if not isinstance(splits, (list, tuple)) or not all(
        isinstance(h, int) and not isinstance(h, bool) and h > 0 for h in splits
    ):
        order = " (a set has no order)" if isinstance(splits, (set, frozenset)) else ""
        raise ValueError(
            f"split_sizes: expected a sequence of positive ints (a list or a tuple){order}, "
            f"got {splits!r}"
        )
    splits = tuple(splits)
    if not splits:
        raise ValueError("split_sizes: expected at least one block, got an empty sequence")
    if g["num_blocks"] not in (1, len(splits)):
        raise ValueError(
            f"num_blocks: {g['num_blocks']} disagrees with split_sizes ({len(splits)} blocks); "
            "give one of them"
        )
    for p, label in zip(g["params"], labels, strict=True):
        param_blocks(tuple(p.shape), len(splits), label, splits)
    if len(set(splits)) == 1:  # equal blocks: the num_blocks path (local, sub-group, ...)
        g["split_sizes"], g["num_blocks"] = None, len(splits)
    else:
        g["split_sizes"], g["num_blocks"] = splits, len(splits)


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
