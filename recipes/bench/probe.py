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

from recipes.bench.probe_modes import PROBE_FILES, Dispatch, local, patched, tensors

_SKIPPED_DIRS = (
    os.path.dirname(torch.__file__) + os.sep,
    os.path.dirname(contextlib.__file__) + os.sep,  # the standard library and site-packages
)
#: optimizer state entries torch.optim keeps on the host (non-capturable path)
HOST_STATE_KEYS = ("step",)
_NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd")


@dataclass
class Count:
    """What one region cost: syncs by (kind, site), async copies by site, ops by name and by
    site, collectives by kind."""

    syncs: Counter = field(default_factory=Counter)
    async_copies: Counter = field(default_factory=Counter)
    ops: Counter = field(default_factory=Counter)
    ops_by_site: Counter = field(default_factory=Counter)
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
            "ops_by_site": dict(self.ops_by_site.most_common()),
        }


def _site() -> str:
    """`file:line` of the innermost frame outside the Python installation and this module
    (paths under a checkout relative to it)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name not in PROBE_FILES and not name.startswith(_SKIPPED_DIRS) and name[:1] != "<":
            return f"{_relative(name)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


@functools.cache
def _relative(path: str) -> str:
    """`path` relative to the checkout it belongs to: this one, or another one on sys.path
    (a baseline's), else as it is."""
    roots = [Path(__file__).resolve().parents[2]]
    roots += [Path(p).resolve() for p in sys.path if p and os.path.isdir(os.path.join(p, "muon"))]
    resolved = Path(path).resolve()
    for root in roots:
        if resolved.is_relative_to(root):
            return str(resolved.relative_to(root))
    return path


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage of `t`'s (local) data: views, bases and FSDP's flat buffers share it."""
    try:
        return local(t).untyped_storage()
    except (RuntimeError, NotImplementedError):  # no storage (a subclass without data)
        return None


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
    def is_device(self, t: torch.Tensor) -> bool:
        """Would `t` (a DTensor: its local shard) live on the device?"""
        storage = _storage(t)
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
        with patched(self), Dispatch(self):
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
        if not self._active:
            return
        site = None if collective else _site()
        for c in self._active:
            if collective:
                c.collectives[name] += 1
            else:
                c.ops[name] += 1
                c.ops_by_site[site] += 1

    def _host_copy(self, t: torch.Tensor) -> torch.Tensor:
        """A fresh host tensor equal to `t` (what `cpu()` of a device tensor returns)."""
        with self.paused():
            out = t.clone()
        self.unmark(out)
        return out


@contextlib.contextmanager
def all_on_device(name: str = "region") -> Iterator[Count]:
    """Count the code run inside as region `name` of a probe on which every tensor lives on
    the device (`DeviceProbe(every_tensor=True)`): its ops, collectives and host reads by
    kind (`Count.syncs_by_kind()`), for code that computes only on device data."""
    probe = DeviceProbe(every_tensor=True)
    with probe.tracking(), probe.region(name) as count:
        yield count
