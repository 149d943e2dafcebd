"""The step batch (decision 8): every token of a step with its position, sequence and KV slot, and
what the cache rows the step attends over hold. runtime builds it from its slot allocator; each
model turns it into its own graph inputs (position layout, masks, rows), so runtime writes no
model's input by itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

NEG_INF = np.float16(-np.inf)
_MASKED = NEG_INF.view(np.uint16)  # -inf's bits
_NOT_SEEN = np.int32(np.iinfo(np.int32).max)  # a row's key where no token of the step sees it


@dataclass(frozen=True)
class Fill:
    """A graph input written in place: ``fill(dst)`` writes ``size`` values of ``dtype`` into
    the graph's own flat array of the input (``StepBatch.mask_input``), whose size and type
    ``InputBlock.write`` checks first, as it checks an array's."""

    size: int
    dtype: np.dtype
    fill: Callable[[np.ndarray], None]


# a graph input's host value for a step: its array, or a Fill (CompiledGraph.write_inputs)
StepInput = np.ndarray | Fill


@dataclass(frozen=True)
class StepBatch:
    tokens: np.ndarray  # [T] int32
    pos: np.ndarray  # [T] int32: each token's position in its sequence
    seq: np.ndarray  # [T] int32: each token's sequence id
    slots: np.ndarray  # [T] int64: the cache row each token's K/V is written to
    cell_pos: np.ndarray  # [n_kv] int32: the position a cache row holds after the write; -1 empty
    cell_seq: np.ndarray  # [n_kv] int32: the sequence a cache row belongs to
    span: int = 0  # rows a cache indexed by position would attend over; 0: n_kv (KV Flash's
    # pool attends over fewer; a sliding window's ring follows the positions)
    cell_until: np.ndarray | None = None  # [n_kv] int32: a row is seen only by tokens before
    # this position (KV Flash: a chunk paged out inside the step); None: by all
    # S > 0: the step is sequences F..F+S-1 (F: ``stream_first``), T/S tokens each in sequence
    # order, and sequence s attends over its own n_kv rows, ``stream_rows`` * s onward (row r
    # of them holds position r); cell_pos and cell_seq are unused. 0: every token attends over
    # the same n_kv rows.
    streams: int = 0
    stream_rows: int = 0
    stream_first: int = 0

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.size)

    @property
    def n_kv(self) -> int:
        return int(self.cell_pos.size)

    @property
    def n_span(self) -> int:
        return self.span or self.n_kv

    def mask(self, window: int = 0, causal: bool = True) -> np.ndarray:
        """[T, n_kv] f16: 0 where a token may attend to a row (its own sequence, not after it,
        and with ``window`` > 0 fewer than ``window`` positions back), -inf elsewhere. Not
        ``causal``: every token also sees the rest of the step (a DFlash block)."""
        out = np.empty((self.n_tokens, self.n_kv), dtype=np.float16)
        self.fill_mask(out, window, causal)
        return out

    def mask_input(self, window: int = 0, causal: bool = True) -> Fill:
        """``mask`` as a graph input that fills the graph's own array of it
        (``CompiledGraph.write_inputs``): no array of T x n_kv made and copied a step (made and
        copied, a 512-token chunk's over 8,704 rows took 5.3 ms of host time, its temporaries'
        page faults; in place 0.74: docs/BENCHMARKS.md, session 58)."""
        shape = (self.n_tokens, self.n_kv)
        return Fill(
            shape[0] * shape[1],
            np.dtype(np.float16),
            lambda dst: self.fill_mask(dst.reshape(shape), window, causal),
        )

    def fill_mask(self, out: np.ndarray, window: int = 0, causal: bool = True) -> None:
        """``mask`` into ``out`` ([T, n_kv] f16), with no array of its size besides: each value's
        bits 1 where masked, then times -inf's bits."""
        pos = self.pos[:, None] if causal else np.full((self.n_tokens, 1), self.pos.max())
        bad = out.view(np.uint16)
        if self.streams:  # [T, n_kv] is ggml's [n_kv, T/S, 1, S]: each sequence's own rows
            np.greater(np.arange(self.n_kv)[None, :], pos, out=bad, casting="unsafe")
        else:
            cpos, seq = self.cell_pos, self.seq
            if seq.size == 1 or (seq.size and (seq == seq[0]).all()):
                # one sequence: a row's key, its position where the sequence holds it
                key = np.where((cpos >= 0) & (self.cell_seq == seq[0]), cpos, _NOT_SEEN)
                np.greater(key, pos, out=bad, casting="unsafe")
            else:
                ok = (cpos >= 0) & (self.cell_seq[None, :] == seq[:, None]) & (cpos <= pos)
                np.logical_not(ok, out=bad, casting="unsafe")
            if window > 0:
                bad |= pos - cpos >= window
            if self.cell_until is not None:
                bad |= pos >= self.cell_until
        np.multiply(bad, _MASKED, out=bad)

    def ring(self, size: int, n_rows: int) -> StepBatch:
        """This step as a ring of ``size`` rows sees it (position p in row ``p % size``), over its
        first ``n_rows`` rows: each row holds the latest position before the step's end that maps
        to it. One sequence, fed from position 0 (each sequence would need its own ring)."""
        if self.seq.any():
            raise ValueError("a KV ring holds one sequence")
        end = int(self.pos.max()) + 1
        latest = end - 1 - (end - 1 - np.arange(n_rows)) % size
        cell_pos = np.where(latest >= 0, latest, -1).astype(np.int32)
        slots = (self.pos % size).astype(np.int64)
        return replace(
            self,
            slots=slots,
            cell_pos=cell_pos,
            cell_seq=np.zeros_like(cell_pos),
            cell_until=None,
        )
