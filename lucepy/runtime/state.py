"""Per-layer state in backend buffers, behind the protocol the model declares it with
(``lucepy.models.state``): copies on the state's own backend (RAM slots; inside the worker for
worker shards), and host arrays (disk). What a snapshot of ``rows`` cache rows holds is what each
state's ``views(rows)`` says; nothing here reads a tensor's name to learn its kind.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lucepy.ggml import Backend, Context, Lib, alias_tensor, ffi, tensor_set
from lucepy.models.state import LayerState, state_specs
from lucepy.runtime.tensors import Tensors

_DTYPES = {0: np.float32, 1: np.float16}  # ggml type -> numpy, for host copies of state


def _host(t: Any, dims: tuple[int, ...]) -> np.ndarray:
    """An empty host array for ``t`` of view shape ``dims`` (ggml order): float arrays, and
    quantized rows as bytes [rows, bytes]."""
    if int(t.type) in _DTYPES:
        return np.empty(dims[::-1], dtype=_DTYPES[int(t.type)])
    rows = int(np.prod(dims[1:], dtype=np.int64))
    return np.empty((rows, int(t.nb[1])), dtype=np.uint8)


class StateSet:
    """The layer states of a shard (or of the draft) and their tensors, in one buffer."""

    def __init__(self, lib: Lib, backend: Backend, states: list[LayerState], what: str):
        self.lib, self.states = lib, states
        self.tensors = Tensors(lib, backend, state_specs(states), what)

    @property
    def t(self) -> dict[str, Any]:
        return self.tensors.t

    @property
    def nbytes(self) -> int:
        return self.tensors.nbytes

    @property
    def rolls_back(self) -> bool:
        return any(s.rolls_back for s in self.states)

    def views(self, rows: int) -> dict[str, tuple[int, ...]]:
        return {name: shape for s in self.states for name, shape in s.views(rows).items()}

    def appended(self) -> set[str]:
        """The tensors of states that append (``LayerState.appends``): one row per cache row."""
        return {name for s in self.states if s.appends for name in s.views(0)}

    def growth(self) -> tuple[int, int]:
        """(bytes that each cache row adds, bytes stored whole at every length)."""
        per_row = sum(s.nbytes(1, self.lib) for s in self.states if s.appends)
        whole = sum(s.nbytes(0, self.lib) for s in self.states if not s.appends)
        return per_row, whole

    def dtypes(self) -> dict[str, str]:
        """Each tensor's ggml type name (a snapshot's fingerprint includes them)."""
        return {
            name: ffi.string(self.lib.ggml_type_name(t.type)).decode() for name, t in self.t.items()
        }

    def clear(self) -> None:
        self.tensors.clear()

    def clear_sequence(self, seq: int) -> None:
        """Zero sequence ``seq``'s slice of the state kept whole per sequence (a new sequence
        there starts from nothing; its KV rows are masked until written)."""
        for s in self.states:
            for name, n_seq in s.seq_slices().items():
                t = self.t[name]
                size = self.lib.ggml_nbytes(t) // n_seq
                self.lib.ggml_backend_tensor_memset(t, 0, seq * size, size)

    def close(self) -> None:
        self.tensors.close()

    def abandon(self) -> None:
        self.tensors.abandon()


class Live:
    """Aliases over the part of the live state that ``rows`` cache rows fill; with ``since``,
    only rows ``since..rows`` of the appending tensors (the others whole)."""

    def __init__(self, states: StateSet, rows: int, since: int = 0):
        lib = states.lib
        views, appended = states.views(rows), states.appended() if since else set()
        self._ctx = Context(lib, len(views) + 1)
        self.t, self.shapes = {}, {}
        for name, shape in views.items():
            src = states.t[name]
            strides = tuple(int(src.nb[i]) for i in range(1, len(shape)))
            offset = 0
            if name in appended:  # the row is the outermost dimension
                shape = (*shape[:-1], shape[-1] - since)
                offset = since * int(src.nb[len(shape) - 1])
            self.t[name] = alias_tensor(lib, self._ctx.ptr, src, shape, strides, offset)
            self.shapes[name] = shape

    def close(self) -> None:
        self._ctx.close()


class StateCopy:
    """A copy of some state for ``rows`` cache rows, kept on ``backend`` (a RAM slot's content);
    with ``first``, of rows ``first..first+rows`` (a batched sequence's: appending state only)."""

    def __init__(self, lib: Lib, backend: Backend, states: StateSet, rows: int, first: int = 0):
        self.lib, self.rows = lib, rows
        live = Live(states, first + rows, first)
        try:
            specs = {k: (int(t.type), live.shapes[k]) for k, t in live.t.items()}
            self.copy = Tensors(lib, backend, specs, f"snapshot of {rows} rows")
            for name, t in live.t.items():
                lib.ggml_backend_tensor_copy(t, self.copy.t[name])
        finally:
            live.close()

    @property
    def nbytes(self) -> int:
        return self.copy.nbytes

    def restore(self, states: StateSet, first: int = 0) -> None:
        """Write the copy back, to rows ``first`` onward (another sequence's, when batched)."""
        live = Live(states, first + self.rows, first)
        try:
            for name, t in live.t.items():
                self.lib.ggml_backend_tensor_copy(self.copy.t[name], t)
        finally:
            live.close()

    def close(self) -> None:
        self.copy.close()

    def abandon(self) -> None:
        self.copy.abandon()


def export(states: StateSet, rows: int, since: int = 0) -> dict[str, np.ndarray]:
    """Host copies of the state for ``rows`` cache rows (read over RPC for a worker's state);
    with ``since``, of the appending tensors only rows ``since..rows``."""
    live = Live(states, rows, since)
    try:
        out = {}
        for name, t in live.t.items():
            arr = _host(t, live.shapes[name])
            states.lib.ggml_backend_tensor_get(t, ffi.from_buffer(arr), 0, arr.nbytes)
            out[name] = arr
        return out
    finally:
        live.close()


def load(states: StateSet, arrays: dict[str, np.ndarray], rows: int, first: int = 0) -> None:
    """Write host arrays from ``export`` back into the live state; with ``first``, the
    appending tensors' ``rows`` rows from row ``first`` on (a batched sequence's)."""
    live = Live(states, first + rows, first)
    try:
        for name, t in live.t.items():
            arr, want = np.ascontiguousarray(arrays[name]), _host(t, live.shapes[name])
            if arr.shape != want.shape or arr.dtype != want.dtype:
                raise ValueError(f"state {name}: {arr.shape} {arr.dtype} does not fit {want.shape}")
            tensor_set(states.lib, t, arr)
    finally:
        live.close()
