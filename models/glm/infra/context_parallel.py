"""Context parallelism: one sequence divided over the ranks of a cp group, DSA-natively.

Each rank of the group computes its own tokens of the sequence (`LocalTokens`, from
`local_tokens`); its queries stay local, and the attention's key side - MLA's normed latent and
rotary key (L + R values per token: 576 for GLM-5.2, against a hidden state of 6144), the DSA
indexer's keys (C values), a GQA layer's keys and values - is all-gathered over the group in the
compute dtype by the `gather_keys` hook `apply_context_parallel` installs on every attention and
indexer. The indexer scores, the causal masks (by global position), the top-k and the sparse
attention then run on the gathered keys as on one rank. In backward the key side's gradient is
reduce-scattered to its owners (`_GatherSequence`). A checkpointed layer gathers again when it
recomputes; an uncheckpointed one keeps the gathered key side for backward, or, with
`keep_gathered=False`, saves its own rows of it and gathers them again there (`SequenceGather`).

Layouts (`LAYOUTS`), for a sequence of S tokens cut into equal chunks:
- "head_tail" (training's): 2 cp chunks, rank r holding chunks r and 2cp-1-r. Causal work grows
  with a query's position, so each rank's pair of chunks costs the same (the indexer's
  busiest/mean load is 1 up to the chunk's rounding);
- "contiguous": cp chunks, rank r holding chunk r (the busiest rank does (2cp - 1) / cp times the
  mean causal work): for comparison.

Expert parallelism is unchanged (each rank routes its own tokens); parameters stay sharded over
the whole FSDP group, cp ranks included, so Muon's plans span it as they span data parallelism.

Shape legend: B batch, T local tokens, S the full sequence, F per-token features.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from models.glm.model.indexer import Indexer
from models.glm.model.layers import Attention
from models.glm.model.mla import MLAttention
from models.glm.model.model import DecoderLayer
from models.glm.model.sequence import LocalTokens

#: how a sequence is cut over the cp ranks (see the module docstring)
LAYOUTS = ("head_tail", "contiguous")
#: the layout training runs with
TRAIN_LAYOUT = "head_tail"


def chunks_per_rank(layout: str) -> int:
    """Chunks of the sequence each rank holds: 2 (head_tail) or 1 (contiguous)."""
    if layout not in LAYOUTS:
        raise ValueError(f"context-parallel layout {layout!r} is not one of {LAYOUTS}")
    return 2 if layout == "head_tail" else 1


def check_seq_len(seq_len: int, cp: int, layout: str = "head_tail") -> None:
    """ValueError unless `seq_len` cuts into the layout's equal chunks over `cp` ranks."""
    parts = cp * chunks_per_rank(layout)
    if cp < 1 or seq_len % parts:
        raise ValueError(
            f"data.seq_len={seq_len} must be a multiple of {parts} for mesh.cp={cp} with the "
            f"{layout!r} layout ({chunks_per_rank(layout)} equal chunk(s) per rank)"
        )


def layout_runs(layout: str, cp: int, rank: int, seq_len: int) -> tuple[tuple[int, int], ...]:
    """The (first position, count) runs cp rank `rank` holds, in local order."""
    check_seq_len(seq_len, cp, layout)
    if layout == "contiguous":
        chunk = seq_len // cp
        return ((rank * chunk, chunk),)
    chunk = seq_len // (2 * cp)
    return ((rank * chunk, chunk), ((2 * cp - 1 - rank) * chunk, chunk))


def local_tokens(layout: str, cp: int, rank: int, seq_len: int) -> LocalTokens:
    """The tokens cp rank `rank` computes of a sequence of `seq_len`."""
    return LocalTokens(layout_runs(layout, cp, rank, seq_len), seq_len)


@functools.lru_cache(maxsize=64)
def _orders(layout: str, cp: int, seq_len: int, device: torch.device):
    """(for each global position, its slot in the rank-major gathered order; for each slot,
    its global position), int64 [S] each, on `device`."""
    slots = [
        pos
        for r in range(cp)
        for first, count in layout_runs(layout, cp, r, seq_len)
        for pos in range(first, first + count)
    ]
    global_of_slot = torch.tensor(slots, dtype=torch.long)
    slot_of_global = torch.empty_like(global_of_slot)
    slot_of_global[global_of_slot] = torch.arange(seq_len)
    return slot_of_global.to(device), global_of_slot.to(device)


def _gather(x_BTF: torch.Tensor, gather: SequenceGather, seq_len: int) -> torch.Tensor:
    """The all-gather and reorder of `_GatherSequence.forward` (no autograd)."""
    B, T, F = x_BTF.shape
    cp = gather.size
    buf_CBTF = x_BTF.new_empty(cp * B, T, F)
    dist.all_gather_into_tensor(buf_CBTF, x_BTF.contiguous(), group=gather.group)
    slot_of_global, _ = _orders(gather.layout, cp, seq_len, x_BTF.device)
    rank_major_BSF = buf_CBTF.view(cp, B, T, F).transpose(0, 1).reshape(B, cp * T, F)
    return rank_major_BSF.index_select(1, slot_of_global)


