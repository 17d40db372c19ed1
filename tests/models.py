"""The tiny GLM config the model tests build on, written once: each test file states only
what it changes (head layout, routing, MTP), so the shared shape stays one definition."""

import torch

from models.glm import GLMConfig, GLMForCausalLM

#: 3 layers (1 dense), hidden 32, 4 heads over 2 KV heads, 8 routed experts of width 16
TINY_GLM = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    n_dense_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    n_routed_experts=8,
    routed_scaling_factor=2.5,
)


def tiny_glm(**overrides) -> GLMConfig:
    """`TINY_GLM` with `overrides` replacing fields."""
    return GLMConfig(**{**TINY_GLM, **overrides})


def mixed_precision_model(config: GLMConfig, dtype: torch.dtype) -> GLMForCausalLM:
    """The model of `config`, initialized (seed 0) and cast to `dtype` with its routers kept in
    float32, as FSDP2's mixed precision holds them."""
    model = GLMForCausalLM(config)
    model.init_weights(0)
    model.to(dtype)
    for router in model.routers():
        router.weight.data = router.weight.data.float()
    return model
