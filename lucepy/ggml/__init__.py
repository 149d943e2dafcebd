"""The cffi binding to libggml: loading, the pin check, and owner classes for its handles."""

from lucepy.ggml.lib import Lib, address, ffi, load
from lucepy.ggml.owners import (
    Allocator,
    Backend,
    Buffer,
    Context,
    RawBuffer,
    Sched,
    alias_tensor,
    tensor_set,
)

_types = ffi.typeof("enum ggml_type").relements
GGML_TYPE_F32 = _types["GGML_TYPE_F32"]
GGML_TYPE_F16 = _types["GGML_TYPE_F16"]
GGML_TYPE_Q4_0 = _types["GGML_TYPE_Q4_0"]
GGML_TYPE_Q8_0 = _types["GGML_TYPE_Q8_0"]
GGML_TYPE_I32 = _types["GGML_TYPE_I32"]
GGML_TYPE_I64 = _types["GGML_TYPE_I64"]
_ops = ffi.typeof("enum ggml_op").relements
# ops whose result is another tensor's memory: they compute nothing and run where that memory is
VIEW_OPS = frozenset(_ops[f"GGML_OP_{op}"] for op in ("RESHAPE", "VIEW", "PERMUTE", "TRANSPOSE"))

__all__ = [
    "Allocator",
    "Sched",
    "alias_tensor",
    "tensor_set",
    "Backend",
    "Buffer",
    "Context",
    "RawBuffer",
    "Lib",
    "address",
    "ffi",
    "load",
    "GGML_TYPE_F16",
    "GGML_TYPE_F32",
    "GGML_TYPE_I32",
    "GGML_TYPE_I64",
    "GGML_TYPE_Q4_0",
    "GGML_TYPE_Q8_0",
    "VIEW_OPS",
]
