"""The one thread that owns the Engine. Requests wait their turn in a FIFO queue.

Each job talks back to its HTTP handler through its own asyncio queue, so answers never mix.
The handler sets ``job.cancel`` when its client leaves; the generation stops at the next token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from dataclasses import asdict, dataclass, field

from lucepy.decode.ar import Generation
from lucepy.decode.sampling import SamplingParams
from lucepy.errors import GGMLError, ModelFileError, ModelUnavailable
from lucepy.server.status import Stats
from lucepy.server.text import Detokenizer, StopFilter

log = logging.getLogger(__name__)

# after these the model serves no one; a dead worker fails only its request, and the next one
# brings it back (Engine.reset)
FATAL = (GGMLError, ModelFileError)


@dataclass
class Delta:
    text: str


@dataclass
class Done:
    finish_reason: str  # stop, length or cancelled
    prompt_tokens: int
    completion_tokens: int
    timings: dict
    queue_ms: float
    accept: dict | None = None  # DFlash acceptance, when the engine drafted
    cache: dict | None = None  # prefix-cache outcome: hit, restored_tokens, prefilled_tokens


@dataclass
class Failed:
    error: BaseException


@dataclass
class Job:
    prompt_tokens: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    cancel: threading.Event = field(default_factory=threading.Event)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    loop: asyncio.AbstractEventLoop | None = None  # the handler's; set by Worker.submit
    queued_at: float = field(default_factory=time.perf_counter)

    def emit(self, event: Delta | Done | Failed) -> None:
        """Called from the worker thread; hands ``event`` to the handler's event loop."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Worker:
    def __init__(self, engine):
        self.engine = engine
        self.stats = Stats()
        self.failure: BaseException | None = None
        self.recovering = False  # a worker died or froze: the engine is reloading it
        self.current: Job | None = None
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="lucepy-engine", daemon=True)
        self._thread.start()

    @property
    def state(self) -> str:
        if self._closed:
            return "closed"
        return "failed" if self.failure else "recovering" if self.recovering else "ready"

    def submit(self, job: Job) -> None:
        job.loop = asyncio.get_running_loop()
        with self._lock:
            if self._closed or self.failure:
                self.stats.rejected()
                raise ModelUnavailable(self._unavailable())
            self.stats.queued()
            self._jobs.put(job)

    def _unavailable(self) -> str:
        if self._closed:
            return "the server is shutting down; retry against another server"
        return f"the model failed ({self.failure}); restart `lucepy serve`"

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            runs = not job.cancel.is_set()
            self.stats.dequeued(runs)
            if runs:
                self.current = job
                self._run(job)
                self.current = None

    def _run(self, job: Job) -> None:
        try:
            done = run_job(self.engine, job, self.stats.token)
        except Exception as err:  # every failure goes back to its client
            if isinstance(err, FATAL):
                self.failure = err
                log.error("the model failed: %s", err)
            self.stats.finished("failed")
            job.emit(Failed(err))
            self._recover()
            return
        outcome = "cancelled" if done.finish_reason == "cancelled" else "completed"
        self.stats.finished(outcome, asdict(done))
        if outcome == "cancelled" and self._closed:  # stopped by shutdown, not by its client
            job.emit(Failed(ModelUnavailable("the server shut down during this generation")))
        else:
            job.emit(done)

    def _recover(self) -> None:
        """After a failure that broke the model (a worker died or missed its deadline), reload it
        at once, so /health reports "recovering" and then "ready" before the next request."""
        if self.failure is not None or not self.engine.broken:
            return
        self.recovering = True
        try:
            self.engine.recover()
        except Exception as err:  # the reload failed: the next request tries again
            log.error("bringing the workers back failed: %s", err)
        finally:
            self.recovering = False

    def close(self) -> None:
        """Refuse new jobs, fail queued ones, stop the running one, then close the Engine."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                self.stats.dequeued(False)
                job.emit(Failed(ModelUnavailable(self._unavailable())))
        if self.current is not None:
            self.current.cancel.set()
        self._jobs.put(None)
        self._thread.join()
        self.engine.close()
        log.info("engine closed")


def run_job(engine, job: Job, on_token=lambda: None) -> Done:
    """Generate for ``job`` on this thread, emitting text deltas as they become safe to show."""
    gen = Generation(prompt_tokens=list(job.prompt_tokens))
    queue_ms = round((time.perf_counter() - job.queued_at) * 1e3, 3)
    detok, stops = Detokenizer(engine.tokenizer.decode), StopFilter(job.stop)
    tokens = engine.stream(
        job.prompt_tokens,
        job.max_tokens,
        sampling=job.sampling,
        cancelled=job.cancel.is_set,
        gen=gen,
    )
    with contextlib.closing(tokens):
        for token in tokens:
            on_token()
            text = stops.feed(detok.push(token))
            if text:
                job.emit(Delta(text))
            if stops.stopped:
                gen.finish_reason = "stop"
                break
    tail = stops.feed(detok.flush()) + stops.flush()
    if tail and gen.finish_reason != "cancelled":
        job.emit(Delta(tail))
    if stops.stopped:
        gen.finish_reason = "stop"
    return Done(
        gen.finish_reason,
        len(gen.prompt_tokens),
        len(gen.tokens),
        asdict(gen.timings),
        queue_ms,
        gen.accept.to_dict() if gen.accept is not None else None,
        gen.cache,
    )
