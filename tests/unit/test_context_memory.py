"""recipes.context_memory: a context-parallel rank's layer bytes are what autograd saves, its
collectives and the indexer's per-rank work follow the layouts, and a bad cp is refused."""

from fractions import Fraction

import pytest
import torch

from models.glm import get_preset
from models.glm.infra.context_parallel import local_tokens
from models.glm.model.layers import rope_cos_sin
from recipes.context_memory import (
    LayerRun,
    cp_choices,
    cp_error,
    indexer_balance,
    indexer_flops,
    layer_share,
)
from recipes.step_memory import layer_runs
from tests.models import mixed_precision_model
from tests.unit.test_step_memory import CONFIGS, MLA_CONFIGS, saved_bytes

CP_CONFIGS = {
    **{k: MLA_CONFIGS[k] for k in ("mla-latent-kl", "mla-per_head-frozen", "mla-masked-kl")},
    "mla-dense": get_preset(  # no DSA: causal SDPA, masked by global position under cp
        "mla_tiny",
        v_head_dim=24,
        index_topk=None,
        indexer_types=None,
        index_n_heads=None,
        index_head_dim=None,
    ),
    # every causal key kept (S <= index_topk): the masked reference reads the causal mask only
    "mla-masked-all-kept": get_preset("mla_tiny", v_head_dim=24, index_topk=64, dsa_impl="masked"),
    **CONFIGS,
}


