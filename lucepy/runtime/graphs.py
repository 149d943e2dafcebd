"""What a shard and a draft share: tensors in backend buffers, and compiled, reusable graphs.

Decision 2: a graph is built once per shape bucket and reused; a step writes its inputs with
``put`` and reads outputs with ``get``. Neither grows with the number of ops in the graph.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lucepy.errors import ConfigError, GGMLError
from lucepy.ggml import Allocator, Backend, Buffer, Context, Lib, ffi
from lucepy.gguf import GGUFFile
from lucepy.models.base import Builder

_NUMPY = {0: np.float32, 26: np.int32}  # ggml type -> host dtype of outputs we read


@dataclass
class CompiledGraph:
    ctx: Context
    alloc: Allocator
    gf: Any
    inputs: dict[str, Any]
    outputs: dict[str, Any]
    output: Any
    host: dict[str, np.ndarray] = field(default_factory=dict)  # read buffers, made on first read

    def close(self) -> None:
        self.alloc.close()
        self.ctx.close()

    def abandon(self) -> None:
        self.alloc.abandon()
        self.ctx.close()


def compile_graph(
    lib: Lib, backend: Backend, max_nodes: int, build: Callable[[Builder], Any]
) -> CompiledGraph:
    """Build a graph with ``build(builder) -> output`` and allocate its compute buffer."""
    ctx = Context(lib, max_nodes, graph_nodes=max_nodes)
    b = Builder(lib, ctx.ptr, max_nodes)
    out = build(b)
    if out is not None:
        lib.ggml_set_output(out)
        lib.ggml_build_forward_expand(b.gf, out)
    _check_support(lib, backend, b.gf, ctx)
    # a uid lets ggml-rpc re-run a graph it has already received instead of re-sending it
    b.gf.uid = lib.ggml_graph_next_uid()
    alloc = Allocator(lib, backend)
    alloc.alloc(b.gf)
    return CompiledGraph(ctx, alloc, b.gf, b.inputs, b.outputs, out)


def _check_support(lib: Lib, backend: Backend, gf: Any, ctx: Context) -> None:
    """Refuse a graph with an op the backend cannot run, before ggml aborts on it mid-compute."""
    for i in range(lib.ggml_graph_n_nodes(gf)):
        node = lib.ggml_graph_node(gf, i)
        if not lib.ggml_backend_supports_op(backend.ptr, node):
            op = ffi.string(lib.ggml_op_desc(node)).decode()
            shape = [int(node.ne[d]) for d in range(4)]
            ctx.close()
            raise ConfigError(
                f"{backend.name} cannot run {op} {shape} (in a graph of this model); "
                f"place these layers on another device"
            )


def compute(lib: Lib, backend: Backend, g: CompiledGraph) -> None:
    status = lib.ggml_backend_graph_compute(backend.ptr, g.gf)
    if status != 0:
        raise GGMLError(f"graph compute on {backend.name} failed with status {status}")


def put(lib: Lib, t: Any, arr: np.ndarray) -> None:
    lib.ggml_backend_tensor_set(t, ffi.from_buffer(arr), 0, arr.nbytes)


def get(lib: Lib, g: CompiledGraph, name: str, t: Any) -> np.ndarray:
    """Read tensor ``t`` into a host array [ne1, ne0] owned by the graph (reused next read)."""
    host = g.host.get(name)
    if host is None:
        host = g.host[name] = np.empty((t.ne[1], t.ne[0]), dtype=_NUMPY[t.type])
    lib.ggml_backend_tensor_get(t, ffi.from_buffer(host), 0, host.nbytes)
    return host


class Tensors:
    """Named tensors in one backend buffer: a model's weights, or persistent state."""

    def __init__(self, lib: Lib, backend: Backend, specs: dict[str, tuple[int, tuple]], what: str):
        self.lib = lib
        self._ctx = Context(lib, len(specs) + 1)
        self.t: dict[str, Any] = {}
        for name, (gtype, shape) in specs.items():
            ne = ffi.new("int64_t[4]", list(shape) + [1] * (4 - len(shape)))
            t = lib.ggml_new_tensor(self._ctx.ptr, gtype, len(shape), ne)
            lib.ggml_set_name(t, name.encode())
            self.t[name] = t
        self._buf = Buffer(lib, self._ctx, backend, what) if specs else None

    @classmethod
    def from_gguf(cls, lib: Lib, backend: Backend, f: GGUFFile, names, what: str) -> Tensors:
        specs = {n: (int(f.tensors[n].type), f.tensors[n].shape) for n in names}
        out = cls(lib, backend, specs, what)
        for name, t in out.t.items():
            lib.ggml_backend_tensor_set(t, ffi.from_buffer(f.data(name)), 0, f.tensors[name].nbytes)
        return out

    @property
    def nbytes(self) -> int:
        return self._buf.nbytes if self._buf else 0

    def clear(self) -> None:
        if self._buf:
            self._buf.clear(0)

    def close(self) -> None:
        if self._buf:
            self._buf.close()
        self._ctx.close()

    def abandon(self) -> None:
        if self._buf:
            self._buf.abandon()
        self._ctx.close()
