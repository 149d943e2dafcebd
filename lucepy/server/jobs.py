"""A request as the worker thread runs it (``Job``) and the events it sends back to its HTTP
handler (``Delta``, ``Done``, ``Failed``), through the handler's own asyncio queue, so answers
never mix; while the engine steps, through an ``Outbox`` that hands them over between steps."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import os
import threading
import time
from dataclasses import dataclass, field

from lucepy.decode.sampling import SamplingParams


@dataclass
class Delta:
    text: str
    index: int = 0  # the choice (``n`` > 1)
    logprobs: list[dict] | None = None  # per token since the last delta, when asked for
    tool_calls: list[dict] | None = None  # calls completed in this delta (OpenAI entries)


@dataclass
class Done:
    finish_reason: str  # stop, length or cancelled
    prompt_tokens: int
    completion_tokens: int
    timings: dict
    queue_ms: float
    accept: dict | None = None  # DFlash acceptance, when the engine drafted
    cache: dict | None = None  # prefix-cache outcome: hit, restored_tokens, prefilled_tokens
    index: int = 0


@dataclass
class Failed:
    error: BaseException


@dataclass
class Job:
    prompt_tokens: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    n: int = 1  # choices, generated one after another (choice i samples with seed + i)
    logprobs: int | None = None  # top tokens to report per token; None: no log-probabilities
    grammar: str | None = None  # an llguidance grammar every choice must follow
    tools: str | None = None  # cut tool calls in this format out of the text (server/tools.py)
    ignore_eos: bool = False  # the end token does not stop the generation
    cancel: threading.Event = field(default_factory=threading.Event)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    loop: asyncio.AbstractEventLoop | None = None  # the handler's; set by Worker.submit
    queued_at: float = field(default_factory=time.perf_counter)
    outbox: Outbox | None = None  # once running: events wait there for the next launch

    def emit(self, event: Delta | Done | Failed) -> None:
        """Called from the worker thread; hands ``event`` to the handler's event loop."""
        if self.outbox is not None:
            self.outbox.post(self, event)
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Outbox:
    """The events of running jobs, held until the engine launches its next step (or has none to
    run), then handed to each job's event loop in one wake-up, while the engine thread keeps the
    GIL until the compute releases it: the loop's work on them overlaps the step. Handed over
    with ``call_soon_threadsafe``, the wake-up's own write released the GIL and the woken loop
    took it, so the engine waited on the loop between steps: on a 2-core CPU, 0.9 ms of each
    30 ms step of 8 clients, 0.3-0.5 ms of each 7 ms step of one (docs/BENCHMARKS.md). Used by
    the worker thread only."""

    def __init__(self):
        self._held: list[tuple[Job, Delta | Done | Failed]] = []
        self._lanes: dict[asyncio.AbstractEventLoop, _Lane] = {}

    def post(self, job: Job, event: Delta | Done | Failed) -> None:
        self._held.append((job, event))

    def flush(self) -> None:
        if not self._held:
            return
        for job, event in self._held:
            lane = self._lanes.get(job.loop)
            if lane is None or lane.closed:
                lane = self._lanes[job.loop] = _Lane(job.loop)
            lane.items.append((job.events, event))
        self._held = []
        for lane in self._lanes.values():
            lane.wake()

    def close(self) -> None:
        for lane in self._lanes.values():
            lane.close()
        self._lanes.clear()


class _Lane:
    """A pipe the event loop reads (``add_reader``) and the worker writes a byte to, with the GIL
    held, after queueing events in ``items``; the loop then puts them in their jobs' queues."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.items, self.closed = loop, collections.deque(), False
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)  # a full pipe already wakes the loop: nothing is lost
        try:
            loop.call_soon_threadsafe(loop.add_reader, self._r, self._drain)
        except RuntimeError:  # the loop is closed: nobody is listening
            self.closed = True
            self._close_pipe()

    def wake(self) -> None:
        if self.items and not self.closed:
            _write_holding_gil(self._w, b"\0")

    def _drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._r, 4096):
                pass
        while self.items:
            events, event = self.items.popleft()
            events.put_nowait(event)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.loop.call_soon_threadsafe(self._unregister)
        except RuntimeError:  # the loop is closed: it reads the pipe no more
            self._close_pipe()

    def _unregister(self) -> None:
        self.loop.remove_reader(self._r)
        self._close_pipe()

    def _close_pipe(self) -> None:
        os.close(self._r)
        os.close(self._w)


def _gil_holding_write():
    """libc's write through ctypes.PyDLL, which keeps the GIL over the call (os.write releases
    it, and the woken event loop may take it); os.write where the C library has no ``write``.
    A full pipe is not an error: the loop is awake already."""
    try:
        write = ctypes.PyDLL(None).write
    except (OSError, AttributeError):

        def fallback(fd: int, data: bytes) -> None:
            with contextlib.suppress(BlockingIOError):
                os.write(fd, data)

        return fallback
    write.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t)
    write.restype = ctypes.c_ssize_t
    return lambda fd, data: write(fd, data, len(data))


_write_holding_gil = _gil_holding_write()
