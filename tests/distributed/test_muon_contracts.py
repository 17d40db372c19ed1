"""Muon contracts at the edges of the layouts it accepts, on one 4-rank gloo world.

Each case either matches a single-process run of the same optimizer on the same parameters or
raises a clear error on every rank:
- fused experts (and 3-D expert weights) sharded on a tensor dim other than 0;
- `[E, out, in]` expert weights under FSDP2 (dim 0 sharded), each slice a block;
- a hand-built (Shard(0), Shard(0)) expert mesh: the inner (last) split is the comm group;
- `add_param_group` after construction, for a Muon and an AdamW group;
- a parameter whose grad is None on every rank stays untouched, state included; ranks that
  disagree about it raise instead of hanging;
- fp16 and bf16 parameters of one shape never share an exchange buffer.

Tolerance for the float32 cases: both runs apply float32 Newton-Schulz to the same matrices,
differing only in memory layout and summation order, so one step's update differs by a few
float32 rounding errors per NS iteration (5 iterations, inner dims <= 24: well under 1e-5
relative on entries of size <= 1), scaled by an adjusted lr < 0.1; three steps stay below
2e-5 with room. The bugs these cases guard against were 1e-2 off.
"""

from __future__ import annotations

import math
import traceback
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from muon import Muon
from muon.plan import REMAINDER_STRATEGIES as STRATEGIES
from tests.harness import init_mesh, run_world

W = 4
STEPS = 3
TOL = 2e-5
KW = dict(lr=0.05, weight_decay=0.1, ns_dtype=torch.float32, max_inflight=2)
# the group key for blocks stacked on dim 0 (fused experts), whichever name Muon's defaults use
BLOCKS = "num_blocks"


def _tensors(shapes, seed, dtype=torch.float32, scale=None):
    gen = torch.Generator().manual_seed(seed)
    scale = scale or [1.0] * len(shapes)
    return [
        (torch.randn(*s, generator=gen) * k).to(dtype) for s, k in zip(shapes, scale, strict=True)
    ]


def _dist_params(init, mesh, placements):
    return [
        nn.Parameter(distribute_tensor(t.clone(), mesh, placements) if mesh else t.clone())
        for t in init
    ]


def _set_grads(params, grads, skip=()):
    for i, (p, g) in enumerate(zip(params, grads, strict=True)):
        if i in skip:
            p.grad = None
        elif isinstance(p, DTensor):
            p.grad = distribute_tensor(g.clone(), p.device_mesh, p.placements)
        else:
            p.grad = g.clone()


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _diff(a, b) -> float:
    """max |a - b| over full tensors; NaN or Inf anywhere counts as infinitely far."""
    d = (_full(a).float() - _full(b).float()).abs().max().item()
    return d if math.isfinite(d) else math.inf


def _max_err(opt, params, ref, ref_params):
    """Max |distributed - reference| over parameters and every state tensor."""
    err = 0.0
    for p, rp in zip(params, ref_params, strict=True):
        err = max(err, _diff(p, rp))
        for key, value in ref.state[rp].items():
            err = max(err, _diff(opt.state[p][key], value))
    return err


def _groups(params, spec):
    """`spec`: list of (group kwargs, indices into params)."""
    return [dict(kw, params=[params[i] for i in idx]) for kw, idx in spec]


def _parity(
    shapes, spec, mesh, placements, strategy, *, seed=0, dtype=torch.float32, scale=None, **kw
):
    """STEPS steps distributed and single-process on the same groups; returns the max error
    and the distributed optimizer. `placements=None`: FSDP2's `fully_shard` over `mesh`."""
    init = _tensors(shapes, seed, dtype, scale)
    if placements is None:
        holder = nn.ParameterList([nn.Parameter(t.clone()) for t in init])
        fully_shard(holder, mesh=mesh)
        params = list(holder)
    else:
        params = _dist_params(init, mesh, placements)
    ref_params = _dist_params(init, None, None)
    kw = dict(KW, remainder_strategy=strategy, **kw)
    opt = Muon(_groups(params, spec), **kw)
    ref = Muon(_groups(ref_params, spec), **kw)
    for step in range(STEPS):
        grads = _tensors(shapes, seed + 100 + step, dtype, scale)
        _set_grads(params, grads)
        _set_grads(ref_params, grads)
        opt.step()
        ref.step()
    return _max_err(opt, params, ref, ref_params), opt


