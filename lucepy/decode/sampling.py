"""Samplers: turn next-token logits into a distribution, and a distribution into a token.

``probs`` is the distribution the sampler draws from, after temperature, top-k and top-p.
Speculative verification (decision 5) compares these distributions, so both sides use the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lucepy.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def greedy(logits: np.ndarray) -> int:
    return int(np.argmax(logits))


@dataclass(frozen=True)
class TokenLogprob:
    """A chosen token's log-probability under the model (the log-softmax of its logits, before
    temperature and truncation, as OpenAI reports it), and the ``top`` most likely tokens'."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprob(logits: np.ndarray, token: int, top: int = 0) -> TokenLogprob:
    z = logits.astype(np.float64)
    m = z.max()
    lp = z - (m + np.log(np.exp(z - m).sum()))
    best: tuple[tuple[int, float], ...] = ()
    if top:
        k = min(top, lp.size)
        idx = np.argpartition(-lp, k - 1)[:k]
        idx = idx[np.argsort(-lp[idx], kind="stable")]
        best = tuple((int(i), float(lp[i])) for i in idx)
    return TokenLogprob(int(token), float(lp[token]), best)


class Sampler:
    def __init__(self, params: SamplingParams | None = None):
        self.params = params or SamplingParams()
        self.rng = np.random.default_rng(self.params.seed)

    def probs(self, logits: np.ndarray) -> np.ndarray:
        """The sampling distribution over the vocabulary (one-hot when greedy)."""
        p = self.params
        out = np.zeros(logits.shape[-1], dtype=np.float32)
        if p.greedy:
            out[int(np.argmax(logits))] = 1.0
            return out
        z = logits.astype(np.float32, copy=False) * np.float32(1.0 / p.temperature)
        if p.top_k and p.top_k < z.size:
            keep = np.argpartition(-z, p.top_k - 1)[: p.top_k]
        else:
            keep = np.arange(z.size)
        w = np.exp(z[keep] - z[keep].max())
        w /= w.sum()
        if p.top_p < 1.0:
            keep, w = _nucleus(keep, w, p.top_p)
        out[keep] = w
        return out

    def sample(self, logits: np.ndarray) -> int:
        if self.params.greedy:
            return greedy(logits)
        return self.draw(self.probs(logits))

    def draw(self, probs: np.ndarray) -> int:
        c = np.cumsum(probs)
        return int(min(np.searchsorted(c, self.rng.random() * c[-1], side="right"), len(c) - 1))


def _nucleus(keep: np.ndarray, w: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """The smallest set of most likely tokens whose mass reaches ``top_p``, renormalised.

    Sorting a 250k vocabulary costs milliseconds, so sort only the top 256 when they hold the mass.
    """
    head = np.argpartition(-w, 255)[:256] if w.size > 256 else np.arange(w.size)
    if w[head].sum() < top_p:
        head = np.arange(w.size)
    order = head[np.argsort(-w[head], kind="stable")]
    n = int(np.searchsorted(np.cumsum(w[order]), top_p) + 1)
    order = order[:n]
    return keep[order], w[order] / w[order].sum()


def choose(sampler: Sampler, logits: np.ndarray, constraint=None) -> int:
    """The next token: sampled from ``logits``, or under a grammar ``constraint``
    (decode/grammar.py) from the tokens it allows, which then consumes it."""
    if constraint is None:
        return sampler.sample(logits)
    token = sampler.sample(constraint.masked(logits))
    constraint.consume(token)
    return token
