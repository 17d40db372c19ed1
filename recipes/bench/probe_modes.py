"""How the device set of `recipes.bench.probe` grows and what counts as a read: the dispatch
mode every dispatched op passes through, and the wrapped entries that do not dispatch
(`tolist`, `numpy`, `cpu`, `to`, the Python side of `item`/`bool`/`float`/`int`, torch's
factories). Both act on a `DeviceProbe` (its `is_device`, `mark` and counters)."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

if TYPE_CHECKING:
    from recipes.bench.probe import DeviceProbe

#: the probe's own files: a site is never in them
PROBE_FILES = (os.path.join(os.path.dirname(__file__), "probe.py"), __file__)

#: ops whose output size depends on the values of their input: a host read on a GPU
_DATA_DEPENDENT = {
    "nonzero": "nonzero",
    "_unique": "unique",
    "_unique2": "unique",
    "unique_dim": "unique",
    "unique_consecutive": "unique",
    "masked_select": "masked_select",
}
#: the Python entries that read a device value through `_local_scalar_dense`, and their kind
_SCALAR_METHODS = {
    "item": "item",
    "__bool__": "bool",
    "__float__": "float",
    "__int__": "int",
    "__index__": "int",
}
#: host reads per call where a kind takes more than one
_READS = {"bincount": 2}
_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__  # plain tensors and Parameters


def tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors among the leaves of `tree`."""
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor itself."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def _read_kind(probe: DeviceProbe, func, args: tuple, kwargs: dict) -> str | None:
    """The kind of host read `func(*args, **kwargs)` is, when it reads a device input."""
    name = func._opname
    if name == "_local_scalar_dense":
        return probe._entry or "item"
    if name in _DATA_DEPENDENT:
        return _DATA_DEPENDENT[name]
    if name == "equal":
        return "equal"
    if name == "bincount":
        return "bincount"  # CUDA's kernel reads its input's min and max: two reads
    if name == "repeat_interleave" and isinstance(args[0], torch.Tensor):
        repeats = args[0] if func._overloadname == "Tensor" else args[1]
        sized = kwargs.get("output_size") is not None
        if isinstance(repeats, torch.Tensor) and not sized:
            return "repeat_interleave"
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
        masks = [i for i in tensors(args[1]) if i.dtype in (torch.bool, torch.uint8)]
        if masks:
            return "boolean mask"
    return None


class Dispatch(TorchDispatchMode):
    """Propagates the device set through dispatched ops; counts ops, collectives, reads."""

    def __init__(self, probe: DeviceProbe) -> None:
        super().__init__()
        self.probe = probe

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        probe = self.probe
        subclasses = [t for t in types if t.__torch_dispatch__ is not _PLAIN_DISPATCH]
        if subclasses:
            from torch._subclasses.fake_tensor import FakeTensor

            if any(issubclass(t, FakeTensor) for t in subclasses):  # DTensor's shape inference
                return func(*args, **kwargs)
            return NotImplemented  # a subclass (DTensor): its local ops come back here
        if probe._paused:
            return func(*args, **kwargs)
        inputs = tensors((args, kwargs))
        if any(t.device.type == "meta" for t in inputs):
            return func(*args, **kwargs)
        on_device = [probe.is_device(t) for t in inputs]
        if func._opname == "copy_":
            _copy_kind(probe, args, kwargs)
        elif any(on_device):
            kind = _read_kind(probe, func, args, kwargs)
            for _ in range(_READS.get(kind, 1) if kind is not None else 0):
                probe._sync(kind)
        out = func(*args, **kwargs)
        probe._op(func)
        if any(on_device) and func._opname != "copy_":
            probe.mark(out)
            for arg, spec in zip(args, func._schema.arguments, strict=False):
                if spec.alias_info is not None and spec.alias_info.is_write:
                    probe.mark(arg)
        return out


def _copy_kind(probe: DeviceProbe, args: tuple, kwargs: dict) -> None:
    """`dst.copy_(src)`: a host-to-device copy, a device-to-host read, or neither."""
    dst, src = args[0], args[1]
    into, out_of = probe.is_device(dst), probe.is_device(src)
    if into != out_of and _in_collective():
        return  # gloo's own staging copy (as `work.wait()` completes): none under NCCL
    if into and not out_of:
        if kwargs.get("non_blocking") or (len(args) > 2 and args[2]):
            probe._async_copy()
        else:
            probe._sync("h2d")
    elif out_of and not into:
        probe._sync("d2h")


_C10D_FILE = os.path.join("torch", "distributed", "distributed_c10d.py")