# --------------------------------------------------------------------------------- cases
def _shard1_cases(flat):
    """Fused experts and a 3-D expert weight (8 blocks of [6, 4]) sharded on tensor dim 1 over
    4 ranks."""
    shapes = [(16, 12)] * 5 + [(8, 6, 4)] * 2  # a full batch + R=1; dim 1 of 6 -> 2,2,2,0
    spec = [({BLOCKS: 2}, range(5)), ({}, range(5, 7))]
    return {f"shard1 {s}": _parity(shapes, spec, flat, [Shard(1)], s)[0] for s in STRATEGIES}


def _expert3d_cases(flat):
    """[E, out, in] expert weights under FSDP2 (which shards dim 0, the experts): 8 experts
    (2 whole slices per rank: local), 3 experts (shards of 1, 1, 1, 0), and the same exchanged
    as whole matrices (expert_aware=False); each slice is a block."""
    shapes = [(8, 6, 10)] * 2 + [(3, 6, 10)] * 3
    spec = [({BLOCKS: 8}, range(2)), ({}, range(2, 5))]
    out = {}
    for aware in (True, False):
        err, opt = _parity(shapes, spec, flat, None, "pad_all2all", seed=11, expert_aware=aware)
        out[f"expert3d aware={aware}"] = err
        blocks = {b.num_blocks for _, bs in opt.plans for b in bs}
        out[f"expert3d blocks aware={aware}"] = 0.0 if blocks == {8, 3} else f"blocks {blocks}"
    return out


def _shard00_cases(_flat):
    """A hand-built (Shard(0), Shard(0)) mesh: the outer split is EP, the inner one FSDP."""
    mesh = init_mesh((2, 2), ("outer", "inner"))
    # 2 experts of 8 rows: each spans both inner ranks (sub-group); 2 experts of 5 rows: uneven
    # 3/2 shards (exchanged); 4 experts of 4 rows: whole blocks per rank (local)
    shapes = [(16, 6)] * 3 + [(10, 4)] * 3 + [(16, 5)] * 2
    spec = [({BLOCKS: 2}, range(6)), ({BLOCKS: 4}, range(6, 8))]
    out = {}
    for s in STRATEGIES:
        out[f"shard00 {s}"] = _parity(shapes, spec, mesh, [Shard(0), Shard(0)], s)[0]
    return out


def _add_group_case(flat):
    """Groups added after construction are planned and stepped like groups given at first."""
    shapes = [(12, 6)] * 3 + [(8, 5)] * 2 + [(7,), (9, 3)]
    spec = [
        ({}, [0, 1, 2]),
        ({"lr": 0.03}, [3, 4]),
        ({"algorithm": "adamw", "lr": 0.01}, [5, 6]),
    ]
    init = _tensors(shapes, 7)
    params = _dist_params(init, flat, [Shard(0)])
    ref_params = _dist_params(init, None, None)
    opt = Muon(_groups(params, spec[:1]), **KW)
    for group in _groups(params, spec[1:]):
        opt.add_param_group(group)
    ref = Muon(_groups(ref_params, spec), **KW)
    for step in range(STEPS):
        grads = _tensors(shapes, 200 + step)
        _set_grads(params, grads)
        _set_grads(ref_params, grads)
        opt.step()
        ref.step()
    return {"add_param_group": _max_err(opt, params, ref, ref_params)}


def _grad_none_cases(flat):
    """Parameters without a grad on every rank are left as they are, momentum and step too."""
    rank = dist.get_rank()
    # a full batch + R=1 of (10, 7); fused experts whole on each rank (local) and spanning two
    # ranks (sub-group); an AdamW matrix. Skipped: one of each kind.
    shapes = [(10, 7)] * 5 + [(16, 6)] * 2 + [(6, 3)] + [(16, 5)] * 2
    spec = [
        ({}, range(5)),
        ({BLOCKS: 4}, [5, 6]),
        ({"algorithm": "adamw"}, [7]),
        ({BLOCKS: 2}, [8, 9]),
    ]
    skip = {1, 4, 6, 7, 9}
    out = {}
    for s in STRATEGIES:
        init = _tensors(shapes, 3)
        params = _dist_params(init, flat, [Shard(0)])
        ref_params = _dist_params(init, None, None)
        opt = Muon(_groups(params, spec), **dict(KW, remainder_strategy=s))
        ref = Muon(_groups(ref_params, spec), **dict(KW, remainder_strategy=s))
        moved = 0.0
        for step in range(STEPS):
            grads = _tensors(shapes, 300 + step)
            missing = skip if step == 1 else ()
            before = {
                i: [_full(params[i]).clone()]
                + [_full(v).clone() for v in opt.state[params[i]].values()]
                for i in missing
            }
            _set_grads(params, grads, missing)
            _set_grads(ref_params, grads, missing)
            opt.step()
            ref.step()
            for i, old in before.items():
                new = [_full(params[i])] + [_full(v) for v in opt.state[params[i]].values()]
                moved = max(moved, *(_diff(a, b) for a, b in zip(new, old, strict=True)))
        out[f"grad None untouched {s}"] = moved
        out[f"grad None parity {s}"] = _max_err(opt, params, ref, ref_params)

    # ranks that disagree: a clear error on every rank, nothing written, and no hang
    init = _tensors(shapes, 4)
    params = _dist_params(init, flat, [Shard(0)])
    opt = Muon(_groups(params, spec), **KW)
    _set_grads(params, _tensors(shapes, 400))  # distribute_tensor is collective: then drop
    if rank == 0:
        params[2].grad = None
    try:
        opt.step()
        out["disagree"] = "no error"
    except RuntimeError as e:
        out["disagree"] = str(e)
    out["disagree moved"] = max(_diff(p, t) for p, t in zip(params, init, strict=True))
    return out


