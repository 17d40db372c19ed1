"""MemoryMeter's CUDA figures against the allocator's own peak, on one training step.

    python scripts/check_memory_meter.py --out meter_check        # small preset, 8192 tokens

One CUDA rank (an NCCL world of one) builds the model and optimizer with the recipe's own code
(`recipes.build`, `train.param_dtype=bfloat16`) and runs one fixed batch again and again with
learning rates of 1e-12, far below the float32 spacing of weights of size ~0.02 (~2e-9): the
weights, hence the routing and every allocation, repeat from step to step.
1. Two warm-up steps (optimizer state, cuBLAS workspace, the allocator's cache).
2. Reference: `reset_peak_memory_stats`, the step, `max_memory_allocated` (the step's peak);
   the same step again with the reset just before the optimizer (the optimizer's peak).
3. Measured: the step inside `MemoryMeter.measure("step")` with an "optim" region around the
   optimizer, as `recipes.trainer` measures it.
The span's start and end must equal `memory_allocated` exactly; the peaks may differ by what
the caching allocator rounds differently from one step to the next (a cached block of up to
1 MiB more than asked for is handed out whole), bounded here by 2 MiB + 1% of the peak. A
missed region or a reset at the wrong moment misses whole activation or gradient buffers: tens
of MiB at these sizes. Writes meter_check.json into `--out` and prints it; exits 1 on a miss.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from recipes.bench.report import as_shown
from recipes.memory import MemoryMeter
from recipes.units import MiB


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small", help="model preset (conf/model/<name>.yaml)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sequence")
    p.add_argument("--batch-size", type=int, default=16, help="sequences in the batch")
    p.add_argument("--out", default="meter_check", help="output directory")
    return p.parse_args(argv)


def tolerance(peak: int) -> int:
    """Allowed |meter - allocator| on a peak of `peak` bytes (see the module docstring)."""
    return 2 * MiB + peak // 100


def compare(preset: str, seq_len: int, batch_size: int, device: torch.device) -> dict:
    """The meter's figures and the allocator's for one step; needs a process group."""
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
    meter = MemoryMeter(device)
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
    ref_optim = torch.cuda.max_memory_allocated(device)

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


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("check_memory_meter.py: no CUDA device", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    # a one-rank world on a store this process hosts (port 0: no free port guessed)
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=device)
    try:
        res = compare(args.preset, args.seq_len, args.batch_size, device)
    finally:
        dist.destroy_process_group()
    res["command"] = "python scripts/check_memory_meter.py " + " ".join(argv or sys.argv[1:])
    (out / "meter_check.json").write_text(json.dumps(res, indent=1))
    print(f"{res['device']}, preset {res['preset']}, {res['tokens']} tokens")
    print(f"{'figure':<30}{'meter MiB':>12}{'allocator MiB':>15}{'diff':>10}{'tol':>8}  ok")
    for c in res["checks"]:
        print(
            f"{c['figure']:<30}{c['meter_mib']:>12.2f}{c['allocator_mib']:>15.2f}"
            f"{c['diff_mib']:>10.2f}{c['tolerance_mib']:>8.2f}  {c['ok']}"
        )
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
