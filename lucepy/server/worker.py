"""The one thread that owns the Engine. Requests wait their turn in a FIFO queue.

Each job talks back to its HTTP handler through its own asyncio queue, so answers never mix.
The handler sets ``job.cancel`` when its client leaves; the generation stops at the next token.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from dataclasses import asdict

from lucepy.decode.ar import Generation, Timings
from lucepy.decode.batch import Batcher
from lucepy.decode.grammar import grammars_for
from lucepy.errors import GGMLError, ModelFileError, ModelUnavailable
from lucepy.server.jobs import Delta, Done, Failed, Job, Outbox
from lucepy.server.status import Stats
from lucepy.server.text import Detokenizer, StopFilter
from lucepy.server.tools import FORMATS, ToolCallParser

log = logging.getLogger(__name__)

# after these the model serves no one; a dead worker fails only its request, and the next one
# brings it back (Engine.reset)
FATAL = (GGMLError, ModelFileError)


class Worker:
    def __init__(self, engine):
        self.engine = engine
        self.stats = Stats()
        self.failure: BaseException | None = None
        self.recovering = False  # a worker died or froze: the engine is reloading it
        self.current: Job | None = None
        self.batcher: Batcher | None = None  # --parallel above 1
        self._outbox = Outbox()  # the running jobs' events, until the next launch
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
        self.engine.on_launch = self._outbox.flush
        if self.engine.config.parallel > 1:
            self._batch_loop()
            return
        while (job := self._jobs.get()) is not None:
            runs = not job.cancel.is_set()
            self.stats.dequeued(runs)
            if runs:
                self.current = job
                self._run(job)
                self.current = None

    def _batch_loop(self) -> None:
        """``--parallel N``: jobs of one choice, without a grammar or log-probabilities, decode
        together (decode/batch.py), each joining at the next step and leaving when it ends or
        its client goes. Jobs join in arrival order: any other job waits for the batch to drain,
        runs alone, and the jobs behind it wait for it."""
        batcher, running, pending = Batcher(self.engine), {}, collections.deque()
        self.batcher = batcher
        outbox = self._outbox
        while True:
            if batcher.idle or pending:  # no batched step next: what the last one chose goes now
                outbox.flush()
            try:
                job = self._jobs.get(block=batcher.idle and not pending)
            except queue.Empty:
                job = False
            while job is not False:
                if job is None:  # closing: the running jobs end as cancelled
                    for waiting in pending:
                        self.stats.finished("failed")
                        waiting.emit(Failed(ModelUnavailable(self._unavailable())))
                    for running_job, _ in running.values():
                        running_job.cancel.set()
                    self._step_batch(batcher, running)
                    outbox.flush()
                    return
                runs = not job.cancel.is_set()
                self.stats.dequeued(runs)
                if runs:
                    pending.append(job)
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    job = False
            while pending and _batchable(pending[0]):
                self._join(batcher, running, pending.popleft())
            if batcher.idle and pending:
                job = self.current = pending.popleft()
                self._run(job)
                self.current = None
            elif self._lone(batcher, running):
                self._speculate_alone(batcher, running)
            elif not batcher.idle:
                self._step_batch(batcher, running)

    def _join(self, batcher: Batcher, running: dict, job: Job) -> None:
        try:
            stop_at_end = not job.ignore_eos
            req = batcher.submit(job.prompt_tokens, job.max_tokens, job.sampling, stop_at_end)
        except Exception as err:  # a bad request fails alone
            self.stats.finished("failed")
            job.emit(Failed(err))
            return
        gen = Generation(prompt_tokens=list(job.prompt_tokens))
        job.outbox = self._outbox
        running[req] = (job, Choice(self.engine, job, 0, gen))

    def _lone(self, batcher: Batcher, running: dict) -> bool:
        """One request, not started yet, on an idle batch with a draft: it may speculate."""
        return (
            self.engine.draft is not None
            and len(running) == 1
            and not batcher.active
            and len(batcher.waiting) == 1
        )

    def _speculate_alone(self, batcher: Batcher, running: dict) -> None:
        """The one request of an idle server decodes with the draft on the engine's own
        sequence, until another request arrives: at its next step boundary it goes on plainly
        in the batch (``Batcher.adopt``) and the newcomer joins it. It does not speculate
        again after that: the draft's cache lacks the positions decoded in the batch."""
        (req, (job, choice)), engine = running.popitem(), self.engine
        batcher.cancel(req, "cancelled", keep=False)  # not admitted: the batch is idle again
        gen, t_start = choice.gen, time.perf_counter()
        tokens = engine.stream(
            job.prompt_tokens,
            job.max_tokens,
            sampling=job.sampling,
            cancelled=job.cancel.is_set,
            gen=gen,
            stop_at_end=not job.ignore_eos,
        )
        self.current = job
        try:
            with contextlib.closing(tokens):
                for token in tokens:
                    self.stats.token()
                    if choice.feed(token):
                        gen.finish_reason = "stop"
                        break
                    boundary = engine.n_past == len(gen.prompt_tokens) + len(gen.tokens) - 1
                    if boundary and not self._jobs.empty():
                        stop = not job.ignore_eos
                        req = batcher.adopt(
                            job.prompt_tokens, gen.tokens, job.max_tokens, job.sampling, stop
                        )
                        req.t_submit, req.t_first = t_start, gen.t_prefilled or t_start
                        job.outbox = self._outbox
                        running[req] = (job, choice)
                        return
        except Exception as err:  # as in _run: the request fails, the model may recover
            self._fail([job], err)
            return
        finally:
            self.current = None
        self._deliver(job, [choice.done(round((t_start - job.queued_at) * 1e3, 3))])

    def _step_batch(self, batcher: Batcher, running: dict) -> None:
        """One batched step; ends requests whose client left or whose stop string showed."""
        for req, (job, _) in running.items():
            if job.cancel.is_set():
                batcher.cancel(req)
        try:
            chosen = batcher.step() if not batcher.idle else []
        except Exception as err:  # the step failed: every running job fails with it
            batcher.clear()
            self._fail([job for job, _ in running.values()], err)
            running.clear()
            return
        is_end = self.engine.tokenizer.is_end
        for req, token in chosen:
            self.stats.token()
            job, choice = running[req]
            choice.gen.tokens.append(token)
            if req.finish_reason == "stop" and is_end(token):
                continue  # counted, not shown (as the one-at-a-time path does)
            if choice.feed(token):
                batcher.cancel(req, "stop")
        for req in [r for r in running if r.done]:
            job, choice = running.pop(req)
            self._finish_batched(req, job, choice)

    def _finish_batched(self, req, job: Job, choice: Choice) -> None:
        gen, now = choice.gen, time.perf_counter()
        gen.finish_reason, gen.cache = req.finish_reason, req.cache
        first = req.t_first or now
        prefill_ms, decode_ms = (first - req.t_submit) * 1e3, (now - first) * 1e3
        gen.timings = Timings(
            round(prefill_ms, 3),
            round(decode_ms, 3),
            round(len(gen.prompt_tokens) / max(prefill_ms / 1e3, 1e-9), 3),
            round(max(len(gen.tokens) - 1, 0) / max(decode_ms / 1e3, 1e-9), 3),
        )
        self._deliver(job, [choice.done(round((req.t_submit - job.queued_at) * 1e3, 3))])

    def _deliver(self, job: Job, dones: list[Done]) -> None:
        """Count a finished job and send its choices' Done (a shutdown's cancel: a failure)."""
        cancelled = any(d.finish_reason == "cancelled" for d in dones)
        outcome = "cancelled" if cancelled else "completed"
        self.stats.finished(outcome, [asdict(d) for d in dones])
        if outcome == "cancelled" and self._closed:  # stopped by shutdown, not by its client
            job.emit(Failed(ModelUnavailable("the server shut down during this generation")))
        else:
            for done in dones:
                job.emit(done)

    def _run(self, job: Job) -> None:
        job.outbox = self._outbox
        try:
            dones = run_job(self.engine, job, self.stats.token)
        except Exception as err:  # every failure goes back to its client
            self._fail([job], err)
        else:
            self._deliver(job, dones)
        finally:
            self._outbox.flush()

    def _fail(self, jobs: list[Job], err: Exception) -> None:
        """``jobs`` failed with ``err``: each client hears it; a failure that broke the model
        marks it, and the model comes back at once if it can."""
        if isinstance(err, FATAL):
            self.failure = err
            log.error("the model failed: %s", err)
        for job in jobs:
            self.stats.finished("failed")
            job.emit(Failed(err))
        self._outbox.flush()  # before a reload, which takes a while
        self._recover()

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
        self._outbox.close()
        self.engine.close()
        log.info("engine closed")


