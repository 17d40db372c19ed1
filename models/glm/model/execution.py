"""How the model's math runs, one rule each for every module: the dtype its sensitive
arithmetic works in (`work_dtype`), whether a forward is an activation checkpoint's
recomputation (`recomputing`), and the functions that stay eager inside a compiled layer
(`eager`).

Recomputation: statistics gathered in the forward (router loads, attention max logits) must see
each token once, so they are skipped while `recomputing()` is active (`DecoderLayer.forward`
enters it through the checkpoint's recomputation context).

Eager functions: `torch.compiler.disable` imports torch._dynamo, about 0.7 s per process: a run
that never compiles (most runs, and every rank of a CPU test world) should not pay that at
import. `eager(fn)` returns a wrapper that calls `fn`; `mark()`, which
`DecoderLayer.compile_block` calls before `torch.compile`, swaps in `torch.compiler.disable(fn)`,
so compiled code breaks the graph at the call and runs `fn` eagerly, exactly as the decorator
applied at import would.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype norms, RoPE, attention scores and softmax compute in: float32, or `dtype` when
    it is wider (a float64 model is not cut to float32)."""
    return torch.promote_types(dtype, torch.float32)


_depth = 0  # > 0 while activation checkpointing re-runs a forward in backward


@contextlib.contextmanager
def recomputing() -> Iterator[None]:
    """The context of an activation-checkpoint recomputation."""
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1


def is_recomputing() -> bool:
    """True inside `recomputing()`. Read eagerly only (see `moe._count_loads`)."""
    return _depth > 0


#: (the function, the one-element list the wrapper calls through) of every `eager` function
_MARKED: list[tuple[Callable, list[Callable]]] = []


def eager(fn: Callable) -> Callable:
    """`fn`, to run eagerly under torch.compile once `mark()` has run (a function or a method)."""
    impl = [fn]

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return impl[0](*args, **kwargs)

    _MARKED.append((fn, impl))
    return call


def mark() -> None:
    """Make every `eager` function `torch.compiler.disable`d (idempotent)."""
    for fn, impl in _MARKED:
        if impl[0] is fn:
            impl[0] = torch.compiler.disable(fn)


def marked() -> list[tuple[Callable, Callable]]:
    """(the function, what its wrapper calls now) of every `eager` function: the function
    itself, or its `torch.compiler.disable`d form once `mark()` has run."""
    return [(fn, impl[0]) for fn, impl in _MARKED]