class _GatherSequence(torch.autograd.Function):
    """[B, T, F] per rank -> [B, S, F] in global order (all-gather); backward: the gradient's
    rows reduce-scattered (summed) back to the ranks that own them."""

    @staticmethod
    def forward(ctx, x_BTF, gather: SequenceGather, seq_len: int):
        ctx.gather, ctx.seq_len, ctx.shape = gather, seq_len, tuple(x_BTF.shape)
        return _gather(x_BTF, gather, seq_len)

    @staticmethod
    def backward(ctx, g_BSF):
        gather, (B, T, F) = ctx.gather, ctx.shape
        _, global_of_slot = _orders(gather.layout, gather.size, ctx.seq_len, g_BSF.device)
        parts_CBTF = g_BSF.index_select(1, global_of_slot).view(B, gather.size, T, F)
        parts_CBTF = parts_CBTF.transpose(0, 1).reshape(gather.size * B, T, F)
        out_BTF = g_BSF.new_empty(B, T, F)
        dist.reduce_scatter_tensor(out_BTF, parts_CBTF, group=gather.group)
        return out_BTF, None, None


class SequenceGather:
    """The `gather_keys` hook: this rank's key-side rows [B, T, F] -> the sequence's [B, S, F]
    over `group` (the cp ranks, in group-rank order) cut by `layout`.

    `keep_gathered` False: inside an attention's forward (`regathering`), a tensor autograd
    saves that views a gathered key side's storage is saved as this rank's rows instead and
    gathered again when backward needs it: one all-gather more per saved view in backward,
    and no layer's gathered key side outlives its forward. MLA saves views of its gathered
    latent + rotary key; a GQA layer expands K and V per query head before attention (copies
    autograd keeps either way), so there the setting changes nothing."""

    def __init__(
        self, group: dist.ProcessGroup, layout: str = "head_tail", keep_gathered: bool = True
    ) -> None:
        chunks_per_rank(layout)
        self.group, self.layout, self.keep_gathered = group, layout, keep_gathered
        self.size = dist.get_world_size(group)
        #: saved key-side views gathered again in backward so far (keep_gathered False)
        self.regathered = 0
        #: the gathered outputs of the running forward: storage address -> (output, rows, S)
        self._sources: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
        self._depth = 0  # regathering forwards running (nested modules count once each)

    @torch.compiler.disable
    def __call__(self, x_BTF: torch.Tensor, seq_len: int) -> torch.Tensor:
        if x_BTF.shape[1] * self.size != seq_len:
            raise ValueError(
                f"context parallelism: {x_BTF.shape[1]} tokens per rank x {self.size} ranks "
                f"is not the sequence's {seq_len}"
            )
        out_BSF = _GatherSequence.apply(x_BTF, self, seq_len)
        if self._depth and torch.is_grad_enabled():
            key = out_BSF.untyped_storage().data_ptr()
            self._sources[key] = (out_BSF, x_BTF.detach(), seq_len)
        return out_BSF

    def _pack(self, t: torch.Tensor):
        source = self._sources.get(t.untyped_storage().data_ptr())
        if source is None:
            return t
        _, rows, seq_len = source
        return (_Regather, rows, seq_len, t.storage_offset(), t.shape, t.stride())

    def _unpack(self, packed):
        if not (isinstance(packed, tuple) and packed and packed[0] is _Regather):
            return packed
        _, rows, seq_len, offset, shape, stride = packed
        self.regathered += 1
        with torch.no_grad():
            full = _gather(rows, self, seq_len)
        return full.as_strided(shape, stride, offset)

    def regathering(self, module: nn.Module) -> None:
        """Run `module`'s forwards under the re-gathering saved-tensor hooks."""
        contexts: list = []

        def enter(_module, _args):
            ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            ctx.__enter__()
            contexts.append(ctx)
            self._depth += 1

        def leave(_module, _args, _out):
            contexts.pop().__exit__(None, None, None)
            self._depth -= 1
            if not self._depth:
                self._sources.clear()  # the outputs are saved as rows by now

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave)


class _Regather:
    """The tag of a saved tensor `SequenceGather` gathers again in backward."""


def context_group(world_size: int, cp: int, device_type: str) -> dist.ProcessGroup:
    """This rank's cp group: ranks r // cp alike (consecutive ranks, as an EP group's: on one
    host first), from a (world_size // cp, cp) mesh ("dp", "cp"). Every rank must call it."""
    from torch.distributed.device_mesh import init_device_mesh

    if cp < 1 or world_size % cp:
        raise ValueError(f"cp ({cp}) must be a positive divisor of world_size ({world_size})")
    mesh = init_device_mesh(device_type, (world_size // cp, cp), mesh_dim_names=("dp", "cp"))
    return mesh["cp"].get_group()


def apply_context_parallel(
    model: nn.Module, group: dist.ProcessGroup, layout: str, keep_gathered: bool = True
) -> int:
    """Install the key-side gather over `group` on every attention and DSA indexer of `model`
    (the modules that read other tokens' keys); returns how many. The model then runs forwards
    given `tokens=local_tokens(layout, cp, rank, S)` with the full sequence's inputs.
    `keep_gathered` False re-gathers the key side in backward (`SequenceGather`), except in
    activation-checkpointed layers, which gather again when they recompute anyway."""
    gather = SequenceGather(group, layout, keep_gathered)
    hooked = 0
    for module in model.modules():
        if isinstance(module, (Attention, MLAttention, Indexer)):
            module.gather_keys = gather
            hooked += 1
    if not keep_gathered:
        recomputed = {
            id(m.self_attn)
            for m in model.modules()
            if isinstance(m, DecoderLayer) and m.checkpoint_activations
        }
        for module in model.modules():
            if isinstance(module, (Attention, MLAttention)) and id(module) not in recomputed:
                gather.regathering(module)
    return hooked
