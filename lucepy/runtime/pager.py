"""KV Flash's pager (decision 8): ``PagedSlots``, the slot allocator of a sequence whose
full-attention caches hold a pool of fewer rows than its context, in chunks of 64 positions; it
decides which chunks stay resident, and a ``Mover`` (runtime/kvpool.py) copies their rows."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from lucepy.errors import ConfigError
from lucepy.models.batch import StepBatch
from lucepy.models.state import POOL_CHUNK, pool_rows
from lucepy.runtime.slots import check_end, kv_bucket

CHUNK = POOL_CHUNK  # KV Flash pages rows in chunks of this many positions
RECENT = 256  # the last positions a pool always keeps (with the first chunk, the sink)
RANK_EVERY = 64  # qk ranking: positions between reselections
POLICIES = ("lru", "qk")
_ALWAYS = np.iinfo(np.int32).max


class Mover(Protocol):
    """What moves a pool's rows (runtime/kvpool.py): the pager decides, the mover copies."""

    def seal(self, pool_chunk: int, chunk: int) -> None:
        """Sequence chunk ``chunk`` is complete and committed, in pool chunk ``pool_chunk``."""

    def page_out(self, pool_chunk: int, chunk: int) -> None:
        """Keep ``chunk``'s rows, in ``pool_chunk``, in host memory."""

    def page_in(self, pool_chunk: int, chunk: int) -> None:
        """Write ``chunk``'s rows from host memory into ``pool_chunk``."""

    def scores(self, chunks: list[int]) -> np.ndarray | None:
        """How much the latest query attends to each sealed chunk (higher: keep); None: no
        query yet."""


