"""What a batch costs on a rank, counted from its plan alone: each figure asked of the batch's
path object (`muon.paths.PATHS`), and the sums built on them that the plan, the memory model
and the planner read (a batch's planned peak, the in-flight window's peak, the modelled time of
its collectives). The tests check these figures against the exchanges as they run.
"""

from __future__ import annotations

from dataclasses import replace

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
    return _shard_elems(b, r) * b.itemsize


def _shard_elems(b, r: int) -> int:
    """Elements of this rank's shards of the batch (the local path: of its largest chunk)."""
    if b.path == "local":
        return max(len(c) for c in local_chunks(b, r)) * local_rows(b, r) * b.other_numel
    return b.size * b.shard_sizes[r] * b.other_numel


def widened_bytes(b, r: int) -> int:
    """The apply's copy of the returned updates in the parameters' dtype, when they travelled
    narrower (`muon.phases._widened`: one cast of the batch, so that the add is one kernel)."""
    if b.wire_itemsize >= b.itemsize or b.shard_tensor_dim != 0:
        return 0
    return _shard_elems(b, r) * b.itemsize


def normuon_bytes(b, r: int) -> int:
    """NorMuon's float32 temporaries over the blocks this rank orthogonalized (`muon.normuon.
    normalize`: the float32 blocks, their normalized value and its rescale; cast back to the
    wire dtype)."""
    elems = blocks_on(b, r) * b.block_shape[0] * b.block_shape[1]
    return elems * ((3 if b.wire_itemsize != 4 else 2) * 4 + b.wire_itemsize)


def segments(
    b,
    r: int,
    ns_itemsize: int,
    *,
    nesterov: bool = False,
    normuon: bool = False,
    gloo=False,
    agree=False,
):
    """Batch `b`'s bytes on FSDP rank `r` in each stretch its task runs without yielding
    (`muon.task.batch_task`): `[(peak, held after)]`, one stretch for the local path,
    three for an exchange (momentum + launch; orthogonalize + return; apply), one more for
    either with `agree`. The send buffer lives through the task (the return lands in it), the
    receive buffer until the return has landed; Newton-Schulz's workspace, the Nesterov input,
    NorMuon's temporaries and the widened updates only inside their stretch. `gloo`: AGRS's
    all-gather and reduce-scatter also make gloo's flat staging copy of the slab, freed when
    they complete (NCCL: none).
    `agree`: the ranks holding the parameters' shards agree on the verdicts (`muon.verdict.
    verdict_groups`) in an all-reduce the task yields on between the check and the apply, one
    stretch more, holding the returned updates (the local path: its input and NS output)."""
    buf = PATHS[b.path].buffer_figures(b, r)
    send, recv, gather, out = buf["send"], buf["recv"], buf["gather"], buf["output"]
    ws = ns_workspace_bytes(b, r, ns_itemsize)
    post = out + (normuon_bytes(b, r) if normuon and blocks_on(b, r) else 0)
    ns_peak = gather + max(ws, post)
    nest, wide = nesterov_input_bytes(b, r, nesterov), widened_bytes(b, r)
    if PATHS[b.path].collectives == 0:  # local: the result replaces the send buffer's values
        if agree:  # the slots keep the input alive beside the output through the verdicts
            return [(send + max(nest, ns_peak), send + out), (send + out + wide, 0)]
        return [(send + max(nest, ns_peak, out + wide), 0)]
    kept = out if buf["keeps_output"] else 0
    staging = recv if gloo and b.path == "agrs" else 0
    apply = [(send, send), (send + wide, 0)] if agree else [(send + wide, 0)]
    return [
        (send + max(nest, recv + staging), send + recv),
        (send + recv + ns_peak, send + recv + kept + staging),
        *apply,
    ]


def peak_bytes(b, r: int, ns_itemsize: int, *, nesterov: bool = False, normuon=False) -> int:
    """Planned peak bytes of batch `b` alone on FSDP rank `r`: its largest stretch
    (`segments`)."""
    return max(p for p, _ in segments(b, r, ns_itemsize, nesterov=nesterov, normuon=normuon))


