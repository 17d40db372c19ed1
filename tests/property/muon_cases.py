"""Generated Muon groups for the property tests: a parameter (2-D, 3-D experts, uneven rows),
its blocks (`num_blocks` / `split_sizes`, valid or not), its dtype, and every hyperparameter
with a value of any type; an independent statement of which values are valid (`invalid_keys`,
written from the documented contract, not from `muon.validate`); and the per-block reference
step (`reference_step`)."""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st
from torch.optim._muon import _adjust_lr

from muon import NS_COEFFICIENTS, newton_schulz
from muon.coefficients import resolve_coefficients
from muon.normuon import normalize, state_len
from tests.reference import ref_ns

#: values of every type: bools, strings, NaN, infinities, negatives, zero, huge, containers
JUNK = st.sampled_from(
    [True, False, None, "x", "0.5", "True", math.nan, math.inf, -math.inf, -1, -0.5, 0, 0.0,
     1e300, 2**62, [], [1], (0.9,), {"a": 1}]
)  # fmt: skip
NS_DTYPES = ["bfloat16", "float32", "float16", torch.bfloat16, torch.float32, torch.float16]
#: valid values per key (the documented ranges; sane magnitudes so that the update fits)
VALID = {
    "lr": st.floats(1e-3, 0.5),
    "momentum": st.sampled_from([0.0, 0.5, 0.95]),
    "nesterov": st.booleans(),
    "weight_decay": st.sampled_from([0.0, 0.1]),
    "ns_steps": st.integers(1, 8),
    "ns_coefficients": st.one_of(
        st.sampled_from(sorted(NS_COEFFICIENTS)),
        st.sampled_from(sorted(NS_COEFFICIENTS)).map(
            lambda k: [list(t) for t in NS_COEFFICIENTS[k]]
        ),
    ),
    "ns_dtype": st.sampled_from(NS_DTYPES),
    "ns_algorithm": st.sampled_from(["auto", "gram", "standard"]),
    "eps": st.sampled_from([1e-7, 1e-12]),
    "adjust_lr": st.sampled_from(["match_rms_adamw", "original", "none"]),
    "normuon": st.booleans(),
    "normuon_beta2": st.sampled_from([0.0, 0.95]),
}
#: junk of the right type for some keys: near misses a looser check would let through
NEAR = {
    "lr": st.sampled_from([0.0, -0.02, math.inf, 1e6]),
    "momentum": st.sampled_from([1.0, -0.1, math.nan]),
    "ns_steps": st.sampled_from([0, -1, 101, 10**9, 2.0]),
    "ns_coefficients": st.sampled_from(
        ["unknown", [], [(1.0, 2.0)], [(math.nan, 1.0, 1.0)], [("3", 1, 1)], [(True, 1, 1)]]
    ),
    "ns_dtype": st.sampled_from(["float64", torch.float64, "bf16", torch.int32]),
    "weight_decay": st.sampled_from([-0.1, 1e4]),
    "eps": st.sampled_from([0.0, -1e-7, math.inf]),
}
DEFAULTS = dict(
    lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.0, ns_steps=5,
    ns_coefficients="polar_express", ns_dtype="bfloat16", ns_algorithm="auto", eps=1e-7,
    adjust_lr="match_rms_adamw", normuon=False, normuon_beta2=0.95, num_blocks=1,
    split_sizes=None,
)  # fmt: skip


def value_for(key: str, broken: bool):
    """A valid value for `key`, or (`broken`) a near miss or junk."""
    if not broken:
        return VALID[key]
    return st.one_of(JUNK, NEAR[key]) if key in NEAR else JUNK


@st.composite
def compositions(draw, rows: int):
    """An ordered split of `rows` into positive parts."""
    cuts = sorted(draw(st.sets(st.integers(1, rows - 1), max_size=min(4, rows - 1))))
    edges = [0, *cuts, rows]
    return [b - a for a, b in zip(edges[:-1], edges[1:], strict=True)]


