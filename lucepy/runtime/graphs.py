"""What a shard and a draft share: compiled, reusable graphs (their tensors in backend buffers:
runtime/tensors.py).

Decision 2: a graph is built once per shape bucket and reused; a step writes its inputs with
``CompiledGraph.write_inputs`` (one copy to the device for all of them) and reads outputs with
``get``. Neither grows with the number of ops in the graph. ``GraphCache`` keeps the built graphs
within a memory budget.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lucepy.errors import ConfigError, GGMLError
from lucepy.ggml import (
    GGML_TYPE_F16,
    GGML_TYPE_F32,
    GGML_TYPE_I32,
    GGML_TYPE_I64,
    VIEW_OPS,
    Allocator,
    Backend,
    Buffer,
    Context,
    Lib,
    RawBuffer,
    Sched,
    address,
    cpu,
    ffi,
)
from lucepy.models.batch import Fill, StepInput
from lucepy.models.builder import Builder

log = logging.getLogger(__name__)

_NUMPY = {
    GGML_TYPE_F32: np.float32,
    GGML_TYPE_F16: np.float16,
    GGML_TYPE_I32: np.int32,
    GGML_TYPE_I64: np.int64,
}  # ggml type -> host dtype of inputs we write and outputs we read
PINNED_MAX = 16 << 20  # a larger staging area is plain host memory (pinning it costs more)
# the compute and input buffers of the graphs one shard (or draft) keeps built; more are freed,
# least recently used first. Measured on the H200: a 512-token prefill graph of the 27B-shaped or
# Laguna-XS.2-shaped model holds 119-130 MiB; 512 MiB held four, fewer than the five windows of a
# 4,096-token prompt, which then rebuilt every chunk (docs/architecture.md, decision 2)
GRAPH_CACHE_BYTES = 1 << 30


class InputBlock:
    """Host-written inputs of a graph in one buffer of their own on the graph's backend, so a
    step sends them in one copy, not one synchronous copy each (on the H200 those cost about
    20 us apiece, a few percent of a decode step). On a host buffer (the CPU) the arrays are the
    buffer itself. Elsewhere a staging area mirrors the buffer, in the device's pinned host
    memory where it has one, and ``send`` queues one copy on the backend's stream, ahead of the
    graph's compute there. The next ``write`` comes after that compute has returned, so the
    staging area is never rewritten under a copy in flight."""

    def __init__(self, lib: Lib, backend: Backend, ctx: Context, tensors: dict[str, Any]):
        self.lib, self.backend, self.ctx = lib, backend, ctx
        self.arrays: dict[str, np.ndarray] = {}
        self._buffer = self._staging = self._span_ctx = None
        if not tensors:
            return
        self._buffer = Buffer(lib, ctx, backend, "graph inputs")
        base, size = lib.ggml_backend_buffer_get_base(self._buffer.ptr), self._buffer.nbytes
        if lib.ggml_backend_buffer_is_host(self._buffer.ptr):
            self._mem, self._src = ffi.buffer(ffi.cast("char *", base), size), None
        else:
            dev = lib.ggml_backend_get_device(backend.ptr)
            pinned = lib.ggml_backend_dev_host_buffer_type(dev) if dev != ffi.NULL else ffi.NULL
            if pinned != ffi.NULL and size <= PINNED_MAX:
                self._staging = RawBuffer(lib, pinned, size, "pinned input staging")
                self._src = self._staging.base
                self._mem = ffi.buffer(ffi.cast("char *", self._src), size)
            else:
                self._mem = np.empty(size, dtype=np.uint8)
                self._src = ffi.from_buffer(self._mem)
            # one tensor over the whole buffer: what ``send`` copies into
            self._span_ctx = Context(lib, 1)
            self._span = lib.ggml_new_tensor_1d(self._span_ctx.ptr, lib.GGML_TYPE_I8, size)
            lib.ggml_backend_tensor_alloc(self._buffer.ptr, self._span, base)
        raw = np.frombuffer(self._mem, dtype=np.uint8)
        start = int(ffi.cast("uintptr_t", base))
        for name, t in tensors.items():
            off, n = int(ffi.cast("uintptr_t", t.data)) - start, lib.ggml_nbytes(t)
            if not 0 <= off <= size - n:  # a context split over several buffers
                raise GGMLError(f"graph input {name} is outside its input buffer")
            self.arrays[name] = raw[off : off + n].view(_NUMPY[t.type])

    def write(self, name: str, values: StepInput) -> None:
        """``values`` into input ``name``'s array here, or a ``Fill`` that writes that array
        itself (``StepBatch.mask_input``: no array of a mask's size made and copied)."""
        dst = self.arrays[name]
        if values.dtype != dst.dtype or values.size != dst.size:
            raise ValueError(
                f"input {name}: got {values.size} {values.dtype}, the graph takes "
                f"{dst.size} {dst.dtype}"
            )
        if isinstance(values, Fill):
            values.fill(dst)
        else:
            dst[:] = values.reshape(-1)

    def send(self) -> None:
        if self._span_ctx is not None:
            self.lib.ggml_backend_tensor_set_async(
                self.backend.ptr, self._span, self._src, 0, len(self._mem)
            )

    @property
    def nbytes(self) -> int:
        return self._buffer.nbytes if self._buffer is not None else 0

    def close(self) -> None:
        for part in (self._buffer, self._staging, self._span_ctx):
            if part is not None:
                part.close()
        self.ctx.close()

    def abandon(self) -> None:
        if self._buffer is not None:
            self._buffer.abandon()
        for part in (self._staging, self._span_ctx):
            if part is not None:
                part.close()
        self.ctx.close()


@dataclass
class CompiledGraph:
    ctx: Context
    alloc: Allocator | Sched
    gf: Any
    inputs: dict[str, Any]
    outputs: dict[str, Any]
    output: Any
    blocks: tuple[InputBlock, InputBlock]  # the step inputs, and the constants (sent once)
    host: dict[str, np.ndarray] = field(default_factory=dict)  # read buffers, made on first read
    routed: tuple[int, ...] = ()  # the layers whose expert choices the "routing" rows hold

    def write_inputs(self, values: dict[str, StepInput]) -> None:
        """Write this step's inputs and queue them to the device in one copy."""
        step = self.blocks[0]
        for name, v in values.items():
            step.write(name, v)
        step.send()

    @property
    def nbytes(self) -> int:
        """Its compute buffers and input buffers."""
        return self.alloc.nbytes + sum(block.nbytes for block in self.blocks)

    def close(self) -> None:
        self.alloc.close()
        for block in self.blocks:
            block.close()
        self.ctx.close()

    def abandon(self) -> None:
        self.alloc.abandon()
        for block in self.blocks:
            block.abandon()
        self.ctx.close()


class GraphCache:
    """Built graphs by shape key, within ``budget`` bytes of buffers: after a build, the least
    recently used are freed until the rest fit, never the graph just built. A prompt prefilled
    in chunks meets a new KV window every chunk: kept forever, those graphs held 45 GiB of an
    H200 after 128k tokens (docs/BENCHMARKS.md). ``on_evict(key)`` drops what depended on a
    freed graph (a shard's rollback graphs read its verify graph's snapshots)."""

    def __init__(
        self, budget: int | None = None, on_evict: Callable[[Hashable], None] | None = None
    ):
        self.budget = GRAPH_CACHE_BYTES if budget is None else budget
        self.on_evict = on_evict
        self._graphs: OrderedDict[Hashable, CompiledGraph] = OrderedDict()
        self.nbytes = self.evicted = 0

    def get(self, key: Hashable, build: Callable[[], CompiledGraph]) -> CompiledGraph:
        g = self._graphs.get(key)
        if g is not None:
            self._graphs.move_to_end(key)
            return g
        g = self._graphs[key] = build()
        self.nbytes += g.nbytes
        while self.nbytes > self.budget and len(self._graphs) > 1:
            old = next(iter(self._graphs))
            self.pop(old).close()
            self.evicted += 1
            if self.on_evict is not None:
                self.on_evict(old)
        return g

    def pop(self, key: Hashable) -> CompiledGraph:
        g = self._graphs.pop(key)
        self.nbytes -= g.nbytes
        return g

    def clear(self) -> None:
        """Forget every graph (its owner has closed or abandoned them)."""
        self._graphs.clear()
        self.nbytes = 0

    def __getitem__(self, key: Hashable) -> CompiledGraph:
        return self._graphs[key]

    def __len__(self) -> int:
        return len(self._graphs)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._graphs

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._graphs)

    def keys(self):
        return self._graphs.keys()

    def values(self):
        return self._graphs.values()

    def items(self):
        return self._graphs.items()


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
    ``backend``, through a ggml_backend_sched that copies between them; the weights the builder
    lists in ``reads`` (experts partly in host RAM, ggml/vmm.py) stay with the device's ops that
    read them. ``routing``: output the experts each MoE layer chose.

    A graph with routed experts goes through the scheduler given a ``host`` even when nothing is
    offloaded: the scheduler lets the backend see the graph first (ggml-cuda then keeps the
    expert outputs and weights alive until their weighted sum, as its fused top-k and weighted
    sum kernels need), where a plain allocator may reuse that memory and ggml-cuda then runs
    those steps op by op."""
    ctx = Context(lib, max_nodes, graph_nodes=max_nodes)
    step_ctx, const_ctx = (Context(lib, Builder.MAX_INPUTS) for _ in range(2))
    b = Builder(lib, ctx.ptr, max_nodes, step_ctx.ptr, const_ctx.ptr)
    out = build(b)
    routed = tuple(sorted(b.routes)) if routing else ()  # a dense layer routes nothing
    if routed:  # one read a step for every MoE layer's choice: [k*T, len(routed)]
        b.pack_output("routing", [b.routes[il] for il in routed])
    if out is not None:
        lib.ggml_set_output(out)
        lib.ggml_build_forward_expand(b.gf, out)
    plain = host is None or not (b.offload or b.routes)
    if plain and backend.is_cpu and (kinds := cpu.kernels(lib, backend)):
        cpu.take_products(lib, ctx.ptr, b.gf, kinds)  # Q4_1, Q5_1: lucepy's kernels, ggml's bits
    offload = {address(t) for t in b.offload}
    _check_support(lib, backend, b.gf, ctx, skip=offload)
    # a uid lets ggml-rpc re-run a graph it has already received instead of re-sending it
    b.gf.uid = lib.ggml_graph_next_uid()
    if plain:
        alloc: Allocator | Sched = Allocator(lib, backend)
    else:
        alloc = Sched(lib, [backend, host], 2 * max_nodes + 64)
        # every op placed here, none left to the scheduler's guesses: the offloaded ones on the
        # host, the rest on the device; views stay with their source, wherever that is
        for i in range(lib.ggml_graph_n_nodes(b.gf)):
            node = lib.ggml_graph_node(b.gf, i)
            if address(node) in offload:
                alloc.assign(node, host)
            elif node.op not in VIEW_OPS:
                alloc.assign(node, backend)
        # expert weights in host RAM that the device reads: the scheduler would give them to
        # the host (they are in a CPU buffer to ggml) and copy them every step
        for t in b.reads:
            alloc.assign(t, backend)
        if "routing" in b.outputs:  # a leaf the copies fill: the scheduler cannot place it
            alloc.assign(b.outputs["routing"], backend)
        for t in b.inputs.values():  # written on the device, not on the host and copied over
            alloc.assign(t, backend)
    blocks = tuple(
        InputBlock(lib, backend, c, {n: t for n, t in b.inputs.items() if b.kinds[n] == kind})
        for c, kind in ((step_ctx, "step"), (const_ctx, "constant"))
    )
    for name, value in b.constants.items():
        blocks[1].write(name, value.astype(np.float32))
    blocks[1].send()
    alloc.alloc(b.gf)
    return CompiledGraph(ctx, alloc, b.gf, b.inputs, b.outputs, out, blocks, routed=routed)


def _check_support(lib: Lib, backend: Backend, gf: Any, ctx: Context, skip: set[int]) -> None:
    """Refuse a graph with an op the backend cannot run, before ggml aborts on it mid-compute."""
    for i in range(lib.ggml_graph_n_nodes(gf)):
        node = lib.ggml_graph_node(gf, i)
        if address(node) in skip:
            continue
        if not lib.ggml_backend_supports_op(backend.ptr, node):
            op = ffi.string(lib.ggml_op_desc(node)).decode()
            shape = [int(node.ne[d]) for d in range(4)]
            ctx.close()
            raise ConfigError(
                f"{backend.name} cannot run {op} {shape} (in a graph of this model); "
                f"place these layers on another device"
            )


def compute(lib: Lib, backend: Backend, g: CompiledGraph, wait: bool = True) -> None:
    """Run ``g``; unless ``wait``, a plain graph only starts (``ggml_backend_synchronize`` ends
    it: the backend's next graph runs after it in any case)."""
    if isinstance(g.alloc, Sched):
        status = g.alloc.compute(g.gf)
    elif wait:
        status = lib.ggml_backend_graph_compute(backend.ptr, g.gf)
    else:
        status = lib.ggml_backend_graph_compute_async(backend.ptr, g.gf)
    if status != 0:
        raise GGMLError(f"graph compute on {backend.name} failed with status {status}")


def get(lib: Lib, g: CompiledGraph, name: str, t: Any) -> np.ndarray:
    """Read tensor ``t`` into a host array [ne1, ne0] owned by the graph (reused next read)."""
    host = g.host.get(name)
    if host is None:
        host = g.host[name] = np.empty((t.ne[1], t.ne[0]), dtype=_NUMPY[t.type])
    lib.ggml_backend_tensor_get(t, ffi.from_buffer(host), 0, host.nbytes)
    return host
