"""What `scripts/check_memory_meter.py` measures: one training step's MemoryMeter figures
against the CUDA allocator's own, within `tolerance` (the script's doc: the steps and why the
step repeats exactly)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from recipes.memory import MemoryMeter
from recipes.tables import as_shown
from recipes.units import MiB


def tolerance(peak: int) -> int:
    """Allowed |meter - allocator| on a peak of `peak` bytes (see the script's doc)."""
    return 2 * MiB + peak // 100


def _step(preset: str, seq_len: int, batch_size: int, device) -> tuple[Callable, Callable]:
    """(forward_backward, optimizer) of the recipe's model on one fixed batch, learning rates
    of 1e-12: the weights, hence every allocation, repeat from step to step."""
    from omegaconf import OmegaConf

    from recipes.build import build_model, build_optimizer, model_config
    from recipes.config import Config, validate

    dotlist = [
        f"model.preset={preset}",
        f"mesh.world_size={dist.get_world_size()}",
        "mesh.ep=1",
        "train.param_dtype=bfloat16",
        "optim.lr=1e-12",
        "optim.adamw_lr=1e-12",
        f"data.seq_len={seq_len}",
        f"data.batch_size={batch_size}",
    ]
    cfg = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.from_dotlist(dotlist))
    validate(cfg, env_world_size=dist.get_world_size())
    model = build_model(cfg, model_config(cfg), device)
    opt = build_optimizer(cfg.optim, model)
    gen = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(
        0, cfg.data.vocab_size, (batch_size, seq_len + 1), generator=gen, device=device
    )
    x, y = ids[:, :-1], ids[:, 1:]

    def forward_backward() -> None:
        model.loss(x, y).backward()

    def optimizer() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    return forward_backward, optimizer


def _reference(forward_backward, optimizer, device) -> tuple[int, int, int]:
    """The allocator's (step start, step peak, optimizer peak) after two warm-up steps."""
    for _ in range(2):
        forward_backward()
        optimizer()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    ref_start = torch.cuda.memory_allocated(device)
    forward_backward()
    optimizer()
    torch.cuda.synchronize(device)
    ref_step = torch.cuda.max_memory_allocated(device)
    forward_backward()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    optimizer()
    torch.cuda.synchronize(device)
    return ref_start, ref_step, torch.cuda.max_memory_allocated(device)


def compare(preset: str, seq_len: int, batch_size: int, device: torch.device) -> dict:
    """The meter's figures and the allocator's for one step; needs a process group."""
    meter = MemoryMeter(device)
    forward_backward, optimizer = _step(preset, seq_len, batch_size, device)
    ref_start, ref_step, ref_optim = _reference(forward_backward, optimizer, device)
    before = torch.cuda.memory_allocated(device)
    with meter.measure("step") as m:
        forward_backward()
        torch.cuda.synchronize(device)
        with m.region("optim"):
            optimizer()
            torch.cuda.synchronize(device)
    after = torch.cuda.memory_allocated(device)
    rows = [
        ("step start", m.start_bytes(), before, 0),
        ("step end", m.end_bytes(), after, 0),
        ("step peak", m.peak_bytes(), ref_step, tolerance(ref_step)),
        ("optim peak", m.peak_bytes("optim"), ref_optim, tolerance(ref_optim)),
        ("step start (reference step)", m.start_bytes(), ref_start, tolerance(ref_start)),
    ]
    checks = [
        dict(
            figure=name,
            meter_mib=meter_b / MiB,
            allocator_mib=ref_b / MiB,
            diff_mib=(meter_b - ref_b) / MiB,
            tolerance_mib=tol / MiB,
            # judged on the MiB figures the table prints
            ok=abs(as_shown((meter_b - ref_b) / MiB, ".2f")) <= as_shown(tol / MiB, ".2f"),
        )
        for name, meter_b, ref_b, tol in rows
    ]
    return dict(
        preset=preset,
        tokens=seq_len * batch_size,
        device=torch.cuda.get_device_name(device),
        summary=m.summary(),
        checks=checks,
        ok=all(c["ok"] for c in checks),
    )
