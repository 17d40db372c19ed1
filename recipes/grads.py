"""Gradient norms and clipping over parameters that live on different device meshes.

torch's clip_grad_norm_ stacks per-parameter norms, which fails when DTensors of several meshes
(dense FSDP mesh, expert (efsdp, ep) mesh) meet. Here each rank sums the squares of its local
shards, each divided by how many ranks hold a copy of the same elements, and one all-reduce over
the world gives the exact global sum of squares. The sums, the clip factor and the scaling stay
on the device: the trainer reads the norms only when it logs them.
"""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from recipes.ranks import local_tensor, world_size


def _copies(t: torch.Tensor, world_size: int) -> int:
    """How many ranks of the world hold each element of `t`'s local data."""
    if not isinstance(t, DTensor):
        return world_size
    mesh = t.device_mesh
    replicated = 1
    for dim, placement in enumerate(t.placements):
        if isinstance(placement, Replicate):
            replicated *= mesh.size(dim)
    # A submesh (e.g. one EP group) is one of world_size // mesh.size() identical copies.
    return replicated * (world_size // mesh.size())


def squared_norm_tensors(params_by_key: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Collective: the global sum of squared gradients of each parameter list, as 0-dim
    float64 tensors (views of one all-reduced tensor) that stay where the all-reduce ran: the
    gradients' device under NCCL (CUDA), the host under gloo. No host read."""
    world = world_size()
    keys = sorted(params_by_key)
    totals: list[torch.Tensor | None] = []
    for key in keys:
        total = None
        for p in params_by_key[key]:
            if p.grad is not None:
                # Squared in place on a float64 copy (x * x, the values pow(2) gives): one
                # temporary per gradient instead of two; a copy even of a float64 gradient.
                wide = local_tensor(p.grad).detach().to(torch.float64, copy=True)
                term = wide.mul_(wide).sum() / _copies(p.grad, world)
                total = term if total is None else total + term
        totals.append(total)
    if world > 1:
        nccl = dist.get_backend() == "nccl"
        on = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    else:
        on = next((t.device for t in totals if t is not None), torch.device("cpu"))
    zero = torch.zeros((), dtype=torch.float64, device=on)
    stacked = torch.stack([zero if t is None else t.to(on) for t in totals] or [zero])
    if world > 1:
        dist.all_reduce(stacked)
    return dict(zip(keys, stacked[: len(keys)].unbind(), strict=True))


def squared_norms(params_by_key: dict[str, list[torch.Tensor]]) -> dict[str, float]:
    """Collective: `squared_norm_tensors` as floats (one host read)."""
    norms = squared_norm_tensors(params_by_key)
    values = torch.stack(list(norms.values())).tolist() if norms else []
    return dict(zip(norms, values, strict=True))


@torch.no_grad()
def clip_factor(sq_clipped: torch.Tensor, finite: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor that brings the gradients of norm sqrt(`sq_clipped`) down to `max_norm`:
    max_norm / (norm + 1e-6) where the norm exceeds max_norm and `finite` holds, else exactly 1
    (a 0-dim tensor on their device: deciding needs no host read)."""
    norm = sq_clipped.sqrt()
    scaled = max_norm / (norm + 1e-6)
    return torch.where(finite & (norm > max_norm), scaled, torch.ones_like(scaled))


@torch.no_grad()
def scale_grads(params: list[torch.Tensor], factor: float | torch.Tensor) -> None:
    """Multiply the gradients of `params` by `factor`, in place: a float, or a 0-dim tensor
    (then one foreach op per gradient dtype, the factor rounded as a float factor is: to the
    dtype's compute type, float32 for float32 and narrower)."""
    local = [local_tensor(p.grad) for p in params if p.grad is not None]
    if not isinstance(factor, torch.Tensor):
        for g in local:
            g.mul_(factor)
        return
    by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for g in local:
        by_dtype.setdefault((g.dtype, g.device), []).append(g)
    for (dtype, device), tensors in by_dtype.items():
        compute = torch.promote_types(dtype, torch.float32)
        torch._foreach_mul_(tensors, factor.to(device=device, dtype=compute))


@torch.no_grad()
def poison_grad(params: list[torch.Tensor]) -> None:
    """Debug: make the first local gradient element NaN (train.inject_nan_at_step)."""
    for p in params:
        if p.grad is not None:
            local = local_tensor(p.grad)
            if local.numel():
                local.view(-1)[0] = float("nan")
                return
