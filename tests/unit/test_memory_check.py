"""train.memory_check: the recipe's step-memory estimate against the machine's memory, before
any rank starts (recipes.memory_check)."""

import logging
from pathlib import Path

import pytest
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from recipes import memory_check
from recipes.config import ConfigError

CONF = Path(__file__).resolve().parents[2] / "conf"
GiB = 1 << 30


def compose_config(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(config_name="train", overrides=overrides)


def test_seq_len_100000_on_tiny_is_refused_with_the_estimate_and_settings_that_fit(
    monkeypatch, caplog
):
    """data.seq_len=100000 (under tiny's 131072 positions) with 6 GiB for 4 CPU ranks (the
    fault trial's limit): refused naming the estimate (13.4 GiB per rank, 11.3 GiB of it the
    activations of 8 x 100000 tokens: the figure step_fits computes, read back below) and the
    settings that fit (a batch of 1 x 100000 tokens does not: only a shorter sequence);
    `warn` logs the same and returns; `off` does not estimate."""
    cfg = compose_config(["data.seq_len=100000"])
    budget = 6 * GiB // 4
    monkeypatch.setattr(memory_check, "available_bytes", lambda *_: (budget, "6 GiB (test)"))
    text = OmegaConf.to_yaml(cfg, resolve=True)
    with pytest.raises(ConfigError) as info:
        memory_check.measure(cfg, text, "cpu", 4, forked=False)
    assert not dist.is_initialized()  # the fake process group is gone again
    message = str(info.value)
    found = memory_check.step_fits(text, 4, "cpu", budget)
    dist.destroy_process_group()
    fits = dict(found["fits"])
    suggested = ", ".join(f"{k} ({v / GiB:.3f} GiB per rank)" for k, v in fits.items())
    assert message.startswith(
        "train.memory_check=error: data.seq_len=100000 data.batch_size=8: the step needs an "
        f"estimated {found['total'] / GiB:.3f} GiB per rank (recipes/step_memory.py, tensors "
        "only), above the 1.500 GiB per rank this machine has (6 GiB (test)); nearest settings "
        f"that fit: {suggested}"
    ), message
    assert found["total"] > 8 * budget and "data.batch_size=1" not in fits
    assert "activations (all layers)" in message and "train.memory_check=warn" in message
    seq = int(next(k for k in fits if k.startswith("data.seq_len=")).split("=")[1])
    assert fits[f"data.seq_len={seq}"] <= budget
    # the next length up does not fit (the search found the largest)
    longer = text.replace("seq_len: 100000", f"seq_len: {seq + 1}")
    above = memory_check.step_fits(longer, 4, "cpu", budget)
    dist.destroy_process_group()
    assert above["total"] > budget
    cfg.train.memory_check = "warn"
    with caplog.at_level(logging.WARNING, logger="recipes"):
        memory_check.check_step_memory(cfg, found, budget, "6 GiB (test)")
    assert "train.memory_check=warn: data.seq_len=100000" in caplog.text
    cfg.train.memory_check = "off"
    monkeypatch.setattr(memory_check, "step_fits", None)  # not called
    memory_check.measure(cfg, text, "cpu", 4, forked=False)


def test_largest_is_the_largest_that_fits():
    assert memory_check.largest_fitting(100, lambda n: n <= 37) == 37
    assert memory_check.largest_fitting(100, lambda n: True) == 100
    assert memory_check.largest_fitting(100, lambda n: False) is None
    assert memory_check.largest_fitting(0, lambda n: True) is None


def test_a_long_sequence_that_does_not_fit_names_the_mesh_cp_that_does():
    """mla_tiny at 16384 tokens per sequence on 4 ranks: the budget lies between the step's
    estimate at cp = 1 and at cp = 4, so the settings that fit name the smallest mesh.cp that
    does (a divisor of the world and of the sequence into 2 cp chunks), and a shorter
    sequence suggested under mesh.cp=2 is a multiple of 4."""
    cfg = compose_config(["model=mla_tiny", "data.seq_len=16384", "data.batch_size=1"])
    text = OmegaConf.to_yaml(cfg, resolve=True)
    one = memory_check.step_fits(text, 4, "cpu", 1 << 62)["total"]
    dist.destroy_process_group()
    wide = OmegaConf.to_yaml(
        compose_config(["model=mla_tiny", "data.seq_len=16384", "data.batch_size=1", "mesh.cp=4"]),
        resolve=True,
    )
    four = memory_check.step_fits(wide, 4, "cpu", 1 << 62)["total"]
    dist.destroy_process_group()
    assert four < one
    found = memory_check.step_fits(text, 4, "cpu", (one + four) // 2)
    dist.destroy_process_group()
    cps = [k for k, _ in found["fits"] if k.startswith("mesh.cp=")]
    assert len(cps) == 1 and cps[0] in ("mesh.cp=2", "mesh.cp=4"), found["fits"]
    half = OmegaConf.to_yaml(
        compose_config(["model=mla_tiny", "data.seq_len=16384", "data.batch_size=1", "mesh.cp=2"]),
        resolve=True,
    )
    found = memory_check.step_fits(half, 4, "cpu", four)
    dist.destroy_process_group()
    seqs = [int(k.split("=")[1]) for k, _ in found["fits"] if k.startswith("data.seq_len=")]
    assert seqs and all(s % 4 == 0 for s in seqs), found["fits"]
