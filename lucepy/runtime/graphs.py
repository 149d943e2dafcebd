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
from lucepy.ggml import VIEW_OPS, Allocator, Backend, Buffer, Context, Lib, Sched, ffi
from lucepy.ggml.bufts import matmul_placement
from lucepy.gguf import GGUFFile
from lucepy.models.base import Builder

_NUMPY = {0: np.float32, 26: np.int32}  # ggml type -> host dtype of outputs we read


@dataclass
class CompiledGraph:
    ctx: Context
    alloc: Allocator | Sched
    gf: Any
    inputs: dict[str, Any]
    outputs: dict[str, Any]
    output: Any
    constants: dict[str, np.ndarray] = field(default_factory=dict)  # inputs written every step
    host: dict[str, np.ndarray] = field(default_factory=dict)  # read buffers, made on first read
    routed: tuple[int, ...] = ()  # the layers whose expert choices the "routing" rows hold

    def close(self) -> None:
        self.alloc.close()
        self.ctx.close()

    def abandon(self) -> None:
        self.alloc.abandon()
        self.ctx.close()


def compile_graph(
    lib: Lib,
    backend: Backend,
    max_nodes: int,
    build: Callable[[Builder], Any],
    host: Backend | None = None,
    routing: bool = True,
) -> CompiledGraph:
    """Build a graph with ``build(builder) -> output`` and allocate its compute buffer. With a
    ``host`` CPU backend, the nodes the builder offloads (cold experts) run there, the rest on
    ``backend``, through a ggml_backend_sched that copies between them. ``routing``: output the
    experts each MoE layer chose.

    A graph with routed experts goes through the scheduler given a ``host`` even when nothing is
    offloaded: the scheduler lets the backend see the graph first (ggml-cuda then keeps the
    expert outputs and weights alive until their weighted sum, as its fused top-k and weighted
    sum kernels need), where a plain allocator may reuse that memory and ggml-cuda then runs
    those steps op by op."""
    ctx = Context(lib, max_nodes, graph_nodes=max_nodes)
    b = Builder(lib, ctx.ptr, max_nodes)
    out = build(b)
    routed = tuple(sorted(b.routes)) if routing else ()  # a dense layer routes nothing
    if routed:  # one read a step for every MoE layer's choice: [k*T, len(routed)]
        b.pack_output("routing", [b.routes[il] for il in routed])
    if out is not None:
        lib.ggml_set_output(out)
        lib.ggml_build_forward_expand(b.gf, out)
    _check_support(lib, backend, b.gf, ctx, skip={int(ffi.cast("intptr_t", t)) for t in b.offload})
    # a uid lets ggml-rpc re-run a graph it has already received instead of re-sending it
    b.gf.uid = lib.ggml_graph_next_uid()
    if host is None or not (b.offload or b.routes):
        alloc: Allocator | Sched = Allocator(lib, backend)
    else:
        alloc = Sched(lib, [backend, host], 2 * max_nodes + 64)
        # every op placed here, none left to the scheduler's guesses: the offloaded ones on the
        # host, the rest on the device; views stay with their source, wherever that is
        offload = {int(ffi.cast("intptr_t", t)) for t in b.offload}
        for i in range(lib.ggml_graph_n_nodes(b.gf)):
            node = lib.ggml_graph_node(b.gf, i)
            if int(ffi.cast("intptr_t", node)) in offload:
                alloc.assign(node, host)
            elif node.op not in VIEW_OPS:
                alloc.assign(node, backend)
        if "routing" in b.outputs:  # a leaf the copies fill: the scheduler cannot place it
            alloc.assign(b.outputs["routing"], backend)
        for t in b.inputs.values():  # written on the device, not on the host and copied over
            alloc.assign(t, backend)
    alloc.alloc(b.gf)
    return CompiledGraph(ctx, alloc, b.gf, b.inputs, b.outputs, out, b.constants, routed=routed)


def _check_support(lib: Lib, backend: Backend, gf: Any, ctx: Context, skip: set[int]) -> None:
    """Refuse a graph with an op the backend cannot run, before ggml aborts on it mid-compute."""
    for i in range(lib.ggml_graph_n_nodes(gf)):
        node = lib.ggml_graph_node(gf, i)
        if int(ffi.cast("intptr_t", node)) in skip:
            continue
        if not lib.ggml_backend_supports_op(backend.ptr, node):
            op = ffi.string(lib.ggml_op_desc(node)).decode()
            shape = [int(node.ne[d]) for d in range(4)]
            ctx.close()
            raise ConfigError(
                f"{backend.name} cannot run {op} {shape} (in a graph of this model); "
                f"place these layers on another device"
            )


def compute(lib: Lib, backend: Backend, g: CompiledGraph) -> None:
    if isinstance(g.alloc, Sched):
        status = g.alloc.compute(g.gf)
    else:
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
        matmul = matmul or {}
        source = {n: n for n in names} | matmul
        specs = {k: (int(f.tensors[s].type), f.tensors[s].shape) for k, s in source.items()}
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
            info = f.tensors[source[name]]
            lib.ggml_backend_tensor_set(t, ffi.from_buffer(f.data(source[name])), 0, info.nbytes)
        for k, src in shared.items():
            out.t[k] = out.t[src]
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
