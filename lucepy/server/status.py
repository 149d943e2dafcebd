"""What ``/lucepy/status`` reports: shard placement, recent tokens/s, the queue, request counts."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque

BIN_S = 0.5  # tokens/s is counted in bins of this many seconds
WINDOW_BINS = 10  # over the last 5 s


class Stats:
    """Counters the worker thread updates and the HTTP side reads, under one lock."""

    def __init__(self):
        self._lock = threading.Lock()
        self.started = time.time()
        self.requests = {"total": 0, "completed": 0, "cancelled": 0, "failed": 0, "rejected": 0}
        self.waiting = 0
        self.active = 0
        self.tokens = {"prompt": 0, "completion": 0}
        self.last: dict | None = None  # the last finished generation
        self.cache = {"hits": 0, "misses": 0, "restored_tokens": 0}
        self.accept = {"steps": 0, "accepted": 0}  # DFlash, over all requests
        self._bins: deque[list[int]] = deque(maxlen=WINDOW_BINS + 1)

    def queued(self) -> None:
        with self._lock:
            self.requests["total"] += 1
            self.waiting += 1

    def rejected(self) -> None:
        with self._lock:
            self.requests["total"] += 1
            self.requests["rejected"] += 1

    def dequeued(self, runs: bool) -> None:
        """A job left the queue: to run, or dropped because its client went away."""
        with self._lock:
            self.waiting -= 1
            if runs:
                self.active += 1
            else:
                self.requests["cancelled"] += 1

    def token(self) -> None:
        now = int(time.monotonic() / BIN_S)
        with self._lock:
            if self._bins and self._bins[-1][0] == now:
                self._bins[-1][1] += 1
            else:
                self._bins.append([now, 1])

    def finished(self, outcome: str, last: dict | None = None) -> None:
        """``outcome``: completed, cancelled or failed."""
        with self._lock:
            self.active -= 1
            self.requests[outcome] += 1
            if last is not None:
                self.tokens["prompt"] += last["prompt_tokens"]
                self.tokens["completion"] += last["completion_tokens"]
                self.last = last
                self._count(last)

    def _count(self, last: dict) -> None:
        cache, accept = last.get("cache"), last.get("accept")
        if cache is not None:
            self.cache["hits" if cache["hit"] != "none" else "misses"] += 1
            self.cache["restored_tokens"] += cache["restored_tokens"]
        if accept is not None:
            self.accept["steps"] += accept["steps"]
            self.accept["accepted"] += accept["accepted"]

    @property
    def _cache_on(self) -> bool:
        return self.cache["hits"] + self.cache["misses"] > 0

    def _accept_summary(self) -> dict:
        steps, accepted = self.accept["steps"], self.accept["accepted"]
        tau = round((accepted + steps) / steps, 3) if steps else None
        return {"steps": steps, "accepted": accepted, "tau": tau}

    def tokens_per_s(self) -> float:
        lo = int(time.monotonic() / BIN_S) - WINDOW_BINS
        with self._lock:
            n = sum(count for b, count in self._bins if b > lo)
        return round(n / (WINDOW_BINS * BIN_S), 1)

    def snapshot(self) -> dict:
        rate = self.tokens_per_s()
        with self._lock:
            return {
                "uptime_s": round(time.time() - self.started, 1),
                "tokens_per_s": rate,
                "queue": {"waiting": self.waiting, "active": self.active},
                "requests": dict(self.requests),
                "tokens": dict(self.tokens),
                "last": self.last,
                "cache": dict(self.cache) if self._cache_on else {"hits": None, "misses": None},
                "accept": self._accept_summary(),
            }


def _memory_totals(engine) -> dict[str, int]:
    """Device name -> total memory, for the devices of this process (best effort)."""
    with contextlib.suppress(Exception):
        from lucepy.runtime.devices import list_devices

        return {d.name: d.memory_total for d in list_devices(engine.lib)}
    return {}


def placement(engine) -> list[dict]:
    """One dict per shard, as :func:`lucepy.tui.placement_table` takes them."""
    shards = getattr(engine, "shards", None) or [engine.shard]
    totals = _memory_totals(engine)
    out = []
    for shard in shards:
        device = shard.backend.name
        process = getattr(shard, "process", "local")
        out.append(
            {
                "device": device,
                "backend": device.split(":")[0],
                "layers": [shard.layers.start, shard.layers.stop],
                "weight_bytes": shard.weight_bytes,
                "state_bytes": shard.state_bytes,
                "memory_total": totals.get(device) if process == "local" else None,
                "process": process,
            }
        )
    return out
