"""The routed experts' grouped matmul on CUDA in bf16 (torch._grouped_mm's native kernel, sm90 /
sm100) against the float32 per-expert loop, forward and backward, within a bf16 bound derived
op by op; one MoE layer's forward and backward on the device make no host sync. Skipped where
no CUDA device is present, or where the device has no native grouped kernel."""

import pytest
import torch
import torch.nn.functional as F

from models.glm.model.moe import MoE, expert_kernel
from tests.gpu.test_cuda_paths import host_syncs
from tests.models import tiny_glm
from tests.unit.test_models_moe import experts_case, gamma_n, run_kernel

UB = 2.0**-8  # bf16 unit roundoff (8 significant bits)
SILU_SLOPE, SILU_CURVE = 1.1, 0.5  # max |silu'| = 1.0998..., max |silu''| = 0.5 (at 0)


def _bf16_bounds(experts, x_SD, g_SD, counts: list[int]) -> dict:
    """First-order bounds on |bf16 kernel - float32 loop|, element by element.

    Dyadic inputs (x k/4, weights k/64, the output gradient k/4) are exact in bf16, and every
    sum that reads only them is exact in the float32 accumulator of either run: gate/up and
    dh = g W_down. The bf16 run then rounds (relative UB) each op's output once (opmath is
    float32): gate/up, silu, the product h, dh, each elementwise backward op, each matmul. So
      |dh~ - dh| <= UB |dh|, |gate~ - gate| <= UB |gate|, |up~ - up| <= UB |up|,
      |h~ - h| <= UB |up| (SILU_SLOPE |gate| + 3 |silu gate|)           (silu, two roundings),
      |d_up~ - d_up| <= UB |dh| (3 |silu gate| + SILU_SLOPE |gate|),
      |d_gate~ - d_gate| <= UB |dh||up| (3 SILU_SLOPE + SILU_CURVE |gate| + |silu' gate|),
    and a matmul R = A B of perturbed operands is within |dA||B| + |A||dB| + (UB + 2 gamma_n)
    |A||B| (its own rounding and both float32 sums). A 1.25 margin covers the second-order
    terms (relative UB ~ 0.004 of the first-order ones)."""
    D, I = experts.hidden_size, experts.inner_size
    S = sum(counts)
    w_gu = experts.gate_up_proj.detach().double().cpu().view(-1, 2 * I, D)
    w_down = experts.down_proj.detach().double().cpu().view(-1, D, I)
    out = {"y": [], "x": [], "gate_up_proj": [], "down_proj": []}
    rows = zip(torch.split(x_SD.double(), counts), torch.split(g_SD.double(), counts), strict=True)
    for j, (x, g) in enumerate(rows):
        gate, up = (x @ w_gu[j].T).chunk(2, -1)
        s = F.silu(gate)
        h = s * up
        dh = g @ w_down[j]
        sig = torch.sigmoid(gate)
        slope = sig * (1 + gate * (1 - sig))
        dgu = torch.cat([dh * up * slope, dh * s], -1).abs()
        err_h = UB * up.abs() * (SILU_SLOPE * gate.abs() + 3 * s.abs())
        err_dgu = torch.cat(
            [
                UB * (dh * up).abs() * (3 * SILU_SLOPE + SILU_CURVE * gate.abs() + slope.abs()),
                UB * dh.abs() * (3 * s.abs() + SILU_SLOPE * gate.abs()),
            ],
            -1,
        )
        wd, wg = w_down[j].abs(), w_gu[j].abs()
        out["y"].append(err_h @ wd.T + (UB + 2 * gamma_n(I)) * (h.abs() @ wd.T))
        out["down_proj"].append(g.abs().T @ err_h + (UB + 2 * gamma_n(S)) * (g.abs().T @ h.abs()))
        out["x"].append(err_dgu @ wg + (UB + 2 * gamma_n(2 * I)) * (dgu @ wg))
        out["gate_up_proj"].append((err_dgu.T + (UB + 2 * gamma_n(S)) * dgu.T) @ x.abs())
    return {k: 1.25 * torch.cat(v) for k, v in out.items()}


def test_grouped_mm_in_bf16_matches_the_float32_loop_within_the_bf16_bound():
    counts = [37, 0, 64, 5, 0, 120, 1, 29]  # empty experts inside, one of a single row
    experts, x_SD, g_SD = experts_case(counts, D=64, I=32)
    # The reference on the CPU: on CUDA a float32 matmul may run in TF32 (10-bit mantissa).
    want = run_kernel(experts, "loop", x_SD, g_SD, torch.tensor(counts))
    experts.cuda().bfloat16()
    counts_L = torch.tensor(counts, device="cuda")
    x16, g16 = x_SD.cuda().bfloat16(), g_SD.cuda().bfloat16()
    w_gu = experts.gate_up_proj.view(len(counts), -1, 64)
    if expert_kernel(x16, w_gu) != "grouped_mm":
        pytest.skip(f"no native bf16 grouped kernel on {torch.cuda.get_device_name()}")
    assert run_kernel(experts, "auto", x16, g16, counts_L)["y"].dtype == torch.bfloat16
    got = run_kernel(experts, "grouped_mm", x16, g16, counts_L)
    bounds = _bf16_bounds(experts, x_SD, g_SD, counts)
    for name, bound in bounds.items():
        diff = (got[name].double().cpu() - want[name].double().cpu()).abs()
        assert (diff <= bound).all(), (name, (diff - bound).max().item())


def test_moe_layer_forward_and_backward_make_no_host_sync_on_cuda():
    torch.manual_seed(0)
    moe = MoE(tiny_glm(n_routed_experts=16, num_experts_per_tok=4)).cuda().bfloat16()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(8, 64, 32, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step():
        moe(x).float().square().sum().backward()

    step()  # warm-up: cuBLAS handles, workspaces
    syncs = host_syncs(step)
    if expert_kernel(x.view(-1, 32), moe.experts.gate_up_proj) == "grouped_mm":
        assert syncs == 0
    else:  # the padded bmm reads its slot size once per forward
        assert syncs == 1
