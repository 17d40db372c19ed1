"""The exchanges that put whole matrices on the ranks that orthogonalize them, and back.

Every function here is the body of one batch's AsyncTask: a generator that launches a collective
with `async_op=True`, yields so other batches can run, waits, orthogonalizes, launches the return
collective, yields, and finally returns this rank's orthogonalized shards (`yield from` gives
them to the caller). Matrices already whole on a rank (the `local` path) need none of this; the
optimizer orthogonalizes them directly. The number of yields depends only on the batch plan,
never on the rank, so every rank issues the same collectives in the same order.

Layout legend: a shard is `[rows_r, C]` where rows are the sharded dim (moved first) and C the
product of the other dims; a full matrix is `[N, C]` with N the FSDP-visible size; W is the FSDP
group size, n the batch size, c = ceil(N / W) the padded shard rows.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Generator

import torch
import torch.distributed as dist

from muon.plan import BatchPlan

Shards = list[torch.Tensor]
Orthogonalize = Callable[[torch.Tensor], torch.Tensor]
Task = Generator[None, None, Shards]


class NSInputs:
    """A batch's Newton-Schulz inputs, produced straight into the exchange's send buffer.

    `fill(j, out)` writes matrix j's input shard (`[rows, C]`) into `out`, a slot of the send
    buffer, so no separate copy of the momentum updates is ever held next to it.
    """

    def __init__(self, fill: Callable[[int, torch.Tensor], None], dtype, device) -> None:
        self.fill = fill
        self.dtype, self.device = dtype, device

    def new_buffer(self, shape: tuple[int, ...], zero: bool = False) -> torch.Tensor:
        make = torch.zeros if zero else torch.empty
        return make(shape, dtype=self.dtype, device=self.device)


class StepStats:
    """Per-step counters of this rank: bytes, matrices, and time in NS and in waiting."""

    def __init__(self) -> None:
        self.bytes_sent: dict[str, int] = defaultdict(int)
        self.bytes_recv: dict[str, int] = defaultdict(int)
        self.matrices: dict[str, int] = defaultdict(int)
        self.ns_s = 0.0
        self.wait_s = 0.0

    def wait(self, work) -> None:
        t0 = time.perf_counter()
        work.wait()
        self.wait_s += time.perf_counter() - t0

    def orthogonalize(self, fn: Orthogonalize, x: torch.Tensor, path: str, blocks: int):
        t0 = time.perf_counter()
        out = fn(x)
        self.ns_s += time.perf_counter() - t0
        self.matrices[path] += blocks
        return out

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for path in sorted(set(self.bytes_sent) | set(self.matrices)):
            out[f"muon/{path}/bytes_sent"] = float(self.bytes_sent[path])
            out[f"muon/{path}/bytes_recv"] = float(self.bytes_recv[path])
            out[f"muon/{path}/matrices"] = float(self.matrices[path])
        out["muon/bytes_sent"] = float(sum(self.bytes_sent.values()))
        out["muon/bytes_recv"] = float(sum(self.bytes_recv.values()))
        out["muon/matrices"] = float(sum(self.matrices.values()))
        out["muon/ns_s"] = self.ns_s
        out["muon/wait_s"] = self.wait_s
        return out


def _a2a(out, inp, out_splits, in_splits, group):
    return dist.all_to_all_single(out, inp, out_splits, in_splits, group=group, async_op=True)


def _nbytes(numel: int, t: torch.Tensor) -> int:
    return numel * t.element_size()


def subgroup_all_gather(
    plan: BatchPlan, inputs: NSInputs, me: int, group, ortho: Orthogonalize, stats: StepStats
) -> Task:
    """Each expert block spans k consecutive FSDP ranks: gather the block within those k only.

    Every rank of the sub-group orthogonalizes the same block and keeps its own rows, so there is
    no return trip. `ortho` here orthogonalizes one `[k*c, C]` block.
    """
    k, n = plan.subgroup_size, plan.size
    rows, cols = plan.shard_sizes[me], plan.other_numel
    send = inputs.new_buffer((n, rows, cols))
    for j in range(n):
        inputs.fill(j, send[j])
    gathered = send.new_empty(k * n, rows, cols)  # gloo wants the ranks' inputs stacked on dim 0
    work = dist.all_gather_into_tensor(gathered, send, group=group, async_op=True)
    gathered = gathered.view(k, n, rows, cols)
    stats.bytes_sent["subgroup"] += _nbytes(send.numel() * (k - 1), send)
    stats.bytes_recv["subgroup"] += _nbytes(send.numel() * (k - 1), send)
    yield
    stats.wait(work)
    del work  # a finished Work still references its buffers
    mine = me % k
    for j in range(n):  # each result's rows go back into the send buffer, now free
        block = gathered[:, j].reshape(k * rows, cols)
        send[j] = stats.orthogonalize(ortho, block, "subgroup", 1)[mine * rows : (mine + 1) * rows]
    return list(send.unbind(0))


def ragged_all_to_all(
    plan: BatchPlan, inputs: NSInputs, me: int, group, ortho: Orthogonalize, stats: StepStats
) -> Task:
    """all_to_all_single with per-rank split sizes: matrix j is assembled on rank owners[j] only.

    Serves full batches (n = W, every rank owns one) and the ragged remainder (n < W: ranks that
    own nothing receive nothing and allocate no full-matrix buffer). Split sizes follow the shard
    sizes, so uneven and empty shards need no padding. The send buffer, which has exactly the
    return's size and layout, receives the returned shards.
    """
    path = "full" if plan.size == plan.fsdp_size else "ragged_all_to_all"
    W, C = plan.fsdp_size, plan.other_numel
    sizes = plan.shard_sizes
    order = sorted(range(plan.size), key=lambda j: plan.owners[j])
    owned = [j for j in range(plan.size) if plan.owners[j] == me]
    assert len(owned) <= 1, "a rank assembles at most one matrix per batch"
    send_splits = [0] * W
    for j in order:
        send_splits[plan.owners[j]] += sizes[me] * C
    recv_splits = [sizes[r] * C * len(owned) for r in range(W)]
    send = inputs.new_buffer((plan.size * sizes[me] * C,))
    for slot, j in enumerate(order):
        inputs.fill(j, send[slot * sizes[me] * C : (slot + 1) * sizes[me] * C].view(sizes[me], C))
    full = send.new_empty(sum(recv_splits))
    work = _a2a(full, send, recv_splits, send_splits, group)
    stats.bytes_sent[path] += _nbytes(sum(send_splits) - send_splits[me], send)
    stats.bytes_recv[path] += _nbytes(sum(recv_splits) - recv_splits[me], send)
    yield
    stats.wait(work)
    del work  # a finished Work still references its buffers
    if owned:
        matrix = full.view(-1, C)
        result = stats.orthogonalize(ortho, matrix, path, plan.blocks_per_matrix).reshape(-1)
        del matrix
    else:
        result = full  # empty
    del full
    work = _a2a(send, result, send_splits, recv_splits, group)
    stats.bytes_sent[path] += _nbytes(sum(recv_splits) - recv_splits[me], send)
    stats.bytes_recv[path] += _nbytes(sum(send_splits) - send_splits[me], send)
    yield
    stats.wait(work)
    del work, result
    out: Shards = [send] * plan.size
    for piece, j in zip(send.split([sizes[me] * C] * plan.size), order, strict=True):
        out[j] = piece.view(sizes[me], C)
    return out


def pad_all_to_all(
    plan: BatchPlan, inputs: NSInputs, me: int, group, ortho: Orthogonalize, stats: StepStats
) -> Task:
    """Pad the batch with zero matrices to W and every shard to c rows: a uniform all-to-all.

    Every rank receives and orthogonalizes one full matrix (W - R of them zeros), so memory is
    flat in R and the same on busy and idle ranks.
    """
    W, C, c = plan.fsdp_size, plan.other_numel, plan.padded_shard_rows
    N = plan.global_shard_dim_size
    send = inputs.new_buffer((W, c, C), zero=True)  # slot s goes to rank owners[s]
    for j in range(plan.size):
        inputs.fill(j, send[plan.owners[j], : plan.shard_sizes[me]])
    full = torch.empty_like(send)
    work = _a2a(full, send, None, None, group)
    stats.bytes_sent["pad_all2all"] += _nbytes(send.numel() // W * (W - 1), send)
    stats.bytes_recv["pad_all2all"] += _nbytes(send.numel() // W * (W - 1), send)
    yield
    stats.wait(work)
    del work  # a finished Work still references its buffers
    # the padding rows past N arrived as zeros; the result overwrites the N real rows in place
    matrix = full.view(W * c, C)[:N]
    matrix.copy_(stats.orthogonalize(ortho, matrix, "pad_all2all", plan.blocks_per_matrix))
    del matrix
    work = _a2a(send, full, None, None, group)
    stats.bytes_sent["pad_all2all"] += _nbytes(full.numel() // W * (W - 1), send)
    stats.bytes_recv["pad_all2all"] += _nbytes(full.numel() // W * (W - 1), send)
    yield
    stats.wait(work)
    del work, full
    rows = plan.shard_sizes[me]
    return [send[plan.owners[j], :rows] for j in range(plan.size)]


def agrs(
    plan: BatchPlan, inputs: NSInputs, me: int, group, ortho: Orthogonalize, stats: StepStats
) -> Task:
    """All-gather the batch onto every rank, orthogonalize the owned share, reduce-scatter back.

    Buffers are sized from the FSDP-visible dim (`global_shard_dim_size`), never the global one.
    The gathered batch, zeroed, becomes the reduce-scatter input and the send buffer its output,
    but the gathered buffer alone holds all n matrices, so memory and time grow with n.
    """
    W, C, c, n = plan.fsdp_size, plan.other_numel, plan.padded_shard_rows, plan.size
    N = plan.global_shard_dim_size
    send = inputs.new_buffer((n, c, C), zero=True)
    for j in range(n):
        inputs.fill(j, send[j, : plan.shard_sizes[me]])
    gathered = send.new_empty(W * n, c, C)  # gloo wants the ranks' inputs stacked on dim 0
    work = dist.all_gather_into_tensor(gathered, send, group=group, async_op=True)
    stats.bytes_sent["agrs"] += _nbytes(send.numel() * (W - 1), send)
    stats.bytes_recv["agrs"] += _nbytes(send.numel() * (W - 1), send)
    yield
    stats.wait(work)
    del work  # a finished Work still references its buffers
    slab = gathered.view(W, n, c, C)
    results = {
        j: stats.orthogonalize(
            ortho, slab[:, j].reshape(W * c, C)[:N], "agrs", plan.blocks_per_matrix
        )
        for j in range(n)
        if plan.owners[j] == me
    }
    gathered.zero_()
    for j in list(results):
        _scatter_rows(slab, j, results.pop(j), plan.shard_sizes)
    del slab
    work = dist.reduce_scatter_tensor(
        send, gathered, op=dist.ReduceOp.SUM, group=group, async_op=True
    )
    stats.bytes_sent["agrs"] += _nbytes(send.numel() * (W - 1), send)
    stats.bytes_recv["agrs"] += _nbytes(send.numel() * (W - 1), send)
    yield
    stats.wait(work)
    del work, gathered
    rows = plan.shard_sizes[me]
    return [send[j, :rows] for j in range(n)]


def _scatter_rows(slab: torch.Tensor, j: int, matrix: torch.Tensor, sizes) -> None:
    """Write matrix j's rows into the `[W, n, c, C]` slab, rank r's shard at r (refs die here)."""
    for r, piece in enumerate(matrix.split(list(sizes))):
        slab[r, j, : piece.size(0)] = piece


EXCHANGES = {
    "full": ragged_all_to_all,
    "ragged_all_to_all": ragged_all_to_all,
    "pad_all2all": pad_all_to_all,
    "agrs": agrs,
}
