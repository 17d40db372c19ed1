"""Multi-token prediction and DSA indexer training on one device: the MTP loss trains and its
gradients reach the MTP layers; without it the next-token path is that of a model without MTP
layers; a frozen indexer stays bit-identical and holds no optimizer state; the KL mode lowers
the KL and leaves the main model's gradients as in frozen mode."""

import pytest
import torch
import torch.nn.functional as F

from models.glm import GLMForCausalLM, get_preset
from models.glm.model.layers import RMSNorm, rope_cos_sin
from models.glm.model.model import IGNORE_INDEX, DecoderLayer
from muon import Muon, param_groups

SEQ = 40  # > mla_tiny's index_topk (16): the attention is sparse


def _batch(seed: int = 0, batch: int = 2):
    """A learnable stream: short random motifs repeated, so two tokens ahead is predictable."""
    g = torch.Generator().manual_seed(seed)
    motif = torch.randint(0, 256, (batch, 6), generator=g)
    ids = motif.repeat(1, (SEQ + 1) // 6 + 1)[:, : SEQ + 1]
    return ids[:, :-1], ids[:, 1:]


def _model(preset: str, **overrides) -> GLMForCausalLM:
    model = GLMForCausalLM(get_preset(preset, **overrides))
    model.init_weights(0)
    return model


def _objective(terms: dict, weight: float) -> torch.Tensor:
    total = terms["loss"] + weight * terms.get("mtp_loss", 0.0)
    return total + terms.get("indexer_kl", 0.0)


@pytest.mark.parametrize("preset", ["tiny", "mla_tiny"])
def test_mtp_loss_decreases_and_reaches_mtp_params(preset):
    model = _model(preset, num_mtp_layers=1)
    x, y = _batch()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    mtp_losses = []
    for step in range(6):
        terms = model(x, y)
        _objective(terms, 0.3).backward()
        if step == 0:
            for name, p in model.model.mtp_layers.named_parameters():
                assert p.grad is not None and p.grad.abs().max() > 0, name
        opt.step()
        opt.zero_grad()
        mtp_losses.append(terms["mtp_loss"].item())
    assert mtp_losses[-1] < 0.8 * mtp_losses[0], mtp_losses


def test_mtp_target_is_two_tokens_ahead():
    """Depth 1 reads t_{i+1} and predicts t_{i+2}: a model whose MTP head copies its input
    embedding would get the loss of predicting t_{i+1}; the last position has no target."""
    model = _model("tiny", num_mtp_layers=2)
    x, y = _batch(batch=1)
    seen = {}

    def capture(module, args, out):
        seen.setdefault(module, args[1].detach())

    for layer in model.model.mtp_layers:
        layer.register_forward_hook(capture)
    with torch.no_grad():
        model(x, y)
    emb = model.model.embed_tokens.weight
    for k, layer in enumerate(model.model.mtp_layers, start=1):
        # Position i of depth k embeds input_ids[i + k] (wrapped at the end, where no loss).
        torch.testing.assert_close(seen[layer][0, : SEQ - k], emb[x[0, k:]], rtol=0, atol=0)


def test_mtp_weight_zero_matches_no_mtp_layers():
    """with_mtp=False (train.mtp_loss_weight=0) from the same main weights: the same next-token
    losses and main gradients, bit for bit, over a few optimizer steps."""
    with_mtp = _model("mla_tiny", num_mtp_layers=1)
    without = _model("mla_tiny", num_mtp_layers=0)
    main = {k: v for k, v in with_mtp.state_dict().items() if not k.startswith("model.mtp_")}
    without.load_state_dict(main, strict=True)
    x, y = _batch(1)
    curves = []
    for model in (with_mtp, without):
        params = [p for n, p in model.named_parameters() if not n.startswith("model.mtp_")]
        opt = torch.optim.AdamW(params, lr=3e-3)
        losses = []
        for _ in range(3):
            terms = model(x, y, with_mtp=False)
            assert "mtp_loss" not in terms
            _objective(terms, 0.0).backward()
            opt.step()
            opt.zero_grad()
            losses.append(terms["loss"].item())
        curves.append(losses)
    assert curves[0] == curves[1]
    for k, v in without.state_dict().items():
        assert torch.equal(with_mtp.state_dict()[k], v), k


def test_frozen_indexer_is_bit_identical_and_not_in_optimizer():
    model = _model("mla_tiny", indexer_training="frozen")
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if ".indexer." in n}
    assert frozen and all(not p.requires_grad for n, p in model.named_parameters() if n in frozen)
    groups = param_groups(model)
    grouped = {n for g in groups for n in g["param_names"]}
    assert grouped.isdisjoint(frozen)
    assert grouped | set(frozen) == {n for n, _ in model.named_parameters()}
    opt = Muon(groups, lr=0.02, ns_dtype="float32")
    x, y = _batch(2)
    for _ in range(3):
        terms = model(x, y)
        assert "indexer_kl" not in terms
        _objective(terms, 0.3).backward()
        opt.step()
        opt.zero_grad()
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n
            assert p.grad is None and p not in opt.state, n
    assert model.model.layers[0].self_attn.q_b_proj.weight in opt.state  # the rest trains


