"""The paths a batch can take: each one object that owns its exchange.

A path object has
- `send_buffer(b, fsdp_rank, dtype=, device=)`: the send buffer and one slot view per parameter,
  into which the optimizer writes the Newton-Schulz inputs (the momentum step) in place;
- `run(b, send, fsdp_rank=, group=, ortho=, stats=)`: the body of one batch's AsyncTask, a
  generator that launches a collective with `async_op=True`, yields so other batches can run,
  waits, orthogonalizes what this rank owns, launches the return collective, yields, and finally
  returns this rank's orthogonalized shards (`yield from` gives them to the caller);
- what it moves and holds is counted from the plan alone by `muon.cost` (one table entry per
  path there, checked against these exchanges by the tests).
Which units a rank holds and owns is the plan's (`BatchPlan.exchange_view`, `unit_blocks`,
`units_on`). The number of yields depends only on the plan, never on the rank, so every rank
issues the same collectives in the same order.

Layout legend: a shard is `[rows_r, C]` where rows are the sharded dim (moved first) and C the
product of the other dims; a unit is what one owner assembles, `[N, C]` with N its rows; W is
the exchange group's size, n the batch size, p = ceil(N / W) * C * itemsize a padded shard.
"""

from __future__ import annotations

from collections.abc import Callable, Generator

import torch
import torch.distributed as dist

from muon.stats import StepStats

Shards = list[torch.Tensor]
#: `ortho(x, units=units)`: orthogonalize `x`, the rows of `units` stacked; each unit is
#: (parameter index j in the batch, its first block, its block count), in row order
Units = list[tuple[int, int, int]]
Orthogonalize = Callable[[torch.Tensor, Units], torch.Tensor]
Task = Generator[None, None, Shards]


def _a2a(out, inp, out_splits, in_splits, group):
    return dist.all_to_all_single(out, inp, out_splits, in_splits, group=group, async_op=True)


class Local:
    """Whole matrices or whole expert blocks already on the rank: no communication. The
    optimizer orthogonalizes them one parameter at a time (no send buffer, no `run`)."""