def _repeat_gather(x_BTF: torch.Tensor, seq_len: int) -> torch.Tensor:
    """A stand-in for the cp all-gather: rows of the whole sequence's shape (what autograd
    saves depends on the shapes, not on which rows arrive)."""
    return x_BTF.repeat(1, seq_len // x_BTF.shape[1], 1)


@pytest.mark.parametrize("name", sorted(CP_CONFIGS))
@pytest.mark.parametrize("dtype,cp", [(torch.float32, 2), (torch.bfloat16, 2), (torch.bfloat16, 4)])
def test_layer_share_matches_autograd_under_cp(name, dtype, cp):
    """Each layer of a cp rank (head-tail, rank 1) saves its local share plus the whole
    sequence's key side, as `layer_share` counts them."""
    config = CP_CONFIGS[name]
    model = mixed_precision_model(config, dtype)
    for module in model.modules():
        if hasattr(module, "record_max_logits") or type(module).__name__ == "Indexer":
            module.gather_keys = _repeat_gather
    B, S = 2, 48
    tokens = local_tokens("head_tail", cp, 1, S).on(torch.device("cpu"))
    cos, sin = rope_cos_sin(S, config.rotary_dim, config.rope_theta, "cpu")
    cos, sin = cos[tokens.positions_T], sin[tokens.positions_T]
    a = torch.finfo(dtype).bits // 8
    # shared by every layer of a forward: the rope tables and the local positions
    params = [*model.parameters(), cos, sin, tokens.positions_T]
    kl, topk = config.indexer_training == "kl", None
    for run, layer in zip(layer_runs(model, mtp=False), model.model.layers, strict=True):
        h = torch.randn(B, S // cp, config.hidden_size, dtype=dtype, requires_grad=True)
        out = []

        def step(layer=layer, h=h, topk=topk if layer.reads_topk else None, out=out):
            out.append(layer(h, cos, sin, topk, kl, None, tokens))

        got = saved_bytes(step, params)
        topk = out[0][1]
        share = layer_share(config, run, a, 1, B, S, cp)
        assert got == share.local + share.keys, (name, dtype, run.layer, got - share.local)
        assert share.keys > 0 and share.key_grads > share.keys


def test_cp_one_counts_everything_locally():
    config = get_preset("mla_tiny")
    share = layer_share(config, LayerRun(0, False, True), 2, 1, 2, 64, 1)
    assert share.keys == share.key_grads == 0 and not share.gathers


def test_gathered_widths_per_layer():
    """MLA gathers L + R values a token for the attention and C for a layer's own indexer;
    GQA gathers K and V; a "shared" DSA layer gathers no indexer keys."""
    mla = get_preset("glm52")
    full = layer_share(mla, LayerRun(0, False, True), 2, 8, 1, 4096, 4)
    shared = layer_share(mla, LayerRun(4, True, False), 2, 8, 1, 4096, 4)
    assert full.gathers == {"attention": 512 + 64, "indexer": 128}
    assert shared.gathers == {"attention": 576}
    air = get_preset("glm45_air")
    gqa = layer_share(air, LayerRun(1, True, False), 2, 8, 1, 4096, 4)
    assert gqa.gathers == {"attention": 2 * 8 * 128}


def _contiguous_ratio(S: int, cp: int, K: int) -> Fraction:
    """busiest / mean indexer work, rank r holding chunk r of cp (c = S / cp positions): the
    last rank scores sum (p + 1) over its c positions = c ((2 cp - 1) c + 1) / 2, the whole
    sequence S (S + 1) / 2 plus the floor's K (K - 1) / 2 (queries p < K - 1 score K keys),
    so busiest / mean = S ((2 cp - 1) c + 1) / (S (S + 1) + K (K - 1)) -> (2 cp - 1) / cp."""
    c = S // cp
    return Fraction(S * ((2 * cp - 1) * c + 1), S * (S + 1) + K * (K - 1))


def _head_tail_ratio(S: int, cp: int, K: int) -> Fraction:
    """Head-tail: every rank's pair of chunks scores S (S + 1) / (2 cp); rank 0 adds the
    floor's K (K - 1) / 2: busiest / mean = (S (S + 1) + cp K (K - 1)) / (S (S + 1) + K (K - 1))."""
    return Fraction(S * (S + 1) + cp * K * (K - 1), S * (S + 1) + K * (K - 1))


@pytest.mark.parametrize("S,cp", [(131072, 8), (131072, 2), (1 << 20, 64), (1 << 20, 16)])
def test_indexer_balance_of_the_layouts(S, cp):
    config = get_preset("glm52")
    K = config.index_topk
    fig = indexer_balance(config, S, cp, indexers=22)
    for layout, ratio in (("head_tail", _head_tail_ratio), ("contiguous", _contiguous_ratio)):
        flops = indexer_flops(config, S, cp, layout, indexers=22)
        got = Fraction(max(flops) * cp, sum(flops))
        assert got == ratio(S, cp, K), layout
        assert fig[layout]["busiest_over_mean"] == pytest.approx(float(got), rel=1e-12)
    assert fig["head_tail"]["busiest_over_mean"] <= 1.02
    assert fig["contiguous"]["busiest_over_mean"] == pytest.approx((2 * cp - 1) / cp, rel=2e-3)


def test_indexer_flops_count_every_causal_pair():
    """One rank: sum over positions p of max(p + 1, K) pairs, 2 M (C + 1) FLOPs each."""
    config = get_preset("mla_tiny")  # M 4, C 16, K 16
    S, K = 40, config.index_topk
    pairs = sum(max(p + 1, K) for p in range(S))
    assert indexer_flops(config, S, 1) == [pairs * 2 * 4 * 17]
    assert sum(indexer_flops(config, S, 4)) == pairs * 2 * 4 * 17


def test_cp_choices_and_errors():
    assert cp_choices(16, 64) == [1, 2, 4, 8, 16]
    assert cp_choices(12, 24) == [1, 2, 3, 4, 6, 12]
    assert cp_choices(12, 8) == [1, 2, 4]
    assert cp_error(512, 131072, 8) is None and cp_error(512, 4097, 1) is None
    assert "divisor of the world of 512" in cp_error(512, 131072, 3)
    assert "2 x cp = 16 must divide the sequence of 4104" in cp_error(512, 4104, 8)
