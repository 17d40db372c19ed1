"""This rank's share of the training data under data and context parallelism.

The world's ranks form `dp_size = world_size // cp` data-parallel groups of `cp` consecutive
ranks. The ranks of one group read the same sequences (the data stream is cut by `dp_rank`
of `dp_size`, as a world of `dp_size` ranks without context parallelism cuts it) and each
computes its own tokens of them (`tokens`, the head-tail layout of
`models.glm.infra.context_parallel`), passing the full sequence's ids and labels to the
model. The model's loss terms are then each rank's share of its sequences' means; FSDP averages
gradients over all world_size ranks, so each term is scaled by cp (`scaled`): the mean over the
world is then the mean over the dp groups of their sequences' token means, as in a world of
dp_size ranks, and the logged figures read the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.glm.infra.context_parallel import TRAIN_LAYOUT, local_tokens
from models.glm.model.sequence import LocalTokens


@dataclass(frozen=True)
class DataShare:
    """Which sequences this rank reads (`dp_rank` of `dp_size`) and which of their tokens it
    computes (`tokens`; None: all of them, cp = 1)."""

    dp_rank: int
    dp_size: int
    cp: int
    tokens: LocalTokens | None

    @classmethod
    def of(cls, rank: int, world_size: int, cp: int, seq_len: int) -> DataShare:
        """Rank `rank`'s share in a world of `world_size` with context-parallel degree `cp`."""
        if cp < 1 or world_size % cp:
            raise ValueError(f"mesh.cp={cp} must divide the world of {world_size} ranks")
        tokens = local_tokens(TRAIN_LAYOUT, cp, rank % cp, seq_len) if cp > 1 else None
        return cls(rank // cp, world_size // cp, cp, tokens)

    @property
    def counts_tokens(self) -> bool:
        """Whether this rank counts its sequences' tokens (one rank of each cp group)."""
        return self.tokens is None or self.tokens.runs[0][0] == 0

    def model_kwargs(self) -> dict:
        """The model's keyword arguments for this share (`tokens` under context parallelism)."""
        return {} if self.tokens is None else {"tokens": self.tokens}

    def scaled(self, terms: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The loss terms as the world averages them (see the module docstring)."""
        return terms if self.cp == 1 else {k: v * self.cp for k, v in terms.items()}