def _dtype_case(flat):
    """fp16 and bf16 matrices of one shape, interleaved: bf16 values beyond fp16's range."""
    out = {}
    shapes = [(8, 6)] * 4
    init = _tensors(shapes, 5)
    dtypes = [torch.float16, torch.bfloat16] * 2
    scale = [1.0, 1e6] * 2  # bf16 momentum of ~1e5 does not fit an fp16 buffer (max 65504)
    for s in STRATEGIES:
        params = [
            nn.Parameter(distribute_tensor(t.to(d), flat, [Shard(0)]))
            for t, d in zip(init, dtypes, strict=True)
        ]
        ref_params = [nn.Parameter(t.to(d)) for t, d in zip(init, dtypes, strict=True)]
        opt = Muon(params, **dict(KW, remainder_strategy=s))
        ref = Muon(ref_params, **dict(KW, remainder_strategy=s))
        rel = 0.0
        for step in range(STEPS):
            grads = [
                g.to(d) * k
                for g, d, k in zip(_tensors(shapes, 500 + step), dtypes, scale, strict=True)
            ]
            _set_grads(params, grads)
            _set_grads(ref_params, grads)
            opt.step()
            ref.step()
        for p, rp in zip(params, ref_params, strict=True):
            # both runs round the same float32 NS output to the parameter dtype; a differing
            # last bit of the update flips at most one rounding of p per step
            ulp = torch.finfo(rp.dtype).eps * rp.float().abs().max().item()
            err = _diff(p, rp)
            rel = max(rel, err / (STEPS * ulp))
        out[f"dtypes {s}"] = rel
    return out


def _contracts_world():
    torch.manual_seed(0)
    flat = init_mesh((W,), ("fsdp",))
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        cases = (_shard1_cases, _expert3d_cases, _shard00_cases, _add_group_case)
        for case in (*cases, _grad_none_cases, _dtype_case):
            try:  # the errors of every case are reported, not only the first
                out.update(case(flat))
            except Exception as e:  # noqa: BLE001 - reported by the test with its traceback
                out[case.__name__] = "".join(traceback.format_exception(e))[-1500:]
    return out


#: every case the world computes, by the label it reports (one pytest case each)
CASES = (
    *(f"shard1 {s}" for s in STRATEGIES),
    *(f"shard00 {s}" for s in STRATEGIES),
    *(f"expert3d{what} aware={a}" for a in (True, False) for what in ("", " blocks")),
    "add_param_group",
    *(f"grad None {what} {s}" for s in STRATEGIES for what in ("untouched", "parity")),
    "disagree",
    "disagree moved",
    *(f"dtypes {s}" for s in STRATEGIES),
)


@pytest.fixture(scope="module")
def contracts() -> list[dict]:
    """Every case on one 4-rank world (a world costs seconds; the cases only milliseconds)."""
    return run_world(_contracts_world, W, timeout_s=300)


def test_every_case_reported(contracts):
    """No case raised (a raising case reports its traceback under its function's name)."""
    for out in contracts:
        assert set(out) == set(CASES), set(out) ^ set(CASES)


@pytest.mark.parametrize("label", CASES)
def test_contract(contracts, label):
    for rank, out in enumerate(contracts):
        value = out.get(label)
        assert value is not None, f"rank {rank}: case {label} did not run"
        if label == "disagree":
            # names the parameter and how many ranks hold its grad (all but rank 0)
            assert "group 0 param 2" in value and f"3 of {W} ranks" in value, value
        elif label.startswith("dtypes"):
            assert value <= 1.0, f"rank {rank}: {value}"
        elif "untouched" in label or label == "disagree moved" or "blocks" in label:
            assert value == 0.0, f"rank {rank}: {value}"
        else:
            assert value < TOL, f"rank {rank}: {value}"
