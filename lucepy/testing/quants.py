"""Quantized weights for the kernel tests (issue 19), made by ggml itself: rows quantized with
ggml_quantize_chunk, their exact values with ggml's to_float, and int8 activations quantized as
lucepy's CUDA kernels do (per 32 values: scale amax / 127, round half to even)."""

from __future__ import annotations

import numpy as np

from lucepy.ggml import Lib, ffi
from lucepy.ggml import _types as TYPES

# the kernels' types: ggml type, and lucepy's kind number in vendor/ggml/cuda/lucepy-quants.cuh
KINDS = {
    "q4_0": (TYPES["GGML_TYPE_Q4_0"], 0),
    "q8_0": (TYPES["GGML_TYPE_Q8_0"], 1),
    "q4_k": (TYPES["GGML_TYPE_Q4_K"], 2),
    "q6_k": (TYPES["GGML_TYPE_Q6_K"], 3),
    "q4_1": (TYPES["GGML_TYPE_Q4_1"], 4),
    "q5_1": (TYPES["GGML_TYPE_Q5_1"], 5),
    "q5_k": (TYPES["GGML_TYPE_Q5_K"], 6),
    "iq4_xs": (TYPES["GGML_TYPE_IQ4_XS"], 7),
}


def row_bytes(lib: Lib, gtype: int, n: int) -> int:
    return int(lib.ggml_row_size(gtype, n))


def quantize(lib: Lib, values: np.ndarray, gtype: int) -> np.ndarray:
    """Rows [rows, n] of f32 as ggml's quant blocks, [rows, row bytes] of uint8."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    rows, n = values.shape
    out = np.zeros((rows, row_bytes(lib, gtype, n)), dtype=np.uint8)
    lib.ggml_quantize_init(gtype)
    written = lib.ggml_quantize_chunk(
        gtype, ffi.from_buffer("float[]", values), ffi.from_buffer(out), 0, rows, n, ffi.NULL
    )
    assert written == out.nbytes
    return out


def dequantize(lib: Lib, raw: np.ndarray, gtype: int, n: int) -> np.ndarray:
    """The exact values of quantized rows [rows, row bytes], as f32 [rows, n]."""
    rows = raw.shape[0]
    out = np.zeros((rows, n), dtype=np.float32)
    to_float = lib.ggml_get_type_traits(gtype).to_float
    raw = np.ascontiguousarray(raw)
    to_float(ffi.from_buffer(raw), ffi.from_buffer("float[]", out), rows * n)
    return out


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Columns [..., n] of f32 as int8 [..., n / 32, 32] and their scales [..., n / 32]."""
    pieces = x.reshape(*x.shape[:-1], -1, 32).astype(np.float32)
    amax = np.abs(pieces).max(axis=-1)
    d = (amax / np.float32(127)).astype(np.float32)
    safe = np.where(d == 0, np.float32(1), d)
    q = np.where(amax[..., None] == 0, 0, np.rint(pieces / safe[..., None]))
    return q.astype(np.int8), d
