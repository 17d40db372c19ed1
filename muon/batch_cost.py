"""What a batch costs on a rank, counted from its plan alone: each figure asked of the batch's
path object (`muon.paths.PATHS`), and the sums built on them that the plan, the memory model
and the planner read (a batch's planned peak, the in-flight window's peak, the modelled time of
its collectives). The tests check these figures against the exchanges as they run.
"""

from __future__ import annotations

from muon.cost import LinkModel
from muon.paths import PATHS, local_chunks, local_rows


def blocks_on(b, r: int) -> int:
    """Blocks FSDP rank `r` orthogonalizes for batch `b`."""
    return PATHS[b.path].blocks_on(b, r)


def bytes_sent(b, r: int) -> int:
    """Bytes FSDP rank `r` sends for batch `b`, both directions, counted from the plan."""
    return PATHS[b.path].bytes_sent(b, r)


def collective_buffer_bytes(b, r: int) -> int:
    """Bytes of the largest receive buffer one collective of batch `b` allocates on rank `r`."""
    return PATHS[b.path].collective_buffer_bytes(b, r)


def exchange_buffer_bytes(b, r: int) -> int:
    """Peak bytes of batch `b`'s exchange buffers alive at once on rank `r` (NS inputs
    included)."""
    return PATHS[b.path].exchange_buffer_bytes(b, r)


def ns_workspace_bytes(b, r: int, ns_itemsize: int) -> int:
    """Rough peak Newton-Schulz temporaries for what rank `r` orthogonalizes at once."""
    return PATHS[b.path].ns_workspace_bytes(b, r, ns_itemsize)


def nesterov_input_bytes(b, r: int, nesterov: bool) -> int:
    """NS inputs the step allocates outside the exchange buffers: Nesterov's `lerp(G, M)` of
    the batch's (the local path: the chunk's) parameters at once, in the parameter's dtype,
    when the wire dtype is narrower (`muon.update.muon_momentum_`; otherwise it is written
    straight into the send buffer)."""
    if not nesterov or b.wire_itemsize >= b.itemsize:
        return 0
    if b.path == "local":
        n, rows = max(len(c) for c in local_chunks(b, r)), local_rows(b, r)
    else:
        n, rows = b.size, b.shard_sizes[r]
    return n * rows * b.other_numel * b.itemsize


def peak_bytes(b, r: int, ns_itemsize: int, *, nesterov: bool = False) -> int:
    """Planned peak bytes of batch `b` on FSDP rank `r`: exchange buffers + Newton-Schulz
    workspace (+ `nesterov_input_bytes`)."""
    return (
        nesterov_input_bytes(b, r, nesterov)
        + exchange_buffer_bytes(b, r)
        + ns_workspace_bytes(b, r, ns_itemsize)
    )


def window_peak_bytes(plans, *, ns_itemsize: int, nesterov: bool, max_inflight: int) -> int:
    """The largest sum of per-batch `peak_bytes` over `max_inflight` consecutive batches of
    `plans` (`[(mesh plan, batches)]`, seen from each mesh plan's `fsdp_rank`): the runtime keeps
    that many batches alive. 0 without batches."""
    peaks = [
        peak_bytes(b, mp.fsdp_rank, ns_itemsize, nesterov=nesterov)
        for mp, batches in plans
        for b in batches
    ]
    k = max(1, max_inflight)
    return max((sum(peaks[i : i + k]) for i in range(max(1, len(peaks) - k + 1))), default=0)


def modelled_s(b, link: LinkModel, ranks=None) -> float:
    """Modelled time of batch `b`'s collectives, from the busiest rank's bytes (of `ranks`,
    default all)."""
    ranks = range(b.fsdp_size) if ranks is None else ranks
    per_collective = max(bytes_sent(b, r) for r in ranks) / 2
    return PATHS[b.path].collectives * link.collective_s(int(per_collective))
