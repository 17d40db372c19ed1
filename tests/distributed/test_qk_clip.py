"""QK-clip on FSDP2-sharded attention (W = 3: shards cut heads) equals the single-process clip."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from models.glm.parallelize import build_meshes, parallelize
from tests.harness import run_world
from tests.unit.test_qk_clip import _model

B = 2  # sequences per rank


def _full(model) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in model.named_parameters()
    }


def _clip_world():
    rank, W = dist.get_rank(), dist.get_world_size()
    ref = _model()
    model = copy.deepcopy(ref)
    parallelize(model, build_meshes(W, 1, "cpu"))
    ids = torch.randint(0, 64, (W * B, 11), generator=torch.Generator().manual_seed(3))
    mine = ids[rank * B : (rank + 1) * B]
    opts = []
    for m, batch in ((ref, ids), (model, mine)):
        m.record_max_logits(True)
        m.loss(batch[:, :-1], batch[:, 1:]).backward()
        for name, p in m.named_parameters():
            if name.endswith("k_proj.bias"):
                # softmax ignores a key bias (it adds q.b to every logit of a query): its
                # gradient is rounding noise, which AdamW would blow up to +-lr either way
                p.grad = None
        opts.append(torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False))
        opts[-1].step()  # QK-clip runs after the update, whatever the optimizer
    ref_logits, logits = ref.take_max_logits(), model.take_max_logits()
    stepped = _full(model)
    tau = 0.6 * float(ref_logits.max())
    clipped = (ref.qk_clip_(ref_logits, tau), model.qk_clip_(logits, tau))
    after, ref_after = _full(model), _full(ref)
    return dict(
        logit_err=(logits - ref_logits).abs().max().item(),
        clipped=clipped,
        # the attention's weights (AdamW turns the rounding noise of near-zero router
        # gradients into larger, layout-dependent differences elsewhere)
        param_err={
            n: (after[n] - ref_after[n]).abs().max().item() for n in after if ".self_attn." in n
        },
        changed=sorted(n for n in after if not torch.equal(after[n], stepped[n])),
        rows=model.attentions()[0].q_proj.weight.to_local().shape[0],
    )


@pytest.mark.slow
def test_sharded_clip_equals_single_process():
    results = run_world(_clip_world, 3)
    res = results[0]
    assert [r["rows"] for r in results] == [11, 11, 10]  # 8-row heads cut by the shards
    # the max logits: the same float32 products of ranks' own sequences, a MAX is exact
    assert res["logit_err"] <= 1e-5 and res["clipped"][0] == res["clipped"][1] >= 1
    # float32: gradients summed over ranks in another order (a few ulps), AdamW elementwise
    assert max(res["param_err"].values()) <= 1e-5, res["param_err"]
    prefix = "model.layers.0.self_attn."
    assert {prefix + f"{p}_proj.{w}" for p in "qk" for w in ("weight", "bias")} <= set(
        res["changed"]
    )
    assert all(".self_attn.q_proj." in n or ".self_attn.k_proj." in n for n in res["changed"])
    assert all(r["changed"] == res["changed"] for r in results)
