"""A shard: one contiguous layer range of a model on one backend, with its weights and state.

Graphs are cached per ``GraphSpec`` (tokens, KV bucket, logits rows, verify, capture). Each step's
inputs come from the model (``step_inputs`` of the step batch). A verify graph keeps per-token
recurrent snapshots, and a small rollback graph per kept length, built by the layer states, copies
the right snapshot back (decision 4).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from lucepy.ggml import Backend, Lib
from lucepy.gguf import GGUFFile
from lucepy.models.base import GraphSpec
from lucepy.models.batch import StepBatch
from lucepy.runtime.graphs import CompiledGraph, Tensors, compile_graph, compute, get, put
from lucepy.runtime.state import StateSet

log = logging.getLogger(__name__)


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
        self.state = StateSet(
            lib, backend, model.make_state(layers, n_ctx), f"state of layers {layers}"
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
        self, batch: StepBatch, logits: str, verify: bool, capture: tuple[int, ...]
    ) -> GraphSpec:
        mine = tuple(
            L
            for L in capture
            if self.layers.start <= L < self.layers.stop
            or L == self.layers.stop == self.model.p.n_layer
        )
        last = self.layers.stop == self.model.p.n_layer
        return GraphSpec(batch.n_tokens, batch.n_kv, logits if last else "last", verify, mine)

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

    def prepare(self, spec: GraphSpec, batch: StepBatch) -> CompiledGraph:
        """The graph for this step, with the inputs the model derives from the batch written."""
        g = self.graph(spec)
        for name, values in self.model.step_inputs(batch, g.inputs).items():
            put(self.lib, g.inputs[name], values)
        for name, values in g.constants.items():
            put(self.lib, g.inputs[name], values)
        return g

    def compute(self, g: CompiledGraph) -> None:
        compute(self.lib, self.backend, g)

    def read(self, g: CompiledGraph, what: str = "out") -> np.ndarray:
        """An output as a host array [rows, width], in a buffer the graph owns."""
        t = g.output if what == "out" else g.outputs[what]
        return get(self.lib, g, what, t)

    def features(self, g: CompiledGraph, spec: GraphSpec) -> dict[int, Any]:
        """The graph outputs holding the residual entering each captured layer this shard owns
        (``feat.L`` [n_embd, T]), on this shard's backend, valid until its next step."""
        return {L: g.outputs[f"feat.{L}"] for L in spec.capture}

    def rollback(self, g: CompiledGraph, spec: GraphSpec, keep: int) -> None:
        """After a verify pass of ``spec.n_tokens``, keep only the first ``keep`` tokens' effect."""
        if keep == spec.n_tokens or not self.state.rolls_back:
            return
        rb = self._rollbacks.get((spec, keep))
        if rb is None:
            rb = self._rollbacks[(spec, keep)] = compile_graph(
                self.lib,
                self.backend,
                8 * len(self.layers) + 16,
                lambda b: self._rollback(b, g, spec.n_tokens, keep),
            )
        compute(self.lib, self.backend, rb)

    def _rollback(self, b, g: CompiledGraph, n_tokens: int, keep: int) -> None:
        for state in self.state.states:
            state.rollback(b, self.state.t, g.outputs, n_tokens, keep)

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
