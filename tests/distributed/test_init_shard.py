"""Per-shard init: every mesh gives the values of a single-process init, and each rank draws
random values in proportion to its shard (models/glm/model/init.py, models/glm/infra/init.py)."""

import math

import torch
import torch.distributed as dist

import models.glm.model.init as shard_init
from models.glm import GLMConfig, GLMForCausalLM, get_preset
from models.glm.infra.init import init_weights
from models.glm.infra.parallelize import build_meshes, parallelize
from tests.harness import run_world

# Small chunks (4 rows of 64 values) so chunk edges straddle shard edges: vocab 250 over 4 ranks
# gives shards of 63, 63, 63 and 61 rows.
CHUNK = 256
CFG = GLMConfig(vocab_size=250, hidden_size=64, num_hidden_layers=3, num_mtp_layers=1)
# Two experts over 4 ranks: the router weight [2, 64] leaves two ranks with empty shards.
CFG_TWO_EXPERTS = GLMConfig(
    vocab_size=250, hidden_size=64, n_routed_experts=2, num_experts_per_tok=1
)
# MLA + DSA (indexers with LayerNorm weight and bias) and an MTP layer.
CFG_MLA = get_preset("mla_tiny", vocab_size=250)
CASES = [(CFG, 1), (CFG, 2), (CFG, 4), (CFG_TWO_EXPERTS, 2), (CFG_MLA, 2)]


def _init_world(cases, seed):
    shard_init.CHUNK_ELEMENTS = CHUNK
    out = []
    for config, ep in cases:
        with torch.device("meta"):
            model = GLMForCausalLM(config)
        parallelize(model, build_meshes(dist.get_world_size(), ep, "cpu"))
        model.to_empty(device="cpu")
        drawn = init_weights(model, seed)
        # The bound a rank may draw: its own values plus at most two partly used chunks per
        # random matrix (one at each shard edge).
        bound = 0
        for name, p in model.named_parameters():
            local = p.to_local()
            if p.ndim == 2 and "norm" not in name:
                bound += local.numel() + 2 * shard_init.rows_per_chunk(p.shape) * p.shape[1]
        full = {name: p.full_tensor().detach().numpy() for name, p in model.named_parameters()}
        out.append({"drawn": drawn, "bound": bound, "full": full if dist.get_rank() == 0 else {}})
    return out


def test_per_shard_init_matches_single_process_on_every_mesh(monkeypatch):
    monkeypatch.setattr(shard_init, "CHUNK_ELEMENTS", CHUNK)
    results = run_world(_init_world, 4, CASES, 3, timeout_s=240)
    for i, (config, ep) in enumerate(CASES):
        ref = GLMForCausalLM(config)
        total = ref.init_weights(3)
        got = results[0][i]["full"]
        for name, p in ref.named_parameters():
            assert torch.equal(torch.from_numpy(got[name]), p), (ep, name)
        for rank_result in results:
            drawn, bound = rank_result[i]["drawn"], rank_result[i]["bound"]
            assert drawn <= bound, (ep, drawn, bound)
            assert drawn < 0.5 * total, (ep, drawn, total)  # a quarter of the model, plus edges
    # The values are N(0, std) and the chunks independent: a sanity check of the statistics
    # (std of 16000 values: relative standard error ~1/sqrt(2n) = 0.6%, 5% is > 8 sigma).
    w = torch.from_numpy(results[0][0]["full"]["model.embed_tokens.weight"])
    assert math.isclose(w.std().item(), CFG.initializer_range, rel_tol=0.05)
    rows = shard_init.rows_per_chunk(w.shape)
    assert not torch.equal(w[:rows], w[rows : 2 * rows])
