"""Quantize a GGUF with llama.cpp's own quantizer (libllama's ``llama_model_quantize``), the way
users' Q4_K_M files are made; gguf-py cannot write K-quants."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from lucepy.errors import ConfigError

FTYPES = {
    "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
    "q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
    "q4_K_S": "LLAMA_FTYPE_MOSTLY_Q4_K_S",
}


def quantize(src: str | os.PathLike, dst: str | os.PathLike, ftype: str = "q4_K_M") -> Path:
    """Write ``dst``: ``src`` (an f32 or f16 GGUF) quantized to ``ftype``. Tensors whose rows are
    not whole 256-blocks get llama.cpp's fallback types, as in real files."""
    import llama_cpp

    if ftype not in FTYPES:
        raise ConfigError(f"quantize: unknown type {ftype!r}; use one of {sorted(FTYPES)}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, FTYPES[ftype])
    params.nthread = 1
    with open(os.devnull, "w") as null, contextlib.redirect_stderr(null):
        status = llama_cpp.llama_model_quantize(
            str(src).encode(), str(dst).encode(), llama_cpp.byref(params)
        )
    if status != 0:
        raise ConfigError(f"llama_model_quantize({src} -> {ftype}) failed with status {status}")
    return Path(dst)