def _batchable(job: Job) -> bool:
    return job.n == 1 and job.grammar is None and job.logprobs is None


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


class Choice:
    """One choice's answer on its way to the client: tokens detokenized, cut at stop strings,
    tool calls parsed out, log-probabilities attached, sent as deltas when safe to show."""

    def __init__(self, engine, job: Job, index: int, gen: Generation):
        self.engine, self.job, self.index, self.gen = engine, job, index, gen
        self.detok, self.stops = Detokenizer(engine.tokenizer.decode), StopFilter(job.stop)
        self.calls = ToolCallParser(FORMATS[job.tools]) if job.tools else None
        self.told = 0  # log-probabilities already sent

    def feed(self, token: int) -> bool:
        """Show what ``token`` makes safe to show; whether a stop string ended the choice."""
        text = self.stops.feed(self.detok.push(token))
        if text:
            self._send(text)
        return self.stops.stopped

    def done(self, queue_ms: float) -> Done:
        """Send the rest, then the choice's ``Done`` (its finish reason set on ``gen``)."""
        gen = self.gen
        tail = self.stops.feed(self.detok.flush()) + self.stops.flush()
        if gen.finish_reason != "cancelled":
            self._send(tail, final=True)
        if self.stops.stopped:
            gen.finish_reason = "stop"
        if self.calls is not None and self.calls.count and gen.finish_reason == "stop":
            gen.finish_reason = "tool_calls"
        return Done(
            gen.finish_reason,
            len(gen.prompt_tokens),
            len(gen.tokens),
            asdict(gen.timings),
            queue_ms,
            gen.accept.to_dict() if gen.accept is not None else None,
            gen.cache,
            self.index,
        )

    def _send(self, text: str, final: bool = False) -> None:
        found: list[dict] = []
        if self.calls is not None:
            text, found = self.calls.feed(text)
            if final:
                rest, _ = self.calls.flush()
                text += rest
        lp = self._logprobs()
        if text or found or lp:
            self.job.emit(Delta(text, self.index, lp, found or None))

    def _logprobs(self) -> list[dict] | None:
        if self.job.logprobs is None:
            return None
        tokenizer = self.engine.tokenizer
        out = [_logprob_entry(tokenizer, lp) for lp in self.gen.logprobs[self.told :]]
        self.told = len(self.gen.logprobs)
        return out


def _choice(engine, job: Job, index: int, sampling, queue_ms: float, on_token) -> Done:
    gen = Generation(prompt_tokens=list(job.prompt_tokens))
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
        stop_at_end=not job.ignore_eos,
    )
    choice = Choice(engine, job, index, gen)
    with contextlib.closing(tokens):
        for token in tokens:
            on_token()
            if choice.feed(token):
                gen.finish_reason = "stop"
                break
    return choice.done(queue_ms)


def _logprob_entry(tokenizer, lp) -> dict:
    """One token's log-probabilities as OpenAI's chat API shows them."""

    def piece(token: int, logprob: float) -> dict:
        raw = tokenizer.token_bytes(token)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob,
                "bytes": list(raw)}  # fmt: skip

    return {**piece(lp.token, lp.logprob), "top_logprobs": [piece(t, v) for t, v in lp.top]}
