"""The one thread that owns the Engine. Requests wait their turn in a FIFO queue.

Each job talks back to its HTTP handler through its own asyncio queue, so answers never mix.
The handler sets ``job.cancel`` when its client leaves; the generation stops at the next token.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from dataclasses import asdict, dataclass, field

from lucepy.decode.ar import Generation
from lucepy.decode.grammar import grammars_for
from lucepy.decode.sampling import SamplingParams
from lucepy.errors import GGMLError, ModelFileError, ModelUnavailable
from lucepy.server.status import Stats
from lucepy.server.text import Detokenizer, StopFilter
from lucepy.server.tools import FORMATS, ToolCallParser

log = logging.getLogger(__name__)

# after these the model serves no one; a dead worker fails only its request, and the next one
# brings it back (Engine.reset)
FATAL = (GGMLError, ModelFileError)


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
            dones = run_job(self.engine, job, self.stats.token)
        except Exception as err:  # every failure goes back to its client
            if isinstance(err, FATAL):
                self.failure = err
                log.error("the model failed: %s", err)
            self.stats.finished("failed")
            job.emit(Failed(err))
            self._recover()
            return
        cancelled = any(d.finish_reason == "cancelled" for d in dones)
        outcome = "cancelled" if cancelled else "completed"
        self.stats.finished(outcome, [asdict(d) for d in dones])
        if outcome == "cancelled" and self._closed:  # stopped by shutdown, not by its client
            job.emit(Failed(ModelUnavailable("the server shut down during this generation")))
        else:
            for done in dones:
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


def run_job(engine, job: Job, on_token=lambda: None) -> list[Done]:
    """Generate ``job.n`` choices for ``job`` on this thread, emitting text deltas (with their
    tokens' log-probabilities) as they become safe to show. A cancelled choice ends the job."""
    queue_ms = round((time.perf_counter() - job.queued_at) * 1e3, 3)
    dones = []
    for index in range(job.n):
        sampling = job.sampling
        if index and sampling.seed is not None:
            sampling = dataclasses.replace(sampling, seed=sampling.seed + index)
        dones.append(_choice(engine, job, index, sampling, queue_ms, on_token))
        if dones[-1].finish_reason == "cancelled":
            break
    return dones


def _choice(engine, job: Job, index: int, sampling, queue_ms: float, on_token) -> Done:
    gen = Generation(prompt_tokens=list(job.prompt_tokens))
    detok, stops = Detokenizer(engine.tokenizer.decode), StopFilter(job.stop)
    constraint = None
    if job.grammar is not None:
        grammars = grammars_for(engine.tokenizer, engine.params.n_vocab)
        constraint = grammars.constraint(job.grammar)
    tokens = engine.stream(
        job.prompt_tokens,
        job.max_tokens,
        sampling=sampling,
        cancelled=job.cancel.is_set,
        gen=gen,
        logprobs=job.logprobs,
        constraint=constraint,
    )
    told = 0  # log-probabilities already sent
    calls = ToolCallParser(FORMATS[job.tools]) if job.tools else None

    def send(text: str, final: bool = False) -> None:
        found: list[dict] = []
        if calls is not None:
            text, found = calls.feed(text)
            if final:
                rest, _ = calls.flush()
                text += rest
        lp = notes()
        if text or found or lp:
            job.emit(Delta(text, index, lp, found or None))

    def notes() -> list[dict] | None:
        nonlocal told
        if job.logprobs is None:
            return None
        out = [_logprob_entry(engine.tokenizer, lp) for lp in gen.logprobs[told:]]
        told = len(gen.logprobs)
        return out

    with contextlib.closing(tokens):
        for token in tokens:
            on_token()
            text = stops.feed(detok.push(token))
            if text:
                send(text)
            if stops.stopped:
                gen.finish_reason = "stop"
                break
    tail = stops.feed(detok.flush()) + stops.flush()
    if gen.finish_reason != "cancelled":
        send(tail, final=True)
    if stops.stopped:
        gen.finish_reason = "stop"
    if calls is not None and calls.count and gen.finish_reason == "stop":
        gen.finish_reason = "tool_calls"
    return Done(
        gen.finish_reason,
        len(gen.prompt_tokens),
        len(gen.tokens),
        asdict(gen.timings),
        queue_ms,
        gen.accept.to_dict() if gen.accept is not None else None,
        gen.cache,
        index,
    )


def _logprob_entry(tokenizer, lp) -> dict:
    """One token's log-probabilities as OpenAI's chat API shows them."""

    def piece(token: int, logprob: float) -> dict:
        raw = tokenizer.token_bytes(token)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob,
                "bytes": list(raw)}  # fmt: skip

    return {**piece(lp.token, lp.logprob), "top_logprobs": [piece(t, v) for t, v in lp.top]}
