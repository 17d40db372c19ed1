"""QK-clip's weight surgery (Kimi K2's MuonClip): rescale W_q / W_k from the recorded maxima.

The model records each head's largest attention logit (`models.glm.model.qk_clip`); after the
optimizer step, with the maximum over the ranks that saw different data
(`models.glm.infra.statistics.take_max_logits`), `qk_clip_` rescales every layer. GQA:
eta = min(1, tau / S) per KV group, S the largest logit of the group's query heads (Megatron-LM's
GQA rule): the group's W_q rows (and q biases) scale by eta^alpha, its W_k rows (and k biases) by
eta^(1 - alpha), so each of its logits scales by eta and the largest lands on tau. V and o_proj
are untouched. With QK-norm the projections' scale cancels in the norm, so the norm weights,
shared by every head of the layer, take it instead: q_norm.weight by eta^alpha and k_norm.weight
by eta^(1 - alpha) with the layer's smallest eta (every head of the layer shrinks by it).
MLA (`_clip_mla_`): eta per head, q_nope rows by eta^alpha, q_rope rows by eta, k_nope rows by
eta^(1 - alpha), the shared rotary key untouched (Kimi K2's MuonClip).
Sharded weights (FSDP2 / EP DTensors) scale their local rows; nothing is gathered.

Decided on the device: eta is computed with tensor ops and every unit's rows are multiplied by
their factor, exactly 1 (x * 1 == x bit for bit) where nothing clips, so the clip never reads a
logit on the host; the count it returns is a 0-dim tensor, read only by whoever logs it.
Non-finite max logits: NaN or +-inf comes from a forward that overflowed (the trainer skips that
step's update); it says nothing about the scale of the weights, so such a head is left out of its
unit's maximum, and the unit's finite heads alone decide its eta: one NaN head neither turns the
clip off for its KV group nor zeroes the group's weights (eta = tau / inf). A unit with no finite
head is not clipped. A threshold `tau` that is not a finite number > 0, or an `alpha` outside
[0, 1], is refused (`check_clip_args`) before any weight is written.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch.distributed.tensor import DTensor, Replicate

from models.glm.model.model import GLMForCausalLM


def qk_clip_(
    model: GLMForCausalLM, max_logits_LN: torch.Tensor, tau: float, alpha: float = 0.5
) -> torch.Tensor:
    """QK-clip every layer of `model` (`GLMForCausalLM.attentions`) from the per-head maxima
    [L, N] (`models.glm.infra.statistics.take_max_logits`); returns the number of KV groups
    (with QK-norm: of layers' groups; MLA: heads) clipped, a 0-dim tensor."""
    return sum(
        clip_attention_(attn, row_N, tau, alpha)
        for attn, row_N in zip(model.attentions(), max_logits_LN, strict=True)
    )


def check_clip_args(tau, alpha) -> None:
    """Refuse a threshold that is not a finite number > 0 (tau <= 0 would zero or NaN the
    weights) and an `alpha` that is not a number in [0, 1], naming the argument."""
    for name, value, ok, allowed in (
        ("tau", tau, lambda v: v > 0, "a finite number > 0"),
        ("alpha", alpha, lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    ):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"QK-clip {name}={value!r}: must be {allowed}, not {type(value)}")
        if not (math.isfinite(value) and ok(value)):
            raise ValueError(f"QK-clip {name}={value!r}: must be {allowed}")


def _check_logits(max_logit_N, heads: int) -> None:
    if not (isinstance(max_logit_N, torch.Tensor) and max_logit_N.is_floating_point()):
        raise TypeError(f"QK-clip max_logit_N: must be a floating tensor, got {max_logit_N!r}")
    if tuple(max_logit_N.shape) != (heads,):
        raise ValueError(
            f"QK-clip max_logit_N: shape {tuple(max_logit_N.shape)}, the attention has "
            f"{heads} query heads: expected ({heads},)"
        )


def clip_factors(max_logit_N: torch.Tensor, n_units: int, tau: float) -> torch.Tensor:
    """eta per unit (KV group; MLA: head), `[n_units]`: min(1, tau / S) with S the largest
    finite logit of the unit's heads; 1 where no head is finite (see the module docstring).
    Tensor ops only: no host read."""
    finite_N = torch.where(torch.isfinite(max_logit_N), max_logit_N, -torch.inf)
    s_M = finite_N.view(n_units, -1).amax(dim=1)
    return torch.where(s_M > tau, tau / s_M, torch.ones_like(s_M))


def scale_rows_(p: torch.Tensor, scale_rows: torch.Tensor) -> None:
    """p[i] *= scale_rows[i] along dim 0, in place; a DTensor scales its local rows only (the
    replicated factors are cut to the parameter's layout locally, without communication)."""
    if isinstance(p, DTensor):
        mesh = p.device_mesh
        full = DTensor.from_local(
            scale_rows.to(p.to_local().device), mesh, [Replicate()] * mesh.ndim, run_check=False
        )
        factors, local = full.redistribute(mesh, p.placements).to_local(), p.to_local()
    else:
        factors, local = scale_rows.to(p.device), p.data
    local.mul_(factors.view(-1, *[1] * (local.ndim - 1)).to(local.dtype))


@torch.no_grad()
def clip_attention_(attn, max_logit_N: torch.Tensor, tau: float, alpha: float) -> torch.Tensor:
    """Rescale one attention's query/key projections (see the module docstring); returns the
    number of KV groups (MLA: heads) clipped, a 0-dim tensor. Rows of units under tau are
    multiplied by exactly 1: bit-equal, and no host read decides anything."""
    check_clip_args(tau, alpha)
    _check_logits(max_logit_N, attn.n_heads)
    if hasattr(attn, "kv_b_proj"):
        return _clip_mla_(attn, max_logit_N, tau, alpha)
    eta_M = clip_factors(max_logit_N, attn.n_kv_heads, tau)
    clipped = (eta_M < 1).sum()
    if attn.q_norm is not None:  # the layer's smallest eta, on every head's shared norm weights
        eta = eta_M.amin()
        scale_rows_(attn.q_norm.weight, (eta**alpha).expand(attn.q_norm.weight.shape[0]))
        scale_rows_(attn.k_norm.weight, (eta ** (1 - alpha)).expand(attn.k_norm.weight.shape[0]))
        return clipped
    K, rep = attn.head_dim, attn.n_heads // attn.n_kv_heads
    # query head h is in group h // rep; expand, not repeat_interleave (it reads its size)
    q_rows = (eta_M**alpha)[:, None].expand(-1, rep * K).reshape(-1)
    k_rows = (eta_M ** (1 - alpha))[:, None].expand(-1, K).reshape(-1)
    for proj, rows in ((attn.q_proj, q_rows), (attn.k_proj, k_rows)):
        scale_rows_(proj.weight, rows)
        if proj.bias is not None:
            scale_rows_(proj.bias, rows)
    return clipped


def _clip_mla_(attn, max_logit_N: torch.Tensor, tau: float, alpha: float) -> torch.Tensor:
    """MLA, per head: q_nope rows by eta^alpha, q_rope rows by eta, k_nope rows (in kv_b_proj) by
    eta^(1 - alpha); the rotary key (kv_a_proj_with_mqa) serves every head and is not touched,
    nor are v's rows. Each term of the head's logit, q_nope.k_nope + q_rope.k_rope, scales by
    eta."""
    eta_N = clip_factors(max_logit_N, attn.n_heads, tau)
    P, R, V = attn.nope, attn.rope, attn.v_dim
    ones = torch.ones_like(eta_N)
    q_rows = torch.stack([eta_N**alpha] * P + [eta_N] * R, dim=1).reshape(-1)
    kv_rows = torch.stack([eta_N ** (1 - alpha)] * P + [ones] * V, dim=1).reshape(-1)
    q = attn.q_b_proj if hasattr(attn, "q_b_proj") else attn.q_proj
    scale_rows_(q.weight, q_rows)
    scale_rows_(attn.kv_b_proj.weight, kv_rows)
    return (eta_N < 1).sum()
