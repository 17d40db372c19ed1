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
  `ops_by_site`: the same ops by the project's line that dispatched them (as for syncs).
- `collectives` by kind: the c10d and functional-collective ops (their waits left out).

`all_on_device()` counts a region in which every tensor is a device tensor, whatever made it:
for code that computes only on device data (a model layer on its activations and parameters),
where nothing needs seeding and every read listed above would block the host on a GPU.

The Tensor entries that do not dispatch (`tolist`, `numpy`, `cpu`, `to`, and the Python side of
`item`/`bool`/`float`/`int`) and torch's factories are wrapped while `tracking()` is on. Counts
are deterministic for a given model, mesh and data: tests may assert them. What counts as
which read, `Count` and the site of a call are in probe_count.py (pure functions, no state).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from recipes.bench.probe_count import (
    FACTORIES,
    NOT_COLLECTIVES,
    READS,
    SCALAR_METHODS,
    Count,
    in_collective,
    op_name,
    read_kind,
    site,
    target_device,
    tensors,
    writes,
)

#: optimizer state entries torch.optim keeps on the host (non-capturable path)
HOST_STATE_KEYS = ("step",)
_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__  # plain tensors and Parameters

__all__ = ["HOST_STATE_KEYS", "Count", "DeviceProbe", "all_on_device"]


class _Mode(TorchDispatchMode):
    """Every dispatched op, handed to its probe (`DeviceProbe.dispatch`)."""

    def __init__(self, probe: DeviceProbe) -> None:
        super().__init__()
        self.probe = probe

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.probe.dispatch(func, types, args, kwargs or {})


