"""What the Engine reads and writes of its state, beside its steps: snapshots and host arrays of
the sequence's state (the prefix cache and disk snapshots speak these; decision 6), and the
batched sequences of ``--parallel`` (decode/batch.py speaks these). Mixins of ``Engine``
(runtime/engine.py), which holds what they read: ``pipeline``, ``shards``, ``draft``, ``lib``,
``n_ctx`` and ``n_past``."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from lucepy.errors import ConfigError
from lucepy.runtime import state
from lucepy.runtime.kvpool import PagerCopy
from lucepy.runtime.pipeline import Step
from lucepy.runtime.slots import SeqSlots
from lucepy.runtime.state import StateCopy, StateSet


class StateIO:
    """Every shard's (and the draft's) state as snapshots on its own backend or as host arrays."""

    def _states(self) -> list[tuple[str, object, StateSet, bool]]:
        """(key, backend, layer states, remote?) for every shard and the draft, with no rollback
        still running (its reader may read or write the state)."""
        self.pipeline.settle()
        out = [
            (f"shard{i}", s.backend, s.state, s.process != "local")
            for i, s in enumerate(self.shards)
        ]
        if self.draft is not None:
            out.append(("draft", self.draft.backend, self.draft.kv, self.draft.remote))
        return out

    def _run(self, remote: bool, fn):
        return self.pipeline.call(fn) if remote else fn()

    def snapshot(self, n: int | None = None) -> dict[str, StateCopy]:
        """Copies of every shard's (and the draft's) state for the first ``n`` tokens held
        (default: all; fewer only without whole state), each kept on its own backend: nothing
        crosses for a worker shard. Once KV Flash has paged, of all tokens held: the whole pool,
        with the mapping and the host rows (``pager``)."""
        n, out = self._check_readable(n), {}
        try:
            for key, backend, live, remote in self._states():
                rows = self._rows(key, n)
                out[key] = self._run(
                    remote, lambda b=backend, t=live, r=rows: StateCopy(self.lib, b, t, r)
                )
            if not self.pipeline.slots.readable(n):
                out["pager"] = PagerCopy(self.pipeline.pager_state())
        except BaseException:
            self.drop_snapshot(out)
            raise
        return out

    def restore(self, copies: dict[str, StateCopy], n: int) -> None:
        for key, _, live, remote in self._states():
            self._run(remote, lambda c=copies[key], t=live: c.restore(t))
        if "pager" in copies:
            self.pipeline.load_pager(copies["pager"].arrays)
        else:
            self.pipeline.reset(n)
        self.n_past = n

    def drop_snapshot(self, copies: dict[str, StateCopy]) -> None:
        remote = {key for key, _, _, r in self._states() if r}
        for key, copy in copies.items():
            if key in remote and self.pipeline.broken:
                copy.abandon()
            else:
                self._run(key in remote, copy.close)

    def export_state(self, n: int | None = None, since: int = 0) -> dict[str, np.ndarray]:
        """Host arrays of all state for the first ``n`` tokens held (default: all), a worker's
        over RPC. With ``since``, the appending tensors hold only the rows of tokens
        ``since..n``; the others are whole, so ``n`` below the tokens held needs none of them.
        Once KV Flash has paged: the whole pool and ``pager/`` arrays, never ``since``."""
        n = self._check_readable(n)
        paged = not self.pipeline.slots.readable(n)
        if paged and since:
            raise ValueError("once the KV pool has paged, a snapshot holds the whole pool")
        out = self._export_arrays(
            lambda key: (self._rows(key, n), self._rows(key, since) if since else 0)
        )
        if paged:
            out.update({f"pager/{k}": a for k, a in self.pipeline.pager_state().items()})
        return out

    def _export_arrays(self, rows: Callable[[str], tuple[int, int]]) -> dict[str, np.ndarray]:
        """Host arrays of every state, named ``key/name``; ``rows(key)``: (the end row, the first
        row of the appending tensors)."""
        out = {}
        for key, _, live, remote in self._states():
            end, first = rows(key)
            arrays = self._run(remote, lambda t=live, e=end, f=first: state.export(t, e, f))
            out.update({f"{key}/{name}": a for name, a in arrays.items()})
        return out

    def _load_arrays(
        self, arrays: dict[str, np.ndarray], rows: Callable[[str], tuple[int, int]]
    ) -> None:
        """Write ``_export_arrays``'s arrays back; ``rows(key)``: (the rows, the first row)."""
        for key, _, live, remote in self._states():
            mine = {
                name.split("/", 1)[1]: a for name, a in arrays.items() if name.startswith(key + "/")
            }
            count, first = rows(key)
            self._run(remote, lambda t=live, m=mine, r=count, f=first: state.load(t, m, r, f))

    def _rows(self, key: str, n: int) -> int:
        """Cache rows of state ``key`` that hold the first ``n`` tokens (the draft's KV is not
        pooled)."""
        return n if key == "draft" else self.pipeline.slots.rows(n)

    def _check_readable(self, n: int | None) -> int:
        if n is not None and not 0 < n <= self.n_past:
            raise ValueError(f"the state of {n} tokens is not held ({self.n_past} are)")
        if n is not None and n < self.n_past and self.state_growth()[1]:
            raise ValueError("whole (recurrent) state holds every token: not readable at fewer")
        n = self.n_past if n is None else n
        if n < self.n_past and not self.pipeline.slots.readable(n):
            raise ValueError(
                f"the KV pool has paged: a snapshot holds all {self.n_past} tokens, not {n}"
            )
        return n

    def appended_state(self) -> set[str]:
        """The names in ``export_state`` of tensors that append one row per cache row."""
        return {f"{key}/{name}" for key, _, live, _ in self._states() for name in live.appended()}

    def state_growth(self) -> tuple[int, int]:
        """(bytes each token adds to an exported state, bytes exported whole at any length)."""
        per_row = whole = 0
        for _, _, live, _ in self._states():
            a, w = live.growth()
            per_row, whole = per_row + a, whole + w
        return per_row, whole

    def load_state(self, arrays: dict[str, np.ndarray], n: int) -> None:
        pager = {k.split("/", 1)[1]: a for k, a in arrays.items() if k.startswith("pager/")}
        if pager:
            self.pipeline.load_pager(pager)  # first: it says which rows the arrays hold
        else:
            self.pipeline.reset(n)
        self._load_arrays(arrays, lambda key: (self._rows(key, n), 0))
        self.n_past = n

    def state_dtypes(self) -> dict[str, str]:
        """Every state tensor, ``shard0/k.3``, with its ggml type (snapshot fingerprints)."""
        return {
            f"{key}/{name}": dtype
            for key, _, states, _ in self._states()
            for name, dtype in states.dtypes().items()
        }


