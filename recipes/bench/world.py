"""The local-world runner moved to `recipes.world` (training and the benchmarks both stand on
it); this name stays importable for code written against it."""

from recipes.world import WorldError, WorldStopped, run_world

__all__ = ["WorldError", "WorldStopped", "run_world"]
