"""The paths a batch can take: one object per path, holding its name, its exchange and its cost.

Every path is registered once, in `PATHS`. A path object has
- `name` and `collectives` (collectives per direction pair: 0 for the local path, else 2);
- its exchange, in the phases `muon.task.batch_task` runs for every path:
  `send_buffer` (the buffer the momentum phase writes the Newton-Schulz inputs into, one slot
  view per parameter) -> `launch` (the first collective, `async_op=True`) -> wait ->
  `received` (what this rank orthogonalizes, or None) -> `give_back` (the orthogonalized units
  written back, the return collective launched) -> wait -> `returned` (this rank's shards: on
  the exchange paths the send buffer's slots, where the return lands), all views of one
  stacked tensor (`stacked`, `[S, rows, C]`, parameter position j in slot `slot_of(...)[j]`),
  so that the apply checks and zeroes a batch's updates in a few ops (`muon.guard`);
- its cost, counted from the plan alone (`blocks_on`, `bytes_sent`, `collective_buffer_bytes`,
  `buffer_figures`, `ns_workspace_bytes`), checked by the tests against the exchange
  (`muon.batch_cost` builds the planned peaks on them). Which units a rank holds and owns is
  the plan's (`BatchPlan.exchange_view`, `units_on`). Whether a path waits depends only on the
  plan, never on the rank: every rank issues the same collectives in the same order.

Layout legend: a shard is `[rows_r, C]` where rows are the sharded dim (moved first) and C the
product of the other dims; a unit is what one owner assembles, `[N, C]` with N its rows; W is
the exchange group's size, n the batch size, p = ceil(N / W) * C * itemsize a padded shard.

This module reads plans by their fields only, so `muon.plan` may ask what a path costs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from muon.cost import ns_block_bytes

Shards = list[torch.Tensor]
#: default byte budget of one batch's planned peak on a rank (`memory_budget` replaces it):
#: full and sub-group batches and local chunks are cut to fit it (`muon.batch_cost.fitting`)
BATCH_BYTES = 256 << 20


@dataclass
class Exchange:
    """One batch's exchange in flight on this rank: its buffers and the pending collective."""

    send: torch.Tensor
    work: object = None
    recv: torch.Tensor | None = None
    #: path-specific values between phases (split sizes, views of the received units)
    extra: dict = field(default_factory=dict)


def _a2a(out, inp, out_splits, in_splits, group):
    return dist.all_to_all_single(out, inp, out_splits, in_splits, group=group, async_op=True)


def _padded(b) -> int:
    return b.padded_shard_rows * b.other_numel * b.wire_itemsize


def local_rows(b, r: int) -> int:
    """Rows of one parameter's shard on FSDP rank `r` (the whole dim on an unsharded mesh)."""
    return b.shard_sizes[r] if b.fsdp_size > 1 else b.fsdp_visible_rows


