"""The step batch (decision 8): every token of a step with its position, sequence and KV slot, and
what the cache rows the step attends over hold. runtime builds it from its slot allocator; each
model turns it into its own graph inputs (position layout, masks, rows), so runtime writes no
model's input by itself.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

NEG_INF = np.float16(-np.inf)


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
        pos = self.pos[:, None] if causal else np.full((self.n_tokens, 1), self.pos.max())
        if self.streams:  # [T, n_kv] is ggml's [n_kv, T/S, 1, S]: each sequence's own rows
            ok = np.arange(self.n_kv)[None, :] <= pos
            return np.where(ok, np.float16(0), NEG_INF).astype(np.float16)
        cpos = self.cell_pos[None, :]
        ok = (cpos >= 0) & (self.cell_seq[None, :] == self.seq[:, None]) & (cpos <= pos)
        if window > 0:
            ok &= pos - cpos < window
        if self.cell_until is not None:
            ok &= pos < self.cell_until[None, :]
        out = np.zeros(ok.shape, dtype=np.float16)
        out[~ok] = NEG_INF
        return out

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
