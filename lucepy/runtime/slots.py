"""The KV slot allocator behind the step batch (decision 8). Today's is the identity: one
sequence, and the cache row of a token is its position. A pager (KV Flash) or several sequences
(batching) are other allocators that fill the same ``StepBatch``.
"""

from __future__ import annotations

import numpy as np

from lucepy.errors import ContextOverflow
from lucepy.models.batch import StepBatch

KV_BUCKET = 256  # attention windows grow in steps of this many rows, so decode graphs are reused


def kv_bucket(end: int, n_ctx: int) -> int:
    return min(n_ctx, -(-end // KV_BUCKET) * KV_BUCKET)


class IdentitySlots:
    """Sequence 0 only; row = position. Rows past the sequence's end are empty."""

    def __init__(self, n_ctx: int):
        self.n_ctx = n_ctx

    def rows(self, n_tokens: int) -> int:
        """How many cache rows hold a sequence's first ``n_tokens`` (what a snapshot copies)."""
        return n_tokens

    def batch(self, tokens: np.ndarray, pos0: int) -> StepBatch:
        end = pos0 + tokens.size
        if end > self.n_ctx:
            raise ContextOverflow(
                f"position {end} is past the context of {self.n_ctx}; "
                f"start a new sequence or raise --max-ctx"
            )
        pos = np.arange(pos0, end, dtype=np.int32)
        cells = np.arange(kv_bucket(end, self.n_ctx), dtype=np.int32)
        cells[end:] = -1
        return StepBatch(
            tokens=np.ascontiguousarray(tokens, dtype=np.int32),
            pos=pos,
            seq=np.zeros_like(pos),
            slots=pos.astype(np.int64),
            cell_pos=cells,
            cell_seq=np.zeros_like(cells),
        )