class PagedSlots:
    """KV Flash's pager: a pool of ``pool`` tokens for a sequence of up to ``n_ctx`` positions.

    Chunk c of the sequence (positions 64c..64c+63) sits in one pool chunk while resident. At
    most ``pool / 64`` chunks are. When a position starts a new chunk and the pool is full, a
    resident chunk is paged out for every later position; the first chunk (the sink) and those
    holding the last ``RECENT`` positions never are. The victim is the least recently written
    or paged-in chunk (``lru``), or (``qk``) the one the last ranking scored lowest. So which
    rows a token sees depends on its position, not on how the tokens were grouped into steps:
    a chunk paged out inside a step stays readable to the step's earlier tokens (the batch's
    ``cell_until``), and its rows go to host memory, once (a sealed chunk never changes), at
    the next step. The cache has room for that (``pool_rows``).

    ``qk`` also reselects at the start of a step every ``RANK_EVERY`` positions, and when asked
    (``rank_next``): the best-scoring chunks, resident or on the host, fill the pool, paging in
    and out. Attention runs over the resident rows: ``cell_pos`` holds -1 for every other row,
    so graphs stay the same when the mapping changes.

    Until a chunk is paged out, chunk c sits in pool chunk c: rows, masks and windows equal
    ``IdentitySlots``', so a pool larger than the sequence gives the full cache's output.
    """

    def __init__(
        self, n_ctx: int, pool: int, step: int, mover: Mover | None = None, policy: str = "lru"
    ):
        if pool % CHUNK or pool < 2 * CHUNK + RECENT:
            raise ConfigError(
                f"--kv-pool {pool}: use a multiple of {CHUNK} of at least {2 * CHUNK + RECENT} "
                f"tokens (the sink chunk, the last {RECENT} tokens and a chunk to page)"
            )
        if policy not in POLICIES:
            raise ConfigError(f"--kv-pool-rank {policy!r}: use one of {list(POLICIES)}")
        self.n_ctx, self.pool, self.mover, self.policy = n_ctx, pool, mover, policy
        self.capacity = pool // CHUNK  # chunks resident at most
        self.n_rows = pool_rows(pool, step)  # the cache's rows
        self.page_outs = self.page_ins = 0  # since the pool was made: what status reports
        self.reset()

    def reset(self, n_tokens: int = 0) -> None:
        """A new sequence, or one restored with its first ``n_tokens`` in rows 0..n-1."""
        n = -(-n_tokens // CHUNK)
        if n > self.capacity:
            raise ConfigError(f"{n_tokens} tokens do not fit a pool of {self.pool}")
        self.home: dict[int, int] = {c: c for c in range(n)}  # resident chunk -> pool chunk
        self.owner = [c if c < n else -1 for c in range(self.n_rows // CHUNK)]
        # paged out by the last step, rows still in place: chunk -> (pool chunk, first position
        # that no longer sees it)
        self.retired: dict[int, tuple[int, int]] = {}
        self.placed: list[int] = []  # chunks the last step placed (a rollback may free them)
        self.on_host: set[int] = set()  # chunks whose rows host memory holds
        self.sealed: set[int] = set()  # complete, committed chunks: their rows never change
        self.used = dict.fromkeys(range(n), 0)  # chunk -> the step that last wrote or paged it in
        self.score: dict[int, float] = {}  # chunk -> its score at the last ranking
        self.clock, self.ranked_at, self.rank_next = 0, n_tokens, False

    # what a snapshot holds
    def readable(self, n_tokens: int) -> bool:
        """Whether rows 0..n-1 hold positions 0..n-1 and nothing has been paged, as a snapshot
        of ``rows(n)`` rows alone assumes."""
        if self.retired or self.on_host:
            return False
        return all(self.home.get(c) == c for c in range(-(-n_tokens // CHUNK)))

    def rows(self, n_tokens: int) -> int:
        """Cache rows a snapshot of the first ``n_tokens`` copies: n while nothing has moved,
        then all of them (with ``state()``; of every token held, see Engine)."""
        return n_tokens if self.readable(n_tokens) else self.n_rows

    def state(self) -> dict[str, np.ndarray]:
        """The mapping and the pager's memory, as arrays (a snapshot's ``pager/`` part)."""

        def pairs(d: dict, dtype=np.int64) -> np.ndarray:
            return np.array([[k, v] for k, v in sorted(d.items())], dtype).reshape(-1, 2)

        retired = [[c, pc, b] for c, (pc, b) in sorted(self.retired.items())]
        return {
            "home": pairs(self.home),
            "retired": np.array(retired, np.int64).reshape(-1, 3),
            "placed": np.array(self.placed, np.int64),
            "on_host": np.array(sorted(self.on_host), np.int64),
            "sealed": np.array(sorted(self.sealed), np.int64),
            "used": pairs(self.used),
            "score": pairs(self.score, np.float64),
            "clock": np.array([self.clock, self.ranked_at, int(self.rank_next)], np.int64),
        }

    def load(self, state: dict[str, np.ndarray]) -> None:
        """Take the mapping a ``state()`` saved (the rows are restored beside it)."""
        self.reset()
        self.home = {int(c): int(pc) for c, pc in state["home"]}
        self.retired = {int(c): (int(pc), int(b)) for c, pc, b in state["retired"]}
        for c, pc in [*self.home.items(), *((c, pc) for c, (pc, _) in self.retired.items())]:
            self.owner[pc] = c
        self.placed = [int(c) for c in state["placed"]]
        self.on_host = {int(c) for c in state["on_host"]}
        self.sealed = {int(c) for c in state["sealed"]}
        self.used = {int(c): int(u) for c, u in state["used"]}
        self.score = {int(c): float(v) for c, v in state["score"]}
        self.clock, self.ranked_at, rank_next = (int(v) for v in state["clock"])
        self.rank_next = bool(rank_next)

    @property
    def resident(self) -> int:
        return len(self.home)

    def report(self) -> dict[str, int | str]:
        """Where the pool's chunks are, and the pager's counts (the plan has its sizes)."""
        return {
            "resident_chunks": len(self.home),
            "paged_chunks": len(self.on_host - self.home.keys()),
            "page_outs": self.page_outs,
            "page_ins": self.page_ins,
        }

    # steps
    def batch(self, tokens: np.ndarray, pos0: int) -> StepBatch:
        end = pos0 + tokens.size
        check_end(end, self.n_ctx)
        self.clock += 1
        self._settle()
        self._seal(pos0)
        if self.policy == "qk" and (self.rank_next or pos0 - self.ranked_at >= RANK_EVERY):
            self._reselect(pos0, end)
        self.placed, last = [], (end - 1) // CHUNK
        for c in range(pos0 // CHUNK, last + 1):
            if c not in self.home:
                self._place(c, max(pos0, c * CHUNK))
            self.used[c] = self.clock
        pos = np.arange(pos0, end, dtype=np.int32)
        owner = np.array(self.owner)  # pool chunk -> the chunk it holds (resident or retired)
        held = np.flatnonzero(owner >= 0)
        where = np.full(max(last, int(owner.max())) + 1, -1, dtype=np.int64)  # chunk -> pool's
        where[owner[held]] = held
        home = where[pos // CHUNK]
        n_kv = kv_bucket((int(held.max()) + 1) * CHUNK, self.n_rows, tokens.size)
        cells = (owner[:, None] * CHUNK + np.arange(CHUNK)).ravel()[:n_kv]
        cells[(cells < 0) | (cells >= end)] = -1
        until = None
        if self.retired:  # rows that tokens from a position on no longer see
            until = np.full(n_kv, _ALWAYS, dtype=np.int32)
            for pc, b in self.retired.values():
                until[pc * CHUNK : (pc + 1) * CHUNK] = b
        return StepBatch(
            tokens=np.ascontiguousarray(tokens, dtype=np.int32),
            pos=pos,
            seq=np.zeros_like(pos),
            slots=home * CHUNK + pos % CHUNK,
            cell_pos=cells.astype(np.int32),
            cell_seq=np.zeros(cells.size, dtype=np.int32),
            span=kv_bucket(end, self.n_ctx, tokens.size),
            cell_until=until,
        )

    def rollback(self, end: int) -> None:
        """The last step is kept up to position ``end``: chunks it placed only for later
        positions leave, and what they paged out comes back (its rows never left)."""
        for c in [c for c in self.placed if c * CHUNK >= end]:
            self.owner[self.home.pop(c)] = -1
            self.used.pop(c)
            self.placed.remove(c)
        for c, (pc, b) in list(self.retired.items()):
            if b >= end:
                del self.retired[c]
                self.home[c] = pc
                self.page_outs -= 1

    def _protected(self, position: int) -> set[int]:
        """The sink and the chunks of the last RECENT positions before ``position``."""
        return {0, *range(max(0, position - RECENT) // CHUNK, -(-position // CHUNK))}

    def _place(self, c: int, first: int) -> None:
        """Chunk ``c`` becomes resident from position ``first``, paging out a victim if full."""
        if c * CHUNK < first:  # its first rows were written: it was resident then, and kept
            raise RuntimeError(f"KV pool: chunk {c} was paged out while its rows were written")
        if len(self.home) >= self.capacity:
            keep = self._protected(first)
            victim = min((v for v in self.home if v not in keep), key=self._worth)
            self.retired[victim] = (self.home.pop(victim), first)
            self.page_outs += 1
        free = [pc for pc, who in enumerate(self.owner) if who < 0]
        if not free:
            raise ConfigError(
                f"a step reaching chunk {c} needs more pool rows than the longest step was "
                f"given; feed steps of at most the prefill chunk"
            )
        self.on_host.discard(c)  # rows written anew (after a rollback or restore)
        self.sealed.discard(c)
        self.score.pop(c, None)
        self.owner[free[0]], self.home[c] = c, free[0]
        self.placed.append(c)

    def _worth(self, c: int) -> tuple:
        """Victims first: the lowest last score (a chunk sealed since has none: kept), then
        the least recently used."""
        rank = self.score.get(c, np.inf) if self.policy == "qk" else 0.0
        return (rank, self.used[c], c)

    def _settle(self) -> None:
        """The last step's victims go to host memory, and their pool chunks are free."""
        for c, (pc, _) in sorted(self.retired.items()):
            self._seal_one(pc, c)
            self._to_host(pc, c)
        self.retired.clear()

    def _to_host(self, pc: int, c: int) -> None:
        """Chunk ``c``'s rows to host memory (once: sealed rows never change); ``pc`` is free."""
        if c not in self.on_host and self.mover is not None:
            self.mover.page_out(pc, c)
        self.on_host.add(c)
        self.owner[pc] = -1

    def _seal(self, pos0: int) -> None:
        """Chunks complete before ``pos0`` (committed: a verify's rejected tokens are rolled back
        before the next step) are final; the mover may summarise their keys."""
        for c, pc in sorted(self.home.items()):
            if (c + 1) * CHUNK <= pos0:
                self._seal_one(pc, c)

    def _seal_one(self, pc: int, c: int) -> None:
        if c not in self.sealed:
            self.sealed.add(c)
            if self.mover is not None:
                self.mover.seal(pc, c)

    def _reselect(self, pos0: int, end: int) -> None:
        """Fill the pool with the protected chunks, room for the step's new ones, and the
        best-scoring others."""
        keep = self._protected(pos0)
        new = set(range(pos0 // CHUNK, (end - 1) // CHUNK + 1)) - self.home.keys()
        chunks = sorted(c for c in self.sealed if c not in keep)
        scores = self.mover.scores(chunks) if chunks and self.mover is not None else None
        if scores is None:  # nothing to rank yet, or no query: try again next step
            return
        self.ranked_at, self.rank_next = pos0, False
        self.score = dict(zip(chunks, scores.tolist(), strict=True))
        room = max(0, self.capacity - len(keep & self.home.keys()) - len(new))
        # ties (no query tells them apart) go to the most recently used, as lru would keep them
        best = sorted(chunks, key=lambda c: (-self.score[c], -self.used.get(c, 0), -c))
        best = set(best[:room])
        for c in sorted(c for c in self.home if c not in keep and c not in best):
            self._to_host(self.home.pop(c), c)
            self.page_outs += 1
        for c in sorted(best - self.home.keys()):
            pc = self.owner.index(-1)
            self.mover.page_in(pc, c)
            self.owner[pc], self.home[c], self.used[c] = c, pc, self.clock
            self.page_ins += 1
