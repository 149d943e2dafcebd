"""A shard: one contiguous layer range of a model on one backend, with its weights and state.

Decision 2: a graph is built once per shape bucket ``(n_tokens, n_kv, all_logits)`` and reused; a
step only writes its inputs (tokens or activation, positions, mask, cache rows) and reads the
output.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from lucepy.errors import ContextOverflow, GGMLError
from lucepy.ggml import Allocator, Backend, Buffer, Context, Lib, ffi
from lucepy.gguf import GGUFFile
from lucepy.models.base import Builder

log = logging.getLogger(__name__)

KV_BUCKET = 256  # attention windows grow in steps of this many rows, so decode graphs are reused
_NEG_INF = np.float16(-np.inf)


@dataclass
class CachedGraph:
    ctx: Context
    alloc: Allocator
    gf: Any
    inputs: dict[str, Any]
    output: Any
    out: np.ndarray  # host buffer the output is read into

    def close(self) -> None:
        self.alloc.close()
        self.ctx.close()


def _new_tensors(lib: Lib, ctx: Context, specs: dict[str, tuple[int, tuple[int, ...]]]) -> dict:
    out = {}
    for name, (gtype, shape) in specs.items():
        ne = ffi.new("int64_t[4]", list(shape) + [1] * (4 - len(shape)))
        t = lib.ggml_new_tensor(ctx.ptr, gtype, len(shape), ne)
        lib.ggml_set_name(t, name.encode())
        out[name] = t
    return out


class Shard:
    def __init__(
        self,
        lib: Lib,
        model: Any,
        f: GGUFFile,
        layers: range,
        backend: Backend,
        n_ctx: int,
        process: str = "local",
    ):
        self.lib, self.model, self.layers, self.backend = lib, model, layers, backend
        self.n_ctx, self.process = n_ctx, process
        self.graphs: dict[tuple, CachedGraph] = {}
        # False rebuilds every step: only to test that reuse changes nothing
        self.reuse_graphs = True
        shapes = model.weight_shapes(layers, f)
        specs = {name: (int(f.tensors[name].type), shape) for name, shape in shapes.items()}
        self._wctx = Context(lib, len(specs) + 1)
        self.weights = _new_tensors(lib, self._wctx, specs)
        self._wbuf = Buffer(lib, self._wctx, backend, f"weights of layers {layers}")
        for name, t in self.weights.items():
            lib.ggml_backend_tensor_set(t, ffi.from_buffer(f.data(name)), 0, f.tensors[name].nbytes)
        state_specs = model.state_shapes(layers, n_ctx)
        self._sctx = Context(lib, len(state_specs) + 1)
        self.state = _new_tensors(lib, self._sctx, state_specs)
        self._sbuf = (
            Buffer(lib, self._sctx, backend, f"state of layers {layers}") if state_specs else None
        )
        self.reset()

    @property
    def weight_bytes(self) -> int:
        return self._wbuf.nbytes

    @property
    def state_bytes(self) -> int:
        return self._sbuf.nbytes if self._sbuf else 0

    def reset(self) -> None:
        """Forget the sequence: zero the recurrent state (KV rows are masked until rewritten)."""
        if self._sbuf:
            self._sbuf.clear(0)

    def n_kv_for(self, end: int) -> int:
        if end > self.n_ctx:
            raise ContextOverflow(
                f"position {end} is past the context of {self.n_ctx}; "
                f"start a new sequence or raise --max-ctx"
            )
        return min(self.n_ctx, -(-end // KV_BUCKET) * KV_BUCKET)

    def graph(self, n_tokens: int, n_kv: int, all_logits: bool) -> CachedGraph:
        key = (n_tokens, n_kv, all_logits)
        g = self.graphs.get(key)
        if g is None:
            g = self.graphs[key] = self._build(n_tokens, n_kv, all_logits)
        return g

    def _build(self, n_tokens: int, n_kv: int, all_logits: bool) -> CachedGraph:
        lib = self.lib
        max_nodes = 128 * len(self.layers) + 256
        ctx = Context(lib, max_nodes, graph_nodes=max_nodes)
        b = Builder(lib, ctx.ptr, max_nodes)
        out = self.model.build(b, self.weights, self.state, self.layers, n_tokens, n_kv, all_logits)
        lib.ggml_set_output(out)
        lib.ggml_build_forward_expand(b.gf, out)
        # a uid lets ggml-rpc re-run a graph it has already received instead of re-sending it
        b.gf.uid = lib.ggml_graph_next_uid()
        alloc = Allocator(lib, self.backend)
        alloc.alloc(b.gf)
        host = np.empty((out.ne[1], out.ne[0]), dtype=np.float32)
        log.debug(
            "built graph T=%d n_kv=%d: %d nodes, %d bytes",
            n_tokens,
            n_kv,
            lib.ggml_graph_n_nodes(b.gf),
            alloc.nbytes,
        )
        return CachedGraph(ctx, alloc, b.gf, b.inputs, out, host)

    def prepare(self, n_tokens: int, pos0: int, all_logits: bool) -> CachedGraph:
        """The graph for this step, with positions, mask and cache rows written."""
        n_kv = self.n_kv_for(pos0 + n_tokens)
        g = self.graph(n_tokens, n_kv, all_logits)
        if "pos" in g.inputs:
            pos = np.arange(pos0, pos0 + n_tokens, dtype=np.int32)
            self._put(g.inputs["pos"], np.concatenate([pos, pos, pos, np.zeros_like(pos)]))
            self._put(g.inputs["rows"], pos.astype(np.int64))
            mask = np.zeros((n_tokens, n_kv), dtype=np.float16)
            mask[np.arange(n_kv)[None, :] > pos[:, None]] = _NEG_INF  # token t sees rows <= pos0+t
            self._put(g.inputs["mask"], mask)
        return g

    def put_tokens(self, g: CachedGraph, tokens: np.ndarray) -> None:
        self._put(g.inputs["tokens"], np.ascontiguousarray(tokens, dtype=np.int32))

    def compute(self, g: CachedGraph) -> None:
        status = self.lib.ggml_backend_graph_compute(self.backend.ptr, g.gf)
        if status != 0:
            raise GGMLError(f"graph compute on {self.backend.name} failed with status {status}")

    def read(self, g: CachedGraph) -> np.ndarray:
        """The output rows [rows, width] as float32, in a host buffer the graph owns."""
        self.lib.ggml_backend_tensor_get(g.output, ffi.from_buffer(g.out), 0, g.out.nbytes)
        return g.out

    def release(self, g: CachedGraph) -> None:
        if not self.reuse_graphs:
            key = next(k for k, v in self.graphs.items() if v is g)
            self.graphs.pop(key).close()

    def _put(self, t: Any, arr: np.ndarray) -> None:
        self.lib.ggml_backend_tensor_set(t, ffi.from_buffer(arr), 0, arr.nbytes)

    def abandon(self) -> None:
        """Drop every handle without freeing it: for a shard whose worker died, where freeing
        would talk to a dead connection."""
        for g in self.graphs.values():
            g.alloc.abandon()
        for owner in (self._sbuf, self._wbuf, self.backend):
            if owner is not None:
                owner.abandon()
        self.graphs.clear()
        self._sctx.close()
        self._wctx.close()

    def close(self) -> None:
        for g in self.graphs.values():
            g.close()
        self.graphs.clear()
        for owner in (self._sbuf, self._sctx, self._wbuf, self._wctx, self.backend):
            if owner is not None:
                owner.close()
