"""The bytes op outputs hold at once, counted by a dispatch mode (tests of chunked memory)."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LiveBytes(TorchDispatchMode):
    """Every tensor an op produces: `live`, the bytes alive now (a storage counts once, however
    many views or detached aliases share it, and is freed with the last of them); `peak`, the
    most alive at once since it was last set; `largest`, the largest element count. The
    storages of `existing` tensors (inputs, weights made before) add nothing."""

    def __init__(self, *existing: torch.Tensor):
        super().__init__()
        self.largest = self.live = self.peak = 0
        self.refs: dict[int, int] = {}
        self.existing = {t.untyped_storage().data_ptr() for t in existing}

    def _release(self, ptr: int, n: int) -> None:
        self.refs[ptr] -= 1
        if not self.refs[ptr]:
            del self.refs[ptr]
            self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if not isinstance(t, torch.Tensor) or not t.untyped_storage().nbytes():
                continue
            ptr, n = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
            if ptr in self.existing:
                continue
            self.largest = max(self.largest, t.numel())
            if ptr not in self.refs:
                self.live += n
                self.peak = max(self.peak, self.live)
            self.refs[ptr] = self.refs.get(ptr, 0) + 1
            weakref.finalize(t, self._release, ptr, n)
        return out