class BatchedSequences:
    """The sequences of an engine with ``RuntimeConfig.parallel`` > 1, each its own rows of
    ``n_ctx`` and slice of the recurrent state (copied and written through ``StateIO``'s
    helpers, which ``Engine`` has beside these)."""

    def snapshot_sequence(self, seq: int, n: int) -> dict[str, StateCopy]:
        """Copies of batched sequence ``seq``'s first ``n`` positions (``--parallel``): laid out
        as ``snapshot``'s, so ``restore`` and ``restore_sequence`` take either."""
        first, out = seq * self.n_ctx, {}
        try:
            for key, backend, live, remote in self._states():
                out[key] = self._run(
                    remote, lambda b=backend, t=live: StateCopy(self.lib, b, t, n, first)
                )
        except BaseException:
            self.drop_snapshot(out)
            raise
        return out

    def export_sequence(self, seq: int, n: int) -> dict[str, np.ndarray]:
        """Host arrays of batched sequence ``seq``'s first ``n`` positions, laid out as
        ``export_state(n)``'s (a disk snapshot of either restores into either)."""
        first = seq * self.n_ctx
        return self._export_arrays(lambda key: (first + n, first))

    def load_sequence(self, arrays: dict[str, np.ndarray], seq: int, n: int) -> None:
        """Write ``export_sequence`` or ``export_state`` arrays of ``n`` positions into batched
        sequence ``seq``'s rows."""
        first = seq * self.n_ctx
        self._load_arrays(arrays, lambda key: (n, first))
        slots = self._seq_slots()
        slots.length[seq] = max(slots.length[seq], n)

    @property
    def n_seq(self) -> int:
        """Sequences the engine holds (``RuntimeConfig.parallel``), each of ``n_ctx``."""
        slots = self.pipeline.slots
        return slots.n_seq if isinstance(slots, SeqSlots) else 1

    def _seq_slots(self) -> SeqSlots:
        slots = self.pipeline.slots
        if not isinstance(slots, SeqSlots):
            raise ConfigError("batched sequences need an engine with RuntimeConfig.parallel > 1")
        return slots

    def feed_sequence(self, tokens: np.ndarray, seq: int, pos0: int) -> np.ndarray:
        """A prompt chunk of batched sequence ``seq`` from ``pos0``: its last logits."""
        batch = self._seq_slots().chunk_batch(tokens, seq, pos0)
        return self.pipeline.forward_batch(batch, Step()).values[-1]

    def decode_sequences(
        self, tokens: np.ndarray, seqs: np.ndarray, pos: np.ndarray, greedy: bool
    ) -> np.ndarray:
        """One token for each of the batched sequences ``seqs`` (at ``pos``), one step: the
        argmax per sequence [len(seqs)] (``greedy``), else the logits rows [len(seqs), n_vocab],
        in the order of ``seqs``."""
        batch = self._seq_slots().decode_batch(tokens, seqs, pos)
        step = Step(logits="all", want="argmax" if greedy else "out")
        values = self.pipeline.forward_batch(batch, step).values
        rows = np.asarray(seqs) - batch.stream_first  # step row i is sequence first + i
        return values[0, rows] if greedy else values[rows]

    def release_sequence(self, seq: int) -> None:
        """Batched sequence ``seq`` starts again: its rows masked until written, its recurrent
        state zeroed."""
        self._seq_slots().release(seq)
        self.clear_sequence(seq)

    def clear_sequence(self, seq: int) -> None:
        """Batched sequence ``seq`` starts again: its recurrent state zeroed on every shard."""
        for _, _, live, remote in self._states():
            self._run(remote, lambda t=live: t.clear_sequence(seq))

    def restore_sequence(self, copies: dict[str, StateCopy], seq: int) -> None:
        """Write a snapshot into batched sequence ``seq``'s rows."""
        first = seq * self.n_ctx
        for key, _, live, remote in self._states():
            self._run(remote, lambda c=copies[key], t=live: c.restore(t, first))
        slots = self._seq_slots()
        slots.length[seq] = max(slots.length[seq], next(iter(copies.values())).rows)
