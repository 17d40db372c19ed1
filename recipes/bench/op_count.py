"""Dispatched ops and host reads of a region, counted on any device (a CPU run included).

`counting()` is a context in which every op that reaches the dispatcher from Python or
autograd (not the ops a kernel calls inside itself) is counted by name, collectives apart, and
every host read of a tensor's value by kind: `item` / `bool` / `int` / `float`
(`_local_scalar_dense`), `tolist` and `numpy` (which do not dispatch: seen through a
`TorchFunctionMode`), ops whose output size depends on tensor values (`nonzero`, `unique`,
`masked_select`, `repeat_interleave` with a tensor of repeats and no `output_size`), and
`bincount`, whose CUDA kernel reads its input's min and max on the host (two reads). Every
tensor of the region counts as a device tensor: meant for regions that compute only on device
data (a model layer on its activations and parameters), where each such read would block the
host on a GPU. Counts are deterministic for a given input, so tests may assert them.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_SIZED_BY_VALUES = {"nonzero", "_unique", "_unique2", "unique_dim", "masked_select"}
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")
_PLAIN = (torch.Tensor, torch.nn.Parameter)


@dataclass
class OpCount:
    """One region's counts: ops and collectives by qualified name, host reads by kind."""

    ops: Counter = field(default_factory=Counter)
    collectives: Counter = field(default_factory=Counter)
    reads: Counter = field(default_factory=Counter)

    @property
    def n_ops(self) -> int:
        """Dispatched ops (collectives not included)."""
        return sum(self.ops.values())

    @property
    def n_reads(self) -> int:
        """Host reads in all."""
        return sum(self.reads.values())


def _read_kind(func, args: tuple, kwargs: dict) -> tuple[str, int] | None:
    name = func._opname
    if name == "_local_scalar_dense":
        return "item", 1
    if name in _SIZED_BY_VALUES:
        return name.lstrip("_"), 1
    if name == "bincount":
        return "bincount", 2
    if name == "repeat_interleave" and func._overloadname in ("Tensor", "self_Tensor"):
        repeats = args[0] if func._overloadname == "Tensor" else args[1]
        if repeats.numel() > 1 and kwargs.get("output_size") is None:
            return "repeat_interleave", 1
    return None


class _Dispatched(TorchDispatchMode):
    def __init__(self, count: OpCount) -> None:
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(t not in _PLAIN for t in types):  # a subclass (DTensor): its local ops come back
            return NotImplemented
        read = _read_kind(func, args, kwargs)
        if read is not None:
            self.count.reads[read[0]] += read[1]
        qualified = f"{func.namespace}::{func._opname}"
        collective = func.namespace in _COLLECTIVE_NAMESPACES
        (self.count.collectives if collective else self.count.ops)[qualified] += 1
        return func(*args, **kwargs)


class _NotDispatched(TorchFunctionMode):
    def __init__(self, count: OpCount) -> None:
        super().__init__()
        self.count = count

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.tolist, torch.Tensor.numpy):
            self.count.reads[func.__name__] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting() -> Iterator[OpCount]:
    """Count the ops and host reads of the code run inside (see the module docstring)."""
    count = OpCount()
    with _NotDispatched(count), _Dispatched(count):
        yield count
