"""Five Muon steps under context parallelism equal the same steps of the model on one device.

Each case's model is parallelized as training does it (FSDP2 over every rank, experts over `ep`,
the key-side gather over the cp group: `parallelize`, then `apply_context_parallel`) and trained
for 5 steps with Muon (float32 Newton-Schulz; Muon Split in one case) on one sequence per step,
shared by the cp ranks (cp = the world size: one data-parallel group). Beside it every rank
holds the single-device model (no FSDP, no gather) with its own single-process Muon, and each
step both compute the same sequence from the same parameters: compared are the loss terms
(summed over the cp ranks: each rank's share of the sequence's means), every gradient, every
DSA indexer's kept keys at the rank's positions (exactly), and every parameter after the
optimizer step; then the reference takes the parallel model's parameters, so no step inherits
the previous one's rounding (a top-k decided on parameters that drifted by rounding could
legitimately pick another key at a near tie and make the comparison chaotic).

Tolerances (float32; the two compute the same sums in another order: the gathered keys, the
reduce-scatters, the expert dispatch): a gradient entry sums at most S x (layers + depths) =
48 x 5 token terms, so <= 240 x 2^-24 ~ 1.4e-5 of its largest term: `GRAD_RTOL` 1e-4 of the
parameter's largest gradient (the KL-trained indexer's, softmax(scores) minus the attention's
probabilities, two distributions agreeing to ~1e-2 on entries ~0.1, loses another 10x:
`INDEXER_GRAD_RTOL`). A Muon step moves a parameter by lr x an orthogonalized update of entries
<= 1 computed from those gradients: `MUON_ATOL` = lr x 1e-3 (the gradient bound through
Newton-Schulz, with a 10x margin for its float32 iterations). AdamW divides each entry by its
own gradient scale, so a small entry's relative error reaches its update: `ADAM_ATOL` 1% of
the at most lr it moves an entry. The indexer KL (~4e-5) sums near-cancelling p log p - p log q
terms (each <= 1/e) over 16 kept keys: <= 16 x 0.37 x 2^-24 ~ 3.5e-7 absolute (`KL_ATOL`).
A wrong position, mask, loss share or reduction moves a gradient by O(1) of its scale.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from models.glm import GLMForCausalLM, get_preset
from models.glm.infra.context_parallel import apply_context_parallel, local_tokens
from models.glm.infra.init import init_weights
from models.glm.infra.parallelize import build_meshes, parallelize
from muon import Muon
from muon.groups import param_groups
from tests.harness import run_world

S, STEPS, LR, ADAM_LR = 48, 5, 0.02, 3e-3
GRAD_RTOL, INDEXER_GRAD_RTOL, KL_ATOL = 1e-4, 1e-3, 4e-7
MUON_ATOL, ADAM_ATOL = LR * 1e-3, 0.01 * ADAM_LR

CASES = {
    "mla_kl_split_ep2": dict(preset="mla_tiny", model={}, ep=2, split=True),
    "mla_frozen_ep1": dict(preset="mla_tiny", model={"indexer_training": "frozen"}, ep=1),
    "gqa_ep2": dict(preset="small", model={"num_hidden_layers": 2}, ep=2),
}


def _objective(terms: dict) -> torch.Tensor:
    total = terms["loss"] + 0.3 * terms.get("mtp_loss", 0.0)
    return total + terms.get("indexer_kl", 0.0)


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def _optimizer(model, split: bool) -> tuple[Muon, set[str]]:
    groups = param_groups(model, lr=LR, muon_split=split, adamw_lr=ADAM_LR)
    adamw = {n for g in groups if g.get("algorithm") == "adamw" for n in g["param_names"]}
    return Muon(groups, lr=LR, ns_dtype=torch.float32), adamw


def _kept_keys(model) -> list:
    kept: list = []
    for m in model.modules():
        if type(m).__name__ == "Indexer":
            m.register_forward_hook(lambda mod, a, out: kept.append(out[0]))
    return kept


def _compare_step(name, step, terms, ref_terms, model, ref, kept, ref_kept, pos) -> list[str]:
    problems = []
    for key, want in ref_terms.items():
        got = terms[key].detach().clone()
        dist.all_reduce(got)
        atol = KL_ATOL if key == "indexer_kl" else 0.0
        if not torch.allclose(got, want.detach(), rtol=GRAD_RTOL, atol=atol):
            problems.append(f"{name} step {step}: {key} {got.item()} vs {want.item()}")
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        if q.grad is None:
            continue
        scale = q.grad.abs().max().item()
        rtol = INDEXER_GRAD_RTOL if ".indexer." in n else GRAD_RTOL
        err = (_full(p.grad) - q.grad).abs().max().item()
        if err > rtol * max(scale, 1e-30):
            problems.append(f"{name} step {step}: grad {n} off by {err:.2e} of {scale:.2e}")
    for i, (a, b) in enumerate(zip(kept, ref_kept, strict=True)):
        if not torch.equal(a, b.index_select(1, pos)):
            problems.append(f"{name} step {step}: indexer call {i} kept other keys")
    return problems


def _train(name: str) -> list[str]:
    case = CASES[name]
    world, rank = dist.get_world_size(), dist.get_rank()
    config = get_preset(case["preset"], **case["model"])
    ref = GLMForCausalLM(config)
    init_weights(ref, seed=5)
    with torch.device("meta"):
        model = GLMForCausalLM(config)
    parallelize(model, build_meshes(world, case["ep"], "cpu"))
    apply_context_parallel(model, dist.group.WORLD, "head_tail")
    model.to_empty(device="cpu")
    init_weights(model, seed=5)
    tokens = local_tokens("head_tail", world, rank, S)
    pos = tokens.on(torch.device("cpu")).positions_T
    opt, adamw = _optimizer(model, case.get("split", False))
    ref_opt, _ = _optimizer(ref, case.get("split", False))
    kept, ref_kept = _kept_keys(model), _kept_keys(ref)
    problems = []
    gen = torch.Generator().manual_seed(11)
    for step in range(STEPS):
        ids = torch.randint(2, config.vocab_size, (1, S + 1), generator=gen)
        kept.clear(), ref_kept.clear()
        terms = model(ids[:, :-1], ids[:, 1:], tokens=tokens)
        # FSDP averages gradients over the world (the cp ranks): each share counts world times
        (_objective(terms) * world).backward()
        ref_terms = ref(ids[:, :-1], ids[:, 1:])
        _objective(ref_terms).backward()
        problems += _compare_step(name, step, terms, ref_terms, model, ref, kept, ref_kept, pos)
        opt.step(), ref_opt.step()
        opt.zero_grad(set_to_none=True), ref_opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
                full = _full(p)
                atol = ADAM_ATOL if n in adamw else MUON_ATOL
                if (full - q).abs().max().item() > atol:
                    problems.append(f"{name} step {step}: parameter {n} after the update")
                q.copy_(full)  # the next step starts both from the same parameters
    return problems


def _world(names: list[str]) -> list[str]:
    torch.set_num_threads(1)
    return [p for name in names for p in _train(name)]


@pytest.mark.parametrize("cp", [2, 4])
def test_muon_steps_under_cp_equal_one_device(cp):
    results = run_world(_world, cp, list(CASES), timeout_s=600)
    problems = sorted({p for r in results for p in r})
    assert not problems, "\n".join(problems[:60])
