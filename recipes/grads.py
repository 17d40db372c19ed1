"""Gradient norms and clipping over parameters that live on different device meshes.

torch's clip_grad_norm_ stacks per-parameter norms, which fails when DTensors of several meshes
(dense FSDP mesh, expert (efsdp, ep) mesh) meet. Here each rank sums the squares of its local
shards, each divided by how many ranks hold a copy of the same elements, and one all-reduce over
the world gives the exact global sum of squares.
"""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate


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


def squared_norms(params_by_key: dict[str, list[torch.Tensor]]) -> dict[str, float]:
    """Collective: the global sum of squared gradients of each parameter list, as floats.

    Summed on the gradients' device and read back once (one host sync per call, not one per
    parameter); the all-reduce runs where the backend wants it (CUDA for NCCL, CPU for gloo)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    keys = sorted(params_by_key)
    totals: list[torch.Tensor | None] = []
    for key in keys:
        total = None
        for p in params_by_key[key]:
            if p.grad is not None:
                local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                term = local.detach().double().pow(2).sum() / _copies(p.grad, world)
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
    return dict(zip(keys, stacked.cpu().tolist()[: len(keys)], strict=True))


@torch.no_grad()
def scale_grads(params: list[torch.Tensor], factor: float) -> None:
    """Multiply the gradients of `params` by `factor`, in place."""
    for p in params:
        if p.grad is not None:
            p.grad.mul_(factor)


@torch.no_grad()
def poison_grad(params: list[torch.Tensor]) -> None:
    """Debug: make the first local gradient element NaN (train.inject_nan_at_step)."""
    for p in params:
        if p.grad is not None:
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            if local.numel():
                local.view(-1)[0] = float("nan")
                return