def window_peak_bytes(
    plans, *, ns_itemsize: int, nesterov: bool, max_inflight: int, normuon=False, gloo=False
) -> int:
    """The step's planned transient on this rank: `muon.runtime.AsyncRuntime`'s schedule of the
    batches of `plans` (`[(mesh plan, batches)]`, seen from each mesh plan's `fsdp_rank`; the
    local path in its chunks) replayed on their `segments`: a window of `max_inflight` tasks,
    a new one run to its first yield as soon as one finishes, the others resumed in turn. The
    largest sum of what the live tasks hold while one of them runs a stretch. 0 without
    batches."""
    kw = dict(ns_itemsize=ns_itemsize, nesterov=nesterov, normuon=normuon, gloo=gloo)
    return window_at_peak(plans, max_inflight=max_inflight, **kw)[0]


def window_at_peak(plans, *, max_inflight: int, **kw) -> tuple[int, list]:
    """`window_peak_bytes` (its keywords in `kw`) and who holds it: per live batch at the peak
    `(batch, the index of its stretch then (`segments`) or None when it waits, bytes)`."""
    tasks = []
    for mp, batches in plans:
        agree = mp.sharded and (mp.fsdp_size > 1 or mp.ep_mesh_dim is not None)
        for b in batches:
            segs = segments(b, mp.fsdp_rank, agree=agree, **kw)
            tasks += [(b, segs)] * len(PATHS[b.path].chunks(b, mp.fsdp_rank))
    return replay(tasks, max(1, max_inflight))


def replay(tasks: list, max_inflight: int) -> tuple[int, list]:
    """The peak of `tasks` (each `(label, [(peak, held after)] per stretch)`) run as
    `AsyncRuntime` runs them, and what each live task held then (`window_at_peak`)."""
    pending = iter(tasks)
    live: list[list] = []  # [label, stretches, next stretch, bytes held]
    peak, at_peak = 0, []

    def run(task: list) -> bool:
        """Run the task's next stretch; True when it finished."""
        nonlocal peak, at_peak
        held = sum(t[3] for t in live if t is not task)
        top, after = task[1][task[2]]
        if held + top > peak:
            peak = held + top
            at_peak = [(t[0], None, t[3]) if t is not task else (t[0], t[2], top) for t in live]
        task[2] += 1
        task[3] = after
        return task[2] == len(task[1])

    def fill() -> None:
        while len(live) < max_inflight:
            item = next(pending, None)
            if item is None:
                return
            task = [*item, 0, 0]
            live.append(task)
            if run(task):
                live.remove(task)

    fill()
    while live:
        task = live.pop(0)
        live.append(task)
        if run(task):
            live.remove(task)
            fill()
    return peak, at_peak


def fitting(most: int, batch_of) -> int:
    """The largest n in 1..`most` whose batch `batch_of(n)` has a `sizing_peak` within its
    `batch_bytes` (1 at least: one unit always goes)."""
    n = 1
    while n < most and sizing_peak(batch_of(n + 1)) <= batch_of(n + 1).batch_bytes:
        n += 1
    return n


def with_placeholder_owners(b):
    """`b` with owners as the assignment would spread them before it balances cost: matrix j
    of an exchange on rank j mod W (a remainder's owners ranks 0..R-1), a sub-group block on its
    first rank, so that rank 0 holds the most."""
    if b.path == "subgroup":
        spans = b.fsdp_size // b.block_span
        owners = tuple(i * b.block_span for i in range(spans) for _ in range(b.size))
    else:
        owners = tuple(j % b.fsdp_size for j in range(b.size))
    return replace(b, owners=owners)


def sizing_peak(b) -> int:
    """What planning sizes batch `b` by: its planned peak (Nesterov input included) on the
    ranks that hold the most under `with_placeholder_owners` (the first and the last)."""
    if b.path != "local":
        b = with_placeholder_owners(b)
    ranks = {0, b.fsdp_size - 1}
    return max(peak_bytes(b, r, b.wire_itemsize, nesterov=True) for r in ranks)


def modelled_s(b, link: LinkModel, ranks=None) -> float:
    """Modelled time of batch `b`'s collectives, from the busiest rank's bytes (of `ranks`,
    default all)."""
    ranks = range(b.fsdp_size) if ranks is None else ranks
    per_collective = max(bytes_sent(b, r) for r in ranks) / 2
    return PATHS[b.path].collectives * link.collective_s(int(per_collective))
