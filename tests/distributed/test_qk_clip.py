"""QK-clip on FSDP2-sharded attention (W = 3: shards cut heads) equals the single-process clip.

One world runs every case: GQA with q/k biases, GQA with QK-norm (the norm weights take the
clip), MLA with DSA on the low-rank query (q_b_proj), MLA with a full q_proj (dense MLA), and MLA
under expert parallelism (ep = 3 on the same 3 ranks: the attention is not expert-sharded, it
stays on the dense FSDP mesh, and must still be clipped right). Each case records the max logits
in the training forward of each rank's own sequences, takes one SGD step (AdamW would turn the
rounding noise of near-zero gradients into +-lr, and not every parameter could be compared),
clips with a tau that clips some heads but not all, and is compared with the same model run on
the full batch in one process: the max logits, the number of units clipped, every parameter
after the step and after the clip (within float32 bounds, `_compare`), the rows scaled (exactly
those of the layout; every other row and parameter bit-equal to before the clip), and the next
training forward's logits (it gathers the clipped shards).
"""

from __future__ import annotations

import copy
from functools import partial

import torch
import torch.distributed as dist

from models.glm.infra.parallelize import build_meshes, parallelize
from models.glm.infra.qk_clip import clip_factors, qk_clip_
from models.glm.infra.statistics import take_max_logits
from tests.harness import run_world
from tests.unit.test_qk_clip import gqa_model, mla_model

B, T, LR = 2, 10, 0.1  # sequences per rank, tokens per sequence, SGD learning rate
EPS = 2.0**-24  # float32 unit roundoff

#: name: (model factory, ep). MLA: 4 heads; q rows 4 x (16 + 8) = 96 cut at 32 and 64 (inside
#: heads 1 and 2), kv_b_proj rows 4 x (16 + 16) = 128 cut at 43 and 86 (heads 1 and 2).
#: GQA: q_proj 32 rows cut at 11 and 22, k_proj 16 rows at 6 and 12 (8-row heads).
CASES = {
    "gqa": (gqa_model, 1),
    "gqa_qk_norm": (partial(gqa_model, use_qk_norm=True), 1),
    "mla": (partial(mla_model, 2), 1),
    "mla_q_proj": (partial(mla_model, 2, q_lora=False), 1),
    "mla_ep": (partial(mla_model, 2, n_routed_experts=6), 3),
}

#: the max logits of a rank's sequences are the same float32 products as the full batch's, but
#: the kernels sum a dot product (<= 64 terms: hidden size, q/k width) in a batch-size dependent
#: order: <= 64 x 2^-24 ~ 4e-6 of the sum of |terms|, which is of the order of the logit
LOGIT_RTOL = 1e-5
#: gradients: per parameter, the same terms summed in another order (ranks' means averaged by
#: the reduce-scatter); at most W x B x T = 60 token terms, <= 60 x 2^-24 ~ 4e-6 of the largest
GRAD_RTOL = 1e-5


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _params(model) -> dict[str, torch.Tensor]:
    return {n: _full(p) for n, p in model.named_parameters()}