VALID_BLOCKS = ("none", "divisor", "split")
BROKEN_BLOCKS = ("any_blocks", "split_wrong", "split_junk")


@st.composite
def blocks_of(draw, shape: tuple[int, ...], broken: bool) -> dict:
    """`num_blocks` / `split_sizes` for a parameter of `shape`: valid ones (divisors, E for
    experts, compositions of the rows as a list or a tuple) or (`broken`, mostly invalid) any
    count, sizes that do not add up (equal or not), zeros, sets, strings, bools."""
    rows = shape[0]
    kind = draw(st.sampled_from(BROKEN_BLOCKS if broken else VALID_BLOCKS))
    if kind == "none":
        return {}
    if kind == "divisor":
        counts = [d for d in range(1, rows + 1) if rows % d == 0] if len(shape) == 2 else [1, rows]
        return {"num_blocks": draw(st.sampled_from(counts))}
    if kind == "any_blocks":
        return {"num_blocks": draw(st.one_of(st.integers(-2, rows + 2), JUNK))}
    sizes = draw(compositions(rows)) if rows > 1 else [1]
    if kind == "split":
        if len(shape) > 2:  # blocks of unequal heights need a 2-D parameter
            return {}
        out = {"split_sizes": draw(st.sampled_from([list, tuple]))(sizes)}
        if draw(st.booleans()):
            out["num_blocks"] = draw(st.sampled_from([1, len(sizes)]))
        return out
    if kind == "split_wrong":  # equal or unequal sizes that do not add up to the rows
        size, count = draw(st.integers(1, rows + 1)), draw(st.integers(1, 4))
        wrong = [size] * count if draw(st.booleans()) else [size] * count + [1]
        return {"split_sizes": tuple(wrong), "num_blocks": draw(st.sampled_from([1, 2, 3]))}
    junk = [set(sizes), [*sizes[:-1], 0, sizes[-1]], str(sizes), [True] * rows, [], (-1, rows + 1)]
    return {"split_sizes": draw(st.sampled_from(junk))}


@st.composite
def muon_groups(draw, valid: bool = False) -> tuple[tuple[int, ...], torch.dtype, dict]:
    """(parameter shape, parameter dtype, group keys set away from their defaults): valid in
    about half the examples, else with one part broken (a key's value, the blocks, or an
    unknown key); always valid with `valid`."""
    if draw(st.booleans()):
        shape = (draw(st.integers(1, 24)), draw(st.integers(1, 24)))
    else:
        shape = (draw(st.integers(1, 4)), draw(st.integers(1, 8)), draw(st.integers(1, 8)))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    broken = None if valid else draw(st.sampled_from([None, None, None, "value", "blocks", "key"]))
    group = draw(blocks_of(shape, broken == "blocks"))
    keys = sorted(draw(st.sets(st.sampled_from(sorted(VALID)), min_size=1, max_size=5)))
    bad = draw(st.sampled_from(keys))
    for key in keys:
        group[key] = draw(value_for(key, broken == "value" and key == bad))
    if broken == "key":
        group[draw(st.sampled_from(["num_experts", "betas", "maximize", "nesterov_"]))] = 1
    return shape, dtype, group


#: optimizer-wide options of `muon.Muon` (not group keys), valid or junk
OPTIONS = {
    "enable_all2all": st.one_of(st.booleans(), JUNK),
    "expert_aware": st.one_of(st.booleans(), JUNK),
    "max_inflight": st.one_of(st.integers(1, 4), JUNK),
    "memory_budget": st.one_of(st.none(), st.integers(1, 2**40), JUNK),
    "remainder_strategy": st.one_of(
        st.sampled_from(["agrs", "pad_all2all", "ragged_all_to_all", "auto"]), JUNK
    ),
}


@st.composite
def options(draw) -> dict:
    """Up to two optimizer-wide options, mostly left at their defaults."""
    keys = draw(st.sets(st.sampled_from(sorted(OPTIONS)), max_size=2))
    return {k: draw(OPTIONS[k]) for k in sorted(keys)}


