"""Model architectures, one file each, found by their GGUF ``general.architecture``."""

from lucepy.models import gemma4, laguna, llama, qwen35, qwen35moe  # noqa: F401  (registers)
from lucepy.models.base import Architecture, ModelOptions, architecture_for

__all__ = ["Architecture", "ModelOptions", "architecture_for"]
