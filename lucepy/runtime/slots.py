"""The KV slot allocator behind the step batch (decision 8). ``IdentitySlots``: one sequence,
and the cache row of a token is its position. ``SeqSlots``: several sequences, each in its own
range of rows, one step holding tokens of any of them (batching). KV Flash's ``PagedSlots``, a
pool of fewer rows than the context managed in chunks of 64 by a pager, is in runtime/pager.py.
"""

from __future__ import annotations

import numpy as np

from lucepy.errors import ContextOverflow
from lucepy.models.batch import StepBatch

KV_BUCKET = 256  # attention windows grow in steps of this many rows, so decode graphs are reused


def kv_bucket(end: int, n_ctx: int, n_tokens: int = 1) -> int:
    """The attention window of a step ending at ``end``: one window of the power of two at or
    above its tokens (at least ``KV_BUCKET`` rows) while that holds the step, as a prompt's first
    chunk; past it, rows in steps of ``KV_BUCKET``, or of the power of two at or above 2 x the
    step's tokens where that is more. A prompt in chunks of 512 then meets a new window (a graph
    to build) every 2 chunks after its first, not every chunk. The rows past ``end`` are masked
    and still cost: ggml-cuda's flash attention skips masked rows only for 1,024 queries or more
    (its KV_max scan), the CPU's skips each row."""
    first = max(KV_BUCKET, 1 << (n_tokens - 1).bit_length())
    step = max(KV_BUCKET, 1 << (2 * n_tokens - 1).bit_length())
    return min(n_ctx, first if end <= first else -(-end // step) * step)


def check_end(end: int, n_ctx: int) -> None:
    """Refuse a step whose positions reach past the context (every slot allocator asks)."""
    if end > n_ctx:
        raise ContextOverflow(
            f"position {end} is past the context of {n_ctx}; "
            f"start a new sequence or raise --max-ctx"
        )


class IdentitySlots:
    """Sequence 0 only; row = position. Rows past the sequence's end are empty."""

    def __init__(self, n_ctx: int):
        self.n_ctx = n_ctx

    def rows(self, n_tokens: int) -> int:
        """How many cache rows hold a sequence's first ``n_tokens`` (what a snapshot copies)."""
        return n_tokens

    def readable(self, n_tokens: int) -> bool:
        """Whether rows 0..n-1 hold positions 0..n-1, as a snapshot of ``rows(n)`` assumes."""
        return True

    def reset(self, n_tokens: int = 0) -> None:
        """A new sequence, or one restored with its first ``n_tokens`` in rows 0..n-1."""

    def batch(self, tokens: np.ndarray, pos0: int) -> StepBatch:
        end = pos0 + tokens.size
        check_end(end, self.n_ctx)
        pos = np.arange(pos0, end, dtype=np.int32)
        cells = np.arange(kv_bucket(end, self.n_ctx, tokens.size), dtype=np.int32)
        cells[end:] = -1
        return StepBatch(
            tokens=np.ascontiguousarray(tokens, dtype=np.int32),
            pos=pos,
            seq=np.zeros_like(pos),
            slots=pos.astype(np.int64),
            cell_pos=cells,
            cell_seq=np.zeros_like(cells),
        )


class SeqSlots:
    """``n_seq`` sequences of up to ``n_ctx`` positions each: sequence s holds rows
    ``s * n_ctx + position``, and its tokens attend to its own rows only (the batch's
    ``cell_seq``). A step's window covers the rows up to the highest one it writes, so a step
    of the first sequences alone attends over fewer rows. Sequence 0 is also the one-sequence
    engine's (``batch(tokens, pos0)``), so prefill, snapshots and restores work there as with
    ``IdentitySlots``."""

    def __init__(self, n_seq: int, n_ctx: int):
        self.n_seq, self.n_ctx = n_seq, n_ctx
        self.length = np.zeros(n_seq, dtype=np.int64)  # positions each sequence holds

    def rows(self, n_tokens: int) -> int:
        return n_tokens

    def readable(self, n_tokens: int) -> bool:
        return True

    def reset(self, n_tokens: int = 0) -> None:
        """Sequence 0 starts again (or was restored with ``n_tokens``)."""
        self.length[0] = n_tokens

    def release(self, seq: int) -> None:
        """Sequence ``seq`` ends: its rows are masked until written again."""
        self.length[seq] = 0

    def batch(self, tokens: np.ndarray, pos0: int) -> StepBatch:
        pos = np.arange(pos0, pos0 + tokens.size, dtype=np.int32)
        return self.batch_of(tokens, np.zeros_like(pos), pos)

    def batch_of(self, tokens: np.ndarray, seq: np.ndarray, pos: np.ndarray) -> StepBatch:
        """The step of ``tokens``, token i at position ``pos[i]`` of sequence ``seq[i]``. A
        sequence holds, after it, the positions before its highest one here."""
        seq, pos = np.asarray(seq, dtype=np.int32), np.asarray(pos, dtype=np.int32)
        if seq.size and (seq.min() < 0 or seq.max() >= self.n_seq):
            raise ValueError(f"sequence ids run 0..{self.n_seq - 1}, got {seq.tolist()}")
        check_end(int(pos.max()) + 1, self.n_ctx)
        np.maximum.at(self.length, seq, pos.astype(np.int64) + 1)
        slots = seq.astype(np.int64) * self.n_ctx + pos
        end = int(slots.max()) + 1
        rows = np.arange(kv_bucket(end, self.n_seq * self.n_ctx, tokens.size), dtype=np.int32)
        cell_seq, cell_pos = np.divmod(rows, self.n_ctx)
        cell_pos[cell_pos >= self.length[cell_seq]] = -1
        return StepBatch(
            tokens=np.ascontiguousarray(tokens, dtype=np.int32),
            pos=pos,
            seq=seq,
            slots=slots,
            cell_pos=cell_pos.astype(np.int32),
            cell_seq=cell_seq.astype(np.int32),
        )

    def chunk_batch(self, tokens: np.ndarray, seq: int, pos0: int) -> StepBatch:
        """``tokens`` of sequence ``seq`` from position ``pos0``, as one stream over that
        sequence's own rows (a prompt chunk reads none of the other sequences' rows)."""
        pos = np.arange(pos0, pos0 + tokens.size, dtype=np.int32)
        check_end(pos0 + tokens.size, self.n_ctx)
        self.length[seq] = max(self.length[seq], pos0 + tokens.size)
        window = kv_bucket(pos0 + tokens.size, self.n_ctx, tokens.size)
        return self._streams(np.asarray(tokens, dtype=np.int32), pos, seq, 1, window)

    def decode_batch(self, tokens: np.ndarray, seq: np.ndarray, pos: np.ndarray) -> StepBatch:
        """One token for each of the sequences ``seq``, as streams (StepBatch.streams): row i
        of the step is sequence min(seq) + i, up to max(seq); a sequence between them that is
        not decoding gets a stand-in token written to its last row, which no token of its own
        reaches (a sequence ends a position before it), and its output row is ignored. Every
        sequence attends over its own window of rows only."""
        seq = np.asarray(seq, dtype=np.int32)
        if seq.size != np.unique(seq).size:
            raise ValueError("a decode step holds one token per sequence")
        first, S = int(seq.min()), int(seq.max() - seq.min()) + 1
        if first < 0 or first + S > self.n_seq:
            raise ValueError(f"sequence ids run 0..{self.n_seq - 1}, got {seq.tolist()}")
        check_end(int(np.max(pos)) + 2, self.n_ctx)  # the last row stays the stand-ins'
        all_pos = np.full(S, self.n_ctx - 1, dtype=np.int32)
        all_tokens = np.zeros(S, dtype=np.int32)
        all_pos[seq - first], all_tokens[seq - first] = pos, tokens
        np.maximum.at(self.length, seq, np.asarray(pos, dtype=np.int64) + 1)
        window = kv_bucket(int(np.max(pos)) + 1, self.n_ctx)
        return self._streams(all_tokens, all_pos, first, S, window)

    def _streams(self, tokens, pos, first: int, S: int, window: int) -> StepBatch:
        stream = np.repeat(np.arange(first, first + S, dtype=np.int32), tokens.size // S)
        return StepBatch(
            tokens=tokens,
            pos=pos,
            seq=stream,
            slots=stream.astype(np.int64) * self.n_ctx + pos,
            cell_pos=np.arange(window, dtype=np.int32),
            cell_seq=np.zeros(window, dtype=np.int32),
            streams=S,
            stream_rows=self.n_ctx,
            stream_first=first,
        )
