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
