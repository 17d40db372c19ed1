"""Bad parallel layouts fail naming the field, before any collective."""

import pytest
import torch

from models.glm import GLMConfig, GLMForCausalLM
from models.glm.infra.parallelize import build_meshes, parallelize
from tests.distributed.test_models_parallel import CFG


def test_bad_parallel_configs_fail_naming_the_field():
    from types import SimpleNamespace

    with pytest.raises(
        ValueError, match=r"ep \(3\) must be a positive divisor of world_size \(4\)"
    ):
        build_meshes(4, 3, "cpu")
    with torch.device("meta"):
        model = GLMForCausalLM(
            GLMConfig(**{**CFG.to_dict(), "n_routed_experts": 6, "n_group": 1, "topk_group": 1})
        )
    fake = SimpleNamespace(ep=4, world_size=8)
    with pytest.raises(ValueError, match=r"n_routed_experts \(6\) must be divisible by ep \(4\)"):
        parallelize(model, fake)
