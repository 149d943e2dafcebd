"""Where a weight lives: the CPU backend's extra buffer types hold repacked layouts (q4_0 as
q4_0_8x8, q4_K as q4_K_8x8, ...) whose kernels are faster and round differently from the plain
ones. llama.cpp puts every matmul weight in the first such type that accepts it, so lucepy asks
the same question the same way (``weight_buft_supported`` in src/llama-model-loader.cpp).
"""

from __future__ import annotations

from typing import Any

from lucepy.ggml.lib import Lib, ffi
from lucepy.ggml.owners import Backend, Context

_F32 = ffi.typeof("enum ggml_type").relements["GGML_TYPE_F32"]
_I32 = ffi.typeof("enum ggml_type").relements["GGML_TYPE_I32"]


def extra_buffer_types(lib: Lib, backend: Backend) -> list[Any]:
    """The CPU device's extra buffer types, in its order of preference; none off the CPU."""
    if not lib.ggml_backend_is_cpu(backend.ptr):
        return []
    dev = lib.ggml_backend_get_device(backend.ptr)
    reg = lib.ggml_backend_dev_backend_reg(dev)
    fn = lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
    if fn == ffi.NULL:
        return []
    found = ffi.cast("ggml_backend_dev_get_extra_bufts_t", fn)(dev)
    out = []
    while found != ffi.NULL and found[len(out)] != ffi.NULL:
        out.append(found[len(out)])
    return out


def takes_matmul(lib: Lib, backend: Backend, buft: Any, gtype: int, shape: tuple) -> bool:
    """Whether the device runs ``mul_mat(w, x)`` with ``w`` (``gtype``, ``shape``) in ``buft``,
    asked with a 512-row ``x`` over an empty buffer, as llama.cpp's loader asks; for a 3D ``w``
    (experts) ``mul_mat_id`` with 512 tokens of up to 8 experts each."""
    dev = lib.ggml_backend_get_device(backend.ptr)
    ctx = Context(lib, 8)
    try:
        ne = list(shape) + [1] * (4 - len(shape))
        w = lib.ggml_new_tensor(ctx.ptr, gtype, len(shape), ffi.new("int64_t[4]", ne))
        if len(shape) == 3:
            k = min(8, ne[2])
            x = lib.ggml_new_tensor_3d(ctx.ptr, _F32, ne[0], k, 512)
            ids = lib.ggml_new_tensor_2d(ctx.ptr, _I32, k, 512)
            op = lib.ggml_mul_mat_id(ctx.ptr, w, x, ids)
        else:
            x = lib.ggml_new_tensor_4d(ctx.ptr, _F32, ne[0], 512, ne[2], ne[3])
            op = lib.ggml_mul_mat(ctx.ptr, w, x)
        w.buffer = lib.ggml_backend_buft_alloc_buffer(buft, 0)
        try:
            return bool(lib.ggml_backend_dev_supports_op(dev, op))
        finally:
            lib.ggml_backend_buffer_free(w.buffer)
            w.buffer = ffi.NULL
    finally:
        ctx.close()


def matmul_placement(lib: Lib, backend: Backend, weights: dict[str, tuple[int, tuple]]) -> dict:
    """For matmul weights ``{name: (gtype, shape)}``: the extra buffer type of each that has one."""
    bufts = extra_buffer_types(lib, backend)
    out = {}
    for name, (gtype, shape) in weights.items():
        buft = next((b for b in bufts if takes_matmul(lib, backend, b, gtype, shape)), None)
        if buft is not None:
            out[name] = buft
    return out
