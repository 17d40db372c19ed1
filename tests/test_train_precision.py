"""Mixed precision, activation checkpointing and torch.compile, used the way users use them:
through the config glue (recipes.parallel) in a gloo world, and through `python train.py`."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.utils._python_dispatch import TorchDispatchMode

from recipes.config import Config
from tests.harness import run_world

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.overrides.num_hidden_layers=2", "data.seq_len=32", "data.batch_size=2"]


class _AllGatherBytes(TorchDispatchMode):
    """Bytes each rank contributes to c10d all-gathers (FSDP2's parameter all-gathers)."""

    OPS = ("_allgather_base_", "allgather_into_tensor_coalesced_")

    def __init__(self) -> None:
        super().__init__()
        self.sent = 0
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d" and func.__name__.split(".")[0] in self.OPS:
            inputs = args[1] if isinstance(args[1], list | tuple) else [args[1]]
            self.sent += sum(t.numel() * t.element_size() for t in inputs)
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _mixed_precision_world():
    from recipes.parallel import build_model, build_optimizer, train_dtypes

    out = {}
    for param_dtype in ("float32", "bfloat16"):
        cfg = OmegaConf.merge(
            OmegaConf.structured(Config),
            OmegaConf.from_dotlist(
                ["mesh.world_size=2", "mesh.ep=2", f"train.param_dtype={param_dtype}", *TINY]
            ),
        )
        model = build_model(cfg, torch.device("cpu"))
        opt = build_optimizer(cfg, model)
        ids = torch.randint(
            0, 256, (2, 33), generator=torch.Generator().manual_seed(dist.get_rank())
        )
        counter = _AllGatherBytes()
        with counter:
            loss = model.loss(ids[:, :-1], ids[:, 1:])
        loss.backward()
        opt.step()
        # The router weights stay float32 under bf16 compute (their own FSDP unit).
        router = sum(r.weight.to_local().numel() * 4 for r in model.routers())
        out[param_dtype] = {
            "sent": counter.sent,
            "calls": counter.calls,
            "router_bytes": router,
            "dtypes": train_dtypes(cfg, torch.device("cpu")),
            "param_dtypes": {str(p.dtype) for p in model.parameters()},
            "grad_dtypes": {str(p.grad.dtype) for p in model.parameters() if p.grad is not None},
            "state_dtypes": {
                str(v.dtype)
                for state in opt.state.values()
                for v in state.values()
                if isinstance(v, torch.Tensor) and v.is_floating_point()
            },
        }
    return out


@pytest.mark.slow
def test_bf16_params_halve_the_all_gather_bytes_over_fp32_masters():
    results = run_world(_mixed_precision_world, 2, timeout_s=240)
    for rank in results:
        fp32, bf16 = rank["float32"], rank["bfloat16"]
        assert fp32["dtypes"] == (torch.float32, torch.float32)  # `auto` on CPU
        assert bf16["dtypes"] == (torch.bfloat16, torch.float32)
        # Masters, gradients and optimizer state (Muon momentum, AdamW moments) stay float32.
        for r in (fp32, bf16):
            assert r["param_dtypes"] == r["grad_dtypes"] == r["state_dtypes"] == {"torch.float32"}
        # bf16 sends 2 bytes per parameter value where fp32 sends 4, except the float32 routers.
        assert fp32["sent"] > 0 and bf16["calls"] >= fp32["calls"]
        assert bf16["sent"] == (fp32["sent"] - fp32["router_bytes"]) // 2 + fp32["router_bytes"]


def _train_py(args: list[str], root: Path) -> str:
    env = dict(os.environ, WANDB_MODE="offline")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args, f"run.root={root}", "logger=none"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout


def _metrics(root: Path, name: str) -> list[dict]:
    (run_dir,) = (root / name).iterdir()
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _base(cache: Path) -> list[str]:
    return [
        "mesh.world_size=2",
        "mesh.ep=2",
        "train.warmup_steps=1",
        "optim.ns_dtype=float32",
        "checkpoint.export_hf=false",
        f"data.cache_dir={cache}",
        "+" + TINY[0],  # a new key of the model.overrides dict, on Hydra's command line
        *TINY[1:],
    ]


@pytest.mark.slow
def test_bf16_run_trains_and_resumes_exactly(tmp_path):
    args = [*_base(tmp_path / "cache"), "train.param_dtype=bfloat16", "train.steps=4"]
    args += ["checkpoint.every=2", "checkpoint.keep=3", "run.name=bf16"]
    _train_py(args, tmp_path)
    first = _metrics(tmp_path, "bf16")
    assert first[-1]["loss"] < first[0]["loss"]
    # Drop the last checkpoint: the same command resumes at step 2 and must redo steps 3-4
    # exactly (losses and per-algorithm gradient norms bit for bit).
    (run_dir,) = (tmp_path / "bf16").iterdir()
    ckpts = sorted(p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_"))
    shutil.rmtree(ckpts[-1])
    out = _train_py(args, tmp_path)
    assert "resumed from" in out
    again = _metrics(tmp_path, "bf16")
    keys = ("loss", "grad_norm/adamw", "grad_norm/muon")
    assert [[m[k] for k in keys] for m in again] == [[m[k] for k in keys] for m in first]


@pytest.mark.slow
def test_activation_checkpointing_and_compile_keep_the_loss_curve(tmp_path):
    base = [*_base(tmp_path / "cache"), "train.steps=3", "metrics.memory_every=1"]
    runs = {
        "plain": [],
        "ac": ["train.activation_checkpointing=full"],
        "compiled": ["train.compile=true"],
    }
    curves, peaks = {}, {}
    for name, extra in runs.items():
        _train_py([*base, *extra, f"run.name={name}"], tmp_path)
        lines = _metrics(tmp_path, name)
        curves[name] = [m["loss"] for m in lines]
        peaks[name] = [m["memory/step_peak_mib/max"] for m in lines]
    # Recomputation repeats the same float32 ops in the same order: the same numbers.
    assert curves["ac"] == curves["plain"]
    # ...while keeping only each layer's input for backward: a lower per-rank step peak.
    assert max(peaks["ac"]) < max(peaks["plain"])
    # Compiled kernels fuse and reorder float32 arithmetic (relative rounding ~1e-7 per op);
    # float32 Newton-Schulz keeps three optimizer steps from amplifying it beyond ~1e-5, so
    # 1e-4 relative on the loss leaves margin and still catches a wrong layer (>1e-2).
    np.testing.assert_allclose(curves["compiled"], curves["plain"], rtol=1e-4)
    assert curves["plain"][-1] < curves["plain"][0]
