"""What a step reuses of each batch, made once per plan on the parameters' device.

A batch goes through the step's phases as one chunk (the local path: in memory-bounded chunks
of its parameters, `muon.paths.local_chunks`). For each chunk on this rank, `prepare_chunks`
fixes the units it orthogonalizes and, for blocks of unequal heights (Muon Split), the row
indices of each height and the per-row lr factors as device tensors, so that no step builds an
index on the host and copies it to the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from muon.blocks import SplitGroups, split_groups
from muon.layout import local
from muon.paths import PATHS


def adjusted_lr(lr: float, adjust_lr: str, rows: int, cols: int) -> float:
    """The Muon learning rate for one `[rows, cols]` block."""
    if adjust_lr == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    if adjust_lr == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


@dataclass
class Chunk:
    """What a step reuses of one batch (or, on the local path, of one chunk of it) on this
    rank."""

    #: positions in the batch of the parameters that go through the phases together
    positions: range
    #: the units this rank orthogonalizes: (position j, first block, block count)
    units: list
    #: blocks of unequal heights: their groups by height, row indices on the device
    split: SplitGroups | None
    #: blocks of unequal heights: per `adjust_lr` mode, the lr factor of each local row
    row_scales: dict
    #: per position, the slot of the path's stacked returned tensor (`Path.slot_of`)
    slots: list
    #: `slots` as a device index (the update check reads the stacked tensor by position)
    slot_index: torch.Tensor | None = None


def prepare_chunks(plan, param_groups: list[dict]) -> dict[tuple[int, int], list[Chunk]]:
    """(mesh plan index, batch index) -> that batch's chunks on this rank (`muon.planner`'s
    StepPlan `plan`)."""
    out: dict[tuple[int, int], list[Chunk]] = {}
    for mi, (mp, batches) in enumerate(plan.plans):
        r = mp.fsdp_rank
        for bi, b in enumerate(batches):
            device = local(plan.params[b.param_indices[0]][0]).device
            modes = {param_groups[plan.params[i][1]]["adjust_lr"] for i in b.param_indices}
            scales = row_scales(b, r, modes, device)
            chunks = []
            for positions in PATHS[b.path].chunks(b, r):
                if b.path == "local":
                    first, count = b.unit_blocks(r)
                    units = [(j, first, count) for j in positions] if count else []
                else:
                    units = b.units_on(r)
                split = None
                if b.split_sizes and units:
                    heights = [b.block_heights[i] for _, f, c in units for i in range(f, f + c)]
                    split = split_groups(heights, device)
                slots = PATHS[b.path].slot_of(b, r, positions)
                index = torch.tensor(slots, dtype=torch.long, device=device)
                chunks.append(Chunk(positions, units, split, scales, slots, index))
            out[(mi, bi)] = chunks
    return out


def row_scales(b, r: int, modes, device) -> dict[str, torch.Tensor]:
    """Blocks of unequal heights: per `adjust_lr` mode, the lr factor of each of FSDP rank
    `r`'s rows of dim 0 (`adjusted_lr(1, mode, height, cols)`: the adjustment is linear in
    lr), shaped to broadcast over a shard; {} for blocks of equal heights."""
    if not b.split_sizes:
        return {}
    heights = [h for h in b.block_heights for _ in range(h)]
    if b.shard_tensor_dim == 0 and b.fsdp_size > 1:
        start = sum(b.shard_sizes[:r])
        heights = heights[start : start + b.shard_sizes[r]]
    shape = (len(heights),) + (1,) * (len(b.global_shape) - 1)
    return {
        mode: torch.tensor(
            [adjusted_lr(1.0, mode, h, b.block_cols) for h in heights], device=device
        ).view(shape)
        for mode in modes
    }
