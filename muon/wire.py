"""What travels between ranks, and where: how many ranks there are and whether collectives
move data, the device collectives of the default group run on, and the dtype a parameter's
matrices travel in. Read by planning (`muon.planner`) and by the step (`muon.guard`,
`muon.census`) alike; imports torch only."""

from __future__ import annotations

import torch
import torch.distributed as dist


def wire_dtype(param_dtype: torch.dtype, ns_dtype: torch.dtype) -> torch.dtype:
    """The dtype matrices travel in: the Newton-Schulz dtype when it is not wider, except float16
    for a wider parameter, whose range would flush or overflow the unnormalized momentum
    (Newton-Schulz normalizes before casting to float16, `muon.newton_schulz`)."""
    if ns_dtype == torch.float16 and param_dtype != torch.float16:
        return param_dtype
    return ns_dtype if ns_dtype.itemsize <= param_dtype.itemsize else param_dtype


def comm_device() -> torch.device:
    """The device collectives of the default group run on (NCCL: this rank's GPU)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def world_size() -> int:
    """The ranks of the default group (1 without one). torch's fake backend counts: planning a
    fake world of N ranks plans for N (`muon.planner`)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def collectives_move_data() -> bool:
    """More than one rank, on a backend whose collectives exchange values (not torch's fake
    backend, which returns at once): the step's agreements need to run."""
    return world_size() > 1 and dist.get_backend() != "fake"
