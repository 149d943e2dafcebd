"""lucepy: serve and benchmark GGUF models split across devices, on ggml."""

__version__ = "0.1.0"