class DeviceProbe:
    """The set of tensors that would live on the device, and the counts of what reads them.

    with probe.tracking():
        probe.seed(model, optimizer)
        with probe.region("step") as count:
            step()
    count.n_syncs, count.syncs_by_site(), count.n_ops, count.collectives

    `every_tensor=True`: every tensor with storage is on the device (`mark`, `seed` and the
    growth through ops change nothing); `all_on_device()` counts a region so.
    """

    def __init__(self, every_tensor: bool = False) -> None:
        #: every tensor counts as a device tensor
        self.every_tensor = every_tensor
        # by storage: a view, its base and FSDP's padded shard behind a DTensor are one
        self._device: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        #: every region's count by name, accumulated over its calls until `reset`
        self.counts: dict[str, Count] = {}
        self._active: list[Count] = []
        self._paused = 0
        self._entry: str | None = None  # the Python entry of a scalar read under way

    # ------------------------------------------------------------------------ device set
    def _storage(self, t: torch.Tensor) -> torch.UntypedStorage | None:
        """The storage of `t`'s (local) data: views, bases and FSDP's flat buffers share it."""
        from torch.distributed.tensor import DTensor

        if isinstance(t, DTensor):  # a Parameter's local tensor comes as a view: not counted
            with self.paused(), torch.no_grad():
                t = t.to_local()
        try:
            return t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # no storage (a subclass without data)
            return None

    def is_device(self, t: torch.Tensor) -> bool:
        """Would `t` (a DTensor: its local shard) live on the device?"""
        storage = self._storage(t)
        return storage is not None and (self.every_tensor or storage in self._device)

    def mark(self, *objs: Any) -> None:
        """Put tensors on the device: tensors, DTensors (their local shard too), modules
        (parameters and buffers), and containers of them."""
        if self.every_tensor:
            return  # on the device already
        for obj in objs:
            if isinstance(obj, torch.nn.Module):
                self.mark(list(obj.parameters()), list(obj.buffers()))
                continue
            for t in tensors(obj):
                storage = self._storage(t)
                if storage is not None:
                    self._device[storage] = True

    def unmark(self, t: torch.Tensor) -> None:
        """Take `t`'s storage off the device."""
        storage = self._storage(t)
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

        def counted(original, _):
            def call(*args, **kwargs):
                if before is not None:
                    before()
                with self.region(name):
                    return original(*args, **kwargs)

            return call

        with _patched([(obj, attr, counted)]):
            yield self.counts.setdefault(name, Count())

    @contextlib.contextmanager
    def tracking(self) -> Iterator[DeviceProbe]:
        """Propagate the device set and count inside the active regions: every dispatched
        op (`dispatch`) and the entries that do not dispatch, wrapped (torch's autograd
        engine runs backward hooks, FSDP's among them, without function modes, so wrapping
        is what sees them everywhere)."""
        entries = [(torch.Tensor, n, self._scalar_entry) for n in SCALAR_METHODS]
        entries += [(torch.Tensor, n, self._reader) for n in ("tolist", "numpy")]
        entries += [(torch.Tensor, "cpu", self._to_host), (torch.Tensor, "to", self._mover)]
        entries += [(torch, n, self._factory) for n in FACTORIES]
        with _patched(entries), _Mode(self):
            yield self

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Run the probe's own tensor work uncounted and unmarked."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    # -------------------------------------------------------------------------- dispatch
    def dispatch(self, func, types, args: tuple, kwargs: dict):
        """One dispatched op: run it, count it and its host reads, and grow the device set
        (a device input makes device outputs and marks the arguments it writes)."""
        subclasses = [t for t in types if t.__torch_dispatch__ is not _PLAIN_DISPATCH]
        if subclasses:
            from torch._subclasses.fake_tensor import FakeTensor

            if any(issubclass(t, FakeTensor) for t in subclasses):  # DTensor's shape inference
                return func(*args, **kwargs)
            return NotImplemented  # a subclass (DTensor): its local ops come back here
        if self._paused:
            return func(*args, **kwargs)
        inputs = tensors((args, kwargs))
        if any(t.device.type == "meta" for t in inputs):
            return func(*args, **kwargs)
        on_device = [self.is_device(t) for t in inputs]
        copy = op_name(func)[0] == "copy_"
        if copy:
            self._copy_kind(args, kwargs)
        elif any(on_device):
            kind = read_kind(func, args, kwargs, self._entry)
            for _ in range(READS.get(kind, 1) if kind is not None else 0):
                self._sync(kind)
        out = func(*args, **kwargs)
        self._op(func)
        if any(on_device) and not copy:
            self.mark(out)
            for arg in writes(func, args):
                self.mark(arg)
        return out

    def _copy_kind(self, args: tuple, kwargs: dict) -> None:
        """`dst.copy_(src)`: a host-to-device copy, a device-to-host read, or neither."""
        dst, src = args[0], args[1]
        into, out_of = self.is_device(dst), self.is_device(src)
        if into != out_of and in_collective():
            return  # gloo's own staging copy (as `work.wait()` completes): none under NCCL
        if into and not out_of:
            if kwargs.get("non_blocking") or (len(args) > 2 and args[2]):
                self._async_copy()
            else:
                self._sync("h2d")
        elif out_of and not into:
            self._sync("d2h")

    # -------------------------------------------------------------------------- counting
    def _sync(self, kind: str) -> None:
        if self._active:
            where = site()
            for c in self._active:
                c.syncs[(kind, where)] += 1

    def _async_copy(self) -> None:
        if self._active:
            where = site()
            for c in self._active:
                c.async_copies[where] += 1

    def _op(self, func) -> None:
        name = op_name(func)[0]
        collective = func.namespace in ("c10d", "_c10d_functional")
        if collective and name in NOT_COLLECTIVES:
            return
        if not self._active:
            return
        where = None if collective else site()
        for c in self._active:
            if collective:
                c.collectives[f"{func.namespace}::{name}"] += 1
            else:
                c.ops[f"{func.namespace}::{name}"] += 1
                c.ops_by_site[where] += 1

    # ------------------------------------------------- the entries that do not dispatch
    def _scalar_entry(self, f: Callable, name: str) -> Callable:
        """`item`, `bool`, ...: the read dispatches `_local_scalar_dense`; this names it."""

        def entry(t, *args, **kwargs):
            outer, self._entry = self._entry, SCALAR_METHODS[name]
            try:
                return f(t, *args, **kwargs)
            finally:
                self._entry = outer

        return entry

    def _reader(self, f: Callable, kind: str) -> Callable:
        def read(t, *args, **kwargs):
            if not self._paused and self.is_device(t):
                self._sync(kind)
            return f(t, *args, **kwargs)

        return read

    def _to_host(self, f: Callable, _: str) -> Callable:
        def cpu(t, *args, **kwargs):
            if self._paused or not self.is_device(t):
                return f(t, *args, **kwargs)
            self._sync("cpu")
            out = f(t, *args, **kwargs)
            with self.paused():  # a fresh host tensor, what `cpu()` of a device tensor is
                out = out.clone()
            self.unmark(out)
            return out

        return cpu

    def _mover(self, f: Callable, _: str) -> Callable:
        def to(t, *args, **kwargs):
            if self._paused or not target_device(args, kwargs):
                return f(t, *args, **kwargs)
            return self._to_device(f, t, args, kwargs)

        return to

    def _factory(self, f: Callable, name: str) -> Callable:
        def factory(*args, **kwargs):
            out = f(*args, **kwargs)
            if self._paused or kwargs.get("device") is None:
                return out
            copied = name in ("tensor", "as_tensor")
            if copied and not any(self.is_device(t) for t in tensors(args)):
                self._sync("h2d")  # host data copied to the device
            self.mark(out)
            return out

        return factory

    def _to_device(self, f: Callable, source, args: tuple, kwargs: dict):
        """`t.to(device)`: stays on the device, or a host-to-device copy."""
        out = f(source, *args, **kwargs)
        if self.is_device(source):
            self.mark(out)
            return out
        if kwargs.get("non_blocking"):
            self._async_copy()
        else:
            self._sync("h2d")
        if out is source:  # a CPU run's no-op: the host tensor itself must stay a host tensor
            with self.paused():
                out = source.clone()
        self.mark(out)
        return out


@contextlib.contextmanager
def _patched(entries: list[tuple[Any, str, Callable]]) -> Iterator[None]:
    """`owner.name` replaced by `make(original, name)` inside, each (owner, name, make) of
    `entries`; what was there comes back (an instance's own attribute, or the class's)."""
    saved: list[tuple[Any, str, Any, bool]] = []
    for owner, name, make in entries:
        original = getattr(owner, name)
        saved.append((owner, name, original, name in vars(owner)))
        setattr(owner, name, functools.wraps(original)(make(original, name)))
    try:
        yield
    finally:
        for owner, name, original, own in reversed(saved):
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)


@contextlib.contextmanager
def all_on_device(name: str = "region") -> Iterator[Count]:
    """Count the code run inside as region `name` of a probe on which every tensor lives on
    the device (`DeviceProbe(every_tensor=True)`): its ops, collectives and host reads by
    kind (`Count.syncs_by_kind()`), for code that computes only on device data."""
    probe = DeviceProbe(every_tensor=True)
    with probe.tracking(), probe.region(name) as count:
        yield count
