"""One MoE layer's forward + backward, expert kernel by expert kernel: time, dispatched ops and
host reads, and how far each kernel's output and input gradient are from the loop's.

The layer is a preset's MoE block (router, routed experts, shared expert) with
`n_routed_experts` set to each of `experts`, on `tokens` random rows; all kernels run on the
same layer and rows. Ops and host reads come from one counted call, every tensor a device
tensor (`recipes.bench.probe.all_on_device`); the time is the median over `rounds` interleaved,
rotated rounds (`recipes.bench.timing`), the device synchronized around each call on CUDA; on
CPU one thread (the figures of a shared machine are then comparable from run to run).
"""

from __future__ import annotations

import math
import statistics

import torch

from recipes.bench.probe import all_on_device
from recipes.bench.timing import interleaved
from recipes.dtypes import DTYPES

#: the kernels compared, the reference (the per-expert loop) first
KERNELS = ("loop", "grouped_mm", "padded_bmm")


def moe_layer(preset: str, num_experts: int, device: str, dtype: torch.dtype, seed: int = 0):
    """The MoE block of `preset` with `num_experts` routed experts, weights ~ N(0, 1/fan_in)."""
    from models.glm import get_preset
    from models.glm.model.moe import MoE

    torch.manual_seed(seed)
    with torch.device(device):
        layer = MoE(get_preset(preset, n_routed_experts=num_experts))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))
    return layer.to(dtype=dtype)


def _step(layer, x, g) -> dict[str, torch.Tensor]:
    x = x.detach().requires_grad_()
    y = layer(x)
    y.backward(g)
    return {"y": y.detach(), "x_grad": x.grad}


def measure(cfg: dict) -> list[dict]:
    """One row per (experts, kernel): ms per forward + backward, ops, host reads, and the
    largest difference from the loop (`cfg["kernels"]` starts with "loop"), relative to the
    loop's largest value, over the layer's output and input gradient."""
    return [row for n in cfg["experts"] for row in _measure_layer(cfg, n)]


def _measure_layer(cfg: dict, num_experts: int) -> list[dict]:
    dtype, device = DTYPES[cfg["dtype"]], cfg["device"]
    if device == "cpu":
        torch.set_num_threads(1)
    layer = moe_layer(cfg["preset"], num_experts, device, dtype, cfg["seed"])
    gen = torch.Generator(device=device).manual_seed(cfg["seed"] + 1)
    D = layer.experts.hidden_size
    x, g = (
        torch.randn(cfg["tokens"], D, device=device, dtype=dtype, generator=gen) for _ in range(2)
    )

    def run(kernel: str) -> dict[str, torch.Tensor]:
        layer.experts.kernel = kernel
        layer.zero_grad(set_to_none=True)
        return _step(layer, x, g)

    results, counts = {}, {}
    for kernel in cfg["kernels"]:
        for _ in range(cfg["warmup"]):
            run(kernel)
        results[kernel] = run(kernel)
        with all_on_device() as count:
            run(kernel)
        counts[kernel] = count
    sync = torch.cuda.synchronize if device == "cuda" else None
    times = interleaved({k: (lambda k=k: run(k)) for k in cfg["kernels"]}, cfg["rounds"], sync=sync)
    base = statistics.median(times["loop"])
    rows = []
    for kernel in cfg["kernels"]:
        count, ref = counts[kernel], results["loop"]
        errors = [
            float((t - ref[name]).abs().max()) / float(ref[name].abs().max())
            for name, t in results[kernel].items()
        ]
        rows.append(
            dict(
                experts=num_experts,
                tokens=cfg["tokens"],
                kernel=kernel,
                ms=1e3 * statistics.median(times[kernel]),
                vs_loop=statistics.median(times[kernel]) / base,
                ops=count.n_ops,
                host_reads=count.n_syncs,
                reads=", ".join(f"{k} {n}" for k, n in sorted(count.syncs_by_kind().items())),
                max_rel_diff=max(errors),
            )
        )
    return rows