def invalid_options(opts: dict) -> set[str]:
    """The options the documented contract refuses."""
    checks = {
        "enable_all2all": lambda v: isinstance(v, bool),
        "expert_aware": lambda v: isinstance(v, bool),
        "max_inflight": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
        "memory_budget": lambda v: v is None or (_real(v) and v > 0),
        "remainder_strategy": lambda v: (
            isinstance(v, str) and v in ("agrs", "pad_all2all", "ragged_all_to_all", "auto")
        ),
    }
    return {k for k, v in opts.items() if not checks[k](v)}


# ------------------------------------------------------------------ what is valid
def _real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _unit(x) -> bool:
    return _real(x) and 0 <= x < 1


def _coefficients_ok(c) -> bool:
    if isinstance(c, str):
        return c in NS_COEFFICIENTS
    return (
        isinstance(c, (list, tuple))
        and len(c) > 0
        and all(isinstance(t, (list, tuple)) and len(t) == 3 and all(map(_real, t)) for t in c)
    )


def invalid_keys(shape: tuple[int, ...], group: dict) -> set[str]:
    """The keys of `group` whose values the documented contract refuses (empty: valid)."""
    g = {**DEFAULTS, **group}
    bad = {k for k in group if k not in DEFAULTS}
    checks = {
        "lr": _real(g["lr"]) and g["lr"] > 0,
        "momentum": _unit(g["momentum"]),
        "nesterov": isinstance(g["nesterov"], bool),
        "weight_decay": _real(g["weight_decay"]) and g["weight_decay"] >= 0,
        "ns_steps": isinstance(g["ns_steps"], int)
        and not isinstance(g["ns_steps"], bool)
        and 1 <= g["ns_steps"] <= 100,
        "ns_coefficients": _coefficients_ok(g["ns_coefficients"]),
        "ns_dtype": isinstance(g["ns_dtype"], (str, torch.dtype)) and g["ns_dtype"] in NS_DTYPES,
        "ns_algorithm": isinstance(g["ns_algorithm"], str)
        and g["ns_algorithm"] in ("auto", "gram", "standard"),
        "eps": _real(g["eps"]) and 0 < g["eps"] <= torch.finfo(torch.bfloat16).max,
        "adjust_lr": isinstance(g["adjust_lr"], str)
        and g["adjust_lr"] in ("match_rms_adamw", "original", "none"),
        "normuon": isinstance(g["normuon"], bool),
        "normuon_beta2": _unit(g["normuon_beta2"]),
    }
    bad |= {k for k, ok in checks.items() if not ok}
    if checks["lr"] and checks["weight_decay"] and g["lr"] * g["weight_decay"] > 1:
        bad |= {"weight_decay"}
    bad |= _invalid_blocks(shape, g)
    return bad


def _invalid_blocks(shape, g) -> set[str]:
    n, splits = g["num_blocks"], g["split_sizes"]
    if not (isinstance(n, int) and not isinstance(n, bool) and n >= 1):
        return {"num_blocks"}
    if splits is not None:
        if not (
            isinstance(splits, (list, tuple))
            and splits
            and all(isinstance(h, int) and not isinstance(h, bool) and h > 0 for h in splits)
        ):
            return {"split_sizes"}
        if n not in (1, len(splits)):
            return {"num_blocks", "split_sizes"}
        if len(shape) != 2 or sum(splits) != shape[0]:
            return {"split_sizes"}
        return set()
    if len(shape) == 2:
        return set() if shape[0] % n == 0 else {"num_blocks"}
    return set() if n in (1, shape[0]) else {"num_blocks"}