def _grads(model, x, y) -> dict[str, torch.Tensor]:
    model.zero_grad()
    _objective(model(x, y), 0.3).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_kl_mode_lowers_kl_and_keeps_main_gradients():
    kl_model = _model("mla_tiny")
    with torch.no_grad():  # peaked attention (random init is near uniform, KL ~1e-5)
        for layer in kl_model.model.layers:
            layer.self_attn.q_b_proj.weight.mul_(30.0)
    frozen = _model("mla_tiny", indexer_training="frozen")
    frozen.load_state_dict(kl_model.state_dict())
    x, y = _batch(3)
    g_kl, g_frozen = _grads(kl_model, x, y), _grads(frozen, x, y)
    indexer = {n for n in g_kl if ".indexer." in n}
    assert indexer and all(g_kl[n].abs().max() > 0 for n in indexer)
    assert set(g_kl) - indexer == set(g_frozen)
    # The KL reads detached inputs and a no-grad target, so it adds nothing to the main
    # parameters' gradients: the same float32 operations run in both modes, hence equal up
    # to at most the reordering of one final accumulation (1 ulp ~ 1.2e-7 relative).
    for n, g in g_frozen.items():
        torch.testing.assert_close(g_kl[n], g, rtol=2.5e-7, atol=1e-12, msg=n)
    # Training the indexer alone lowers its KL toward the attention distribution.
    params = [p for n, p in kl_model.named_parameters() if ".indexer." in n]
    opt = torch.optim.AdamW(params, lr=1e-2)
    kls = []
    for _ in range(10):
        terms = kl_model(x, y)
        terms["indexer_kl"].backward()
        opt.step()
        opt.zero_grad()
        kls.append(terms["indexer_kl"].item())
    assert kls[-1] < 0.5 * kls[0], kls


def test_mtp_depths_share_one_layer_like_separate_copies():
    """mtp_depths 3 on one MTP layer without top-k reuse against three MTP layers holding the
    same weights: the same per-depth losses, and the shared layer's gradient is the sum of
    the three copies' (float32: equal up to the order of that 3-term sum and of the
    accumulations into shared tensors, bounded by 8 ulps of the largest entry)."""
    # Each depth runs its own indexer, as each copy does (no top-k reuse across depths).
    shared = _model("mla_tiny", num_mtp_layers=1, mtp_depths=3, index_share_for_mtp_iteration=False)
    copies = _model("mla_tiny", num_mtp_layers=3)
    assert len(shared.model.mtp_layers) == 1
    state = {k: v for k, v in shared.state_dict().items() if "mtp_layers" not in k}
    for i in range(3):
        state |= {
            k.replace("mtp_layers.0.", f"mtp_layers.{i}."): v
            for k, v in shared.state_dict().items()
            if "mtp_layers.0." in k
        }
    copies.load_state_dict(state, strict=True)
    x, y = _batch(4)
    terms_s, terms_c = shared(x, y), copies(x, y)
    for k in (1, 2, 3):
        assert terms_s[f"mtp_loss/depth_{k}"] == terms_c[f"mtp_loss/depth_{k}"]
    mean = torch.stack([terms_s[f"mtp_loss/depth_{k}"] for k in (1, 2, 3)]).mean()
    assert terms_s["mtp_loss"] == mean and not terms_s["mtp_loss/depth_2"].requires_grad
    _objective(terms_s, 0.3).backward()
    _objective(terms_c, 0.3).backward()
    for name, p in shared.model.mtp_layers[0].named_parameters():
        if p.grad is None:  # the kl indexer's gradient: from each depth's own KL, summed too
            continue
        summed = sum(copies.model.mtp_layers[i].get_parameter(name).grad for i in range(3))
        scale = max(g.abs().max() for g in [p.grad, summed]).item()
        torch.testing.assert_close(p.grad, summed, rtol=0, atol=8 * 2.0**-23 * scale + 1e-30)
    for name, p in shared.named_parameters():  # the same operations: the same gradients
        if "mtp_layers" not in name and p.grad is not None:
            scale = p.grad.abs().max().item()
            other = copies.get_parameter(name).grad
            torch.testing.assert_close(p.grad, other, rtol=0, atol=8 * 2.0**-23 * scale + 1e-30)


def test_mtp_depths_need_one_layer_or_one_per_depth():
    with pytest.raises(ValueError, match="mtp_depths"):
        get_preset("mla_tiny", num_mtp_layers=2, mtp_depths=3)
    assert get_preset("mla_tiny", num_mtp_layers=2).mtp_depths_resolved == 2
    assert get_preset("mla_tiny", num_mtp_layers=0).mtp_depths_resolved == 0


