"""Speculative decoding with a DFlash draft (decision 5: lossless).

Each step: the draft proposes d_1..d_{B-1} after the last token; the target verifies
[last, d_1..d_{B-1}] in one pass, whose row i is the target's distribution p_i for the token after
position n+i. Greedy: accept the longest prefix with d_{i+1} = argmax p_i, then the bonus
argmax p_j. Sampling (Leviathan et al., 2023): accept d_{i+1} ~ q_i with probability
min(1, p_i(d)/q_i(d)); on the first rejection draw from norm(max(0, p_i - q_i)); if all are
accepted draw the bonus from p_{B-1}. Either way every committed token is distributed as the
target alone would sample it. Then every shard rolls back to the kept length (no replay) and the
kept positions' features are injected into the draft.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from lucepy.decode.prefill import begin
from lucepy.decode.sampling import Sampler, choose, token_logprob


@dataclass
class AcceptStats:
    block: int
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    histogram: list[int] = field(default_factory=list)  # [j]: steps that accepted j drafts
    draft_ms: float = 0.0
    verify_ms: float = 0.0

    def __post_init__(self) -> None:
        self.histogram = self.histogram or [0] * self.block

    @property
    def mean_len(self) -> float:
        """tau: tokens committed per verify step, the bonus token included."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    def record(self, drafted: int, accepted: int) -> None:
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.histogram[accepted] += 1

    def to_dict(self) -> dict:
        return {
            "steps": self.steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "mean_len": round(self.mean_len, 4),
            "histogram": self.histogram,
            "draft_ms": round(self.draft_ms, 3),
            "verify_ms": round(self.verify_ms, 3),
        }


def accept_greedy(drafts: np.ndarray, target: np.ndarray) -> tuple[int, int]:
    """(accepted count j, bonus token): the longest prefix where draft i+1 == argmax row i."""
    miss = np.nonzero(drafts != target[: drafts.size])[0]
    j = int(miss[0]) if miss.size else drafts.size
    return j, int(target[j])


def accept_sampled(
    sampler: Sampler, drafts: np.ndarray, q: list[np.ndarray], target_logits: np.ndarray
) -> tuple[int, int]:
    """Speculative rejection sampling over the block; see the module docstring."""
    for i, d in enumerate(drafts):
        p = sampler.probs(target_logits[i])
        if sampler.rng.random() * q[i][d] < p[d]:  # u < p/q, without dividing by zero
            continue
        residual = np.maximum(p - q[i], 0.0)
        return i, sampler.draw(residual)
    return drafts.size, sampler.draw(sampler.probs(target_logits[drafts.size]))


def accept_constrained(
    sampler: Sampler, drafts: np.ndarray, q, target_logits: np.ndarray, constraint
) -> tuple[int, int]:
    """Acceptance (greedy, or rejection sampling against q) where row i is masked by the
    grammar after the accepted drafts before it; consumes what it keeps. A draft the grammar
    forbids has no mass under the masked row, so it is never kept."""
    for i, d in enumerate(drafts):
        row = constraint.masked(target_logits[i])
        if sampler.params.greedy:
            best = int(np.argmax(row))
            if best != d:
                constraint.consume(best)
                return i, best
        else:
            p = sampler.probs(row)
            if not sampler.rng.random() * q[i][d] < p[d]:
                bonus = sampler.draw(np.maximum(p - q[i], 0.0))
                constraint.consume(bonus)
                return i, bonus
        constraint.consume(int(d))
    bonus = choose(sampler, target_logits[drafts.size], constraint)
    return int(drafts.size), bonus


def _propose(draft, sampler: Sampler, last: int, pos: int, block: int):
    """Draft tokens d_1..d_{B-1}, and their distributions q when sampling (none for B = 1: the
    step verifies ``last`` alone, a decode that keeps the draft's features up to date)."""
    if block == 1:
        return np.zeros(0, dtype=np.int64), []
    if sampler.params.greedy:
        return draft.propose(last, pos, "argmax", block)[1:].astype(np.int64), None
    logits = draft.propose(last, pos, "out", block)
    q = [sampler.probs(logits[i]) for i in range(1, block)]
    return np.array([sampler.draw(qi) for qi in q], dtype=np.int64), q


