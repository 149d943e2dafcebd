"""Reading model files: typed metadata, the tensor index, and zero-copy data views."""

from lucepy.gguf.reader import GGUFFile, TensorInfo

__all__ = ["GGUFFile", "TensorInfo"]
