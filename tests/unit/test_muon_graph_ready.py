"""The Muon step is ready for CUDA-graph capture on the local path and the AdamW groups, checked
on CPU: what a graph needs (no host reads, no tensor made from host data, static buffers,
shapes that do not depend on data) is visible in the ops a step dispatches. The capture itself
runs on a GPU (tests/gpu/test_muon_graph.py, `scripts/gpu_check.sh --only graph`)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from muon import Muon
from muon.blowups import may_run_gram
from recipes.bench.probe import all_on_device

#: ops that read a device value on the host or size their output by data
HOST_READS = {"_local_scalar_dense", "item", "nonzero", "unique", "_unique2", "masked_select"}
#: ops that make a tensor from host data (`torch.tensor(...)`): a host-to-device copy on a GPU
HOST_MADE = {"lift_fresh", "lift_fresh_copy"}


class Recorder(TorchDispatchMode):
    """Every dispatched op with the shapes and dtypes of the tensors it returns."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = out if isinstance(out, (tuple, list)) else (out,)
        made = tuple((tuple(t.shape), t.dtype) for t in leaves if isinstance(t, torch.Tensor))
        self.ops.append((func.overloadpacket.__name__, made))
        return out


def graph_optimizer(
    device="cpu", normuon: bool = True, gram: bool = False
) -> tuple[Muon, list[torch.nn.Parameter]]:
    """Every kind of local batch: plain matrices (one bucket of 3), fused experts, blocks of
    unequal heights (Muon Split) with NorMuon, a 3-D parameter, and an AdamW group; with
    `gram`, a [256, 768] matrix too, which the default `ns_algorithm="auto"` orthogonalizes
    with Gram Newton-Schulz and its output check (`muon.blowups`)."""
    gen = torch.Generator().manual_seed(0)

    def param(*shape):
        return torch.nn.Parameter(torch.randn(*shape, generator=gen).to(device))

    dense = [param(32, 48) for _ in range(3)]
    experts, split, cube = [param(64, 16)], [param(24, 40)], [param(4, 8, 12)]
    adamw = [param(48), param(16, 8)]
    wide = [param(256, 768)] if gram else []
    groups = [
        {"params": dense + wide},
        {"params": experts, "num_blocks": 4},
        {"params": split, "split_sizes": (16, 8), "normuon": normuon},
        {"params": cube},
        {"params": adamw, "algorithm": "adamw", "lr": 1e-3, "weight_decay": 0.1},
    ]
    opt = Muon(groups, lr=0.02, weight_decay=0.1, ns_dtype=torch.float32)
    return opt, dense + wide + experts + split + cube + adamw


def fill_grads(params, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        g = torch.randn(p.shape, generator=gen).to(p.device)
        if p.grad is None:
            p.grad = g
        else:
            p.grad.copy_(g)  # static gradient buffers, as a captured step reads them


def _recorded(opt, params, step: int) -> list[tuple[str, tuple]]:
    fill_grads(params, step)
    with Recorder() as rec:
        opt.update()
    return rec.ops


@pytest.mark.parametrize("gram", [False, True])
def test_the_local_path_and_adamw_make_no_host_read_and_the_same_buffers_each_step(
    monkeypatch, gram
):
    opt, params = graph_optimizer(gram=gram)
    # the plan has batches that may run Gram (and so get blow-up counters) only with `gram`
    assert any(may_run_gram(b) for _, batches in opt.plans for b in batches) == gram
    assert {b.path for _, batches in opt.plans for b in batches} == {"local"}
    fill_grads(params, 0)
    opt.step()  # the census once: which parameters have grads
    reads = []
    for name in ("tolist", "item", "__bool__", "__float__", "__int__", "numpy"):
        real = getattr(torch.Tensor, name)

        def reader(self, *a, _name=name, _real=real, **kw):
            reads.append(_name)
            return _real(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, reader)
    second, third = _recorded(opt, params, 1), _recorded(opt, params, 2)
    monkeypatch.undo()
    assert reads == [], f"host reads in the update: {reads}"
    names = {name for name, _ in second}
    assert not names & HOST_READS, names & HOST_READS
    assert not names & HOST_MADE, "a tensor made from host data inside the update"
    # the same ops with the same output shapes and dtypes: a graph's buffers are static
    assert second == third
    assert len(second) > 0


@pytest.mark.parametrize("gram", [False, True])
def test_the_whole_step_reads_the_host_once(gram):
    """`step` = the census (its read of the device: was every gradient finite, with the
    previous update's refusals and Gram blow-up counts, in one `tolist`) + `update`; the verdict of
    `muon.guard` (did every update fit its dtype) stays on the device until
    `last_step_skipped` is asked for, which reads it once."""
    opt, params = graph_optimizer(gram=gram)
    fill_grads(params, 0)
    opt.step()
    fill_grads(params, 1)
    with all_on_device() as count:  # every tensor a device tensor: `tolist` is counted too
        opt.step()
    assert count.syncs_by_kind() == {"tolist": 1}, count.syncs_by_kind()
    with Recorder() as rec:
        assert not opt.last_step_skipped and not opt.last_step_skipped
        assert opt.skipped_steps == 0
    reads = [name for name, _ in rec.ops if name in HOST_READS]
    assert reads == ["_local_scalar_dense"] * 2, reads  # the verdict once, the earlier one once


def test_update_after_the_census_equals_step():
    """`update` is the step after the census: the same parameters and state."""
    a, pa = graph_optimizer()
    b, pb = graph_optimizer()
    for step in range(3):
        fill_grads(pa, step)
        fill_grads(pb, step)
        a.step()
        if step == 0:
            b.step()  # the census once, then update alone
        else:
            b.update()
    for p, q in zip(pa, pb, strict=True):
        assert torch.equal(p, q)
        for key, value in a.state[p].items():
            assert torch.equal(value, b.state[q][key]), key


@pytest.mark.parametrize("nesterov", [True, False])
def test_momentum_and_apply_are_foreach_over_a_batch(nesterov):
    """Batched update math: the bucket of three dense matrices is one batch, whose momentum and
    apply are a fixed number of foreach ops, not one op per parameter (NorMuon off: its
    normalization is per parameter's moments)."""
    opt, params = graph_optimizer(normuon=False)
    for g in opt.param_groups:
        g["nesterov"] = nesterov
    fill_grads(params, 0)
    opt.step()
    ops = _recorded(opt, params, 1)
    per_param = [name for name, _ in ops if name in ("lerp_", "lerp", "mul_", "add_")]
    assert per_param == [], per_param
    foreach = [name for name, _ in ops if name.startswith("_foreach_")]
    batches = sum(len(bs) for _, bs in opt.plans)
    assert len(foreach) <= 6 * batches + 2, foreach
