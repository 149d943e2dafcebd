"""Per-layer state, declared by the model (decision 7): what each layer keeps between steps.

A model's ``make_state(layers, n_ctx)`` returns one object per stateful layer. runtime/ allocates
their tensors (``specs``), and snapshots, restores, exports and imports them through ``views``:
the part of each tensor that holds a given number of cached rows. It never reads a tensor name to
learn what a tensor is.

- ``KVCache``: attention keys and values, one cache row (a slot the step batch assigns) per token.
  It *appends*: a snapshot of more rows holds a shorter one's rows unchanged, so a chained disk
  snapshot stores only the rows added since its parent.
- ``RingKVCache``: sliding-window attention keys and values in a ring: position p lives in row
  ``p % ring``, and the ring holds the window plus the longest step, so a step never overwrites a
  row that one of its own tokens, or a token after a rollback, still attends to. It is stored
  whole (it does not append).
- ``DeltaNetState``: Gated DeltaNet conv tail and recurrent matrix, whole at every length; a verify
  step keeps the state before it and the recurrence's inputs, and ``rollback`` runs the
  recurrence again over the kept tokens (decision 4).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from lucepy.ggml import GGML_TYPE_F16, GGML_TYPE_F32

Tensor = Any
Spec = tuple[int, tuple[int, ...]]  # (ggml type, shape in ggml order)


class LayerState:
    """The protocol every state kind implements. ``views(rows)`` names the part that a snapshot
    of ``rows`` cache rows holds; ``rollback`` adds to a graph the copies that undo a verify step
    past ``keep`` tokens (none where rows are masked by position)."""

    layer: int
    rolls_back = False  # whether a verify step must keep snapshots for ``rollback``
    # whether the views only grow, one row (their outermost dimension) per cache row, with the
    # rows of a shorter view unchanged in a longer one; otherwise a snapshot stores them whole
    appends = False
    # whether it holds several sequences (--parallel): KV rows by sequence, or a slice of the
    # recurrent state per sequence (``seq_slices``)
    sequences = False

    def specs(self) -> dict[str, Spec]:
        raise NotImplementedError

    def seq_slices(self) -> dict[str, int]:
        """Tensors kept whole per sequence, with their sequence count: sequence s is slice s
        of the outermost dimension (a new sequence starts from zeros there)."""
        return {}

    def views(self, rows: int) -> dict[str, tuple[int, ...]]:
        raise NotImplementedError

    def nbytes(self, rows: int, lib) -> int:
        """Bytes of a snapshot of ``rows`` cache rows."""
        total = 0
        for name, shape in self.views(rows).items():
            gtype = self.specs()[name][0]
            total += lib.ggml_row_size(gtype, shape[0]) * _prod(shape[1:])
        return total

    def trim(self, rows: int) -> int:
        """The rows still meaningful after keeping ``rows`` tokens: all of them, for kinds whose
        rows a mask hides past the end, and nothing to free."""
        return rows

    def rollback(self, g, st: dict[str, Tensor], outputs: dict, n_tokens: int, keep: int) -> None:
        return None


class KVCache(LayerState):
    """Full attention: ``k.L`` and ``v.L`` [width, n_ctx], one row per cache slot, of the cache
    types the run asks for (llama.cpp's -ctk/-ctv; f16 by default)."""

    appends = True
    sequences = True

    def __init__(
        self, layer: int, width: int, n_ctx: int, k_type: int, v_type: int, head_dim: int = 0
    ):
        self.layer, self.width, self.n_ctx = layer, width, n_ctx
        self.k, self.v = f"k.{layer}", f"v.{layer}"
        self.types = {self.k: k_type, self.v: v_type}
        # A quantized cache stores rotated heads, as llama.cpp's does (llama-kv-cache.cpp): Q and K
        # turned by the largest Walsh-Hadamard matrix (64, 128, ...) that divides the head, V by
        # the 64 one and turned back after attention. 0: no rotation.
        self.k_rot = _largest_rotation(head_dim) if quantized(k_type) and head_dim else 0
        self.v_rot = 64 if quantized(v_type) and head_dim and head_dim % 64 == 0 else 0

    def specs(self) -> dict[str, Spec]:
        return {name: (gtype, (self.width, self.n_ctx)) for name, gtype in self.types.items()}

    def views(self, rows: int) -> dict[str, tuple[int, ...]]:
        return {self.k: (self.width, rows), self.v: (self.width, rows)}


class RingKVCache(KVCache):
    """Sliding-window attention: ``k.L`` and ``v.L`` [width, ring]. Row ``p % ring`` holds
    position ``p``; a snapshot holds the whole ring."""

    appends = False
    sequences = False

    def views(self, rows: int) -> dict[str, tuple[int, ...]]:
        return {self.k: (self.width, self.n_ctx), self.v: (self.width, self.n_ctx)}


class DeltaNetState(LayerState):
    """Gated DeltaNet: ``conv.L`` [K-1, channels] (the conv's last inputs) and ``ssm.L``
    [S, S, H] (the recurrent matrix per value head), with an outer dimension of ``n_seq``
    sequences when there are several (--parallel). The conv's channels are q's ``k_heads`` heads,
    k's, then v's ``heads``, each of S. A verify graph outputs ``conv.L`` (the conv input with the
    saved tail) and what the recurrence read: ``gdn_s0.L`` (the state before the step), ``gdn_qk.L``
    (q's and k's normalized heads), ``gdn_x.L`` (the conv's output, v its last channels),
    ``gdn_decay.L`` and ``gdn_beta.L``. Snapshots, verify and rollback are sequence 0's (the
    one-sequence engine's)."""

    rolls_back = True
    sequences = True

    def __init__(
        self,
        layer: int,
        conv_tail: int,
        channels: int,
        head_dim: int,
        heads: int,
        k_heads: int,
        n_seq: int = 1,
    ):
        self.layer, self.conv_tail, self.channels = layer, conv_tail, channels
        self.head_dim, self.heads, self.k_heads, self.n_seq = head_dim, heads, k_heads, n_seq
        self.conv, self.ssm = f"conv.{layer}", f"ssm.{layer}"

    def specs(self) -> dict[str, Spec]:
        S, more = self.head_dim, (self.n_seq,) if self.n_seq > 1 else ()
        return {
            self.conv: (GGML_TYPE_F32, (self.conv_tail, self.channels, *more)),
            self.ssm: (GGML_TYPE_F32, (S, S, self.heads, *more)),
        }

    def seq_slices(self) -> dict[str, int]:
        return {self.conv: self.n_seq, self.ssm: self.n_seq}

    def views(self, rows: int) -> dict[str, tuple[int, ...]]:
        """Sequence 0's slice."""
        S = self.head_dim
        return {self.conv: (self.conv_tail, self.channels), self.ssm: (S, S, self.heads)}

    def rollback(self, g, st: dict[str, Tensor], outputs: dict, n_tokens: int, keep: int) -> None:
        """Set the state after the first ``keep`` of ``n_tokens`` verified tokens: the recurrence
        run again over those tokens from the state before the verify (one op, the same
        arithmetic token by token, so the same state as a step of ``keep`` tokens), and the
        conv's tail copied from its input columns. Keeping 16 per-token snapshots instead wrote
        16 states a verify (docs/architecture.md, decision 4)."""
        L, c, S, H, K1, il = g.lib, g.ctx, self.head_dim, self.heads, self.conv_tail, self.layer
        s0 = outputs[f"gdn_s0.{il}"]
        fs = L.ggml_element_size(s0)
        s0 = g.alias(s0, (S, S, H, 1), (s0.nb[1], s0.nb[2], s0.nb[3]), 0)
        qk = outputs[f"gdn_qk.{il}"]  # [S, 2 k_heads, n_tokens, 1]
        strides = (qk.nb[1], qk.nb[2], qk.nb[3])
        q = g.alias(qk, (S, self.k_heads, keep, 1), strides, 0)
        k = g.alias(qk, (S, self.k_heads, keep, 1), strides, qk.nb[1] * self.k_heads)
        act = outputs[f"gdn_x.{il}"]  # the conv's output [channels, n_tokens, 1]
        v_at = fs * S * 2 * self.k_heads  # v's channels after q's and k's
        v = g.alias(act, (S, H, keep, 1), (fs * S, act.nb[1], act.nb[2]), v_at)
        decay, beta = (
            g.alias(outputs[f"gdn_{n}.{il}"], (1, H, keep, 1), (fs, fs * H, fs * H * keep), 0)
            for n in ("decay", "beta")
        )
        res = L.ggml_gated_delta_net(c, q, k, v, decay, beta, s0, 1)
        n = S * S * H
        state = L.ggml_view_1d(c, st[self.ssm], n, 0)  # sequence 0's
        after = L.ggml_view_1d(c, res, n, fs * S * H * keep)  # past the attention rows
        L.ggml_build_forward_expand(g.gf, L.ggml_cpy(c, after, state))
        x = outputs[f"conv.{il}"]
        tail = g.alias(x, (K1, x.ne[1]), (x.nb[1],), g.row_size(x, keep))
        conv = st[self.conv]
        conv0 = L.ggml_view_1d(c, conv, K1 * conv.ne[1], 0)  # flat: see qwen35's _conv
        L.ggml_build_forward_expand(g.gf, L.ggml_cpy(c, tail, conv0))


POOL_CHUNK = 64  # KV Flash pages cache rows in chunks of this many positions


def pool_rows(pool: int, max_step: int) -> int:
    """Cache rows behind a KV Flash pool of ``pool`` tokens (runtime/pager.py): the pool, and
    room for the new chunks of the longest step plus one, since a chunk a step pages out stays
    readable to the step's tokens before the position that paged it out."""
    return pool + (-(-max_step // POOL_CHUNK) + 1) * POOL_CHUNK


def quantized(gtype: int) -> bool:
    """Whether a cache of this ggml type stores blocks (q8_0), not floats."""
    return gtype not in (GGML_TYPE_F32, GGML_TYPE_F16)


def _largest_rotation(head_dim: int) -> int:
    """The largest power of two from 64 up that divides ``head_dim``; 0 if 64 does not."""
    if head_dim % 64:
        return 0
    n = 64
    while head_dim % (2 * n) == 0:
        n *= 2
    return n


@cache
def hadamard(n: int) -> np.ndarray:
    """The orthonormal n x n Walsh-Hadamard matrix (Sylvester's), f32: symmetric, its own
    inverse."""
    h = np.ones((1, 1), dtype=np.float64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    scale = np.float32(1.0 / float(np.sqrt(np.float32(n))))
    return (h.astype(np.float32) * scale).astype(np.float32)


def spec_nbytes(gtype: int, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of ggml type ``gtype`` and ``shape`` (whole blocks per row)."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(gtype)]
    return _prod(shape) // block * size


def state_specs(states: list[LayerState]) -> dict[str, Spec]:
    return {name: spec for s in states for name, spec in s.specs().items()}


def _prod(xs) -> int:
    n = 1
    for x in xs:
        n *= x
    return n