# ------------------------------------------------------------------ the per-block reference
def block_heights(shape, g) -> list[int]:
    """Rows of each block along dim 0 of a 2-D parameter in the normalized group `g`."""
    if g["split_sizes"]:
        return list(g["split_sizes"])
    return [shape[0] // g["num_blocks"]] * g["num_blocks"]


def normalized_group(group: dict) -> dict:
    """The defaults with `group` over them, normalized as the optimizer documents: ns_dtype a
    torch dtype, equal split sizes as `num_blocks`, unequal ones a tuple."""
    g = {**DEFAULTS, **group}
    g["ns_dtype"] = (
        g["ns_dtype"] if isinstance(g["ns_dtype"], torch.dtype) else getattr(torch, g["ns_dtype"])
    )
    if g["split_sizes"] is not None:
        sizes = tuple(g["split_sizes"])
        g["num_blocks"] = len(sizes)
        g["split_sizes"] = None if len(set(sizes)) == 1 else sizes
    return g


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def reference_step(shape, dtype, group: dict, grad: torch.Tensor):
    """One step from a zero parameter, each block a matrix of its own: (the new parameter,
    the tolerance per element, whether the update fits the dtype).

    Newton-Schulz runs on each block alone in the group's dtype (`O_d`, what torch.optim.Muon
    does per matrix) and in float64 (`O_64`, tests/reference.py). The optimizer batches blocks,
    which may round differently: its result must lie within twice the per-block iteration's
    own distance from float64, |O_d - O_64|, plus a few roundings of the NS dtype (float32:
    the schedule's amplification of the inputs' rounding, prod a_i x 64 ulps; see
    tests/reference.py), then the rounding of O and of the new value to the parameter's dtype.
    """
    g = normalized_group(group)
    mu = g["momentum"]
    buf = torch.zeros(shape, dtype=dtype).lerp_(grad, 1 - mu)  # as the optimizer's own ops
    u = grad.lerp(buf, mu) if g["nesterov"] else buf
    schedule = resolve_coefficients(g["ns_coefficients"])
    amp = math.prod(abs(schedule[min(i, len(schedule) - 1)][0]) for i in range(g["ns_steps"]))
    ns_u = unit_roundoff(g["ns_dtype"])
    slack = amp * 64 * ns_u if g["ns_dtype"] == torch.float32 else 4 * ns_u
    if len(shape) > 2:
        mats = list(u.reshape(shape[0], shape[1], -1).unbind(0))
    else:
        mats = list(u.reshape(shape[0], -1).split(block_heights(shape, g)))
    new, tol, peak = [], [], 0.0
    p_u = unit_roundoff(dtype)
    for m in mats:
        kw = dict(steps=g["ns_steps"], coefficients=g["ns_coefficients"], eps=g["eps"])
        o_d = newton_schulz(m, dtype=g["ns_dtype"], algorithm=g["ns_algorithm"], **kw)
        o_64 = ref_ns(m, schedule, steps=g["ns_steps"], eps=g["eps"])
        if g["normuon"]:
            v = torch.zeros(1, state_len(*m.shape))
            o_d = normalize(o_d[None], v.clone(), g["normuon_beta2"])[0]
            o_64 = normalize(o_64.float()[None], v, g["normuon_beta2"])[0].double()
        lr = _adjust_lr(g["lr"], g["adjust_lr"], m.shape)  # torch.optim.Muon's own (torch pinned)
        peak = max(peak, o_d.abs().max().item() * lr if o_d.numel() else 0.0)
        dist = (o_d.double() - o_64).abs().max().item() if o_d.numel() else 0.0
        tol_o = 2 * dist + slack + 2 * p_u * max(1.0, o_d.abs().max().item() if o_d.numel() else 0)
        x = (o_d.to(dtype).double() * -lr).to(dtype)  # the optimizer rounds once, from float32
        new.append(x)
        tol.append(lr * tol_o + 2 * p_u * x.double().abs())
    fits = peak <= torch.finfo(dtype).max
    stack = (lambda ts: torch.stack(ts)) if len(shape) > 2 else (lambda ts: torch.cat(ts))
    return stack(new).reshape(shape), stack(tol).reshape(shape), fits
