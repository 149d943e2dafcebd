"""A loaded DFlash draft on its device: weights, its KV cache, and the inject/propose graphs.

The target's features come straight from the graph outputs of whichever shards captured them
(local or worker), by ggml_backend_tensor_copy: a prefill chunk's all at once, a verify block's
once its accepted length is known, and only the accepted rows.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from lucepy.errors import ConfigError
from lucepy.ggml import Backend, Context, Lib, alias_tensor
from lucepy.gguf import GGUFFile
from lucepy.models.dflash import DFlash
from lucepy.runtime.graphs import (
    CompiledGraph,
    GraphCache,
    compile_graph,
    compute,
    get,
)
from lucepy.runtime.slots import IdentitySlots
from lucepy.runtime.state import StateSet
from lucepy.runtime.tensors import Tensors

log = logging.getLogger(__name__)


class Draft:
    def __init__(
        self,
        lib: Lib,
        path: str | os.PathLike,
        target_file: GGUFFile,
        target_model,
        backend: Backend,
        n_ctx: int,
    ):
        self.lib, self.backend, self.n_ctx = lib, backend, n_ctx
        self.file = GGUFFile(Path(path))
        try:
            self.model = DFlash.from_gguf(self.file, target_model)
            self.p = self.model.p
            self.n_target_embd = target_model.p.n_embd
            self._load(target_file)
        except BaseException:
            self.file.close()
            raise
        self.kv = StateSet(lib, backend, self.model.make_state(n_ctx), "draft KV")
        self.slots = IdentitySlots(n_ctx)  # the draft's KV rows are the target's positions
        self.graphs = GraphCache()
        self.block = self.p.block_size
        # a draft in a worker runs its steps under the pipeline's supervision (Engine sets both)
        self.remote = False
        self.run = lambda fn: fn()

    def _load(self, target_file: GGUFFile) -> None:
        lib, backend = self.lib, self.backend
        own = self.model.own_weights(self.file)
        self.weights = Tensors.from_gguf(lib, backend, self.file, own, "draft weights")
        # the target's tensors the draft reads (embedding, head), copied onto the draft's device
        shared = self.model.target_weights(target_file)
        self.shared = Tensors.from_gguf(lib, backend, target_file, shared, "draft's target tensors")
        self.w = {**self.shared.t, **self.weights.t}

    def set_block(self, block: int) -> None:
        if not 2 <= block <= self.p.block_size:
            raise ConfigError(
                f"--draft-block must be 2..{self.p.block_size} (the draft's trained "
                f"block size), got {block}"
            )
        self.block = block

    def _graph(self, key: tuple, build) -> CompiledGraph:
        nodes = 64 * self.p.n_layer + 128
        return self.graphs.get(key, lambda: compile_graph(self.lib, self.backend, nodes, build))

    def _put_inputs(self, g: CompiledGraph, batch) -> None:
        """What the draft model derives from the step batch (positions, rows, its mask)."""
        g.write_inputs(self.model.step_inputs(batch, g.inputs))

    def inject(self, features: list[Any], pos0: int, n: int | None = None) -> None:
        """Write K/V of the first ``n`` (default: all) rows of the target's features, one
        captured ``feat.L`` output [n_embd, T] per target layer, at positions pos0.. They are
        copied backend to backend (ggml stages the copy when the backends differ)."""
        self.run(lambda: self._inject(features, pos0, n or int(features[0].ne[1])))

    def _inject(self, features: list[Any], pos0: int, T: int) -> None:
        g = self._graph(
            ("inject", T),
            lambda b: self.model.build_inject(b, self.w, self.kv.t, self.n_target_embd, T),
        )
        rows = Context(self.lib, len(features) + 1)
        try:
            for j, f in enumerate(features):
                first = alias_tensor(self.lib, rows.ptr, f, (int(f.ne[0]), T), (int(f.nb[1]),), 0)
                self.lib.ggml_backend_tensor_copy(first, g.inputs[f"feat.{j}"])
        finally:
            rows.close()
        self._put_inputs(g, self.slots.batch(np.zeros(T, dtype=np.int32), pos0))
        compute(self.lib, self.backend, g)

    def propose(self, last: int, pos0: int, want: str, block: int | None = None) -> np.ndarray:
        """Run the block [last, mask...] of ``block`` (default: the draft's) tokens at pos0;
        argmax [B] or logits [B, n_vocab] per row."""
        return self.run(lambda: self._propose(last, pos0, want, block or self.block))

    def _propose(self, last: int, pos0: int, want: str, T: int) -> np.ndarray:
        tokens = np.full(T, self.p.mask_token, dtype=np.int32)
        tokens[0] = last
        batch = self.slots.batch(tokens, pos0)
        n_kv = batch.n_kv
        g = self._graph(
            ("propose", T, n_kv), lambda b: self.model.build_propose(b, self.w, self.kv.t, T, n_kv)
        )
        self._put_inputs(g, batch)
        compute(self.lib, self.backend, g)
        if want == "argmax":
            return get(self.lib, g, "argmax", g.outputs["argmax"])[0]
        return get(self.lib, g, "out", g.output)

    def reset(self) -> None:
        """Nothing to clear: KV rows are written (injected) before they are read."""

    def abandon(self) -> None:
        """Drop every device handle without freeing it: the draft's worker is gone."""
        for g in self.graphs.values():
            g.abandon()
        self.graphs.clear()
        for t in ("kv", "weights", "shared"):
            if hasattr(self, t):
                getattr(self, t).abandon()
        self.backend.abandon()
        self.file.close()

    def close(self) -> None:
        for g in self.graphs.values():
            g.close()
        self.graphs.clear()
        for t in ("kv", "weights", "shared"):
            if hasattr(self, t):
                getattr(self, t).close()
        self.backend.close()
        self.file.close()
