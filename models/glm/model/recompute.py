"""Whether a forward is the activation-checkpoint recomputation of one that already ran.

Statistics gathered in the forward (router loads, attention max logits) must see each token once,
so they are skipped while `recomputing()` is active (`DecoderLayer.forward` enters it through the
checkpoint's recomputation context).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

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
