"""A shard: one contiguous layer range of a model on one backend, with its weights and state.

Graphs are cached per ``GraphSpec`` (tokens, KV bucket, logits rows, verify, capture). A verify
graph keeps per-token recurrent snapshots, and a small rollback graph per kept length copies the
right snapshot back into the state (decision 4).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from lucepy.errors import ContextOverflow
from lucepy.ggml import Backend, Lib
from lucepy.gguf import GGUFFile
from lucepy.models.base import GraphSpec
from lucepy.runtime.graphs import CompiledGraph, Tensors, compile_graph, compute, get, put

log = logging.getLogger(__name__)

KV_BUCKET = 256  # attention windows grow in steps of this many rows, so decode graphs are reused
_NEG_INF = np.float16(-np.inf)


def kv_bucket(end: int, n_ctx: int) -> int:
    return min(n_ctx, -(-end // KV_BUCKET) * KV_BUCKET)


def causal_mask(pos0: int, n_tokens: int, n_kv: int) -> np.ndarray:
    """[T, n_kv] f16: token t sees cache rows 0 .. pos0 + t."""
    mask = np.zeros((n_tokens, n_kv), dtype=np.float16)
    pos = np.arange(pos0, pos0 + n_tokens)
    mask[np.arange(n_kv)[None, :] > pos[:, None]] = _NEG_INF
    return mask


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
        self.graphs: dict[GraphSpec, CompiledGraph] = {}
        self._rollbacks: dict[tuple[GraphSpec, int], CompiledGraph] = {}
        # False rebuilds every step: only to test that reuse changes nothing
        self.reuse_graphs = True
        self.weights = Tensors.from_gguf(
            lib,
            backend,
            f,
            model.weight_shapes(layers, f),
            f"weights of layers {layers}",
            matmul=model.matmul_weights(layers, f),
        )
        self.state = Tensors(
            lib, backend, model.state_shapes(layers, n_ctx), f"state of layers {layers}"
        )
        self.reset()

    @property
    def weight_bytes(self) -> int:
        return self.weights.nbytes

    @property
    def state_bytes(self) -> int:
        return self.state.nbytes

    def reset(self) -> None:
        """Forget the sequence: zero the recurrent state (KV rows are masked until rewritten)."""
        self.state.clear()

    def spec(
        self, n_tokens: int, pos0: int, logits: str, verify: bool, capture: tuple[int, ...]
    ) -> GraphSpec:
        end = pos0 + n_tokens
        if end > self.n_ctx:
            raise ContextOverflow(
                f"position {end} is past the context of {self.n_ctx}; "
                f"start a new sequence or raise --max-ctx"
            )
        mine = tuple(
            L
            for L in capture
            if self.layers.start <= L < self.layers.stop
            or L == self.layers.stop == self.model.p.n_layer
        )
        last = self.layers.stop == self.model.p.n_layer
        return GraphSpec(
            n_tokens, kv_bucket(end, self.n_ctx), logits if last else "last", verify, mine
        )

    def graph(self, spec: GraphSpec) -> CompiledGraph:
        g = self.graphs.get(spec)
        if g is None:
            max_nodes = 160 * len(self.layers) + 256
            g = self.graphs[spec] = compile_graph(
                self.lib,
                self.backend,
                max_nodes,
                lambda b: self.model.build(b, self.weights.t, self.state.t, self.layers, spec),
            )
            log.debug(
                "built %s on %s: %d nodes, %d bytes",
                spec,
                self.backend.name,
                self.lib.ggml_graph_n_nodes(g.gf),
                g.alloc.nbytes,
            )
        return g

    def prepare(self, spec: GraphSpec, pos0: int) -> CompiledGraph:
        """The graph for this step, with positions, mask and cache rows written."""
        g = self.graph(spec)
        if "pos" in g.inputs:
            pos = np.arange(pos0, pos0 + spec.n_tokens, dtype=np.int32)
            put(self.lib, g.inputs["pos"], np.concatenate([pos, pos, pos, np.zeros_like(pos)]))
            put(self.lib, g.inputs["rows"], pos.astype(np.int64))
            put(self.lib, g.inputs["mask"], causal_mask(pos0, spec.n_tokens, spec.n_kv))
        return g

    def put_tokens(self, g: CompiledGraph, tokens: np.ndarray) -> None:
        put(self.lib, g.inputs["tokens"], np.ascontiguousarray(tokens, dtype=np.int32))

    def compute(self, g: CompiledGraph) -> None:
        compute(self.lib, self.backend, g)

    def read(self, g: CompiledGraph, what: str = "out") -> np.ndarray:
        """An output as a host array [rows, width], in a buffer the graph owns."""
        t = g.output if what == "out" else g.outputs[what]
        return get(self.lib, g, what, t)

    def features(self, g: CompiledGraph) -> dict[int, np.ndarray]:
        return {int(k[5:]): self.read(g, k) for k in g.outputs if k.startswith("feat.")}

    def rollback(self, g: CompiledGraph, spec: GraphSpec, keep: int) -> None:
        """After a verify pass of ``spec.n_tokens``, keep only the first ``keep`` tokens' effect."""
        if keep == spec.n_tokens or not any(k.startswith("gdn.") for k in g.outputs):
            return
        rb = self._rollbacks.get((spec, keep))
        if rb is None:
            rb = self._rollbacks[(spec, keep)] = compile_graph(
                self.lib,
                self.backend,
                8 * len(self.layers) + 16,
                lambda b: self.model.rollback(
                    b, self.state.t, self.layers, g.outputs, spec.n_tokens, keep
                ),
            )
        compute(self.lib, self.backend, rb)

    def release(self, spec: GraphSpec) -> None:
        if not self.reuse_graphs:
            for key in [k for k in self._rollbacks if k[0] == spec]:
                self._rollbacks.pop(key).close()
            self.graphs.pop(spec).close()

    def _all_graphs(self) -> list[CompiledGraph]:
        return [*self._rollbacks.values(), *self.graphs.values()]

    def abandon(self) -> None:
        """Drop every handle without freeing it: for a shard whose worker died, where freeing
        would talk to a dead connection."""
        for g in self._all_graphs():
            g.abandon()
        self.graphs.clear()
        self._rollbacks.clear()
        self.state.abandon()
        self.weights.abandon()
        self.backend.abandon()

    def close(self) -> None:
        for g in self._all_graphs():
            g.close()
        self.graphs.clear()
        self._rollbacks.clear()
        self.state.close()
        self.weights.close()
        self.backend.close()
