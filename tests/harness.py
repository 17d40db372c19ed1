"""Worlds for tests: `run_world` is the library's runner (recipes.world), so tests,
scripts and benchmarks start local worlds one way (the store hosted by the caller, one failure
and timeout policy); `init_mesh` builds a CPU DeviceMesh inside one."""

from __future__ import annotations

from recipes.world import WorldError, run_world

__all__ = ["WorldError", "init_mesh", "run_world"]


def init_mesh(shape: tuple[int, ...], names: tuple[str, ...]):
    """A CPU DeviceMesh over the current world, e.g. init_mesh((2, 2), ("ep", "efsdp"))."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)
