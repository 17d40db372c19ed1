"""What travels between ranks, and where: the device collectives of the default group run on,
and the dtype a parameter's matrices travel in. Read by planning (`muon.planner`) and by the
step (`muon.guard`, `muon.census`) alike; imports torch only."""

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
