"""The routed experts' kernels: the grouped matmul and the padded batched matmul equal the
per-expert loop within the float32 bound of a reordered sum, forward and backward, with empty
experts; which kernel "auto" runs; the ops and host reads of one MoE layer, which do not grow
with the number of experts.

Shape legend: S rows, D hidden, I expert inner size, L local experts.
"""

import pytest
import torch
import torch.nn.functional as F

from models.glm.model.moe import EXPERT_KERNELS, FusedExperts, MoE, expert_counts, expert_kernel
from recipes.bench.probe import all_on_device
from tests.models import tiny_glm

U32 = 2.0**-24  # float32 unit roundoff


def gamma_n(n: int) -> float:
    """Higham's gamma_n = n u / (1 - n u): a float32 sum of n products, in any order, is within
    gamma_n * sum |a_i b_i| of the exact sum (Accuracy and Stability of Numerical Algorithms,
    eq. 3.5). Two orders are then within twice that of each other."""
    return n * U32 / (1 - n * U32)


def _dyadic(*shape: int, scale: int, gen: torch.Generator) -> torch.Tensor:
    """Integers in [-scale, scale] / scale: few enough significant bits that every sum of up to
    thousands of their products is exact in float32, whatever the order."""
    return torch.randint(-scale, scale + 1, shape, generator=gen).float() / scale


def experts_case(counts: list[int], D: int = 32, I: int = 16, seed: int = 0):
    """Experts with dyadic weights, dyadic rows and a dyadic output gradient."""
    gen = torch.Generator().manual_seed(seed)
    L = len(counts)
    experts = FusedExperts(tiny_glm(n_routed_experts=L, hidden_size=D, moe_intermediate_size=I))
    with torch.no_grad():
        experts.gate_up_proj.copy_(_dyadic(L * 2 * I, D, scale=64, gen=gen))
        experts.down_proj.copy_(_dyadic(L * D, I, scale=64, gen=gen))
    S = sum(counts)
    return experts, _dyadic(S, D, scale=4, gen=gen), _dyadic(S, D, scale=4, gen=gen)


def run_kernel(experts: FusedExperts, kernel: str, x_SD, g_SD, counts_L):
    experts.kernel = kernel
    experts.zero_grad(set_to_none=True)
    x = x_SD.clone().requires_grad_()
    y = experts(x, counts_L)
    y.backward(g_SD)
    return {
        "y": y.detach(),
        "x": x.grad,
        "gate_up_proj": experts.gate_up_proj.grad,
        "down_proj": experts.down_proj.grad,
    }


def _reorder_bounds(experts: FusedExperts, x_SD, g_SD, counts: list[int]) -> dict:
    """How far two kernels may be apart, element by element.

    With dyadic x, weights and output gradient, the sums that read only them are exact in any
    order: gate/up = x W_gu^T and dh = g W_down. So h = silu(gate) * up and the gate/up
    gradient dgu = [dh * up * silu'(gate), dh * silu(gate)] are the same bits in every kernel
    (the same elementwise ops on the same inputs), and the kernels differ only in the order of
    the sums that read h or dgu: y = h W_down^T (I terms), the down gradient g^T h and the
    gate/up gradient dgu^T x (a group's rows, <= S terms), dx = dgu W_gu (2I terms). Each
    element is then within 2 gamma_n sum |a_i b_i|, taken here in float64 on absolute values
    (with a 1e-6 margin for the float64 silu of the bound itself)."""
    D, I = experts.hidden_size, experts.inner_size
    S = sum(counts)
    w_gu = experts.gate_up_proj.detach().double().view(-1, 2 * I, D)
    w_down = experts.down_proj.detach().double().view(-1, D, I)
    out = {"y": [], "x": [], "gate_up_proj": [], "down_proj": []}
    rows = zip(torch.split(x_SD.double(), counts), torch.split(g_SD.double(), counts), strict=True)
    for j, (x, g) in enumerate(rows):
        gate, up = (x @ w_gu[j].T).chunk(2, -1)
        h = F.silu(gate) * up
        dh = g @ w_down[j]
        sig = torch.sigmoid(gate)
        dgu = torch.cat([dh * up * sig * (1 + gate * (1 - sig)), dh * F.silu(gate)], -1)
        out["y"].append(2 * gamma_n(I) * (h.abs() @ w_down[j].abs().T))
        out["x"].append(2 * gamma_n(2 * I) * (dgu.abs() @ w_gu[j].abs()))
        out["down_proj"].append(2 * gamma_n(S) * (g.abs().T @ h.abs()))
        out["gate_up_proj"].append(2 * gamma_n(S) * (dgu.abs().T @ x.abs()))
    return {k: torch.cat(v) * (1 + 1e-6) for k, v in out.items()}


