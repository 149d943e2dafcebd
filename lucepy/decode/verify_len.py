"""How many tokens each speculative step verifies, from measured costs (``--draft-block auto``).

A step with length k drafts k - 1 tokens (none for k = 1) and verifies [last, d_1..d_{k-1}]: it
costs ``StepCosts.step(k)`` seconds, measured once per device (``measure``), and commits
1 + min(J, k - 1) tokens, where J is how many drafts in a row the target accepts. With a_i the
running rate at which draft i is accepted once the drafts before it were,

    E[committed | k] = 1 + sum_{i < k} a_1 a_2 ... a_i,

and each step takes the k that maximises E[committed | k] / step(k). The rates are counts that
decay toward ``PRIOR``, so they follow the text; a step of length k informs a_1..a_{j+1} only (a
draft never offered says nothing). They start at the prior, so drafting is tried before it is
judged; where even the prior finds no length above 1 worth it (``drafts``), generation decodes
plainly.
On ggml-cuda a 16-token verify costs about 2.4 decodes (its kernels change above 8 rows), on a
CPU about 7: the best k is often far from the trained block.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

PRIOR = (0.6, 2.0)  # each draft's acceptance rate before any step, and its weight in steps
DECAY = 0.98  # per step: the counts of about the last 50 steps weigh
CALIBRATION_PROMPT = 64  # tokens before the measured steps
# decodes a timed run of plain decoding, one after another as a generation's are (ggml-cuda
# replays a graph from its third run of the same shape); one untimed run first
DECODE_RUN = 8


@dataclass(frozen=True)
class StepCosts:
    """Seconds per step of length k = 1..block: the draft's pass over k tokens, and the target's
    k-token verify with what a step does after it (the commit of the kept tokens, the draft's
    copy of their features); and ``decode``, a plain decode step, what drafting competes with.
    Index 0 is unused."""

    draft: tuple[float, ...]
    verify: tuple[float, ...]
    decode: float

    @property
    def block(self) -> int:
        return len(self.verify) - 1

    def step(self, k: int) -> float:
        return self.verify[k] + (self.draft[k] if k > 1 else 0.0)

    def to_dict(self) -> dict:
        return {"draft": list(self.draft), "verify": list(self.verify), "decode": self.decode}

    @classmethod
    def from_dict(cls, d: dict) -> StepCosts:
        return cls(
            tuple(float(x) for x in d["draft"]),
            tuple(float(x) for x in d["verify"]),
            float(d["decode"]),
        )


class VerifyLength:
    """Chooses each step's length; ``record`` feeds it what the step accepted."""

    def __init__(self, costs: StepCosts, prior: tuple[float, float] = PRIOR):
        n = costs.block  # drafts 1..n-1 at indices 1..n-1
        self.costs = costs
        self.prior_offered = np.full(n, prior[1])
        self.prior_accepted = np.full(n, prior[0] * prior[1])
        self.offered, self.accepted = self.prior_offered.copy(), self.prior_accepted.copy()
        self._step = np.array([costs.step(k) for k in range(1, n + 1)])

    def expected(self, accepted=None, offered=None) -> np.ndarray:
        """E[committed tokens] for k = 1..block (index k - 1), under the running rates or
        the given counts."""
        a = self.accepted if accepted is None else accepted
        o = self.offered if offered is None else offered
        survive = np.cumprod(a[1:] / o[1:])
        return 1.0 + np.concatenate([[0.0], np.cumsum(survive)])

    def choose(self, limit: int) -> int:
        """The best length at most ``limit`` (the room left in the context)."""
        rate = self.expected()[:limit] / self._step[:limit]
        return int(np.argmax(rate)) + 1

    def drafts(self) -> bool:
        """Whether a generation drafts at all: some length above 1 commits tokens faster than
        plain decoding (which, unlike a 1-token step, copies no features for the draft) under
        the running rates, or under the prior ones (the rates drift back to them as steps go
        by). When not, it decodes plainly."""
        if self.costs.block < 2:
            return False
        running = self.expected() / self._step
        prior = self.expected(self.prior_accepted, self.prior_offered) / self._step
        return max(running[1:].max(), prior[1:].max()) * self.costs.decode > 1.0

    def record(self, k: int, accepted: int) -> None:
        """A step of length k accepted ``accepted`` drafts: drafts 1..accepted were taken and,
        if it stopped short of k - 1, draft accepted + 1 was refused. The counts decay toward
        the prior, so a length given up is tried again once the prior would."""
        self.offered = DECAY * self.offered + (1 - DECAY) * self.prior_offered
        self.accepted = DECAY * self.accepted + (1 - DECAY) * self.prior_accepted
        seen = min(accepted + 1, k - 1)
        self.offered[1 : seen + 1] += 1
        self.accepted[1 : accepted + 1] += 1

    def to_dict(self) -> dict:
        return {
            "rates": np.round(self.accepted[1:] / self.offered[1:], 3).tolist(),
            "step_ms": np.round(self._step * 1e3, 3).tolist(),
            "best": self.choose(self.costs.block),
        }


def median_s(run: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``run`` over ``repeats`` runs after one untimed warm-up (graph builds
    and first touches are not what is measured). lucepy's benchmarks time with it too."""
    run()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measurable(n_ctx: int, block: int, repeats: int = 3) -> bool:
    """Whether ``measure`` fits a context of ``n_ctx``: its prompt, one kept token per timed
    step (and warm-up) and per decode, and the longest verify."""
    decodes = (repeats + 1) * DECODE_RUN
    return n_ctx >= CALIBRATION_PROMPT + decodes + (repeats + 1) * block + block


def measure(engine, repeats: int = 3) -> StepCosts:
    """Time a plain greedy decode (its argmax alone read back, as the greedy loop reads it) and
    then a step of each length on ``engine`` (with its draft) at a short context, each as the
    median of ``repeats`` after a warm-up; then reset the engine. A decode is timed in runs of
    DECODE_RUN, first (where a generation starts). A timed step is a speculative step's work:
    the draft's pass, the verify with the features the draft reads, the commit of its first
    token and the draft's copy of that token's features; so the context grows by one per run."""
    draft, block = engine.draft, engine.draft.block
    assert measurable(engine.n_ctx, block, repeats), "the caller checks measurable()"
    layers, capture = draft.p.target_layers, engine.capture
    engine.reset()
    tokens = np.arange(CALIBRATION_PROMPT, dtype=np.int32) % engine.params.n_vocab
    engine.prefill(tokens)

    def verify(k: int) -> None:
        handle = engine.verify(np.ones(k, dtype=np.int32), greedy=True)
        engine.commit(handle, 1)
        draft.inject([handle.features[L] for L in layers], handle.pos0, 1)

    def propose(k: int) -> None:
        draft.propose(1, engine.n_past, "argmax", k)

    def decodes() -> None:
        for _ in range(DECODE_RUN):
            engine.decode_greedy(1)

    draft_s, verify_s = [0.0, 0.0], [0.0]
    try:
        decode_s = median_s(decodes, repeats) / DECODE_RUN
        engine.capture = layers
        for k in range(1, block + 1):
            verify_s.append(median_s(lambda k=k: verify(k), repeats))
            if k > 1:
                draft_s.append(median_s(lambda k=k: propose(k), repeats))
    finally:
        engine.capture = capture
        engine.reset()
    return StepCosts(tuple(draft_s), tuple(verify_s), decode_s)
