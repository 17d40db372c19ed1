"""The step's memory against the machine's, before any rank starts (`train.memory_check`).

The estimate is the recipe's own (`recipes.step_memory`: the rank's sharded model and
optimizer built on the meta device, activations counted op by op), for the run's config on its
world. It is compared with what the ranks of this machine can use:
- CPU: host RAM, MemAvailable of /proc/meminfo, or less when the process's cgroup (v2
  `memory.max`, v1 `memory.limit_in_bytes`) allows less; the ranks on this host
  (`mesh.world_size` for a local world, LOCAL_WORLD_SIZE under a launcher) share it;
- CUDA: each local device's total memory, one rank per device.
The estimate counts tensors only (a CPU rank's interpreter and libraries come on top, and the
estimate is 5-15% low: docs/scale.md), so a run it refuses would not fit, and one it passes
may still be tight. When the step does not fit, `error` (the default) refuses the run naming
the estimate, the memory it was compared with and the nearest settings that fit (each key on
its own: the largest `data.batch_size` or `data.seq_len` below the configured one (a multiple
of 2 mesh.cp under context parallelism), `train.activation_checkpointing=full`, the smallest
larger `mesh.cp` that divides the world and the sequence); `warn` logs the same and runs; `off`
skips the check.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from recipes.config.schema import ConfigError
from recipes.units import GiB

log = logging.getLogger("recipes")


def available_bytes(device: str, local_ranks: int) -> tuple[int, str]:
    """(bytes one rank may use, where that figure comes from) on this machine."""
    if device == "cuda":
        import torch

        count = max(1, min(local_ranks, torch.cuda.device_count()))
        props = [torch.cuda.get_device_properties(i) for i in range(count)]
        least = min(props, key=lambda p: p.total_memory)
        return least.total_memory, f"device memory of one GPU ({least.name})"
    host, source = _host_available()
    return host // max(1, local_ranks), f"{source} shared by {local_ranks} rank(s) on this host"


def _host_available() -> tuple[int, str]:
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        lines = meminfo.read_text().splitlines()
        fields = dict(line.split(":", 1) for line in lines if ":" in line)
        host, source = int(fields["MemAvailable"].split()[0]) * 1024, "host RAM (MemAvailable)"
    else:
        host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        source = "host RAM (total)"
    limit = _cgroup_room()
    if limit is not None and limit < host:
        return limit, "the cgroup's memory limit"
    return host, source


def _cgroup_room() -> int | None:
    """Bytes this process's cgroup still allows (limit - usage), None without a limit."""
    v1 = "/sys/fs/cgroup/memory/memory."
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (f"{v1}limit_in_bytes", f"{v1}usage_in_bytes"),
    ):
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:  # v1's "no limit" is near 2**63
            return max(0, int(limit) - usage)
    return None


def step_fits(config_yaml: str, world_size: int, device: str, budget: int) -> dict:
    """The step's estimate for the run's config (plain data, so a forked rank can return it)
    and, when it exceeds `budget` bytes per rank, the nearest settings that fit."""
    from recipes.config import from_yaml
    from recipes.step_memory import estimate_inputs, estimate_step_memory

    cfg = from_yaml(config_yaml)
    model, opt, kw = estimate_inputs(cfg, world_size=world_size, device_type=device)

    def total(**change) -> int:
        return estimate_step_memory(model, opt, **{**kw, **change}).total

    est = estimate_step_memory(model, opt, **kw)
    out = {"total": est.total, "table": est.format(), "fits": []}
    if est.total <= budget:
        return out
    batch, seq = int(cfg.data.batch_size), int(cfg.data.seq_len)
    if not kw["activation_checkpointing"]:
        need = total(activation_checkpointing=True)
        if need <= budget:
            out["fits"].append(("train.activation_checkpointing=full", need))
    b = largest_fitting(batch - 1, lambda b: total(tokens=b * seq) <= budget)
    if b:
        out["fits"].append((f"data.batch_size={b}", total(tokens=b * seq)))
    cp = int(cfg.mesh.get("cp", 1))
    unit = 2 * cp if cp > 1 else 1  # a length the cp ranks cut into equal chunks
    u = largest_fitting(
        (seq - 1) // unit, lambda u: total(tokens=batch * u * unit, seq_len=u * unit) <= budget
    )
    if u:
        s = u * unit
        out["fits"].append((f"data.seq_len={s}", total(tokens=batch * s, seq_len=s)))
    world = int(cfg.mesh.world_size)
    for c in range(cp + 1, world + 1):  # the smallest larger mesh.cp that fits
        if world % c == 0 and seq % (2 * c) == 0 and (need := total(cp=c)) <= budget:
            out["fits"].append((f"mesh.cp={c}", need))
            break
    return out


def largest_fitting(high: int, fits) -> int | None:
    """The largest n in [1, high] with fits(n), for fits monotone (true below some n)."""
    if high < 1 or not fits(1):
        return None
    low = 1
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def measure(cfg, config_yaml: str, device: str, local_ranks: int, *, forked: bool) -> None:
    """`train.memory_check` for a run about to start: the estimate in a rank of its own
    (`forked`: a world of one rank, forked from the fork server, which has the libraries
    imported; no fake process group is left in this process, which may join a real world
    next: what launch does, under a launcher too), else here (tests)."""
    if str(cfg.train.memory_check) == "off":
        return
    budget, source = available_bytes(device, local_ranks)
    args = (config_yaml, int(cfg.mesh.world_size), device, budget)
    try:
        if forked:
            from recipes.world import run_world

            found = run_world(step_fits, 1, *args, backend=None, timeout_s=600)[0]
        else:
            import torch.distributed as dist

            try:
                found = step_fits(*args)
            finally:
                if dist.is_initialized():
                    dist.destroy_process_group()  # the fake one: the real world comes next
    except Exception as err:  # noqa: BLE001 - an estimate that fails does not stop the run
        log.warning("train.memory_check: the step-memory estimate failed, not checked: %s", err)
        return
    check_step_memory(cfg, found, budget, source)


def check_step_memory(cfg, found: dict, budget: int, source: str) -> None:
    """Refuse (`train.memory_check=error`) or warn about a step `found` by `step_fits` that
    exceeds `budget` bytes per rank."""
    if found["total"] <= budget:
        return
    fits = ", ".join(f"{s} ({n / GiB:.3f} GiB per rank)" for s, n in found["fits"])
    message = (
        f"data.seq_len={cfg.data.seq_len} data.batch_size={cfg.data.batch_size}: the step needs "
        f"an estimated {found['total'] / GiB:.3f} GiB per rank (recipes/step_memory.py, "
        f"tensors only), above the {budget / GiB:.3f} GiB per rank this machine has "
        f"({source}); nearest settings that fit: {fits or 'none of one key'}; "
        "train.memory_check=warn runs anyway\n" + found["table"]
    )
    if str(cfg.train.memory_check) == "warn":
        log.warning("train.memory_check=warn: %s", message)
        return
    raise ConfigError(f"train.memory_check=error: {message}")
