"""The trainer's figures on the device: clipping decided without a host read, the logged
values read in one copy (counted with recipes.bench.probe), equal to what `.item()` gives."""

import math

import torch

from recipes import grads
from recipes.bench.probe import DeviceProbe
from recipes.metrics import DeviceValues


def _params(*scales: float) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for s in scales:
        p = torch.nn.Parameter(torch.zeros(3, 4))
        p.grad = s * torch.randn(3, 4, generator=gen)
        out.append(p)
    return out


def test_clipping_on_the_device_matches_the_float_factor_and_reads_nothing():
    for scale, limit in ((10.0, 0.5), (0.01, 0.5), (float("inf"), 0.5), (float("nan"), 0.5)):
        params = _params(scale, 1.0)
        old = [p.grad.clone() for p in params]
        probe = DeviceProbe()
        probe.mark([p.grad for p in params])
        with probe.tracking(), probe.region("clip") as count:
            sq = sum(p.grad.double().pow(2).sum() for p in params)
            finite = torch.isfinite(sq)
            grads.scale_grads(params, grads.clip_factor(sq, finite, limit))
        assert count.n_syncs == 0
        # the trainer's float rule: scale by limit / (norm + 1e-6) when finite and above it
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in old))
        clipped = math.isfinite(norm) and norm > limit
        for p, g in zip(params, old, strict=True):
            expected = g * (limit / (norm + 1e-6)) if clipped else g
            assert torch.equal(p.grad, expected) or (
                not clipped and torch.equal(p.grad.isnan(), g.isnan())
            )


def test_logged_values_are_read_in_one_sync_as_item_would_give():
    terms = torch.tensor([2.5, 0.125], dtype=torch.float32)
    sq = torch.tensor(7.0, dtype=torch.float64)
    logits = torch.randn(3, 4)
    probe = DeviceProbe()
    probe.mark(terms, sq, logits)  # on the device
    with probe.tracking():
        loss, norm, layers = terms / 3, sq.sqrt(), logits.amax(1)
        values = DeviceValues()
        values.add("loss", loss)
        values.add("grad_sq", norm)
        values.add("layers", layers)
        values.add("clipped", 2)  # a host number stays as it is
        with probe.region("read") as count:
            out = values.read()
    assert count.n_syncs == 1
    assert out["loss"] == [loss[0].item(), loss[1].item()]
    assert out["grad_sq"] == [norm.item()]
    assert out["layers"] == layers.tolist()
    assert out["clipped"] == [2.0]


def test_summary_line_shows_small_loss_terms_with_their_digits():
    """The mla_tiny run's indexer_kl (~3e-5) reads 3.012e-05 -> 2.500e-05, not 0.0000."""
    from recipes.metrics import Summary

    summary = Summary()
    for step, kl in ((1, 3.0123e-5), (2, 2.5e-5)):
        row = {"loss": 5.5, "skipped_steps": 0, "step_s": 1.0, "optim_s": 0.1}
        summary.add(step, {**row, "tokens_per_s": 64.0, "indexer_kl": kl, "mtp_loss": 5.25}, False)
    text = summary.text()
    assert "indexer_kl 3.012e-05 -> 2.500e-05" in text and "mtp_loss 5.2500 -> 5.2500" in text