def _record(model, ids) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A training forward + backward recording the max logits: (logits [L, N], full grads)."""
    model.record_max_logits(True)
    model.loss(ids[:, :-1], ids[:, 1:]).backward()
    grads = {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    return take_max_logits(model), grads


def _tau(logits: torch.Tensor) -> float:
    """Halfway between layer 0's head 1 (its rows are cut by the shards: W = 3, see CASES) and
    the next smaller logit: that head and every larger one clip, the smaller ones do not."""
    pivot = logits[0, 1]
    below = logits[torch.isfinite(logits) & (logits < pivot)]
    return float(pivot + below.max()) / 2


def _expected_rows(attn, eta: torch.Tensor) -> dict[str, tuple[torch.Tensor, int]]:
    """Per parameter of one attention: (the rows the clip must scale, rows of one clipped unit),
    written from the layouts of models.glm (not from qk_clip's code)."""
    hit = eta < 1
    if hasattr(attn, "kv_b_proj"):  # MLA, per head: all of its q rows, its k_nope rows
        P, R, V = attn.nope, attn.rope, attn.v_dim
        k_nope = torch.arange(P + V) < P
        q = "q_b_proj" if hasattr(attn, "q_b_proj") else "q_proj"
        return {
            f"{q}.weight": (hit.repeat_interleave(P + R), P + R),
            "kv_b_proj.weight": ((hit[:, None] & k_nope).reshape(-1), P + V),
        }
    K = attn.head_dim
    if attn.q_norm is not None:  # the layer's shared norm weights
        return {f"{n}_norm.weight": (hit.any().expand(K), K) for n in "qk"}
    rep = attn.n_heads // attn.n_kv_heads  # per KV group: its query heads' rows, its key rows
    q, k = hit.repeat_interleave(rep * K), hit.repeat_interleave(K)
    rows = {f"q_proj.{w}": (q, rep * K) for w in ("weight", "bias")}
    return rows | {f"k_proj.{w}": (k, K) for w in ("weight", "bias")}


def _changed_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a != b).reshape(a.shape[0], -1).any(dim=1)


def _rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((a - ref).abs() / ref.abs()).max())


def _expected(model, logits: torch.Tensor, tau: float) -> dict[str, tuple[torch.Tensor, int]]:
    """`_expected_rows` of every attention, by parameter name (biases only where configured)."""
    names = dict(model.named_parameters())
    out = {}
    for i, attn in enumerate(model.attentions()):
        eta = clip_factors(logits[i], _units(attn), tau)
        for suffix, rows in _expected_rows(attn, eta).items():
            if f"model.layers.{i}.self_attn.{suffix}" in names:
                out[f"model.layers.{i}.self_attn.{suffix}"] = rows
    return out


def _units(attn) -> int:
    """What the clip counts: MLA heads, GQA KV groups."""
    return attn.n_heads if hasattr(attn, "kv_b_proj") else attn.n_kv_heads


def _compare(pre, post, ref_pre, ref_post, grads, ref_grads, expected, r) -> dict:
    """Every parameter against the single process, after the step and after the clip."""
    wrong_rows, step_excess, clip_excess = [], {}, {}
    for n in post:
        want = expected.get(n, (torch.zeros(post[n].shape[0], dtype=torch.bool), 0))[0]
        if not (
            torch.equal(_changed_rows(post[n], pre[n]), want)
            and torch.equal(_changed_rows(ref_post[n], ref_pre[n]), want)
        ):
            wrong_rows.append(n)  # the rows not to scale must be bit-equal, the others scaled
        # SGD: p - lr g per element, each side rounded twice (lr g, the difference)
        dg = (grads[n] - ref_grads[n]).abs().max() if n in grads else 0.0
        g = ref_grads[n].abs().max() if n in ref_grads else 0.0
        step_bound = LR * dg + 2 * EPS * (LR * g + ref_pre[n].abs().max())
        step_excess[n] = float((pre[n] - ref_pre[n]).abs().max() - step_bound)
        # a clipped element becomes f x, f = eta^a <= 1, eta = tau / S. Each side's f rounds
        # by <= 3 x 2^-24 relative (tau / S once, the power <= 1 ulp = 2 x 2^-24) and carries
        # a <= 1 times S's relative error r: the two f differ by <= f (r + 6 x 2^-24); the
        # products round by 2^-24 each: |dpost| <= f |dpre| + f |x| (r + 8 x 2^-24)
        bound = (pre[n] - ref_pre[n]).abs() + ref_pre[n].abs() * (r + 8 * EPS)
        clip_excess[n] = float(((post[n] - ref_post[n]).abs() - bound).max())
    return dict(
        grad_err={
            n: float((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-30))
            for n, g in ref_grads.items()
        },
        wrong_rows=wrong_rows,
        step_excess=max(step_excess.values()),
        clip_excess=max(clip_excess.items(), key=lambda kv: kv[1]),
    )


