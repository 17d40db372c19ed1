"""models.glm.model.init's chunk layout: a function of the parameter's shape and name only."""

import models.glm.model.init as shard_init


def test_chunk_layout_depends_on_shape_and_name_only():
    assert shard_init.rows_per_chunk((1 << 20, 4096)) == 4
    assert shard_init.rows_per_chunk((10, 3)) == 4096  # a power of two, whole tensor here
    assert shard_init.rows_per_chunk((7, 1 << 20)) == 1
    seeds = {shard_init.chunk_seed(0, name, c) for name in ("a", "b") for c in range(3)}
    assert len(seeds) == 6 and shard_init.chunk_seed(0, "a", 1) == shard_init.chunk_seed(0, "a", 1)
