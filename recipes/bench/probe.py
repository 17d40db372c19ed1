"""What a step would cost the host on a GPU, counted on a CPU run: host syncs by site,
dispatched ops, collectives by kind.

A CPU run has no device, so `DeviceProbe` keeps the set of tensors that *would* live on it. It
is seeded (`mark`, `seed`) with a module's parameters and buffers (DTensors: their local
shards), the gradients and the optimizer's state, except the `step` counters torch.optim keeps
on the host on its non-capturable path; it grows through every op while `tracking()` is on:

- a dispatched op (a `TorchDispatchMode`, which sees the local ops DTensor turns its ops into)
  with a device input has device outputs, and marks the arguments it writes in place;
- a factory called with an explicit `device=` (`torch.zeros(..., device=d)`) makes a device
  tensor, one called without it a host tensor (`torch.tensor(sizes)`);
- `Tensor.to(device)` / `.cuda()` of a host tensor is a host-to-device copy; its result is a
  device tensor. `Tensor.to(device)` of a device tensor stays on the device, and `cpu()` is the
  way to the host: on a CPU run `x.to(self.device)` and `x.to("cpu")` are the same call, and
  the code this probes moves to the host with `cpu()`.

Counted per region (`region(name)`, or `wrap(obj, "method", name)` around every call):

- `syncs` by (kind, site): host reads of a device tensor (`item`, `bool`, `float`, `int` -
  `_local_scalar_dense` -, `tolist`, `numpy`, `cpu()`, `torch.equal`, a host tensor's `copy_`
  from a device one), ops whose output size depends on device data (`nonzero`, `unique`,
  `repeat_interleave` with a tensor of repeats and no `output_size`, boolean-mask indexing,
  `masked_select`; `bincount`, whose CUDA kernel reads its input's min and max: two), and
  blocking host-to-device copies of host-made tensors (`.to(device)` without
  `non_blocking=True`, `torch.tensor(data, device=d)`, a device tensor's `copy_` from a host
  one). The site is `file:line` of the innermost Python frame outside the Python
  installation (torch, the standard library, site-packages) and this module: the project's
  line that asked for it.
- `async_copies` by site: host-to-device copies with `non_blocking=True` (not a sync once the
  host tensor is pinned, which a CPU-only build cannot do).
- `ops` by name: every op dispatched on plain tensors; on a GPU each is at least one launch.
- `collectives` by kind: the c10d and functional-collective ops (their waits left out).

The Tensor entries that do not dispatch (`tolist`, `numpy`, `cpu`, `to`, and the Python side of
`item`/`bool`/`float`/`int`) and torch's factories are wrapped while `tracking()` is on. Counts
are deterministic for a given model, mesh and data: tests may assert them.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_SKIPPED_DIRS = (
    os.path.dirname(torch.__file__) + os.sep,
    os.path.dirname(contextlib.__file__) + os.sep,  # the standard library and site-packages
)
_THIS_FILE = __file__
#: optimizer state entries torch.optim keeps on the host (non-capturable path)
HOST_STATE_KEYS = ("step",)
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
_NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd")
_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__  # plain tensors and Parameters


@dataclass
class Count:
    """What one region cost: syncs by (kind, site), async copies by site, ops by name,
    collectives by kind."""

    syncs: Counter = field(default_factory=Counter)
    async_copies: Counter = field(default_factory=Counter)
    ops: Counter = field(default_factory=Counter)
    collectives: Counter = field(default_factory=Counter)
    calls: int = 0

    @property
    def n_syncs(self) -> int:
        """Host syncs in all."""
        return sum(self.syncs.values())

    @property
    def n_ops(self) -> int:
        """Dispatched ops in all."""
        return sum(self.ops.values())

    @property
    def n_collectives(self) -> int:
        """Collectives in all."""
        return sum(self.collectives.values())

    def syncs_by_site(self) -> Counter:
        """Syncs per site, whatever their kind."""
        out: Counter = Counter()
        for (_, site), n in self.syncs.items():
            out[site] += n
        return out

    def syncs_by_kind(self) -> Counter:
        """Syncs per kind (item, tolist, h2d, nonzero, ...), wherever they are."""
        out: Counter = Counter()
        for (kind, _), n in self.syncs.items():
            out[kind] += n
        return out

    def as_dict(self) -> dict[str, Any]:
        """Plain data (JSON, pickles across ranks)."""
        return {
            "calls": self.calls,
            "syncs": self.n_syncs,
            "ops": self.n_ops,
            "collectives": dict(self.collectives),
            "syncs_by_site": [
                {"kind": kind, "site": site, "count": n}
                for (kind, site), n in sorted(self.syncs.items(), key=lambda kv: (-kv[1], kv[0]))
            ],
            "async_copies": dict(self.async_copies),
            "ops_by_name": dict(self.ops.most_common()),
        }


def _site() -> str:
    """`file:line` of the innermost frame outside the Python installation and this module
    (paths under a checkout relative to it)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name != _THIS_FILE and not name.startswith(_SKIPPED_DIRS) and name[:1] != "<":
            return f"{_relative(name)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