def _cuts(model, expected) -> list[tuple[str, int]]:
    """(projection, row) where a shard boundary falls inside the rows of a clipped unit."""
    rows = {n: p.to_local().shape[0] for n, p in model.named_parameters() if n in expected}
    sizes = [None] * dist.get_world_size()
    dist.all_gather_object(sizes, rows)
    cuts = []
    for n, (want, unit) in expected.items():
        b = 0
        for per_rank in sizes[:-1]:
            b += per_rank[n]
            if 0 < b < len(want) and b % unit and want[b - 1] and want[b]:
                cuts.append((n.rsplit(".", 2)[-2], b))
    return cuts


def _case(make, ep: int, ids: torch.Tensor) -> dict:
    rank, W = dist.get_rank(), dist.get_world_size()
    mine = ids[rank * B : (rank + 1) * B]
    ref = make()
    model = copy.deepcopy(ref)
    parallelize(model, build_meshes(W, ep, "cpu"))
    (ref_logits, ref_grads), (logits, grads) = _record(ref, ids), _record(model, mine)
    for m in (ref, model):
        torch.optim.SGD(m.parameters(), lr=LR).step()  # QK-clip runs after the update
    ref_pre, pre = _params(ref), _params(model)
    tau = _tau(ref_logits)
    clipped = (int(qk_clip_(ref, ref_logits, tau)), int(qk_clip_(model, logits, tau)))
    ref_post, post = _params(ref), _params(model)
    expected = _expected(ref, ref_logits, tau)
    finite = torch.isfinite(ref_logits)
    r = _rel_err(logits[finite], ref_logits[finite])
    # the next training forward gathers the clipped shards: its logits equal those of one
    # process holding the sharded model's clipped weights, on the full batch
    twin = copy.deepcopy(ref)
    with torch.no_grad():
        for n, p in twin.named_parameters():
            p.copy_(post[n])
    after, twin_after = _record(model, mine)[0], _record(twin, ids)[0]
    return dict(
        _compare(pre, post, ref_pre, ref_post, grads, ref_grads, expected, r),
        logit_err=r,
        margin=float((ref_logits[finite] - tau).abs().min()) / tau,
        clipped=clipped,
        units=sum(_units(a) for a in ref.attentions()),
        scaled=sorted(expected),
        after_err=_rel_err(after[finite], twin_after[finite]),
        cuts=_cuts(model, expected),
    )


def _clip_world() -> dict[str, dict]:
    W = dist.get_world_size()
    ids = torch.randint(0, 64, (W * B, T + 1), generator=torch.Generator().manual_seed(3))
    return {name: _case(make, ep, ids) for name, (make, ep) in CASES.items()}


def test_sharded_clip_equals_single_process():
    results = run_world(_clip_world, 3)
    for name, res in results[0].items():
        assert all(r[name]["clipped"] == res["clipped"] for r in results), name
        # some units (KV groups, MLA heads) clipped, not all, the same on both sides
        assert 0 < res["clipped"][0] == res["clipped"][1] < res["units"], (name, res["clipped"])
        assert res["logit_err"] <= LOGIT_RTOL and res["margin"] > 100 * LOGIT_RTOL, (name, res)
        assert max(res["grad_err"].values()) <= GRAD_RTOL, (name, res["grad_err"])
        assert res["step_excess"] <= 0, (name, res["step_excess"])
        assert res["clip_excess"][1] <= 0, (name, res["clip_excess"])
        assert not res["wrong_rows"], (name, res["wrong_rows"])
        assert res["after_err"] <= LOGIT_RTOL, (name, res["after_err"])
        # shard boundaries inside a clipped unit's rows, on the query side and on the key side
        # (QK-norm: inside the 8 scaled norm weights)
        assert len({p for p, _ in res["cuts"]}) == 2, (name, res["cuts"], res["scaled"])
