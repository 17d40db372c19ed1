"""Random initialization by global row chunks, whose values do not depend on who holds the rows.

A parameter of global shape [R, ...] is cut into fixed global row chunks of
`rows_per_chunk(shape)` rows (about `CHUNK_ELEMENTS` values each; the last chunk may be
shorter). Chunk c is drawn from a generator seeded with a hash of (seed, parameter name, c),
so every chunk has the same values whoever draws it. A holder of global rows [a, b) draws only
the chunks that overlap [a, b) and copies the overlap into its rows: time and memory
proportional to the rows it holds (plus at most two partly used chunks per parameter), never to
the full tensor. Which rows a process holds is a `Rows` function: on one device `whole_rows`
(all of them); a sharded model's is `models.glm.infra.init.shard_rows`.

The generator lives on the parameter's device: on CUDA the values come from Philox on the
device, on CPU from mt19937, so a CUDA run and a CPU run draw different (equally
distributed) numbers; within one device type the values are the same for every mesh.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
from torch import nn

from models.glm.model.layers import RMSNorm
from models.glm.model.moe import FusedExperts, Router

# 16 Ki values (64 KiB in float32) per chunk: small enough that the two partial chunks at a
# shard's edges stay a small fraction of a shard even for the `small` preset at 8 ranks,
# large enough that the per-chunk generator seeding (a few microseconds) is negligible.
CHUNK_ELEMENTS = 1 << 14


def rows_per_chunk(shape: torch.Size | tuple[int, ...]) -> int:
    """Rows of one init chunk of a tensor of global `shape` (a function of the shape only)."""
    row = 1
    for n in shape[1:]:
        row *= n
    # A power of two, so chunk edges fall on the shard edges of power-of-two row counts.
    return 1 << max(0, (CHUNK_ELEMENTS // max(1, row)).bit_length() - 1)


def chunk_seed(seed: int, name: str, chunk: int) -> int:
    """The generator seed of chunk `chunk` of parameter `name` (stable across processes)."""
    digest = hashlib.blake2b(f"{seed}/{name}/{chunk}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


#: the part of a parameter this process holds: (its local tensor, the first global row of it,
#: its row count); a holder of no rows returns a count of 0
Rows = Callable[[torch.Tensor], tuple[torch.Tensor, int, int]]


def whole_rows(p: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """All of `p` (a 0-dim tensor is one row): a tensor on one device. A tensor subclass (a
    parameter sharded over ranks) is refused: its rows are the installer's to tell."""
    if type(p) not in (torch.Tensor, nn.Parameter):
        raise TypeError(
            f"whole_rows: a {type(p).__name__} is not a plain tensor; initialize a sharded "
            "model with models.glm.infra.init.init_weights"
        )
    return p, 0, p.shape[0] if p.ndim else 1


@torch.no_grad()
def normal_(
    p: torch.Tensor,
    *,
    std: float,
    seed: int,
    name: str,
    generator: torch.Generator,
    rows: Rows = whole_rows,
) -> int:
    """Fill the rows of `p` this process holds (`rows(p)`) with N(0, std) values drawn by global
    row chunks; `generator` must be on their device and is reseeded per chunk. Returns the
    number of random values drawn."""
    local, first, count = rows(p)
    if count == 0 or local.numel() == 0:
        return 0
    total = p.shape[0] if p.ndim else 1
    local_2d = local.view(count, -1)
    per_row = local_2d.shape[1]
    step = rows_per_chunk(p.shape)
    drawn = 0
    for chunk in range(first // step, (first + count - 1) // step + 1):
        lo, hi = chunk * step, min(total, (chunk + 1) * step)
        generator.manual_seed(chunk_seed(seed, name, chunk))
        values = torch.empty(hi - lo, per_row, dtype=torch.float32, device=local.device)
        values.normal_(0.0, std, generator=generator)
        drawn += values.numel()
        a, b = max(lo, first), min(hi, first + count)
        local_2d[a - first : b - first].copy_(values[a - lo : b - lo])
    return drawn


@torch.no_grad()
def init_model(model: nn.Module, seed: int, rows: Rows = whole_rows) -> int:
    """`GLMForCausalLM.init_weights`: matrices ~ N(0, initializer_range), norms 1, biases and
    the router correction bias 0, expert loads 0, each parameter in the rows `rows(p)` gives;
    returns the number of random values drawn."""
    std = model.config.initializer_range
    generators: dict[torch.device, torch.Generator] = {}
    seen: set[int] = set()
    drawn = 0

    def fill(p: torch.Tensor, name: str, kind: str) -> None:
        nonlocal drawn
        if id(p) in seen or p.is_meta:
            return
        seen.add(id(p))
        local = rows(p)[0]
        if kind != "normal":
            local.fill_(1.0 if kind == "ones" else 0.0)
            return
        if local.device not in generators:
            generators[local.device] = torch.Generator(device=local.device)
        gen = generators[local.device]
        drawn += normal_(p, std=std, seed=seed, name=name, generator=gen, rows=rows)

    for prefix, module in model.named_modules():
        at = f"{prefix}." if prefix else ""
        if isinstance(module, RMSNorm):
            fill(module.weight, at + "weight", "ones")
        elif isinstance(module, nn.Linear):
            fill(module.weight, at + "weight", "normal")
            if module.bias is not None:
                fill(module.bias, at + "bias", "zeros")
        elif isinstance(module, nn.Embedding):
            fill(module.weight, at + "weight", "normal")
            _zero_pad_row(module, rows)
        elif isinstance(module, nn.LayerNorm):
            fill(module.weight, at + "weight", "ones")
            fill(module.bias, at + "bias", "zeros")
        elif isinstance(module, Router):
            fill(module.weight, at + "weight", "normal")
            fill(module.e_score_correction_bias, at + "e_score_correction_bias", "zeros")
            if not module.expert_load.is_meta:
                module.expert_load.zero_()
        elif isinstance(module, FusedExperts):
            fill(module.gate_up_proj, at + "gate_up_proj", "normal")
            fill(module.down_proj, at + "down_proj", "normal")
    return drawn


def _zero_pad_row(embedding: nn.Embedding, rows: Rows) -> None:
    """Zero the pad row in the rows of the weight this process holds (transformers' init of
    `padding_idx`); a no-op without a pad id or on meta."""
    pad, p = embedding.padding_idx, embedding.weight
    if pad is None or p.is_meta:
        return
    local, first, count = rows(p)
    if first <= pad < first + count:
        local[pad - first].zero_()
