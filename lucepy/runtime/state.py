"""Per-layer state (attention KV, recurrent conv and SSM state) as one protocol: copies on the
state's own backend (RAM slots; inside the worker for worker shards), and host arrays (disk).

Only the first ``n`` KV rows matter for a snapshot of ``n`` tokens; recurrent state is whole.
KV tensors are named ``k.*``/``v.*`` with shape [width, n_ctx] (rows = positions).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lucepy.ggml import Backend, Context, Lib, alias_tensor, ffi
from lucepy.runtime.graphs import Tensors

_DTYPES = {0: np.float32, 1: np.float16}  # ggml type -> numpy, for the state types we use


def _is_kv(name: str) -> bool:
    return name.startswith(("k.", "v."))


def _shape(name: str, t: Any, n: int) -> tuple[int, ...]:
    dims = [int(t.ne[i]) for i in range(4)]
    while len(dims) > 1 and dims[-1] == 1:
        dims.pop()
    return (dims[0], n) if _is_kv(name) else tuple(dims)


class Live:
    """Aliases over the live state covering ``n`` tokens (KV rows 0..n-1, all of the rest)."""

    def __init__(self, lib: Lib, state: dict[str, Any], n: int):
        self._ctx = Context(lib, len(state) + 1)
        self.t = {}
        for name, src in state.items():
            shape = _shape(name, src, n)
            strides = tuple(int(src.nb[i]) for i in range(1, len(shape)))
            self.t[name] = alias_tensor(lib, self._ctx.ptr, src, shape, strides, 0)

    def close(self) -> None:
        self._ctx.close()


class StateCopy:
    """A copy of some state for ``n`` tokens, kept on ``backend`` (a RAM slot's content)."""

    def __init__(self, lib: Lib, backend: Backend, state: dict[str, Any], n: int):
        self.lib, self.n = lib, n
        live = Live(lib, state, n)
        try:
            specs = {k: (int(t.type), _shape(k, t, n)) for k, t in live.t.items()}
            self.copy = Tensors(lib, backend, specs, f"snapshot of {n} tokens")
            for name, t in live.t.items():
                lib.ggml_backend_tensor_copy(t, self.copy.t[name])
        finally:
            live.close()

    @property
    def nbytes(self) -> int:
        return self.copy.nbytes

    def restore(self, state: dict[str, Any]) -> None:
        live = Live(self.lib, state, self.n)
        try:
            for name, t in live.t.items():
                self.lib.ggml_backend_tensor_copy(self.copy.t[name], t)
        finally:
            live.close()

    def close(self) -> None:
        self.copy.close()

    def abandon(self) -> None:
        self.copy.abandon()


def export(lib: Lib, state: dict[str, Any], n: int) -> dict[str, np.ndarray]:
    """Host copies of the state for ``n`` tokens (read over RPC for a worker's state)."""
    live = Live(lib, state, n)
    try:
        out = {}
        for name, t in live.t.items():
            arr = np.empty(_shape(name, t, n)[::-1], dtype=_DTYPES[int(t.type)])
            lib.ggml_backend_tensor_get(t, ffi.from_buffer(arr), 0, arr.nbytes)
            out[name] = arr
        return out
    finally:
        live.close()


def load(lib: Lib, state: dict[str, Any], arrays: dict[str, np.ndarray], n: int) -> None:
    """Write host arrays from ``export`` back into the live state."""
    live = Live(lib, state, n)
    try:
        for name, t in live.t.items():
            arr = np.ascontiguousarray(arrays[name])
            want = _shape(name, t, n)[::-1]
            if arr.shape != want or arr.dtype != _DTYPES[int(t.type)]:
                raise ValueError(f"state {name}: {arr.shape} {arr.dtype} does not fit {want}")
            lib.ggml_backend_tensor_set(t, ffi.from_buffer(arr), 0, arr.nbytes)
    finally:
        live.close()