@pytest.mark.parametrize(
    "counts",
    [
        [5, 0, 7, 9],  # an empty expert inside
        [0, 0, 12, 0],  # one busy expert
        [0, 0, 0, 0],  # no rows at all (an EP rank that receives nothing)
        [3, 1, 4, 1, 5, 9, 2, 6],
    ],
)
def test_kernels_equal_the_loop_within_the_reordered_sum_bound(counts):
    experts, x_SD, g_SD = experts_case(counts)
    counts_L = torch.tensor(counts)
    want = run_kernel(experts, "loop", x_SD, g_SD, counts_L)
    bounds = _reorder_bounds(experts, x_SD, g_SD, counts)
    for kernel in ("grouped_mm", "padded_bmm"):
        got = run_kernel(experts, kernel, x_SD, g_SD, counts_L)
        for name, bound in bounds.items():
            diff = (got[name].double() - want[name].double()).abs()
            assert diff.shape == bound.shape, (kernel, name)
            assert (diff <= bound).all(), (kernel, name, (diff - bound).max().item())
        # A gradient that is not a plain dense tensor (that of .sum() is broadcast) works too.
        x = x_SD.clone().requires_grad_()
        experts(x, counts_L).sum().backward()
        assert x.grad.shape == x_SD.shape


def test_auto_runs_grouped_mm_where_torch_has_a_kernel_and_padded_bmm_elsewhere():
    w32 = torch.empty(4, 32, 32)
    assert expert_kernel(torch.empty(8, 32), w32) == "grouped_mm"
    assert expert_kernel(torch.empty(8, 32, dtype=torch.bfloat16), w32.bfloat16()) == "grouped_mm"
    assert expert_kernel(torch.empty(8, 32).double(), w32.double()) == "padded_bmm"
    # rows of 30 float32 values: 120 bytes, not a multiple of the 16 torch._grouped_mm needs
    assert expert_kernel(torch.empty(8, 30), torch.empty(4, 32, 30)) == "padded_bmm"
    assert expert_kernel(torch.empty(8, 30, dtype=torch.bfloat16)) == "padded_bmm"  # 60 bytes
    # float64 experts run (padded bmm) and agree with the float64 loop to float64 rounding.
    experts, x_SD, g_SD = experts_case([2, 0, 3, 1])
    experts.double()
    x_SD, g_SD, counts_L = x_SD.double(), g_SD.double(), torch.tensor([2, 0, 3, 1])
    got, want = (run_kernel(experts, k, x_SD, g_SD, counts_L) for k in ("auto", "loop"))
    for name in want:  # float64 sums of <= 32 terms of size <= 32: within 1e-12
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-12)


def test_bad_kernel_and_counts_fail_naming_what_is_allowed():
    experts = FusedExperts(tiny_glm())
    with pytest.raises(ValueError, match=r"kernel 'cutlass' is not one of \('auto', "):
        experts.kernel = "cutlass"
    with pytest.raises(ValueError, match=r"kernel 'x' is not one of"):
        FusedExperts(tiny_glm(), kernel="x")
    assert EXPERT_KERNELS == ("auto", "grouped_mm", "padded_bmm", "loop")
    with pytest.raises(ValueError, match=r"counts_L has shape \(3,\); expected .* \(8,\)"):
        experts(torch.zeros(3, 32), torch.ones(3, dtype=torch.long))


def test_expert_counts_match_bincount():
    idx = torch.randint(0, 7, (50, 3), generator=torch.Generator().manual_seed(1))
    assert torch.equal(expert_counts(idx, 9), torch.bincount(idx.reshape(-1), minlength=9))


def _layer_counts(num_experts: int, kernel: str) -> tuple[int, dict, dict]:
    """(ops of one MoE layer's forward + backward, host reads of its forward, of its backward)."""
    torch.manual_seed(0)
    moe = MoE(tiny_glm(n_routed_experts=num_experts, num_experts_per_tok=2))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    moe.experts.kernel = kernel
    x = torch.randn(4, 16, 32, requires_grad=True)
    with all_on_device() as forward:
        y = moe(x)
    with all_on_device() as backward:
        y.backward(torch.randn_like(y))
    return forward.n_ops + backward.n_ops, forward.syncs_by_kind(), backward.syncs_by_kind()


def test_moe_layer_ops_do_not_grow_with_experts_and_read_nothing_on_the_host():
    """Counted by dispatched op, every tensor a device tensor (recipes.bench.probe.all_on_device):
    deterministic for a given input."""
    grouped = {E: _layer_counts(E, "grouped_mm") for E in (8, 32)}
    assert grouped[8][0] == grouped[32][0]
    assert all(c[1:] == ({}, {}) for c in grouped.values())
    # The padded bmm reads its slot size once per forward (`int(...)`); the loop reads the counts.
    padded = {E: _layer_counts(E, "padded_bmm") for E in (8, 32)}
    assert padded[8][0] == padded[32][0]
    assert all(c[1:] == ({"int": 1}, {}) for c in padded.values())
    loop = {E: _layer_counts(E, "loop") for E in (8, 32)}
    assert loop[32][0] > loop[8][0] + 24 * 10  # >= ~11 ops per expert forward + backward
    assert all(c[1:] == ({"tolist": 1}, {}) for c in loop.values())
    assert _layer_counts(8, "auto") == grouped[8]  # float32 on CPU: the grouped matmul