def local_chunks(b, r: int) -> list[range]:
    """The local path orthogonalizes its parameters stacked, in chunks whose NS input, output,
    workspace and widened updates stay within the plan's `b.batch_bytes` (one at least). Sized
    by the largest shard of the FSDP group, so that every rank cuts the same chunks: each
    chunk's verdicts are agreed in one collective of the group (`muon.phases.check`)."""
    ranks = range(b.fsdp_size) if b.fsdp_size > 1 else [r]
    elems = max(local_rows(b, q) for q in ranks) * b.other_numel
    wide = elems * b.itemsize if b.wire_itemsize < b.itemsize else 0
    per = 2 * elems * b.wire_itemsize + wide
    per += max(b.unit_blocks(q)[1] for q in ranks) * ns_block_bytes(b, b.wire_itemsize)
    n = max(1, b.batch_bytes // max(1, per))
    return [range(i, min(i + n, b.size)) for i in range(0, b.size, n)]


class Path:
    """What every path shares; subclasses define the exchange and its cost."""

    name = ""
    collectives = 2

    def chunks(self, b, r: int) -> list[range]:
        """Parameter positions of `b` that go through the phases together: the whole batch."""
        return [range(b.size)]

    def returned(self, b, ex: Exchange, slots: Shards) -> Shards:
        """This rank's orthogonalized shards: the return landed in the send buffer's slots."""
        ex.recv = None
        return slots

    def stacked(self, b, ex: Exchange) -> torch.Tensor:
        """After `returned`: the `[S, rows, C]` tensor whose slots hold the returned shards
        (slot `slot_of(...)[j]` holds position j's rows first; the other slots and rows hold
        no parameter's update, only zeros)."""
        return ex.send

    def slot_of(self, b, r: int, positions: range) -> list[int]:
        """The slot of `stacked` each of `positions` returns in, on FSDP rank `r`."""
        return list(positions)

    def ns_workspace_bytes(self, b, r: int, ns_itemsize: int) -> int:
        return self.blocks_on(b, r) * ns_block_bytes(b, ns_itemsize)

    def exchange_buffer_bytes(self, b, r: int) -> int:
        """The batch's exchange buffers alive at once: send (later the return), receive, the
        contiguous copy of the received units and the Newton-Schulz output."""
        f = self.buffer_figures(b, r)
        return f["send"] + f["recv"] + f["gather"] + f["output"]


def _figures(send: int, recv: int, gather: int, output: int, keeps_output: bool) -> dict:
    """`buffer_figures`: bytes by role (`keeps_output`: the return reads the NS output)."""
    return dict(send=send, recv=recv, gather=gather, output=output, keeps_output=keeps_output)


class Local(Path):
    """Whole matrices or whole expert blocks already on the rank: no communication. The chunk's
    parameters are stacked into one buffer and orthogonalized in one call."""

    name = "local"
    collectives = 0

    def chunks(self, b, r: int) -> list[range]:
        return local_chunks(b, r)

    def send_buffer(self, b, r: int, *, dtype, device, count: int) -> tuple[torch.Tensor, Shards]:
        send = torch.empty(count, local_rows(b, r), b.other_numel, dtype=dtype, device=device)
        return send, list(send.unbind(0))

    def launch(self, b, send, *, fsdp_rank, group, stats) -> Exchange:
        return Exchange(send)

    def received(self, b, ex: Exchange, fsdp_rank: int) -> torch.Tensor | None:
        return ex.send.view(-1, b.other_numel) if ex.send.numel() else None

    def give_back(self, b, ex: Exchange, result, *, fsdp_rank, group, stats) -> None:
        if result is not None:
            ex.send = result.view(ex.send.shape)

    def returned(self, b, ex: Exchange, slots: Shards) -> Shards:
        return list(ex.send.unbind(0))

    def slot_of(self, b, r: int, positions: range) -> list[int]:
        return list(range(len(positions)))  # the chunk's own buffer

    # cost
    def blocks_on(self, b, r: int) -> int:
        return b.size * b.unit_blocks(r)[1]

    def bytes_sent(self, b, r: int) -> int:
        return 0

    def collective_buffer_bytes(self, b, r: int) -> int:
        return 0

    def buffer_figures(self, b, r: int) -> dict:
        # the largest chunk's stacked NS input and its output
        n = max(len(c) for c in self.chunks(b, r))
        stack = n * local_rows(b, r) * b.other_numel * b.wire_itemsize
        return _figures(stack, 0, 0, stack, False)

    def ns_workspace_bytes(self, b, r: int, ns_itemsize: int) -> int:
        n = max(len(c) for c in self.chunks(b, r))
        return n * b.unit_blocks(r)[1] * ns_block_bytes(b, ns_itemsize)


class OwnerAllToAll(Path):
    """all_to_all_single with per-rank split sizes: unit u is assembled on its owner only.

    Serves full batches (n = W), the ragged remainder (n < W: ranks that own nothing receive
    nothing and allocate no unit buffer) and, on a sub-group, expert blocks that span k FSDP
    ranks (`Subgroup`). Every rank sends its rows of the n units it holds (`ExchangeView.held`),
    and an owner receives the rows of each unit it owns from that unit's holders. Split sizes
    follow the shard sizes, so uneven and empty shards need no padding. An owner of several
    units of the batch orthogonalizes them in one call.
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def send_buffer(self, b, r: int, *, dtype, device, count: int) -> tuple[torch.Tensor, Shards]:
        view = b.exchange_view(r)
        send = torch.empty(view.n * view.sizes[view.me] * b.other_numel, dtype=dtype, device=device)
        return send, self._slots(send, b, view)

    def _slots(self, send: torch.Tensor, b, view) -> Shards:
        """Parameter j's `[rows, C]` view of the send buffer, which is ordered by owner."""
        parts = send.view(view.n, view.sizes[view.me], b.other_numel).unbind(0)
        return [parts[pos] for pos in _owner_order(view)]

    def stacked(self, b, ex: Exchange) -> torch.Tensor:
        view = ex.extra["view"]
        return ex.send.view(view.n, view.sizes[view.me], b.other_numel)

    def slot_of(self, b, r: int, positions: range) -> list[int]:
        order = _owner_order(b.exchange_view(r))
        return [order[j] for j in positions]

    def _splits(self, b, r: int):
        view = b.exchange_view(r)
        sizes, me, held = view.sizes, view.me, view.held
        by_block: dict[int, int] = {}  # the units I own, per block
        for u in view.owned():
            by_block[u // view.n] = by_block.get(u // view.n, 0) + 1
        C = b.other_numel
        send_splits = [sizes[me] * C * held.count(q) for q in range(len(sizes))]
        recv_splits = [sizes[q] * C * by_block.get(q // view.span, 0) for q in range(len(sizes))]
        return view, by_block, send_splits, recv_splits

    def launch(self, b, send, *, fsdp_rank, group, stats) -> Exchange:
        view, by_block, send_splits, recv_splits = self._splits(b, fsdp_rank)
        recv = send.new_empty(sum(recv_splits))
        ex = Exchange(send, _a2a(recv, send, recv_splits, send_splits, group), recv)
        me, item = view.me, send.element_size()
        out_elems = sum(send_splits) - send_splits[me]
        in_elems = sum(recv_splits) - recv_splits[me]
        stats.moved(self.name, sent=out_elems * item, recv=in_elems * item)
        ex.extra = dict(view=view, by_block=by_block, splits=(send_splits, recv_splits))
        ex.extra["elems"] = (out_elems, in_elems)
        return ex

    def received(self, b, ex: Exchange, fsdp_rank: int) -> torch.Tensor | None:
        view, by_block = ex.extra["view"], ex.extra["by_block"]
        if not by_block:
            return None
        C, sizes, recv_splits = b.other_numel, view.sizes, ex.extra["splits"][1]
        if sum(by_block.values()) == 1:  # one owned unit arrives contiguous (holders in order)
            return ex.recv.view(-1, C)
        pieces = ex.recv.split(recv_splits)
        # per block: [units, rows of holder q, C] from each holder, in row order
        parts = {
            i: [pieces[q].view(m, sizes[q], C) for q in view.holders(i * view.n)]
            for i, m in by_block.items()
        }
        ex.extra["parts"] = parts
        return torch.cat([torch.cat(p, dim=1) for p in parts.values()]).view(-1, C)

    def give_back(self, b, ex: Exchange, result, *, fsdp_rank, group, stats) -> None:
        view, by_block = ex.extra["view"], ex.extra["by_block"]
        back = ex.recv
        if result is not None and "parts" not in ex.extra:
            back = result.reshape(-1)
        elif result is not None:  # several units: scatter each back into its holders' pieces
            owned = view.owned()
            result = result.view(len(owned), view.unit_rows(owned[0]), b.other_numel)
            first = 0
            for m, ps in ((by_block[i], ps) for i, ps in ex.extra.pop("parts").items()):
                offset = 0
                for piece in ps:
                    piece.copy_(result[first : first + m, offset : offset + piece.size(1)])
                    offset += piece.size(1)
                first += m
        send_splits, recv_splits = ex.extra["splits"]
        ex.work = _a2a(ex.send, back, send_splits, recv_splits, group)
        out_elems, in_elems = ex.extra["elems"]
        item = ex.send.element_size()
        stats.moved(self.name, sent=in_elems * item, recv=out_elems * item)

    # cost
    def _figures(self, b, r: int) -> tuple[int, int, int, int, int]:
        """Bytes on the wire dtype: (my rows of one unit, units held here that others own,
        units I own, bytes of the units I own, of those the bytes other ranks hold)."""
        view = b.exchange_view(r)
        row = b.other_numel * b.wire_itemsize
        mine = view.sizes[view.me] * row
        owned = view.owned()
        owned_bytes = sum(view.unit_rows(u) for u in owned) * row
        own_rows = sum(view.me in view.holders(u) for u in owned) * mine
        away = sum(o != view.me for o in view.held)
        return mine, away, len(owned), owned_bytes, owned_bytes - own_rows

    def blocks_on(self, b, r: int) -> int:
        return self._figures(b, r)[2] * b.blocks_per_unit

    def bytes_sent(self, b, r: int) -> int:
        # my rows of each unit owned elsewhere; each owned unit's other rows back
        mine, away, _, _, others = self._figures(b, r)
        return mine * away + others

    def collective_buffer_bytes(self, b, r: int) -> int:
        # the owned units arrive whole; the return lands in the send buffer
        mine, _, _, owned_bytes, _ = self._figures(b, r)
        return max(owned_bytes, b.size * mine)

    def buffer_figures(self, b, r: int) -> dict:
        # send (later the return) + received units + NS output; several units are also
        # gathered into one contiguous input; one unit's output is returned as it is
        mine, _, owned, owned_bytes, _ = self._figures(b, r)
        gather = owned_bytes if owned > 1 else 0
        return _figures(b.size * mine, owned_bytes, gather, owned_bytes, owned == 1)


def _owner_order(view) -> list[int]:
    """Per parameter position j, its slot in a send buffer ordered by owner (then by j)."""
    held = view.held
    slot = [0] * view.n
    for pos, j in enumerate(sorted(range(view.n), key=lambda j: (held[j], j))):
        slot[j] = pos
    return slot


class Subgroup(OwnerAllToAll):
    """Each expert block spans k consecutive FSDP ranks; a sub-group (those k ranks, or m * k
    when the owners widen it) exchanges with split sizes inside it so that every block is
    assembled on exactly one of its ranks, orthogonalized once and returned. For k = 2 and an
    owner among the block's own ranks this moves the bytes of an all-gather; for k = 4, half;
    an owner outside them (a widened sub-group) receives all k shards."""

    def __init__(self) -> None:
        super().__init__("subgroup")


class PadAllToAll(Path):
    """Pad the batch with zero matrices to W and every shard to c rows: a uniform all-to-all.

    Memory is flat in R and the same on busy and idle ranks; the W - R padding slots run no
    Newton-Schulz (their zeros travel and come back untouched).
    """

    name = "pad_all2all"

    def send_buffer(self, b, r: int, *, dtype, device, count: int) -> tuple[torch.Tensor, Shards]:
        send = torch.zeros(
            b.fsdp_size, b.padded_shard_rows, b.other_numel, dtype=dtype, device=device
        )
        return send, [send[o, : b.shard_sizes[r]] for o in b.owners]  # slot s goes to rank s

    def slot_of(self, b, r: int, positions: range) -> list[int]:
        return [b.owners[j] for j in positions]

    def launch(self, b, send, *, fsdp_rank, group, stats) -> Exchange:
        full = torch.empty_like(send)
        ex = Exchange(send, _a2a(full, send, None, None, group), full)
        moved = send.numel() // b.fsdp_size * (b.fsdp_size - 1) * send.element_size()
        stats.moved(self.name, sent=moved, recv=moved)
        return ex

    def received(self, b, ex: Exchange, fsdp_rank: int) -> torch.Tensor | None:
        if fsdp_rank not in b.owners:  # a padding slot holds zeros: nothing to orthogonalize
            return None
        return ex.recv.view(-1, b.other_numel)[: b.fsdp_visible_rows]  # past N: padding

    def give_back(self, b, ex: Exchange, result, *, fsdp_rank, group, stats) -> None:
        if result is not None:
            ex.recv.view(-1, b.other_numel)[: b.fsdp_visible_rows].copy_(result)
        ex.work = _a2a(ex.send, ex.recv, None, None, group)
        moved = ex.send.numel() // b.fsdp_size * (b.fsdp_size - 1) * ex.send.element_size()
        stats.moved(self.name, sent=moved, recv=moved)

    # cost
    def blocks_on(self, b, r: int) -> int:
        return b.num_blocks if r in b.owners else 0

    def bytes_sent(self, b, r: int) -> int:
        return 2 * _padded(b) * (b.fsdp_size - 1)

    def collective_buffer_bytes(self, b, r: int) -> int:
        return b.fsdp_size * _padded(b)

    def buffer_figures(self, b, r: int) -> dict:
        # send (later the return) + received slab + an owner's NS output copied back into it
        slab = b.fsdp_size * _padded(b)
        return _figures(slab, slab, 0, b.matrix_bytes if r in b.owners else 0, False)


class Agrs(Path):
    """All-gather the batch onto every rank, orthogonalize the owned share, reduce-scatter back.

    Buffers are sized from the FSDP-visible rows, never the global ones. The gathered batch,
    zeroed, becomes the reduce-scatter input and the send buffer its output, but the gathered
    buffer alone holds all n matrices, so memory and time grow with n. A rank owns at most one
    matrix of a batch (`muon.owners`).
    """

    name = "agrs"

    def send_buffer(self, b, r: int, *, dtype, device, count: int) -> tuple[torch.Tensor, Shards]:
        send = torch.zeros(b.size, b.padded_shard_rows, b.other_numel, dtype=dtype, device=device)
        return send, [send[j, : b.shard_sizes[r]] for j in range(b.size)]

    def launch(self, b, send, *, fsdp_rank, group, stats) -> Exchange:
        W, n, c, C = b.fsdp_size, b.size, b.padded_shard_rows, b.other_numel
        gathered = send.new_empty(W * n, c, C)  # gloo wants the ranks' inputs stacked on dim 0
        ex = Exchange(send, dist.all_gather_into_tensor(gathered, send, group=group, async_op=True))
        ex.recv = gathered
        moved = send.numel() * (W - 1) * send.element_size()
        stats.moved(self.name, sent=moved, recv=moved)
        return ex

    def received(self, b, ex: Exchange, fsdp_rank: int) -> torch.Tensor | None:
        owned = [j for j in range(b.size) if b.owners[j] == fsdp_rank]
        if not owned:
            return None
        W, n, c, C = b.fsdp_size, b.size, b.padded_shard_rows, b.other_numel
        ex.extra["owned"] = owned[0]
        slab = ex.recv.view(W, n, c, C)
        return slab[:, owned[0]].reshape(W * c, C)[: b.fsdp_visible_rows]

    def give_back(self, b, ex: Exchange, result, *, fsdp_rank, group, stats) -> None:
        W, n, c, C = b.fsdp_size, b.size, b.padded_shard_rows, b.other_numel
        slab = ex.recv.view(W, n, c, C)
        ex.recv.zero_()
        if result is not None:  # matrix j's rows into the slab, rank q's shard at q
            j = ex.extra["owned"]
            for q, piece in enumerate(result.split(list(b.shard_sizes))):
                slab[q, j, : piece.size(0)] = piece
        ex.work = dist.reduce_scatter_tensor(
            ex.send, ex.recv, op=dist.ReduceOp.SUM, group=group, async_op=True
        )
        moved = ex.send.numel() * (W - 1) * ex.send.element_size()
        stats.moved(self.name, sent=moved, recv=moved)

    # cost
    def _owned(self, b, r: int) -> int:
        return sum(o == r for o in b.owners)

    def blocks_on(self, b, r: int) -> int:
        return self._owned(b, r) * b.num_blocks

    def bytes_sent(self, b, r: int) -> int:
        # all-gather my padded shards to W-1 peers; reduce-scatter W-1 padded shards back
        return 2 * b.size * _padded(b) * (b.fsdp_size - 1)

    def collective_buffer_bytes(self, b, r: int) -> int:
        return b.fsdp_size * b.size * _padded(b)

    def buffer_figures(self, b, r: int) -> dict:
        # send (later the reduce-scatter output) + gathered (later its input) + the owned
        # matrix's contiguous copy out of the gathered slab + its NS output
        n, w, owned = b.size, b.fsdp_size, self._owned(b, r)
        gather = w * _padded(b) if owned else 0
        return _figures(n * _padded(b), n * w * _padded(b), gather, owned * b.matrix_bytes, False)

    def ns_workspace_bytes(self, b, r: int, ns_itemsize: int) -> int:
        return (b.num_blocks if self._owned(b, r) else 0) * ns_block_bytes(b, ns_itemsize)


#: every path, once: name -> the object that exchanges and costs it
PATHS: dict[str, Path] = {
    p.name: p
    for p in (Local(), Subgroup(), OwnerAllToAll("full"), Agrs(), PadAllToAll())
    + (OwnerAllToAll("ragged_all_to_all"),)
}
#: the remainder strategies, in the order `remainder_strategy` lists them
REMAINDER_STRATEGIES: tuple[str, ...] = ("agrs", "pad_all2all", "ragged_all_to_all")
#: what `remainder_strategy` accepts: a strategy, or "auto" (the cheapest per batch)
REMAINDER_CHOICES: tuple[str, ...] = (*REMAINDER_STRATEGIES, "auto")
