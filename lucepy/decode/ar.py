"""The autoregressive loop: prefill the prompt, then one token in, one token out."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from lucepy.decode.sampling import greedy


@dataclass
class Timings:
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    prefill_tok_s: float = 0.0
    decode_tok_s: float = 0.0


@dataclass
class Generation:
    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    timings: Timings = field(default_factory=Timings)

    def to_dict(self) -> dict:
        return asdict(self)


def _rate(n: int, ms: float) -> float:
    return round(n / (ms / 1000.0), 3) if ms > 0 else 0.0


def generate(
    engine,
    prompt_tokens: list[int],
    max_tokens: int,
    *,
    chunk: int | None = None,
    stop_at_end: bool = True,
) -> Generation:
    """Greedy generation of up to ``max_tokens`` from a fresh sequence."""
    gen = Generation(prompt_tokens=list(prompt_tokens))
    engine.reset()
    t0 = time.perf_counter()
    logits = engine.prefill(prompt_tokens, chunk=chunk)
    t1 = time.perf_counter()
    n_decoded = 0
    tok = engine.tokenizer
    while len(gen.tokens) < max_tokens:
        token = greedy(logits)
        gen.tokens.append(token)
        if stop_at_end and tok is not None and tok.is_end(token):
            break
        if len(gen.tokens) == max_tokens:
            break
        logits = engine.decode(token)
        n_decoded += 1
    t2 = time.perf_counter()
    prefill_ms, decode_ms = (t1 - t0) * 1e3, (t2 - t1) * 1e3
    gen.timings = Timings(
        round(prefill_ms, 3),
        round(decode_ms, 3),
        _rate(len(prompt_tokens), prefill_ms),
        _rate(n_decoded, decode_ms),
    )
    if tok is not None:
        gen.text = tok.decode(gen.tokens)
    return gen
