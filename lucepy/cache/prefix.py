"""The prefix cache: restore the longest cached prefix of a prompt, prefill only the rest.

Snapshots are taken at chat-turn boundaries: at the end of each prompt (with its last logits, so
an identical prompt needs no prefill at all) and at the end of each generation (the next turn's
prompt starts with this turn's prompt and answer). The disk policy ``N`` adds a snapshot every N
prompt tokens, for long prompts edited near their end. Turn boundaries are where chat clients
resend from; intervals cost a state copy each, so they are opt-in.

RAM slots hold copies on each state's own backend (inside the worker for worker shards); disk
files hold host copies of the same tensors. Both are keyed by the exact token prefix and guarded
by a fingerprint of model, architecture, layout, dtypes, context and draft (decision 6).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from lucepy.cache.disk import VERSION, DiskCache, Link, token_hash
from lucepy.cache.policy import DiskPolicy, parse_policy

log = logging.getLogger(__name__)


def fingerprint(engine) -> str:
    """What a snapshot must match to be restored into ``engine``."""
    draft = engine.draft.file.identity() if engine.draft is not None else None
    ident = {
        "format": VERSION,
        "model": engine.file.identity(),
        "arch": engine.file.architecture,
        "layout": [[s.layers.start, s.layers.stop] for s in engine.shards],
        "state": engine.state_dtypes(),
        "n_ctx": engine.n_ctx,
        "draft": draft,
    }
    if engine.pipeline.host_pool is not None:  # KV Flash: a snapshot may hold the pool's map
        ident["kv_pool"] = [engine.pipeline.slots.pool, engine.pipeline.slots.policy]
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


@dataclass
class Slot:
    tokens: tuple[int, ...]
    copies: dict
    logits: np.ndarray | None
    nbytes: int


class PrefixCache:
    def __init__(
        self, engine, slots: int, ram_budget: int, disk: DiskCache | None, policy: DiskPolicy
    ):
        self.engine, self.max_slots, self.ram_budget = engine, slots, ram_budget
        self.disk, self.policy = disk, policy
        self.slots: OrderedDict[tuple[int, ...], Slot] = OrderedDict()
        # the disk snapshot the engine's state continues (its token hash): the next one written
        # along the same sequence links to it and stores only what came after
        self.lineage: str | None = None
        self.per_row, self.whole = engine.state_growth()
        # KV Flash: once a pool pages, a snapshot holds it whole, like recurrent state
        pooled = engine.pipeline.host_pool is not None
        self.pool_bytes = self.per_row * engine.pipeline.slots.pool if pooled else 0
        self.appended = engine.appended_state()
        if disk is not None and policy.interval:
            every = self._interval(engine.config.chunk)
            if every != policy.interval:
                log.info(
                    "prefix cache: interval snapshots every %d tokens, not %d: this model keeps "
                    "%d bytes of recurrent state whole, %d bytes of KV a token "
                    "(docs/prefix-cache.md)",
                    every, policy.interval, self.whole, self.per_row,
                )  # fmt: skip

    @classmethod
    def for_engine(cls, engine) -> PrefixCache | None:
        cfg = engine.config
        policy = parse_policy(cfg.disk_prefix_cache)
        disk = None
        if cfg.kv_cache_dir and policy.enabled:
            disk = DiskCache(cfg.kv_cache_dir, fingerprint(engine), cfg.kv_cache_budget_mb << 20)
        if not cfg.prefix_cache_slots and disk is None:
            return None
        return cls(engine, cfg.prefix_cache_slots, cfg.prefix_cache_mb << 20, disk, policy)

    # lookup and restore
    def _ram_hit(self, prompt: list[int]) -> Slot | None:
        best = None
        for slot in self.slots.values():
            n = len(slot.tokens)
            usable = n < len(prompt) or (n == len(prompt) and slot.logits is not None)
            if (
                usable
                and (best is None or n > len(best.tokens))
                and tuple(prompt[:n]) == slot.tokens
            ):
                best = slot
        return best

    def _restore(self, prompt: list[int]) -> tuple[str, int, np.ndarray | None]:
        self.lineage = None
        hit, n, logits, entry = self._take(
            prompt,
            lambda slot: self.engine.restore(slot.copies, len(slot.tokens)),
            self.engine.load_state,
            self.engine.reset,
        )
        if hit == "ram":
            self._continue(prompt[:n])
        elif hit == "disk":
            self.lineage = entry.key
        return hit, n, logits

    def _take(self, prompt: list[int], into_ram, into_disk, undo=None) -> tuple:
        """Write ``prompt``'s longest cached prefix, a RAM slot (``into_ram(slot)``) or a disk
        snapshot (``into_disk(arrays, n)``; ``undo()`` after one that does not fit): the hit
        ("ram", "disk" or "none"), the tokens restored, a whole prompt's logits, the entry."""
        while True:
            ram = self._ram_hit(prompt)
            entry = self.disk.find(prompt) if self.disk else None
            if ram is not None and (entry is None or len(ram.tokens) >= len(entry.tokens)):
                into_ram(ram)
                self.slots.move_to_end(ram.tokens)
                return "ram", len(ram.tokens), ram.logits, None
            if entry is None:
                return "none", 0, None, None
            arrays = self.disk.load(entry)
            if arrays is None:  # a bad file, gone with what hung from it: look again
                continue
            logits = arrays.pop("logits", None)
            try:
                into_disk(arrays, len(entry.tokens))
            except (KeyError, ValueError) as err:
                log.warning("prefix cache: %s does not fit this engine: %s", entry.path, err)
                if undo is not None:
                    undo()
                return "none", 0, None, None
            return "disk", len(entry.tokens), None if logits is None else logits[0], entry

    def _continue(self, tokens) -> None:
        """The engine now holds ``tokens``: links go on from their disk snapshot, if any."""
        key = token_hash(tokens)
        self.lineage = key if self.disk is not None and key in self.disk.entries else None

    def start(self, prompt: list[int], chunk: int | None, on_chunk=None):
        """Fill the engine with ``prompt`` from the best snapshot and prefill the rest.
        Returns the last logits and the report for ``generate --json``'s ``cache``."""
        engine = self.engine
        engine.reset()
        hit, n, logits = self._restore(prompt)
        points = self._interval_points(n, len(prompt), chunk or engine.config.chunk)
        # whole (recurrent) state can only be read where the prefill stands: stop at each point;
        # appending state alone can be read for any earlier point after a longer prefill, unless
        # a KV pool may page (it holds the whole pool, not the rows of each point)
        stops = points if self.whole or self.pool_bytes else []
        done = n
        for stop in [*stops, len(prompt)]:
            if stop > engine.n_past:
                tail = prompt[engine.n_past : stop]
                logits = engine.prefill(tail, chunk=chunk, on_chunk=on_chunk)
            for t in (p for p in points if done < p <= stop):
                self._save_disk(prompt[:t], None)
            done = stop
        if n < len(prompt) or hit == "none":
            self._save(prompt, logits)
        return logits, {"hit": hit, "restored_tokens": n, "prefilled_tokens": len(prompt) - n}

    def _interval_points(self, start: int, end: int, chunk: int) -> list[int]:
        """The interval snapshots after ``start`` and before ``end``."""
        step = self._interval(chunk)
        return list(range((start // step + 1) * step, end, step)) if step else []

    def _interval(self, chunk: int) -> int:
        """Tokens between interval snapshots (``--disk-prefix-cache N``; 0: none).

        N when all state appends (attention KV). State kept whole (recurrent) is stored in every
        link and can only be read where the prefill stops, so with it the interval widens to a
        multiple of N that is at least a prefill chunk (stopping more often tripled a hybrid
        model's prefill time; docs/prefix-cache.md), and over which the KV grows by at least the
        whole state's bytes: a prompt's chain then costs at most twice one snapshot of it. A KV
        Flash pool counts as whole state (once it pages, a snapshot holds the whole pool)."""
        step = self.policy.interval if self.disk else 0
        whole = self.whole + self.pool_bytes
        if step and whole:
            widest = max(chunk, -(-whole // max(self.per_row, 1)))
            step *= -(-widest // step)
        return step

    def finish(self, tokens: list[int]) -> None:
        """After a generation: keep the state of every token the engine processed. A speculative
        step cut short by a stop or the token limit has processed accepted tokens the
        generation does not keep; only appending state (KV rows) can then be kept for the
        tokens kept, since whole (recurrent) state has taken in the others too."""
        n = self.engine.n_past
        if n > len(tokens):
            if self.whole or not self.engine.pipeline.slots.readable(n):
                self.lineage = None
                return
            n = len(tokens)
        if n > 0 and not self.engine.pipeline.broken:
            self._save(tokens[:n], None)

    # saving
    def _save(self, tokens, logits: np.ndarray | None) -> None:
        tokens = tuple(int(t) for t in tokens)
        if self.max_slots:
            self._save_ram(tokens, logits)
        self._save_disk(tokens, logits)

    def _save_disk(self, tokens, logits: np.ndarray | None) -> None:
        """Write the state of the first ``len(tokens)`` tokens held: a link when the engine
        continues a kept snapshot, else (or when its chain leaves no room) a root."""
        if self.disk is None or not self.policy.wants(len(tokens)):
            return
        tokens = tuple(int(t) for t in tokens)
        parent = self.disk.entries.get(self.lineage) if self.lineage else None
        link = None
        n = len(parent.tokens) if parent is not None else 0
        readable = self.engine.pipeline.slots.readable(len(tokens))  # rows = positions
        if parent is not None and n < len(tokens) and tokens[:n] == parent.tokens and readable:
            link = Link(parent.key, n, self.engine.pipeline.slots.rows(n))
        appended = self.appended
        path = self.disk.save(tokens, self._export(tokens, link, logits), appended, link)
        if path is None and link is not None:  # its chain leaves no room: a root may fit
            path = self.disk.save(tokens, self._export(tokens, None, logits), appended)
        if path is not None:
            self.lineage = token_hash(tokens)

    def _export(self, tokens, link: Link | None, logits) -> dict[str, np.ndarray]:
        arrays = self.engine.export_state(len(tokens), link.start if link else 0)
        if logits is not None:
            arrays["logits"] = np.asarray(logits, dtype=np.float32)[None]
        return arrays

    # batched sequences (decode/batch.py), sharing the slots and files of the one-sequence path
    def restore_sequence(self, prompt: list[int], seq: int) -> tuple[str, int, np.ndarray | None]:
        """Restore ``prompt``'s longest cached prefix (RAM or disk) into batched sequence
        ``seq``: the hit ("ram", "disk" or "none"), the tokens restored and, for a whole
        prompt, its logits."""
        hit, n, logits, _ = self._take(
            prompt,
            lambda slot: self.engine.restore_sequence(slot.copies, seq),
            lambda arrays, n: self.engine.load_sequence(arrays, seq, n),
        )
        return hit, n, logits

    def save_sequence(self, tokens, seq: int, logits) -> None:
        """Keep batched sequence ``seq``'s state of ``tokens``: in a RAM slot, and on disk as a
        whole snapshot (no link: the sequence continues no snapshot of the files' lineage)."""
        tokens = tuple(int(t) for t in tokens)
        if self.max_slots:
            self._save_ram(tokens, logits, lambda: self.engine.snapshot_sequence(seq, len(tokens)))
        if self.disk is not None and self.policy.wants(len(tokens)):
            arrays = self.engine.export_sequence(seq, len(tokens))
            if logits is not None:
                arrays["logits"] = np.asarray(logits, dtype=np.float32)[None]
            self.disk.save(tokens, arrays, self.appended)

    def _save_ram(self, tokens: tuple[int, ...], logits, snapshot=None) -> None:
        old = self.slots.get(tokens)
        if old is not None:  # the same tokens give the same state: keep it, and its logits
            if old.logits is None and logits is not None:
                old.logits = np.array(logits, dtype=np.float32)
            self.slots.move_to_end(tokens)
            return
        copies = snapshot() if snapshot else self.engine.snapshot(len(tokens))
        nbytes = sum(c.nbytes for c in copies.values())
        kept = None if logits is None else np.array(logits, dtype=np.float32)
        self.slots[tokens] = Slot(tokens, copies, kept, nbytes)
        while self.slots and (len(self.slots) > self.max_slots or self.ram_bytes > self.ram_budget):
            _, slot = self.slots.popitem(last=False)
            self.engine.drop_snapshot(slot.copies)

    @property
    def ram_bytes(self) -> int:
        return sum(s.nbytes for s in self.slots.values())

    def forget(self) -> None:
        """Drop every RAM slot; those on a dead worker are abandoned, not freed."""
        self.lineage = None
        for slot in self.slots.values():
            self.engine.drop_snapshot(slot.copies)
        self.slots.clear()

    def close(self) -> None:
        while self.slots:
            _, slot = self.slots.popitem()
            self.engine.drop_snapshot(slot.copies)
