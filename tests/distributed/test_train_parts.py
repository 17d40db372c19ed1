"""Parts of the training loop: schedule, cross-mesh grad norm, clipping, accumulation."""

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.harness import run_world
from tests.reference import assert_same_step
from tests.unit.test_train_parts import train_cfg


def _norms_world():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from recipes import grads

    mesh = init_device_mesh("cpu", (2,))
    full = {
        "sharded": torch.arange(12.0).reshape(4, 3),
        "replicated": torch.full((2, 2), 3.0),
        "plain": torch.tensor([1.0, 2.0]),
    }
    params = {}
    for name, value in full.items():
        p = torch.nn.Parameter(torch.zeros_like(value))
        if name == "plain":
            p.grad = value.clone()
        else:
            placement = Shard(0) if name == "sharded" else Replicate()
            p = torch.nn.Parameter(distribute_tensor(torch.zeros_like(value), mesh, [placement]))
            p.grad = distribute_tensor(value, mesh, [placement])
        params[name] = [p]
    return grads.squared_norms(params)


def _full_params(model) -> dict[str, np.ndarray]:
    return {n: p.detach().full_tensor().numpy() for n, p in model.named_parameters()}


def _accum_and_clip_world(cache: str):
    from recipes import grads
    from recipes.trainer import Trainer

    out = {"norms": _norms_world()}
    for name, extra in {
        "accum": ["train.grad_accum_steps=2", "data.batch_size=1"],
        "batch": ["train.grad_accum_steps=1", "data.batch_size=2"],
    }.items():
        # float32 Newton-Schulz: the two sum the gradients in another order (see the bound).
        cfg = train_cfg(
            f"data.cache_dir={cache}", "train.grad_clip=0", "optim.ns_dtype=float32", *extra
        )
        trainer = Trainer(cfg, Path("/nonexistent"), torch.device("cpu"))
        out["init"] = _full_params(trainer.model)
        metrics = trainer.train_step(measure=False)
        out[name] = ((metrics["loss"], metrics["grad_norm"]), _full_params(trainer.model))
        out["ns_dtype"] = {g["ns_dtype"] for g in trainer.opt.param_groups if "ns_dtype" in g}
    # Clipping: AdamW groups are scaled to the limit; Muon groups only with clip_muon.
    for clip_muon in (False, True):
        cfg = train_cfg(
            f"data.cache_dir={cache}", "train.grad_clip=0.01", f"train.clip_muon={clip_muon}"
        )
        trainer = Trainer(cfg, Path("/nonexistent"), torch.device("cpu"))
        trainer.forward_backward()
        before = grads.squared_norms(trainer.params)
        trainer.optimizer_step()
        after = grads.squared_norms(trainer.params)
        out[f"clip_muon={clip_muon}"] = (before, after)
    return out


def test_grad_norm_accumulation_and_clipping(tmp_path):
    """One 2-rank world: the cross-mesh grad norm counts every element once; accumulation
    equals a bigger batch; clipping scales the AdamW groups (and Muon's with clip_muon)."""
    out = run_world(_accum_and_clip_world, 2, str(tmp_path / "cache"))[0]
    norms = out["norms"]
    assert norms["sharded"] == pytest.approx(sum(v * v for v in range(12)))
    assert norms["replicated"] == pytest.approx(4 * 9.0)
    assert norms["plain"] == pytest.approx(5.0)
    assert out["ns_dtype"] == {"float32"}  # optim.ns_dtype reaches the optimizer
    (figures_a, params_a), (figures_b, params_b) = out["accum"], out["batch"]
    # Loss and global grad norm: float32 sums of the same terms in another order, a few ulps
    # (2^-24 ~ 6e-8) apart; 1e-5 leaves a factor ~100.
    assert figures_a == pytest.approx(figures_b, rel=1e-5)
    # Parameters: one float32 Newton-Schulz step from the same weights (bound in reference.py).
    assert_same_step(out["init"], params_a, params_b)
    before, after = out["clip_muon=False"]
    assert before["adamw"] ** 0.5 > 0.01 and after["adamw"] ** 0.5 == pytest.approx(0.01, rel=1e-3)
    assert after["muon"] == pytest.approx(before["muon"])
    before, after = out["clip_muon=True"]
    total = (after["adamw"] + after["muon"]) ** 0.5
    assert total == pytest.approx(0.01, rel=1e-3)
