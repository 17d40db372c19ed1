"""What `recipes.bench.probe` counts, as plain data and pure functions: a region's `Count`,
the site of a call (the project's line that asked for it), and which ops and entries read the
device (the kind of host read an op is, the factories, whether `to()` names a device). It
imports no other module of the probe; `DeviceProbe` (probe.py) applies these to the tensors
it tracks."""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

#: the probe's own files: a site is never in them
PROBE_FILES = tuple(
    os.path.join(os.path.dirname(__file__), name) for name in ("probe.py", "probe_count.py")
)
_SKIPPED_DIRS = (
    os.path.dirname(torch.__file__) + os.sep,
    os.path.dirname(contextlib.__file__) + os.sep,  # the standard library and site-packages
)
#: ops whose output size depends on the values of their input: a host read on a GPU
DATA_DEPENDENT = {
    "nonzero": "nonzero",
    "_unique": "unique",
    "_unique2": "unique",
    "unique_dim": "unique",
    "unique_consecutive": "unique",
    "masked_select": "masked_select",
}
#: the Python entries that read a device value through `_local_scalar_dense`, and their kind
SCALAR_METHODS = {
    "item": "item",
    "__bool__": "bool",
    "__float__": "float",
    "__int__": "int",
    "__index__": "int",
}
#: host reads per call where a kind takes more than one
READS = {"bincount": 2}
#: torch's factories: a device tensor when called with an explicit `device=`
FACTORIES = (
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
#: collective ops that are not collectives of their own
NOT_COLLECTIVES = ("wait_tensor", "_wrap_tensor_autograd")
_C10D_FILE = os.path.join("torch", "distributed", "distributed_c10d.py")


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


def site() -> str:
    """`file:line` of the innermost frame outside the Python installation and the probe's
    files (paths under a checkout relative to it)."""
    frame = inspect.currentframe()
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


def tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors among the leaves of `tree`."""
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def op_name(func) -> tuple[str, str]:
    """(name, overload) of a dispatched op: ("add", "Tensor") of `aten::add.Tensor`."""
    name, _, overload = func.name().partition("::")[2].partition(".")
    return name, overload or "default"


def writes(func, args: tuple) -> list:
    """The arguments `func` writes in place (its schema marks them)."""
    specs = func._schema.arguments  # no public accessor of an op's schema
    return [
        a
        for a, s in zip(args, specs, strict=False)
        if s.alias_info is not None and s.alias_info.is_write
    ]


def read_kind(func, args: tuple, kwargs: dict, entry: str | None) -> str | None:
    """The kind of host read `func(*args, **kwargs)` is when it reads a device input (`entry`:
    the Python entry of a scalar read under way, `item` if none)."""
    name, overload = op_name(func)
    if name == "_local_scalar_dense":
        return entry or "item"
    if name in DATA_DEPENDENT:
        return DATA_DEPENDENT[name]
    if name == "equal":
        return "equal"
    if name == "bincount":
        return "bincount"  # CUDA's kernel reads its input's min and max: two reads
    if name == "repeat_interleave" and isinstance(args[0], torch.Tensor):
        repeats = args[0] if overload == "Tensor" else args[1]
        sized = kwargs.get("output_size") is not None
        if isinstance(repeats, torch.Tensor) and not sized:
            return "repeat_interleave"
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
        masks = [i for i in tensors(args[1]) if i.dtype in (torch.bool, torch.uint8)]
        if masks:
            return "boolean mask"
    return None


def in_collective() -> bool:
    """Is the op issued from inside torch.distributed's collective entry (its innermost
    frames outside the probe's files, past torch's own wrappers)?"""
    frame, seen = inspect.currentframe(), 0
    while frame is not None and seen < 4:
        name = frame.f_code.co_filename
        if name.endswith(_C10D_FILE):
            return True
        if name not in PROBE_FILES:
            seen += 1
        frame = frame.f_back
    return False


def target_device(args: tuple, kwargs: dict) -> bool:
    """Does `t.to(*args, **kwargs)` name a device (not only a dtype)?"""
    if kwargs.get("device") is not None:
        return True
    return any(isinstance(a, str | torch.device | torch.Tensor) for a in args)
