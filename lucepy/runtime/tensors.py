"""Named tensors in backend buffers (``Tensors``): a model's weights, loaded from a GGUF where
llama.cpp would put them (a CPU's repacked buffer types; on a GPU lucepy's own CUDA layouts), and
a shard's persistent state."""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

from lucepy.ggml import Backend, Buffer, Context, Lib, ffi, tensor_set
from lucepy.ggml.bufts import matmul_placement
from lucepy.ggml.kernels import cuda_kernels
from lucepy.gguf import GGUFFile

log = logging.getLogger(__name__)


def _stackable(lib: Lib, backend: Backend, f: GGUFFile, matmul: dict) -> dict:
    """``matmul`` with each stack (a tuple of sources) kept only where all its parts would land in
    the buffer type that it lands in, else taken apart into its parts (their own keys): a CPU
    repacks a tensor by its row count, and a stack computed by other kernels than its parts
    would round otherwise than llama.cpp, which multiplies them apart."""
    out: dict = {}
    for key, src in matmul.items():
        if isinstance(src, tuple):
            alone = matmul_placement(lib, backend, {n: _spec(f, n) for n in src})
            whole = matmul_placement(lib, backend, {key: _spec(f, src)}).get(key)
            if any(alone.get(n) != whole for n in src):
                out.update({n: n for n in src})
                continue
        out[key] = src
    return out


def _spec(f: GGUFFile, source: str | tuple[str, ...]) -> tuple[int, tuple[int, ...]]:
    """(ggml type, shape) of a file tensor, or of several stacked by rows (same type and row
    length: Architecture.stacked checked)."""
    if isinstance(source, str):
        return int(f.tensors[source].type), f.tensors[source].shape
    first = f.tensors[source[0]]
    rows = sum(f.tensors[n].shape[1] for n in source)
    return int(first.type), (first.shape[0], rows)


def _repack(lib: Lib, backend: Backend, weights: dict[str, Any], what: str) -> list[str]:
    """The Q4_0, Q4_K, Q5_K and Q6_K ``weights`` (read by products alone) rewritten in place into
    the layouts of lucepy's CUDA kernels (vendor/ggml/cuda/lucepy-layouts.cuh, decision 12), those
    the kernels take, on a local GPU where they are on (Q5_K and Q6_K from compute capability
    9.0); LUCEPY_CUDA_REPACK=0 leaves them as blocks. Their names."""
    if os.environ.get("LUCEPY_CUDA_REPACK", "1") == "0" or not backend.is_local_gpu:
        return []
    kernels = cuda_kernels(lib)
    if kernels is None:
        return []
    done = [name for name, t in weights.items() if kernels.repack(t)]
    if done:
        log.info("%s: %d of %d product weights repacked", what, len(done), len(weights))
    return done


class Tensors:
    """Named tensors in backend buffers: a model's weights, or persistent state. One buffer per
    buffer type: the backend's own, and for CPU weights the repacked types that take them."""

    def __init__(
        self,
        lib: Lib,
        backend: Backend,
        specs: dict[str, tuple[int, tuple]],
        what: str,
        placement: dict[str, Any] | None = None,
    ):
        self.lib = lib
        self.t: dict[str, Any] = {}
        self.repacked: list[str] = []  # weights in lucepy's CUDA layout (from_gguf)
        groups: dict[Any, list[str]] = {}
        for name in specs:
            groups.setdefault((placement or {}).get(name), []).append(name)
        self._parts: list[tuple[Context, Buffer]] = []
        for buft, names in groups.items():
            ctx = Context(lib, len(names) + 1)
            for name in names:
                gtype, shape = specs[name]
                ne = ffi.new("int64_t[4]", list(shape) + [1] * (4 - len(shape)))
                t = lib.ggml_new_tensor(ctx.ptr, gtype, len(shape), ne)
                lib.ggml_set_name(t, name.encode())
                self.t[name] = t
            self._parts.append((ctx, Buffer(lib, ctx, backend, what, buft)))

    @classmethod
    def from_gguf(
        cls,
        lib: Lib,
        backend: Backend,
        f: GGUFFile,
        names,
        what: str,
        matmul: dict[str, str] | None = None,
    ) -> Tensors:
        """Load ``names`` from ``f``. ``matmul`` maps the weights a graph uses only as mul_mat's
        first operand to their GGUF source; on the CPU those go where llama.cpp puts them (a
        repacked buffer type, ``lucepy.ggml.bufts``). A key that is not a file tensor (a tied head)
        is the same tensor as its source unless it lands in another buffer type, then a copy."""
        matmul = _stackable(lib, backend, f, matmul or {})
        # a key whose source is several tensors is their rows stacked (Architecture.stacked):
        # the parts are loaded only as that
        parts = {n for src in matmul.values() if isinstance(src, tuple) for n in src}
        source = {n: n for n in names if n not in parts} | matmul
        specs = {k: _spec(f, s) for k, s in source.items()}
        placement = matmul_placement(lib, backend, {k: specs[k] for k in matmul})
        shared = {
            k: src
            for k, src in matmul.items()
            if k != src and src in specs and placement.get(k) == placement.get(src)
        }
        out = cls(
            lib, backend, {k: v for k, v in specs.items() if k not in shared}, what, placement
        )
        for name, t in out.t.items():
            src = source[name]
            if isinstance(src, tuple):  # in one piece: a repacked buffer takes whole tensors only
                data = np.concatenate([np.frombuffer(f.data(n), dtype=np.uint8) for n in src])
            else:
                data = f.data(src)
            tensor_set(lib, t, data)
        for k, src in shared.items():
            out.t[k] = out.t[src]
        tied = set(shared.values())
        kept = {k: out.t[k] for k in matmul if k in out.t and k not in tied}
        out.repacked = _repack(lib, backend, kept, what)
        return out

    @property
    def nbytes(self) -> int:
        return sum(buf.nbytes for _, buf in self._parts)

    def clear(self) -> None:
        for _, buf in self._parts:
            buf.clear(0)

    def close(self) -> None:
        for ctx, buf in self._parts:
            buf.close()
            ctx.close()

    def abandon(self) -> None:
        for ctx, buf in self._parts:
            buf.abandon()
            ctx.close()
