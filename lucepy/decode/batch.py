"""Continuous batching: several requests decoded together, one step for all of them.

An engine loaded with ``RuntimeConfig.parallel = N`` holds N sequences, each in its own cache
rows (``runtime/slots.py``, ``SeqSlots``), and steps them through its ``feed_sequence`` and
``decode_sequences`` methods. ``Batcher`` gives each admitted request a sequence;
requests beyond N wait in a queue, in arrival order. Each ``step``:

1. admits waiting requests to free sequences;
2. feeds one prompt chunk of the oldest request still reading its prompt (one step of that
   sequence alone, so a long prompt delays the running streams by one chunk at a time, not by
   its whole prefill), and when its prompt is in, chooses its first token; while no request is
   decoding, the chunks of every prompt being read, up to one chunk's tokens in all (requests
   that arrive together then decode together, as llama-server's do);
3. decodes: the last token of every generating request, in one step of one graph (the weights
   read once for all of them), and chooses each one's next token from its own logits row;
4. ends requests that stopped, reached their length or were cancelled, freeing their sequence.

Each request keeps its own sampler. On the CPU with ``batch_invariant`` a request's tokens
equal those it gets alone (tests/test_batch.py); elsewhere up to the near-tie rule.

With the engine's prefix cache (its RAM slots, ``--prefix-cache-slots``, and its disk files,
``--kv-cache-dir``), an admitted request restores its prompt's longest cached prefix into its own
sequence's rows (the others go on decoding) and prefills only the rest; a prompt, once
prefilled, and a request's whole sequence, once it ends, are kept for the next ones. A batched
sequence's disk snapshots are whole ones (no links, no interval snapshots inside a prompt) and
are the same files as the one-sequence path's: either restores the other's.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

import numpy as np

from lucepy.decode.sampling import Sampler, SamplingParams
from lucepy.errors import ConfigError


@dataclass(eq=False)
class Request:
    prompt: list[int]
    max_tokens: int
    sampler: Sampler
    stop_at_end: bool = True
    tokens: list[int] = field(default_factory=list)  # generated so far
    finish_reason: str | None = None  # "length", "stop" or "cancelled" once it has ended
    seq: int = -1  # its sequence while admitted
    fed: int = 0  # positions of its sequence written (prompt, then generated tokens)
    t_submit: float = 0.0
    t_first: float = 0.0  # perf_counter when its first token was chosen
    cache: dict | None = None  # the prefix cache's report: hit, restored and prefilled tokens

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def reading(self) -> bool:
        """Still feeding its prompt."""
        return self.seq >= 0 and self.fed < len(self.prompt)


class Batcher:
    """Requests on an engine with ``parallel`` sequences, decoded together (module doc)."""

    def __init__(self, engine, chunk: int | None = None):
        if engine.n_seq < 2:
            raise ConfigError("batching needs an engine loaded with RuntimeConfig.parallel > 1")
        self.engine, self.n_ctx = engine, engine.n_ctx
        # recurrent state (qwen35's delta net) is kept per sequence: a new sequence starts from
        # zeros there, a decode step takes only sequences that decode (a stand-in token would
        # change its sequence's state), and snapshots are sequence 0's, so no prefix cache
        self.recurrent = engine.state_growth()[1] > 0
        self.cache = None if self.recurrent else getattr(engine, "prefix_cache", None)
        self.chunk = min(chunk or engine.config.chunk, engine.model.max_step() or 1 << 30)
        self.free = list(range(engine.n_seq))
        self.waiting: collections.deque[Request] = collections.deque()
        self.active: list[Request] = []  # admitted, in admission order
        self.steps = {"prefill": 0, "decode": 0, "decoded": 0}  # decoded: tokens in decode steps

    def submit(
        self,
        prompt: list[int],
        max_tokens: int,
        sampling: SamplingParams | None = None,
        stop_at_end: bool = True,
    ) -> Request:
        if not prompt:
            raise ConfigError("nothing to prefill: the token list is empty")
        if len(prompt) >= self.n_ctx:
            raise ConfigError(
                f"a prompt of {len(prompt)} tokens leaves no room in a sequence's context of "
                f"{self.n_ctx}"
            )
        self.engine.check_tokens(np.asarray(prompt, dtype=np.int32))
        req = Request(list(prompt), max_tokens, Sampler(sampling), stop_at_end)
        req.t_submit = time.perf_counter()
        self.waiting.append(req)
        return req

    def adopt(
        self, prompt: list[int], tokens: list[int], max_tokens: int, sampling, stop_at_end: bool
    ) -> Request:
        """Take over a generation that ran alone on the engine's own sequence (sequence 0, with
        the draft, while the batch was idle) and goes on here, decoding plainly beside new
        requests. Its state: ``prompt`` and ``tokens`` chosen, all but the last fed."""
        if not self.idle:
            raise ValueError("a generation is adopted into an idle batch only")
        req = Request(list(prompt), max_tokens, Sampler(sampling), stop_at_end)
        req.tokens, req.seq = list(tokens), 0
        req.fed = len(prompt) + len(tokens) - 1
        req.t_submit = req.t_first = time.perf_counter()
        self.free.remove(0)
        self.active.append(req)
        return req

    def cancel(self, req: Request, reason: str = "cancelled", keep: bool = True) -> None:
        """End ``req`` now (its client went away, or a stop string ended its text, ``reason``
        "stop"); its sequence is free at once, its state kept in the prefix cache (``keep``)."""
        if req.done:
            return
        if req in self.waiting:
            self.waiting.remove(req)
        self._finish(req, reason, keep)

    def clear(self) -> None:
        """Forget every request after a failed step (their state is not kept): all sequences
        are free."""
        for req in [*self.waiting, *self.active]:
            self.cancel(req, keep=False)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.active

    def step(self) -> list[tuple[Request, int]]:
        """One round (module doc): the tokens chosen in it, as (request, token)."""
        out: list[tuple[Request, int]] = []
        while self.waiting and self.free:
            req = self.waiting.popleft()
            # the lowest free sequence: a decode step runs its lowest sequence to its highest
            # (stand-ins for those between that are not decoding cost a row each)
            req.seq, req.fed = min(self.free), 0
            self.free.remove(req.seq)
            self.engine.release_sequence(req.seq)
            self.active.append(req)
            self._restore(req, out)
        # one prompt chunk a round while others decode (they stall by one chunk at most); with
        # none decoding there is no one to stall: the chunks of every prompt being read, up to
        # one chunk's tokens in all, so that requests that came together decode together
        budget, decoding = self.chunk, bool(self._generating())
        for req in [r for r in self.active if r.reading]:
            if budget < self.chunk and (budget <= 0 or decoding):
                break
            budget -= self._prefill_chunk(req, out)
        for run in self._runs(self._generating()):
            self._decode(run, out)
        return out

    def _generating(self) -> list[Request]:
        return [r for r in self.active if not r.reading and r.fed < self._held(r)]

    def _runs(self, reqs: list[Request]) -> list[list[Request]]:
        """The decode steps of a round: one for all, or, with recurrent state, one for each run
        of consecutive sequences."""
        if not reqs or not self.recurrent:
            return [reqs] if reqs else []
        reqs, runs = sorted(reqs, key=lambda r: r.seq), []
        for req in reqs:
            if runs and runs[-1][-1].seq == req.seq - 1:
                runs[-1].append(req)
            else:
                runs.append([req])
        return runs

    def run(self) -> None:
        """Step until every request has ended."""
        while not self.idle:
            self.step()

    def _held(self, req: Request) -> int:
        """Positions of ``req``'s sequence once its last chosen token is fed."""
        return len(req.prompt) + len(req.tokens)

    def _restore(self, req: Request, out: list) -> None:
        """Start ``req`` from its prompt's longest prefix in the prefix cache (RAM or disk)."""
        if self.cache is None:
            return
        hit, n, logits = self.cache.restore_sequence(req.prompt, req.seq)
        req.cache = {"hit": hit, "restored_tokens": n,
                     "prefilled_tokens": len(req.prompt) - n}  # fmt: skip
        if not n:
            return
        req.fed = n
        if n == len(req.prompt):  # a whole prompt is cached with its logits: nothing to prefill
            self._choose(req, logits, out)

    def _prefill_chunk(self, req: Request, out: list) -> int:
        """Feed ``req``'s next prompt chunk; the tokens fed."""
        part = np.asarray(req.prompt[req.fed : req.fed + self.chunk], dtype=np.int32)
        logits = self.engine.feed_sequence(part, req.seq, req.fed)
        self.steps["prefill"] += 1
        req.fed += part.size
        if not req.reading:
            if self.cache is not None:
                self.cache.save_sequence(req.prompt, req.seq, logits)
            self._choose(req, logits, out)
        return int(part.size)

    def _decode(self, reqs: list[Request], out: list) -> None:
        tokens = np.array([r.tokens[-1] for r in reqs], dtype=np.int32)
        seq = np.array([r.seq for r in reqs], dtype=np.int32)
        pos = np.array([r.fed for r in reqs], dtype=np.int32)
        greedy = all(r.sampler.params.greedy for r in reqs)
        values = self.engine.decode_sequences(tokens, seq, pos, greedy)
        self.steps["decode"] += 1
        self.steps["decoded"] += len(reqs)
        for req, row in zip(reqs, values, strict=True):
            req.fed += 1
            if greedy:
                self._take(req, int(row), out)
            else:
                self._choose(req, row, out)

    def _choose(self, req: Request, logits: np.ndarray, out: list) -> None:
        self._take(req, req.sampler.sample(logits), out)

    def _take(self, req: Request, token: int, out: list) -> None:
        if not req.tokens:
            req.t_first = time.perf_counter()
        req.tokens.append(token)
        out.append((req, token))
        tok = self.engine.tokenizer
        if req.stop_at_end and tok is not None and tok.is_end(token):
            self._finish(req, "stop")
        elif len(req.tokens) >= req.max_tokens or self._held(req) >= self.n_ctx:
            self._finish(req, "length")

    def _finish(self, req: Request, reason: str, keep: bool = True) -> None:
        req.finish_reason = reason
        if keep and req.seq >= 0 and self.cache is not None and req.fed > len(req.prompt):
            held = (req.prompt + req.tokens)[: req.fed]  # the positions its rows hold
            self.cache.save_sequence(held, req.seq, None)
        if req.seq >= 0:
            self.active.remove(req)
            self.free.append(req.seq)  # released when it is given again
            req.seq = -1