def _in_collective() -> bool:
    """Is the op issued from inside torch.distributed's collective entry (its innermost
    frames outside this module, past torch's own wrappers)?"""
    frame, seen = sys._getframe(1), 0
    while frame is not None and seen < 4:
        name = frame.f_code.co_filename
        if name.endswith(_C10D_FILE):
            return True
        if name not in PROBE_FILES:
            seen += 1
        frame = frame.f_back
    return False


def _target_device(args: tuple, kwargs: dict) -> bool:
    """Does `t.to(*args, **kwargs)` name a device (not only a dtype)?"""
    if kwargs.get("device") is not None:
        return True
    return any(isinstance(a, str | torch.device | torch.Tensor) for a in args)


#: torch's factories: a device tensor when called with an explicit `device=`
_FACTORIES = (
    "empty",
    "empty_strided",
    "zeros",
    "ones",
    "full",
    "arange",
    "eye",
    "linspace",
    "logspace",
    "rand",
    "randn",
    "randint",
    "randperm",
    "scalar_tensor",
    "tensor",  # host data: a copy to the device
    "as_tensor",
)


@contextlib.contextmanager
def patched(probe: DeviceProbe) -> Iterator[None]:
    """The entries that do not dispatch, wrapped (torch's autograd engine runs backward hooks,
    FSDP's among them, without function modes, so wrapping is what sees them everywhere):
    scalar reads (for their kind), `tolist`/`numpy`/`cpu`, `to(device)`, the factories."""
    saved: list[tuple[Any, str, Any, bool]] = []

    def patch(owner: Any, name: str, make: Callable) -> None:
        original = getattr(owner, name)
        saved.append((owner, name, original, name in vars(owner)))
        setattr(owner, name, functools.wraps(original)(make(original, name)))

    for name in _SCALAR_METHODS:
        patch(torch.Tensor, name, lambda f, n: _scalar_entry(probe, f, _SCALAR_METHODS[n]))
    for name in ("tolist", "numpy"):
        patch(torch.Tensor, name, lambda f, n: _reader(probe, f, n))
    patch(torch.Tensor, "cpu", lambda f, n: _to_host(probe, f))
    patch(torch.Tensor, "to", lambda f, n: _mover(probe, f))
    for name in _FACTORIES:
        patch(torch, name, lambda f, n: _factory(probe, f, n))
    try:
        yield
    finally:
        for owner, name, original, own in reversed(saved):
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)


def _scalar_entry(probe: DeviceProbe, f: Callable, kind: str) -> Callable:
    def entry(self, *args, **kwargs):
        outer, probe._entry = probe._entry, kind
        try:
            return f(self, *args, **kwargs)
        finally:
            probe._entry = outer

    return entry


def _reader(probe: DeviceProbe, f: Callable, kind: str) -> Callable:
    def read(self, *args, **kwargs):
        if not probe._paused and probe.is_device(self):
            probe._sync(kind)
        return f(self, *args, **kwargs)

    return read


def _to_host(probe: DeviceProbe, f: Callable) -> Callable:
    def cpu(self, *args, **kwargs):
        if probe._paused or not probe.is_device(self):
            return f(self, *args, **kwargs)
        probe._sync("cpu")
        return probe._host_copy(f(self, *args, **kwargs))

    return cpu


def _mover(probe: DeviceProbe, f: Callable) -> Callable:
    def to(self, *args, **kwargs):
        if probe._paused or not _target_device(args, kwargs):
            return f(self, *args, **kwargs)
        return _to_device(probe, f, self, args, kwargs)

    return to


def _factory(probe: DeviceProbe, f: Callable, name: str) -> Callable:
    def factory(*args, **kwargs):
        out = f(*args, **kwargs)
        if probe._paused or kwargs.get("device") is None:
            return out
        copied = name in ("tensor", "as_tensor")
        if copied and not any(probe.is_device(t) for t in tensors(args)):
            probe._sync("h2d")  # host data copied to the device
        probe.mark(out)
        return out

    return factory


def _to_device(probe: DeviceProbe, f: Callable, source, args: tuple, kwargs: dict):
    """`t.to(device)`: stays on the device, or a host-to-device copy."""
    out = f(source, *args, **kwargs)
    if probe.is_device(source):
        probe.mark(out)
        return out
    if kwargs.get("non_blocking"):
        probe._async_copy()
    else:
        probe._sync("h2d")
    if out is source:  # a CPU run's no-op: the host tensor itself must stay a host tensor
        with probe.paused():
            out = source.clone()
    probe.mark(out)
    return out
