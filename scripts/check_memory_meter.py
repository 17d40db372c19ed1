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

from recipes.bench.meter_check import compare


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small", help="model preset (conf/model/<name>.yaml)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sequence")
    p.add_argument("--batch-size", type=int, default=16, help="sequences in the batch")
    p.add_argument("--out", default="meter_check", help="output directory")
    return p.parse_args(argv)


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
