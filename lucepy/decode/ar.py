"""The autoregressive loop: prefill the prompt, then one token in, one token out."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

from lucepy.decode.sampling import Sampler, SamplingParams


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
    finish_reason: str = "length"  # "length", "stop" (end token) or "cancelled"

    def to_dict(self) -> dict:
        out = asdict(self)
        del out["finish_reason"]  # not part of the stable generate --json object
        return out


def _rate(n: int, ms: float) -> float:
    return round(n / (ms / 1000.0), 3) if ms > 0 else 0.0


def stream(
    engine,
    prompt_tokens: list[int],
    max_tokens: int,
    *,
    sampling: SamplingParams | None = None,
    chunk: int | None = None,
    stop_at_end: bool = True,
    cancelled: Callable[[], bool] = lambda: False,
    gen: Generation | None = None,
) -> Iterator[int]:
    """Yield generated tokens one by one from a fresh sequence; ``gen`` collects tokens, the finish
    reason and timings as it goes. ``cancelled`` is polled before every decode step."""
    gen = gen if gen is not None else Generation(prompt_tokens=list(prompt_tokens))
    sampler = Sampler(sampling)
    tok = engine.tokenizer
    engine.reset()
    t0 = time.perf_counter()
    logits = engine.prefill(prompt_tokens, chunk=chunk)
    t1 = time.perf_counter()
    n_decoded = 0
    try:
        while len(gen.tokens) < max_tokens:
            token = sampler.sample(logits)
            gen.tokens.append(token)
            if stop_at_end and tok is not None and tok.is_end(token):
                gen.finish_reason = "stop"
                return
            yield token
            if len(gen.tokens) == max_tokens:
                return
            if cancelled():
                gen.finish_reason = "cancelled"
                return
            logits = engine.decode(token)
            n_decoded += 1
    finally:
        t2 = time.perf_counter()
        prefill_ms, decode_ms = (t1 - t0) * 1e3, (t2 - t1) * 1e3
        gen.timings = Timings(
            round(prefill_ms, 3),
            round(decode_ms, 3),
            _rate(len(prompt_tokens), prefill_ms),
            _rate(n_decoded, decode_ms),
        )


def generate(
    engine,
    prompt_tokens: list[int],
    max_tokens: int,
    *,
    sampling: SamplingParams | None = None,
    chunk: int | None = None,
    stop_at_end: bool = True,
) -> Generation:
    """Generate up to ``max_tokens`` (greedy unless ``sampling`` says otherwise)."""
    gen = Generation(prompt_tokens=list(prompt_tokens))
    for _ in stream(
        engine,
        prompt_tokens,
        max_tokens,
        sampling=sampling,
        chunk=chunk,
        stop_at_end=stop_at_end,
        gen=gen,
    ):
        pass
    if engine.tokenizer is not None:
        gen.text = engine.tokenizer.decode(gen.tokens)
    return gen
