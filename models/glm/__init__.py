"""GLM-4.5 / GLM-5 style mixture-of-experts causal language model (torch only)."""

from models.glm.config import GLMConfig, get_preset
from models.glm.model import GLMForCausalLM

__all__ = ["GLMConfig", "GLMForCausalLM", "get_preset"]
