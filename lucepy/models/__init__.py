"""Model architectures, one file each, found by their GGUF ``general.architecture``."""

from lucepy.models import qwen35  # noqa: F401  (registers itself)
from lucepy.models.base import Architecture, architecture_for

__all__ = ["Architecture", "architecture_for"]
