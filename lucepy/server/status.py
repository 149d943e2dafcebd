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
        self.ttft = {"sum_s": 0.0, "count": 0}  # queue wait plus prefill, per generation
        self.decode = {"tokens": 0, "seconds": 0.0}
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

    def finished(self, outcome: str, choices: list[dict] | None = None) -> None:
        """``outcome``: completed, cancelled or failed; ``choices``: each generation's Done (one
        per choice; the prompt is counted once)."""
        with self._lock:
            self.active -= 1
            self.requests[outcome] += 1
            for i, last in enumerate(choices or ()):
                if not i:
                    self.tokens["prompt"] += last["prompt_tokens"]
                self.tokens["completion"] += last["completion_tokens"]
                self.last = last
                self._count(last)

    def _count(self, last: dict) -> None:
        timings = last.get("timings") or {}
        self.ttft["sum_s"] += (last.get("queue_ms", 0.0) + timings.get("prefill_ms", 0.0)) / 1e3
        self.ttft["count"] += 1
        self.decode["tokens"] += max(last["completion_tokens"] - 1, 0)
        self.decode["seconds"] += timings.get("decode_ms", 0.0) / 1e3
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
                "ttft": dict(self.ttft),
                "decode": dict(self.decode),
            }


def prometheus(stats: Stats, ready: bool) -> str:
    """The counters in Prometheus' text format (version 0.0.4)."""
    snap = stats.snapshot()
    ttft, decode, accept = snap["ttft"], snap["decode"], snap["accept"]
    cache = {k: v or 0 for k, v in snap["cache"].items()}  # None: no prefix cache
    out: list[str] = []

    def family(name: str, kind: str, text: str, samples: list[tuple[str, float]]) -> None:
        out.extend([f"# HELP {name} {text}", f"# TYPE {name} {kind}"])
        out.extend(f"{name}{suffix} {value}" for suffix, value in samples)

    requests = [(f'{{outcome="{k}"}}', v) for k, v in snap["requests"].items() if k != "total"]
    family("lucepy_requests_total", "counter", "Requests by outcome.", requests)
    family(
        "lucepy_time_to_first_token_seconds",
        "summary",
        "Queue wait plus prefill, per generation.",
        [("_sum", round(ttft["sum_s"], 6)), ("_count", ttft["count"])],
    )
    for name, kind, text, value in (
        ("prompt_tokens_total", "counter", "Prompt tokens of requests served.",
         snap["tokens"]["prompt"]),
        ("completion_tokens_total", "counter", "Tokens generated.", snap["tokens"]["completion"]),
        ("requests_waiting", "gauge", "Requests queued.", snap["queue"]["waiting"]),
        ("requests_running", "gauge", "Requests generating.", snap["queue"]["active"]),
        ("ready", "gauge", "1 while the model serves requests.", int(ready)),
        ("decode_seconds_total", "counter", "Time spent decoding after the first token.",
         round(decode["seconds"], 6)),
        ("decode_tokens_total", "counter", "Tokens decoded after the first of each answer.",
         decode["tokens"]),
        ("tokens_per_second", "gauge", "Tokens generated per second, recent window.",
         snap["tokens_per_s"]),
        ("prefix_cache_hits_total", "counter", "Generations restored from a snapshot.",
         cache["hits"]),
        ("prefix_cache_misses_total", "counter", "Generations prefilled from scratch.",
         cache["misses"]),
        ("prefix_cache_restored_tokens_total", "counter", "Prompt tokens restored.",
         cache.get("restored_tokens", 0)),
        ("draft_steps_total", "counter", "DFlash verify steps.", accept["steps"]),
        ("draft_accepted_tokens_total", "counter", "Draft tokens the target accepted.",
         accept["accepted"]),
        ("draft_tau", "gauge", "Tokens committed per verify step (0: no draft ran).",
         accept["tau"] or 0),
    ):  # fmt: skip
        family(f"lucepy_{name}", kind, text, [("", value)])
    return "\n".join(out) + "\n"


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
