"""The stop request of a training run: a signal on any rank, agreed on by all at a step boundary."""

import signal
import threading

import torch
import torch.distributed as dist


class StopSignal:
    """SIGUSR1 (Slurm's warning before a time limit or preemption, forwarded to every rank by
    torchrun's --signals-to-handle) or SIGTERM (Slurm's own preemption and time limit, which
    torchrun forwards by default) asks for a checkpoint and a clean exit at the next step
    boundary. Ranks may get it at different moments, so they agree with one MAX all-reduce
    per step (a single int) before acting."""

    SIGNALS = (signal.SIGUSR1, signal.SIGTERM)

    def __init__(self, device: torch.device) -> None:
        self.received = False
        self.name = ""
        self.flag = torch.zeros(1, dtype=torch.int32, device=device)
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = True
        self.name = signal.Signals(signum).name

    def requested(self) -> bool:
        """Collective: did any rank receive the signal?"""
        self.flag.fill_(int(self.received))
        dist.all_reduce(self.flag, op=dist.ReduceOp.MAX)
        return bool(self.flag.item())