class OwnerAllToAll:
    """all_to_all_single with per-rank split sizes: unit u is assembled on its owner only.

    Serves full batches (n = W), the ragged remainder (n < W: ranks that own nothing receive
    nothing and allocate no unit buffer) and, on a sub-group, expert blocks that span k FSDP
    ranks (`Subgroup`). Every rank sends its rows of the n units it holds (`ExchangeView.held`),
    and an owner receives the rows of each unit it owns from that unit's holders. Split sizes
    follow the shard sizes, so uneven and empty shards need no padding. An owner of several
    units of the batch orthogonalizes them in one call.
    """

    def __init__(self, label: str) -> None:
        self.label = label

    def send_buffer(self, b, r: int, *, dtype, device) -> tuple[torch.Tensor, Shards]:
        view = b.exchange_view(r)
        send = torch.empty(view.n * view.sizes[view.me] * b.other_numel, dtype=dtype, device=device)
        return send, self._slots(send, b, view)

    def _slots(self, send: torch.Tensor, b, view) -> Shards:
        """Parameter j's `[rows, C]` view of the send buffer, which is ordered by owner."""
        rows, held = view.sizes[view.me], view.held
        size = rows * b.other_numel
        order = sorted(range(view.n), key=lambda j: (held[j], j))
        slots: Shards = [send] * view.n
        for pos, j in enumerate(order):
            slots[j] = send[pos * size : (pos + 1) * size].view(rows, b.other_numel)
        return slots

    def run(self, b, send, *, fsdp_rank, group, ortho: Orthogonalize, stats: StepStats) -> Task:
        view = b.exchange_view(fsdp_rank)
        sizes, me, held, owned = view.sizes, view.me, view.held, view.owned()
        W, C, item = len(sizes), b.other_numel, send.element_size()
        # by block: the units I own, and from each holder of that block its rows of each
        by_block: dict[int, int] = {}
        for u in owned:
            by_block[u // view.n] = by_block.get(u // view.n, 0) + 1
        send_splits = [sizes[me] * C * held.count(r) for r in range(W)]
        recv_splits = [sizes[r] * C * by_block.get(r // view.span, 0) for r in range(W)]
        recv = send.new_empty(sum(recv_splits))
        work = _a2a(recv, send, recv_splits, send_splits, group)
        out_elems = sum(send_splits) - send_splits[me]
        in_elems = sum(recv_splits) - recv_splits[me]
        stats.moved(self.label, sent=out_elems * item, recv=in_elems * item)
        yield
        stats.wait(work)
        del work  # a finished Work still references its buffers
        back = recv
        if owned:
            pieces = recv.split(recv_splits)
            # per block: [units, rows of holder r, C] from each holder, in row order
            parts = {
                i: [pieces[r].view(m, sizes[r], C) for r in view.holders(i * view.n)]
                for i, m in by_block.items()
            }
            # one owned unit arrives contiguous (holders in row order); several interleave
            if len(owned) == 1:
                units = recv.view(-1, C)
            else:
                units = torch.cat([torch.cat(p, dim=1) for p in parts.values()]).view(-1, C)
            result = stats.orthogonalize(
                ortho,
                units,
                self.label,
                len(owned) * b.blocks_per_unit,
                units=b.units_on(fsdp_rank),
            )
            del units
            if len(owned) == 1:
                back = result.reshape(-1)
            else:
                rows = view.unit_rows(owned[0])
                result = result.view(len(owned), rows, C)
                first = 0
                for m, ps in ((by_block[i], ps) for i, ps in parts.items()):
                    offset = 0
                    for piece in ps:
                        n_rows = piece.size(1)
                        piece.copy_(result[first : first + m, offset : offset + n_rows])
                        offset += n_rows
                    first += m
            del result, pieces, parts
        work = _a2a(send, back, send_splits, recv_splits, group)
        stats.moved(self.label, sent=in_elems * item, recv=out_elems * item)
        del back, recv
        yield
        stats.wait(work)
        del work
        return self._slots(send, b, view)


class Subgroup(OwnerAllToAll):
    """Each expert block spans k consecutive FSDP ranks; a sub-group (those k ranks, or m * k
    when the owners widen it) exchanges with split sizes inside it so that every block is
    assembled on exactly one of its ranks, orthogonalized once and returned. For k = 2 and an
    owner among the block's own ranks this moves the bytes of an all-gather; for k = 4, half;
    an owner outside them (a widened sub-group) receives all k shards."""

    def __init__(self) -> None:
        super().__init__("subgroup")


class PadAllToAll:
    """Pad the batch with zero matrices to W and every shard to c rows: a uniform all-to-all.

    Memory is flat in R and the same on busy and idle ranks; the W - R padding slots run no
    Newton-Schulz (their zeros travel and come back untouched).
    """

    def send_buffer(self, b, r: int, *, dtype, device) -> tuple[torch.Tensor, Shards]:
        send = torch.zeros(
            b.fsdp_size, b.padded_shard_rows, b.other_numel, dtype=dtype, device=device
        )
        return send, [send[o, : b.shard_sizes[r]] for o in b.owners]  # slot s goes to rank s

    def run(self, b, send, *, fsdp_rank, group, ortho: Orthogonalize, stats: StepStats) -> Task:
        W, N = b.fsdp_size, b.fsdp_visible_rows
        full = torch.empty_like(send)
        work = _a2a(full, send, None, None, group)
        moved = send.numel() // W * (W - 1) * send.element_size()
        stats.moved("pad_all2all", sent=moved, recv=moved)
        yield
        stats.wait(work)
        del work  # a finished Work still references its buffers
        if fsdp_rank in b.owners:  # a padding slot holds zeros: nothing to orthogonalize
            matrix = full.view(-1, b.other_numel)[:N]  # rows past N arrived as padding
            owned = b.units_on(fsdp_rank)
            matrix.copy_(
                stats.orthogonalize(ortho, matrix, "pad_all2all", b.num_blocks, units=owned)
            )
            del matrix
        work = _a2a(send, full, None, None, group)
        stats.moved("pad_all2all", sent=moved, recv=moved)
        yield
        stats.wait(work)
        del work, full
        return [send[o, : b.shard_sizes[fsdp_rank]] for o in b.owners]


class Agrs:
    """All-gather the batch onto every rank, orthogonalize the owned share, reduce-scatter back.

    Buffers are sized from the FSDP-visible rows, never the global ones. The gathered batch,
    zeroed, becomes the reduce-scatter input and the send buffer its output, but the gathered
    buffer alone holds all n matrices, so memory and time grow with n.
    """

    def send_buffer(self, b, r: int, *, dtype, device) -> tuple[torch.Tensor, Shards]:
        send = torch.zeros(b.size, b.padded_shard_rows, b.other_numel, dtype=dtype, device=device)
        return send, [send[j, : b.shard_sizes[r]] for j in range(b.size)]

    def run(self, b, send, *, fsdp_rank, group, ortho: Orthogonalize, stats: StepStats) -> Task:
        W, C, n, N = b.fsdp_size, b.other_numel, b.size, b.fsdp_visible_rows
        c = b.padded_shard_rows
        gathered = send.new_empty(W * n, c, C)  # gloo wants the ranks' inputs stacked on dim 0
        work = dist.all_gather_into_tensor(gathered, send, group=group, async_op=True)
        moved = send.numel() * (W - 1) * send.element_size()
        stats.moved("agrs", sent=moved, recv=moved)
        yield
        stats.wait(work)
        del work  # a finished Work still references its buffers
        slab = gathered.view(W, n, c, C)
        results = {
            j: stats.orthogonalize(
                ortho,
                slab[:, j].reshape(W * c, C)[:N],
                "agrs",
                b.num_blocks,
                units=[(j, 0, b.num_blocks)],
            )
            for j in range(n)
            if b.owners[j] == fsdp_rank
        }
        gathered.zero_()
        for j in list(results):
            # write matrix j's rows into the slab, rank r's shard at r (the result dies here)
            for r, piece in enumerate(results.pop(j).split(list(b.shard_sizes))):
                slab[r, j, : piece.size(0)] = piece
        del slab
        work = dist.reduce_scatter_tensor(
            send, gathered, op=dist.ReduceOp.SUM, group=group, async_op=True
        )
        stats.moved("agrs", sent=moved, recv=moved)
        yield
        stats.wait(work)
        del work, gathered
        return [send[j, : b.shard_sizes[fsdp_rank]] for j in range(n)]


PATHS = {
    "local": Local(),
    "subgroup": Subgroup(),
    "full": OwnerAllToAll("full"),
    "ragged_all_to_all": OwnerAllToAll("ragged_all_to_all"),
    "pad_all2all": PadAllToAll(),
    "agrs": Agrs(),
}
