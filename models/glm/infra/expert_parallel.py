"""Expert parallelism (EP): the routed experts spread over the ranks of an EP group.

`shard_experts` (what `parallelize` calls per MoE layer) keeps each rank's E_l = E / ep whole
experts (Shard(0) of the fused weights over the EP mesh) and swaps the layer's `FusedExperts` for
`ExpertParallelExperts`, whose `dispatch` sends the rows of the single-device routed forward
(`models.glm.model.moe.routed_experts_forward`, which sorts every token-expert assignment by
expert) to their experts. Expert e lives on EP rank e // E_l (contiguous), so the sorted rows are
already grouped by destination rank: one all_to_all_single (uneven splits) sends them, the owner
runs its experts, and a second one brings the outputs back. Both exchanges are differentiable
(`all_to_all`): backward is the same exchange with the splits swapped.

Shape legend: D hidden, A assignments, E experts, P EP ranks, L local experts (E / P), S rows
received by this rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from models.glm.infra.local import local_tensor
from models.glm.model.moe import FusedExperts


class _AllToAll(torch.autograd.Function):
    """all_to_all_single along dim 0 with uneven splits; backward swaps the splits."""

    @staticmethod
    def forward(ctx, x, send_splits: list[int], recv_splits: list[int], group):
        ctx.send_splits, ctx.recv_splits, ctx.group = send_splits, recv_splits, group
        out = x.new_empty((sum(recv_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grad_in = grad_out.new_empty((sum(ctx.send_splits), *grad_out.shape[1:]))
        dist.all_to_all_single(
            grad_in, grad_out.contiguous(), ctx.send_splits, ctx.recv_splits, group=ctx.group
        )
        return grad_in, None, None, None


def all_to_all(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group):
    """Differentiable all_to_all_single of the rows of `x`: send_splits[r] rows go to rank r,
    recv_splits[r] rows arrive from rank r (in rank order)."""
    return _AllToAll.apply(x, send_splits, recv_splits, group)


class ExpertParallelExperts(FusedExperts):
    """`FusedExperts` holding this rank's experts of an EP group (`ep_group`; None: all local):
    the weights are the local experts' rows (an EP-sharded DTensor's local view, or plain
    tensors of those rows), and `dispatch` exchanges the rows with the other EP ranks."""

    ep_group = None

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up_proj, down_proj) of this rank's experts: the local shards."""
        return local_tensor(self.gate_up_proj), local_tensor(self.down_proj)

    def dispatch(self, x_AD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """The experts' outputs for rows sorted by expert (`FusedExperts.dispatch`), the rows of
        each expert run by its EP rank. Host reads: one, the split sizes of both exchanges
        (`.tolist()` of one stacked tensor) that all_to_all_single takes as Python ints."""
        group = self.ep_group
        ep = 1 if group is None else dist.get_world_size(group)
        if ep == 1:
            return self(x_AD, counts_E)
        L = counts_E.numel() // ep
        # recv_counts_PL[p, j]: rows that source rank p sends to my local expert j.
        recv_counts_E = torch.empty_like(counts_E)
        dist.all_to_all_single(recv_counts_E, counts_E, group=group)
        recv_counts_PL = recv_counts_E.view(ep, L)
        splits_2P = torch.stack([counts_E.view(ep, L).sum(1), recv_counts_PL.sum(1)])
        send_splits, recv_splits = splits_2P.tolist()  # the one host read of the layer
        x_SD = all_to_all(x_AD, send_splits, recv_splits, group)
        # Received rows are ordered (source, local expert); regroup them by local expert. Row s
        # lies in run r = #(run ends <= s) of the P*L runs, the run of local expert r % L.
        row_S = torch.arange(sum(recv_splits), device=x_AD.device)
        run_S = torch.searchsorted(torch.cumsum(recv_counts_E, 0), row_S, right=True)
        perm_S = torch.argsort(run_S % L, stable=True)
        y_grouped_SD = self(x_SD.index_select(0, perm_S), recv_counts_PL.sum(0))
        unperm_S = torch.empty_like(perm_S).scatter_(0, perm_S, row_S)  # perm's inverse, no sort
        y_SD = y_grouped_SD.index_select(0, unperm_S)
        return all_to_all(y_SD, recv_splits, send_splits, group)


def install_expert_parallel(experts: FusedExperts, group) -> ExpertParallelExperts:
    """Make `experts`, which holds this rank's experts of the EP `group` already, dispatch over
    that group (in place: the module becomes an `ExpertParallelExperts`; parameters, names and
    kernel unchanged). Before FSDP2: it refuses a module of another class."""
    if type(experts) not in (FusedExperts, ExpertParallelExperts):
        raise TypeError(
            f"expert parallelism installs on a FusedExperts (before FSDP2), not {type(experts)}"
        )
    experts.__class__ = ExpertParallelExperts
    experts.ep_group = group
    return experts


def shard_experts(experts: FusedExperts, ep_mesh: DeviceMesh) -> ExpertParallelExperts:
    """Keep this rank's E / ep whole experts of the full fused weights (Shard(0) over `ep_mesh`;
    every rank holds the same full weights: each takes its shard, no communication) and install
    the EP dispatch over the mesh's group."""
    for name in ("gate_up_proj", "down_proj"):
        full = getattr(experts, name)
        shard = distribute_tensor(full.data, ep_mesh, [Shard(0)], src_data_rank=None)
        experts.register_parameter(name, nn.Parameter(shard))
    return install_expert_parallel(experts, ep_mesh.get_group())
