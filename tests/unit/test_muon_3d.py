"""Parameters of more than two dims, `[E, out, in]` (muon/validate.py, muon/plan.py): each slice
along dim 0 is one block. Single process, CPU; the FSDP2-sharded case is in
tests/distributed/test_muon_behaviour.py."""

import pytest
import torch
from torch import nn

from muon import Muon, batch_cost, cost

E, OUT, IN = 4, 12, 20


def _steps(params_fn, groups_fn, grads, **kw):
    params = params_fn()
    opt = Muon(groups_fn(params), ns_dtype="float32", lr=0.05, **kw)
    for g in grads:
        for p, gp in zip(params, g(params), strict=True):
            p.grad = gp
        opt.step()
    return params, opt


@pytest.mark.parametrize("num_blocks", [1, E], ids=["default", "declared"])
@pytest.mark.parametrize("adjust_lr", ["match_rms_adamw", "original"])
def test_3d_expert_weight_equals_separate_matrices(num_blocks, adjust_lr):
    """[E, out, in] with num_blocks 1 or E trains exactly like E separate [out, in] matrices
    (float32: batched and single matmuls may round differently, ~1e-7 relative, amplified by
    Newton-Schulz's slopes to < 1e-5 on updates of ~0.05 over 3 steps)."""
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(E, OUT, IN, generator=gen)
    grads = [torch.randn(E, OUT, IN, generator=gen) for _ in range(3)]
    (w,), opt = _steps(
        lambda: [nn.Parameter(w0.clone())],
        lambda ps: [{"params": ps, "num_blocks": num_blocks}],
        [lambda ps, g=g: [g.clone()] for g in grads],
        adjust_lr=adjust_lr,
    )
    sep, _ = _steps(
        lambda: [nn.Parameter(w0[e].clone()) for e in range(E)],
        lambda ps: [{"params": ps}],
        [lambda ps, g=g: [g[e].clone() for e in range(E)] for g in grads],
        adjust_lr=adjust_lr,
    )
    torch.testing.assert_close(
        w.detach(), torch.stack([p.detach() for p in sep]), atol=1e-5, rtol=0
    )
    (b,) = opt.plans[0][1]
    assert b.num_blocks == E and b.block_shape == (OUT, IN)  # the planner counts E blocks
    assert cost.batch_block_flops(b) > 0 and batch_cost.blocks_on(b, 0) == E


def test_3d_update_is_orthogonal_per_slice_not_per_row():
    """The update of each slice has singular values near 1 (Polar Express band), not a
    normalized row vector (1-row blocks: a single singular value)."""
    w = nn.Parameter(torch.zeros(E, OUT, IN))
    opt = Muon(
        [{"params": [w], "num_blocks": E}],
        lr=1.0,
        momentum=0.0,
        nesterov=False,
        adjust_lr="none",
        ns_coefficients="polar_express",
        ns_dtype="float32",
    )
    w.grad = torch.randn(E, OUT, IN, generator=torch.Generator().manual_seed(1))
    opt.step()
    s = torch.linalg.svdvals(-w.detach())
    assert s.min() > 0.5 and s.max() < 1.2, s


def test_3d_other_block_counts_are_rejected_with_how_to_declare():
    w = nn.Parameter(torch.zeros(E, OUT, IN))
    with pytest.raises(ValueError) as info:
        Muon([{"params": [w], "num_blocks": 2 * E}])
    msg = str(info.value)
    assert "num_blocks" in msg and f"[{OUT}, {IN}]" in msg and f"[{E * OUT}, {IN}]" in msg