def _xtuner_order_terms(model: GLMForCausalLM, x, y) -> dict[str, torch.Tensor]:
    """The objective's terms written out in the order of InternLM xtuner's GLM-5.2 forward
    (b934f4620: `moe.py` hands the MTP block the hidden state before the final norm;
    `mtp_layer.py` ends each depth with `final_layernorm`, our shared_head.norm; `mtp_block.py`
    feeds that output to the next depth; `dsa_topk_sharing.py` reuses depth 1's top-k at the
    later depths of the one shared layer), from the model's modules and the plain
    cross-entropy over the full logits."""
    c, m = model.config, model.model
    T = x.shape[1]
    cos, sin = rope_cos_sin(T, c.rotary_dim, c.rope_theta, x.device, c.rope_scaling)
    h, topk, kls = m.embed_tokens(x), None, []
    for layer in m.layers:
        h, topk, kl = layer(h, cos, sin, topk if layer.self_attn.indexer is None else None, True)
        kls += [kl] if kl is not None else []

    def ce(hidden, target):
        logits = model.lm_head(hidden).flatten(0, 1)
        return F.cross_entropy(logits, target.flatten(), ignore_index=IGNORE_INDEX)

    terms = {"loss": ce(m.norm(h), y)}
    mtp, layer, depth1_topk = [], m.mtp_layers[0], None
    for k in range(1, c.mtp_depths_resolved + 1):
        emb = m.embed_tokens(x.roll(-k, dims=1))
        proj = layer.eh_proj(torch.cat([layer.enorm(emb), layer.hnorm(h)], -1))
        out, topk, kl = DecoderLayer.forward(layer, proj, cos, sin, depth1_topk, True)
        depth1_topk = topk if k == 1 else depth1_topk
        kls += [kl] if kl is not None else []
        h = layer.shared_head.norm(out)  # final_layernorm: to lm_head and to the next depth
        target = y.roll(-k, dims=1)
        target[:, T - k :] = IGNORE_INDEX
        mtp.append(ce(h, target))
    terms["mtp_loss"] = torch.stack(mtp).mean()
    terms.update({f"mtp_loss/depth_{k}": v for k, v in enumerate(mtp, 1)})
    terms["indexer_kl"] = torch.stack(kls).mean()
    return terms


def test_mtp_depths_chain_as_xtuner_share_weights():
    """Three depths on GLM-5.2's one MTP layer (`index_share_for_mtp_iteration`, the default)
    against the xtuner-order reference above: every loss term and every parameter's gradient.
    float64, with norm weights away from 1 (as trained ones are, so that a norm left out or
    applied twice shows): the two sides run the same operations except the cross-entropy's
    (chunked vs over the full [T, V] logits: sums of at most V + T terms in another order,
    <= (V + T) 2^-53 relative each, below 1e-13 here), so they agree within 1e-12."""
    model = _model("mla_tiny", num_mtp_layers=1, mtp_depths=3, loss_chunk_tokens=16).double()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.weight.copy_(torch.rand(module.weight.shape, generator=g) + 0.5)
    x, y = _batch(6)
    assert model.config.index_topk < SEQ  # depth 1's kept keys are a real choice
    grads = []
    for terms_of in (lambda: model(x, y), lambda: _xtuner_order_terms(model, x, y)):
        model.zero_grad()
        terms = terms_of()
        _objective(terms, 0.3).backward()
        grads.append((terms, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (ours, g_ours), (ref, g_ref) = grads
    for key in ("loss", "mtp_loss", "indexer_kl", *(f"mtp_loss/depth_{k}" for k in (1, 2, 3))):
        torch.testing.assert_close(ours[key], ref[key].detach(), rtol=1e-12, atol=0, msg=key)
    for name, grad in g_ref.items():
        scale = grad.abs().max().item()
        torch.testing.assert_close(g_ours[name], grad, rtol=0, atol=1e-12 * scale, msg=name)


def test_later_mtp_depths_attend_depth_1s_keys():
    """With top-k reuse the MTP layer's indexer runs once (depth 1) and every depth attends
    the same kept keys; without it, it runs at every depth and picks other keys (T > K)."""
    x, y = _batch(7)
    picked = {}
    for share in (True, False):
        model = _model(
            "mla_tiny", num_mtp_layers=1, mtp_depths=3, index_share_for_mtp_iteration=share
        )
        attn, runs, seen = model.model.mtp_layers[0].self_attn, [], []
        attn.indexer.register_forward_hook(lambda mod, args, out, runs=runs: runs.append(out))
        attn.register_forward_hook(lambda mod, args, out, seen=seen: seen.append(out[1]))
        with torch.no_grad():
            model(x, y)
        assert len(runs) == (1 if share else 3) and len(seen) == 3
        picked[share] = seen
    assert all(torch.equal(t, picked[True][0]) for t in picked[True])
    assert not torch.equal(picked[False][1], picked[False][0])
