"""Held-out evaluation: the mean next-token loss of a fixed set of validation samples.

Every evaluation of a run reads the same samples: rank r's batch b is samples
`(b * world_size + r) * batch_size ...` of the validation stream (seeded by `train.seed`), so
for a given world size and batch size the set never changes, including across a resume, and
the curves of runs with the same seed are measured on the same text. Each rank evaluates its
share; the summed token losses and token counts are all-reduced, so the result is the mean
over all `eval.batches * world_size * data.batch_size` sequences. Under context parallelism
(`recipes.context.DataShare`) r and world_size are the data-parallel group's index and count:
the cp ranks of a group evaluate their tokens of the same sequences.

Evaluation leaves training alone: no gradients, no random numbers drawn, and the routers'
expert-load counts (which the router-bias update consumes) are restored afterwards.
"""

import logging
import math

import torch
import torch.distributed as dist

from models.glm.model.loss_head import IGNORE_INDEX
from recipes.context import DataShare
from recipes.data import TokenStream, packing_kwargs

log = logging.getLogger("recipes")


class Evaluator:
    """`val/loss` (nats per token) and, when the bytes per token are known, `val/bpb`."""

    def __init__(
        self,
        stream: TokenStream,
        batches: int,
        batch_size: int,
        bytes_per_token: float | None,
        share: DataShare | None = None,
    ) -> None:
        self.stream, self.batches, self.batch_size = stream, batches, batch_size
        self.bytes_per_token = bytes_per_token
        self.share = share
        self._warned = False

    def repeated(self, world_size: int) -> str | None:
        """Why some validation sequences count more than once (the set asks for more than the
        split holds: it wraps around), or None."""
        wanted = self.batches * world_size * self.batch_size
        held = self.stream.n_chunks
        if wanted <= held:
            return None
        return (
            f"held-out evaluation reads eval.batches={self.batches} x {world_size} ranks x "
            f"data.batch_size={self.batch_size} = {wanted} sequences of "
            f"{self.stream.seq_len} tokens, but the validation split holds {held}: "
            f"{wanted - held} of them repeat ones already read, which val/loss then counts "
            "more than once; lower "
            "eval.batches or hold out more text (data.val_fraction)"
        )

    def samples(self, rank: int, world_size: int) -> list[tuple[torch.Tensor, ...]]:
        """This rank's validation batches, (input_ids, labels) each (packed: and position_ids,
        doc_ids); rank 0 warns once when the set wraps around the split (`repeated`)."""
        if rank == 0 and not self._warned:
            self._warned = True
            if (why := self.repeated(world_size)) is not None:
                log.warning(why)
        return [
            self.stream.micro_batch(0, b, rank, world_size, self.batch_size)
            for b in range(self.batches)
        ]

    @torch.no_grad()
    def run(self, model: torch.nn.Module, device: torch.device) -> dict[str, float]:
        """Collective: evaluate every rank's share and reduce."""
        routers = model.routers() if hasattr(model, "routers") else []
        loads = [r.expert_load.clone() for r in routers]
        was_training = model.training
        model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, tokens
        share = self.share or DataShare.of(dist.get_rank(), dist.get_world_size(), 1, 1)
        try:
            for x, y, *packed in self.samples(share.dp_rank, share.dp_size):
                packing = packing_kwargs([v.to(device) for v in packed])
                kw = share.model_kwargs()
                loss = model.loss(x.to(device), y.to(device), **packing, **kw)
                tokens = int((y != IGNORE_INDEX).sum())  # packed: the documents' last have none
                # under cp the loss is this rank's share of the sequences' mean: its token sum
                # over their count, which one rank of the group adds
                total[0] += loss.double() * tokens
                total[1] += tokens if share.counts_tokens else 0
        finally:
            model.train(was_training)
            for r, saved in zip(routers, loads, strict=True):
                r.expert_load.copy_(saved)
        dist.all_reduce(total)
        out = {"val/loss": (total[0] / total[1]).item()}
        if self.bytes_per_token:
            out["val/bpb"] = out["val/loss"] / math.log(2) / self.bytes_per_token
        return out
