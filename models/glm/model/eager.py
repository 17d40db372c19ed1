"""Functions that stay eager inside a compiled layer, marked so only once a layer compiles.

`torch.compiler.disable` imports torch._dynamo, about 0.7 s per process: a run that never
compiles (most runs, and every rank of a CPU test world) should not pay that at import.
`eager(fn)` returns a wrapper that calls `fn`; `mark()`, which `DecoderLayer.compile_block`
calls before `torch.compile`, swaps in `torch.compiler.disable(fn)`, so compiled code breaks
the graph at the call and runs `fn` eagerly, exactly as the decorator applied at import would.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

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
    import torch

    for fn, impl in _MARKED:
        if impl[0] is fn:
            impl[0] = torch.compiler.disable(fn)


def marked() -> list[tuple[Callable, Callable]]:
    """(the function, what its wrapper calls now) of every `eager` function: the function
    itself, or its `torch.compiler.disable`d form once `mark()` has run."""
    return [(fn, impl[0]) for fn, impl in _MARKED]