@functools.cache
def _relative(path: str) -> str:
    """`path` relative to the checkout it belongs to: this one, or another one on sys.path
    (a baseline's), else as it is."""
    roots = [Path(_THIS_FILE).resolve().parents[2]]
    roots += [Path(p).resolve() for p in sys.path if p and os.path.isdir(os.path.join(p, "muon"))]
    resolved = Path(path).resolve()
    for root in roots:
        if resolved.is_relative_to(root):
            return str(resolved.relative_to(root))
    return path


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage of `t`'s (local) data: views, bases and FSDP's flat buffers share it."""
    try:
        return _local(t).untyped_storage()
    except (RuntimeError, NotImplementedError):  # no storage (a subclass without data)
        return None


class DeviceProbe:
    """The set of tensors that would live on the device, and the counts of what reads them.

    with probe.tracking():
        probe.seed(model, optimizer)
        with probe.region("step") as count:
            step()
    count.n_syncs, count.syncs_by_site(), count.n_ops, count.collectives
    """

    def __init__(self) -> None:
        # by storage: a view, its base and FSDP's padded shard behind a DTensor are one
        self._device: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        #: every region's count by name, accumulated over its calls until `reset`
        self.counts: dict[str, Count] = {}
        self._active: list[Count] = []
        self._paused = 0
        self._entry: str | None = None  # the Python entry of a scalar read under way

    # ------------------------------------------------------------------------ device set
    def is_device(self, t: torch.Tensor) -> bool:
        """Would `t` (a DTensor: its local shard) live on the device?"""
        storage = _storage(t)
        return storage is not None and storage in self._device

    def mark(self, *objs: Any) -> None:
        """Put tensors on the device: tensors, DTensors (their local shard too), modules
        (parameters and buffers), and containers of them."""
        for obj in objs:
            if isinstance(obj, torch.nn.Module):
                self.mark(list(obj.parameters()), list(obj.buffers()))
                continue
            for t in _tensors(obj):
                storage = _storage(t)
                if storage is not None:
                    self._device[storage] = True

    def unmark(self, t: torch.Tensor) -> None:
        """Take `t`'s storage off the device."""
        storage = _storage(t)
        if storage is not None:
            self._device.pop(storage, None)

    def seed(self, model: torch.nn.Module | None, optimizer=None) -> None:
        """Mark the parameters, buffers and gradients of `model`, and `optimizer`'s state
        except its host-kept counters (`HOST_STATE_KEYS`)."""
        if model is not None:
            self.mark(model)
            self.mark([p.grad for p in model.parameters() if p.grad is not None])
        if optimizer is not None:
            for state in optimizer.state.values():
                self.mark([v for k, v in state.items() if k not in HOST_STATE_KEYS])
            for g in optimizer.param_groups:
                self.mark([p.grad for p in g["params"] if p.grad is not None])

    # --------------------------------------------------------------------------- regions
    def reset(self) -> None:
        """Forget every region's count (the device set stays)."""
        self.counts.clear()

    @contextlib.contextmanager
    def region(self, name: str) -> Iterator[Count]:
        """Count what runs inside under `name` (nested regions count it too)."""
        count = self.counts.setdefault(name, Count())
        count.calls += 1
        self._active.append(count)
        try:
            yield count
        finally:
            self._active.remove(count)

    @contextlib.contextmanager
    def wrap(
        self, obj: Any, attr: str, name: str, before: Callable[[], None] | None = None
    ) -> Iterator[Count]:
        """While inside, every call of `obj.attr` is counted under `name` (`before()` runs
        first, e.g. to seed the gradients the call reads)."""
        original = getattr(obj, attr)
        own = attr in vars(obj)  # an instance attribute already (a wrapper of torch's, say)

        @functools.wraps(original)
        def counted(*args, **kwargs):
            if before is not None:
                before()
            with self.region(name):
                return original(*args, **kwargs)

        setattr(obj, attr, counted)
        try:
            yield self.counts.setdefault(name, Count())
        finally:
            if own:
                setattr(obj, attr, original)
            else:
                delattr(obj, attr)  # the class's method comes back

    @contextlib.contextmanager
    def tracking(self) -> Iterator[DeviceProbe]:
        """Propagate the device set and count inside the active regions."""
        with _patched(self), _Dispatch(self):
            yield self

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Run the probe's own tensor work uncounted and unmarked."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    # -------------------------------------------------------------------------- counting
    def _sync(self, kind: str) -> None:
        if self._active:
            site = _site()
            for c in self._active:
                c.syncs[(kind, site)] += 1

    def _async_copy(self) -> None:
        if self._active:
            site = _site()
            for c in self._active:
                c.async_copies[site] += 1

    def _op(self, func) -> None:
        name = f"{func.namespace}::{func._opname}"
        collective = func.namespace in ("c10d", "_c10d_functional")
        if collective and func._opname in _NOT_COLLECTIVES:
            return
        for c in self._active:
            (c.collectives if collective else c.ops)[name] += 1

    def _host_copy(self, t: torch.Tensor) -> torch.Tensor:
        """A fresh host tensor equal to `t` (what `cpu()` of a device tensor returns)."""
        with self.paused():
            out = t.clone()
        self.unmark(out)
        return out


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
        masks = [i for i in _tensors(args[1]) if i.dtype in (torch.bool, torch.uint8)]
        if masks:
            return "boolean mask"
    return None


class _Dispatch(TorchDispatchMode):
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
        inputs = _tensors((args, kwargs))
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
        if name != _THIS_FILE:
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
def _patched(probe: DeviceProbe) -> Iterator[None]:
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
        if copied and not any(probe.is_device(t) for t in _tensors(args)):
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
