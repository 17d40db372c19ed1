"""GLM-4.5 / GLM-5 style mixture-of-experts causal language model (torch only)."""

from models.glm.model.config import GLMConfig
from models.glm.model.model import GLMForCausalLM
from models.glm.model.presets import get_preset

__all__ = ["GLMConfig", "GLMForCausalLM", "get_preset"]
