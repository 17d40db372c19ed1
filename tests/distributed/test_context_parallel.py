"""Context parallelism (`models.glm.infra.context_parallel`) equals one rank running the whole
sequence: one 4-rank gloo world runs every case at cp = 2 (two groups of 2) and cp = 4.

Each rank builds the same float64 model, computes the whole sequence alone (the reference),
then its own tokens under `LocalTokens` with the key side gathered over its cp group; the
ranks' loss terms (each rank's share of the sequence's means) and gradients are summed over the
group and compared with the reference, and every DSA indexer's kept keys must equal the
reference's at the rank's positions; QK-clip's per-head max logits, recorded in the training
forward and maximized over the group, must equal the reference's. Cases: mla_tiny (DSA with
IndexShare and an MTP layer whose depth-2 reuses depth 1's keys) with the indexer frozen and
KL-trained, under both layouts; the same with packed documents (positions restarting per
document, whose boundaries fall inside the ranks' chunks); 3 MTP depths; the masked, per-head
and dense MLA paths; the key side gathered again in backward, and a model whose layers are
activation-checkpointed (their recompute gathers again); a GQA preset with QK-norm, packed too.

Tolerance: float64 throughout (the indexer scores in float32 on every path alike, so its top-k
is compared exactly). A loss or gradient entry is a sum of at most B x S x (layers + depths)
token terms, each a product chain of a few hundred float64 operations, summed in another order
under cp: its error is below 1e4 x 2^-53 ~ 1e-12 of the largest term; `RTOL` = 1e-9 of the
parameter's largest gradient leaves three orders of margin and is far below any real
difference (a wrong mask or position moves a gradient by O(1) of its scale).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from models.glm import GLMForCausalLM, get_preset
from models.glm.infra.context_parallel import apply_context_parallel, local_tokens
from tests.harness import run_world

B, S = 2, 48  # sequences per forward, tokens per sequence (index_topk 16 < S: sparse)
RTOL = 1e-9
#: the router computes its logits in float32 (as the checkpoints do) in every model: its weight's
#: gradient is float32 products of D <= 256 terms per logit, summed over tokens in another order
#: under cp; 2 x 256 x 2^-24 ~ 3e-5 of the largest term, so 1e-4 of the largest gradient
RTOL_ROUTER = 1e-4
_DSA_FIELDS = ("index_topk", "index_n_heads", "index_head_dim", "indexer_types")

CASES = {
    "mla_kl": dict(preset="mla_tiny", model={}, layout="head_tail"),
    "mla_frozen": dict(preset="mla_tiny", model={"indexer_training": "frozen"}, layout="head_tail"),
    "mla_kl_contiguous": dict(preset="mla_tiny", model={}, layout="contiguous"),
    "mla_packed": dict(preset="mla_tiny", model={}, layout="head_tail", packed=True),
    "mla_mtp3": dict(preset="mla_tiny", model={"mtp_depths": 3}, layout="head_tail"),
    "mla_masked": dict(preset="mla_tiny", model={"dsa_impl": "masked"}, layout="head_tail"),
    "mla_per_head": dict(preset="mla_tiny", model={"dsa_impl": "per_head"}, layout="head_tail"),
    "mla_dense": dict(preset="mla_tiny", model=dict.fromkeys(_DSA_FIELDS), layout="head_tail"),
    "mla_regather": dict(preset="mla_tiny", model={}, layout="head_tail", keep=False),
    "mla_checkpointed": dict(
        preset="mla_tiny", model={}, layout="head_tail", keep=False, checkpoint=True
    ),
    "gqa": dict(preset="small", model={"num_hidden_layers": 2}, layout="head_tail"),
    "gqa_regather": dict(
        preset="small", model={"num_hidden_layers": 2}, layout="head_tail", keep=False
    ),
    "gqa_packed": dict(
        preset="small", model={"num_hidden_layers": 2}, layout="head_tail", packed=True
    ),
}


def _batch(vocab: int, packed: bool):
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(2, vocab, (B, S + 1), generator=gen)
    x, y = ids[:, :-1], ids[:, 1:].clone()
    y[0, 5] = -100  # an ignored label: the loss's count is the sequence's, not a rank's
    if not packed:
        return x, y, {}
    # documents of 13, 20, 15 tokens (row 0) and 30, 18 (row 1): boundaries inside chunks
    lengths = [[13, 20, 15], [30, 18]]
    doc = torch.cat(
        [torch.cat([torch.full((n,), i) for i, n in enumerate(r)])[None] for r in lengths]
    )
    pos = torch.cat([torch.cat([torch.arange(n) for n in r])[None] for r in lengths])
    return x, y, {"position_ids": pos, "doc_ids": doc}


def _model(case: dict) -> GLMForCausalLM:
    config = get_preset(case["preset"], **case["model"])
    torch.manual_seed(0)
    model = GLMForCausalLM(config).double()
    model.init_weights(seed=3)
    return model


def _objective(terms: dict) -> torch.Tensor:
    total = terms["loss"] + 0.3 * terms.get("mtp_loss", 0.0)
    return total + terms.get("indexer_kl", 0.0)


def _topk_hooks(model, store: list):
    hooks = []
    for m in model.modules():
        if type(m).__name__ == "Indexer":
            hooks.append(m.register_forward_hook(lambda mod, a, out: store.append(out[0])))
    return hooks


def _causal_keys(topk_BTK: torch.Tensor, pos_T: torch.Tensor) -> torch.Tensor:
    """The kept causal keys of each query, sorted (-1 for the slots a query below index_topk
    fills with later keys, which every consumer masks: which later ones is arbitrary)."""
    causal = (topk_BTK <= pos_T[None, :, None]) & (topk_BTK >= 0)
    return topk_BTK.masked_fill(~causal, -1).sort(-1).values


def _run_case(name: str, cp: int, group, cp_rank: int) -> list[str]:
    case = CASES[name]
    model = _model(case)
    x, y, packing = _batch(model.config.vocab_size, case.get("packed", False))
    ref_topk: list = []
    hooks = _topk_hooks(model, ref_topk)
    model.record_max_logits(True)  # QK-clip's recording, in the training forward
    ref_terms = model(x, y, **packing)
    _objective(ref_terms).backward()
    ref_logits = model.take_local_max_logits()  # this process's: the whole sequence
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    for layer in (*model.model.layers, *model.model.mtp_layers):
        layer.checkpoint_activations = case.get("checkpoint", False)
    keep = case.get("keep", True)
    apply_context_parallel(model, group, case["layout"], keep_gathered=keep)
    gather = model.model.layers[0].self_attn.gather_keys
    tokens = local_tokens(case["layout"], cp, cp_rank, S)
    got_topk: list = []
    for h in hooks:
        h.remove()
    hooks = _topk_hooks(model, got_topk)
    terms = model(x, y, tokens=tokens, **packing)
    logits = model.take_local_max_logits()
    dist.all_reduce(logits, op=dist.ReduceOp.MAX, group=group)  # the trainer's MAX, over cp
    got_topk = list(got_topk)  # the forward's (a checkpointed layer's recompute runs it again)
    _objective(terms).backward()
    problems = []
    if not torch.allclose(logits, ref_logits, rtol=RTOL, atol=0):
        problems.append(f"{name}: QK-clip max logits {logits} vs {ref_logits}")
    # MLA saves views of its gathered latent; GQA expands K/V per query head first (copies)
    mla = case["preset"] == "mla_tiny"
    regathers = 0 if keep or case.get("checkpoint") or not mla else len(model.model.layers)
    if gather.regathered < regathers:
        problems.append(f"{name}: {gather.regathered} key sides gathered again in backward")
    pos = tokens.on(torch.device("cpu")).positions_T
    if len(got_topk) != len(ref_topk):
        problems.append(f"{name}: {len(got_topk)} indexer calls, reference {len(ref_topk)}")
    for i, (got, ref) in enumerate(zip(got_topk, ref_topk, strict=False)):
        if not torch.equal(_causal_keys(got, pos), _causal_keys(ref.index_select(1, pos), pos)):
            problems.append(f"{name}: indexer call {i} kept other keys")
    for key, value in ref_terms.items():
        summed = terms[key].detach().clone()
        dist.all_reduce(summed, group=group)
        if not torch.allclose(summed, value.detach(), rtol=RTOL, atol=0):
            problems.append(f"{name}: {key} {summed.item()!r} vs {value.item()!r}")
    for n, p in model.named_parameters():
        if n not in ref_grads:
            continue
        g = p.grad.clone() if p.grad is not None else torch.zeros_like(ref_grads[n])
        dist.all_reduce(g, group=group)
        scale = ref_grads[n].abs().max().item()
        err = (g - ref_grads[n]).abs().max().item()
        rtol = RTOL_ROUTER if n.endswith("mlp.gate.weight") else RTOL
        if err > rtol * max(scale, 1e-30):
            problems.append(f"{name}: grad {n} off by {err:.3e} (scale {scale:.3e})")
    return problems


def _world(names: list[str]) -> list[str]:
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    problems = []
    for name in names:
        problems += _run_case(name, 2, pairs[rank // 2], rank % 2)
        problems += _run_case(name, world, dist.group.WORLD, rank)
    return problems


def test_context_parallel_equals_one_rank():
    results = run_world(_world, 4, list(CASES), timeout_s=600)
    problems = sorted({p for r in results for p in r})
    assert not problems, "\n".join(problems)
