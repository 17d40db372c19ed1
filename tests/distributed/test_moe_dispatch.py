"""Expert-parallel token dispatch on a 2-rank world: one host read per MoE layer forward (the
split sizes of both all-to-alls), none in the backward, ops that do not grow with the number
of experts, and outputs and gradients equal to a single-process layer on the global batch,
with every expert kernel and with an EP rank that receives no rows."""

import torch
import torch.distributed as dist

from models.glm.infra.expert_parallel import install_expert_parallel
from models.glm.model.moe import MoE
from recipes.bench.probe import all_on_device
from tests.harness import run_world
from tests.models import tiny_glm

N = 32  # tokens per rank


def _layers(num_experts: int, skew: bool, kernel: str):
    """(the single-process layer, this rank's EP layer holding its E/ep experts)."""
    rank, ep = dist.get_rank(), dist.get_world_size()
    config = tiny_glm(n_routed_experts=num_experts, num_experts_per_tok=2)
    torch.manual_seed(0)
    ref = MoE(config)
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.2)
    if skew:  # every token picks experts of EP rank 0: rank 1 receives no rows
        ref.gate.e_score_correction_bias[: num_experts // ep] += 10.0
    moe = MoE(config)
    moe.load_state_dict(ref.state_dict())
    rows = {n: p.shape[0] // ep for n, p in moe.experts.named_parameters()}
    for name, n in rows.items():
        local = getattr(ref.experts, name).detach()[rank * n : (rank + 1) * n].clone()
        setattr(moe.experts, name, torch.nn.Parameter(local))
    install_expert_parallel(moe.experts, dist.group.WORLD)
    moe.experts.kernel = kernel
    ref.experts.kernel = kernel
    return ref, moe, rows


def _case(num_experts: int, skew: bool, kernel: str) -> dict:
    rank = dist.get_rank()
    ref, moe, rows = _layers(num_experts, skew, kernel)
    gen = torch.Generator().manual_seed(1)
    x_all = torch.randn(2 * N, 32, generator=gen)
    g_all = torch.randn(2 * N, 32, generator=gen)
    mine = slice(rank * N, (rank + 1) * N)
    x_ref = x_all.clone().requires_grad_()
    ref(x_ref).backward(g_all)
    x = x_all[mine].clone().requires_grad_()
    with all_on_device() as forward:
        y = moe(x)
    with all_on_device() as backward:
        y.backward(g_all[mine])
    with torch.no_grad():
        y_ref = ref(x_all)[mine]
    errors = {"y": (y.detach() - y_ref).abs().max() / y_ref.abs().max()}
    errors["x"] = (x.grad - x_ref.grad[mine]).abs().max() / x_ref.grad.abs().max()
    for name, n in rows.items():
        want = getattr(ref.experts, name).grad
        got = getattr(moe.experts, name).grad
        errors[name] = (got - want[rank * n : (rank + 1) * n]).abs().max() / want.abs().max()
    return dict(
        forward_reads=dict(forward.syncs_by_kind()),
        backward_reads=dict(backward.syncs_by_kind()),
        forward_collectives=dict(forward.collectives),
        backward_collectives=dict(backward.collectives),
        ops=forward.n_ops + backward.n_ops,
        received=int(moe.experts.gate_up_proj.grad.abs().sum() > 0),
        errors={k: float(v) for k, v in errors.items()},
    )


def _world(cases):
    return [_case(*case) for case in cases]


CASES = [
    (8, False, "auto"),
    (32, False, "auto"),
    (8, True, "auto"),  # EP rank 1 receives nothing
    (8, False, "padded_bmm"),
    (8, False, "loop"),
]


def test_ep_dispatch_reads_the_host_once_per_layer_and_matches_one_process():
    per_rank = run_world(_world, 2, CASES, timeout_s=240)
    extra_reads = {"auto": {}, "padded_bmm": {"int": 1}, "loop": {"tolist": 1}}
    for i, (E, skew, kernel) in enumerate(CASES):
        for rank, res in enumerate(r[i] for r in per_rank):
            label = (E, skew, kernel, rank)
            want = {"tolist": 1}
            for kind, n in extra_reads[kernel].items():
                want[kind] = want.get(kind, 0) + n
            assert res["forward_reads"] == want, label
            assert res["backward_reads"] == {}, label
            # counts, rows there, rows back; the backward exchanges the rows both ways again
            assert res["forward_collectives"] == {"c10d::alltoall_base_": 3}, label
            assert res["backward_collectives"] == {"c10d::alltoall_base_": 2}, label
            # float32, the same rows per expert in the same order: the sums differ at most in
            # how the matmul kernels block them, a few ulps (2^-24) per sum of <= 2 N K = 128
            # terms, <= 128 * 2^-24 ~ 8e-6 of the largest value.
            assert all(e <= 1e-5 for e in res["errors"].values()), (label, res["errors"])
            if skew:
                assert res["received"] == (rank == 0), label
    ops = {case: [r[i]["ops"] for r in per_rank] for i, case in enumerate(CASES)}
    assert ops[(8, False, "auto")] == ops[(32, False, "auto")]  # per rank, 4 or 16 experts
