"""The measuring toolkit the scripts and tests share: one way to start a local world
(`world.run_world`), sharded matrices with gradients (`fixtures`), a timer that interleaves
variants (`timing`), and one table / CSV writer (`report`). Scripts under `scripts/` are thin
command lines over it; `tests/harness.py` starts its worlds with the same runner."""
