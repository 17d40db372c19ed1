"""Sharded matrices with gradients: what a Muon benchmark or test steps on.

`sharded_matrices` draws each matrix, then shards them with FSDP2 `fully_shard` over `mesh`
and gives every parameter a DTensor gradient of the same sharding, drawn from the same
generator (so a rank's numbers depend only on the seed and the shapes, never on the layout).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence

import torch
from torch import nn


def sharded_matrices(
    shapes: Sequence[tuple[int, ...]],
    mesh,
    *,
    generator: torch.Generator,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    grads: bool = True,
) -> list[nn.Parameter]:
    """One FSDP2-sharded parameter per shape (standard normal values from `generator`), each
    with a standard normal DTensor gradient of its shard's shape when `grads`."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    holder = nn.ParameterList(
        [nn.Parameter(torch.randn(*s, generator=generator).to(device, dtype)) for s in shapes]
    )
    fully_shard(holder, mesh=mesh)
    if grads:
        for p in holder:
            local = torch.randn(p.to_local().shape, generator=generator).to(device, dtype)
            p.grad = DTensor.from_local(
                local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
            )
    return list(holder)


def optimizer_step_peak(meter, opt, repeats: int) -> int:
    """The smallest, over `repeats` steps, of the optimizer step's measured peak beyond its
    start (`meter`: a `recipes.memory.MemoryMeter`), every rank entering each step together."""
    import torch.distributed as dist

    peaks = []
    for _ in range(repeats):
        if dist.is_initialized():
            dist.barrier()
        gc.collect()
        time.sleep(0.05)  # gloo's workers free the last step's buffers first
        with meter.measure() as m, m.region("optim"):
            opt.step()
        peaks.append(m.peak_delta_bytes("optim"))
    return min(peaks)