def stream(
    engine,
    prompt_tokens: list[int],
    max_tokens: int,
    *,
    sampler: Sampler,
    gen,
    chunk: int | None = None,
    stop_at_end: bool = True,
    cancelled: Callable[[], bool] = lambda: False,
    logprobs: int | None = None,
    constraint=None,
    lengths=None,
) -> Iterator[int]:
    """Yield tokens from a fresh sequence; ``gen.accept`` collects the acceptance stats, and
    ``gen.logprobs`` each kept token's log-probability under the target when asked for. Under
    a ``constraint`` each verify row is masked by the grammar after the tokens before it.
    ``lengths`` (decode/verify_len.py) chooses each step's length; None: the draft's block.

    ``engine.draft`` is read after the prefill: starting the sequence may have replaced a draft
    whose worker died."""
    layers = engine.draft.p.target_layers
    engine.capture = layers

    def inject(out, pos0: int) -> None:
        engine.draft.inject([out.features[L] for L in layers], pos0)

    logits = begin(engine, prompt_tokens, gen, chunk=chunk, on_chunk=inject)
    draft = engine.draft
    draft.reset()
    stats = gen.accept = AcceptStats(draft.block)
    pending = [choose(sampler, logits, constraint)]
    notes = _notes(logits[None], pending, logprobs)
    while True:
        for i, token in enumerate(pending):
            if len(gen.tokens) >= max_tokens:
                return
            gen.tokens.append(token)
            if notes:
                gen.logprobs.append(notes[i])
            if stop_at_end and engine.tokenizer is not None and engine.tokenizer.is_end(token):
                gen.finish_reason = "stop"
                return
            yield token
        if len(gen.tokens) >= max_tokens:
            return
        if cancelled():
            gen.finish_reason = "cancelled"
            return
        pos, last = engine.n_past, gen.tokens[-1]
        room = min(draft.block, engine.n_ctx - pos)
        if room == 0:
            return  # the context is full: stop as at max_tokens ("length")
        if room == 1:  # room for one more token only: decode it as plain greedy would
            logits = engine.decode(last)
            pending = [choose(sampler, logits, constraint)]
            notes = _notes(logits[None], pending, logprobs)
            continue
        # a length of 1 verifies the last token alone: it keeps the draft's context whole, so
        # drafting can resume when the rates recover
        block = lengths.choose(room) if lengths is not None else room
        pending, notes = _step(
            engine, draft, sampler, stats, last, pos, block, logprobs, constraint
        )
        if lengths is not None:
            lengths.record(block, len(pending) - 1)


def _notes(rows: np.ndarray, tokens: list[int], top: int | None) -> list:
    """Each token's TokenLogprob under the logits row that chose it (none unless asked)."""
    if top is None:
        return []
    return [token_logprob(rows[i], t, top) for i, t in enumerate(tokens)]


def _step(
    engine,
    draft,
    sampler: Sampler,
    stats: AcceptStats,
    last: int,
    pos: int,
    block: int,
    logprobs: int | None,
    constraint,
) -> tuple[list[int], list]:
    t0 = time.perf_counter()
    drafts, q = _propose(draft, sampler, last, pos, block)
    t1 = time.perf_counter()
    greedy = sampler.params.greedy
    # greedy verification needs only the argmax per row, unless log-probabilities or a grammar
    # want the rows
    argmax_only = greedy and logprobs is None and constraint is None
    handle = engine.verify(np.concatenate([[last], drafts]), greedy=argmax_only)
    if constraint is not None:
        j, bonus = accept_constrained(sampler, drafts, q, handle.values, constraint)
    elif argmax_only:
        j, bonus = accept_greedy(drafts, handle.values[0])
    elif greedy:
        j, bonus = accept_greedy(drafts, np.argmax(handle.values, axis=-1))
    else:
        j, bonus = accept_sampled(sampler, drafts, q, handle.values)
    kept = [int(t) for t in drafts[:j]] + [bonus]
    notes = [] if argmax_only else _notes(handle.values, kept, logprobs)
    engine.commit(handle, j + 1)
    draft.inject([handle.features[L] for L in draft.p.target_layers], pos, j + 1)
    t2 = time.perf_counter()
    stats.draft_ms += (t1 - t0) * 1e3
    stats.verify_ms += (t2 - t1) * 1e3
    stats.record(block - 1, j)
    return kept, notes
