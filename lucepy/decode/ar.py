"""Generation loops: prefill the prompt, then one token at a time, or a drafted block at a time
when the engine has a draft (``decode/speculative.py``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from lucepy.decode import speculative
from lucepy.decode.prefill import begin, end
from lucepy.decode.sampling import Sampler, SamplingParams, choose, token_logprob


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
    accept: Any = None  # speculative.AcceptStats when a draft ran
    cache: dict | None = None  # the prefix cache's report, when there is a cache
    t_prefilled: float = 0.0  # perf_counter when the prompt was in
    logprobs: list = field(default_factory=list)  # a TokenLogprob per token, when asked for
    kv_pool: dict | None = None  # KV Flash's pool after the generation, when there is one

    def to_dict(self) -> dict:
        """The stable ``generate --json`` object."""
        t = self.timings
        return {
            "prompt_tokens": self.prompt_tokens,
            "tokens": self.tokens,
            "text": self.text,
            "timings": {
                "prefill_ms": t.prefill_ms,
                "decode_ms": t.decode_ms,
                "prefill_tok_s": t.prefill_tok_s,
                "decode_tok_s": t.decode_tok_s,
            },
            "accept": self.accept.to_dict() if self.accept is not None else None,
            "cache": self.cache,
            "kv_pool": self.kv_pool,
        }


def _rate(n: int, ms: float) -> float:
    return round(n / (ms / 1000.0), 3) if ms > 0 else 0.0


def _plain(
    engine,
    prompt_tokens,
    max_tokens,
    *,
    sampler,
    gen,
    chunk,
    stop_at_end,
    cancelled,
    logprobs,
    constraint,
):
    engine.capture = ()
    # greedy with nothing else read from the logits: each step reads back only their argmax
    argmax_only = sampler.params.greedy and logprobs is None and constraint is None
    logits = begin(engine, prompt_tokens, gen, chunk=chunk)
    chosen = None  # argmax_only: the token the step before read back
    while len(gen.tokens) < max_tokens:
        token = chosen if chosen is not None else choose(sampler, logits, constraint)
        gen.tokens.append(token)
        if logprobs is not None:
            gen.logprobs.append(token_logprob(logits, token, logprobs))
        if stop_at_end and engine.tokenizer is not None and engine.tokenizer.is_end(token):
            gen.finish_reason = "stop"
            return
        yield token
        if len(gen.tokens) == max_tokens:
            return
        if cancelled():
            gen.finish_reason = "cancelled"
            return
        if engine.n_past >= engine.n_ctx:
            return  # the context is full: stop as at max_tokens ("length")
        if argmax_only:
            chosen = engine.decode_greedy(token)
        else:
            logits = engine.decode(token)


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
    logprobs: int | None = None,
    constraint=None,
) -> Iterator[int]:
    """Yield generated tokens one by one from a fresh sequence; ``gen`` collects tokens, the
    finish reason, timings and acceptance stats as it goes. ``cancelled`` is polled between
    steps. ``logprobs`` (the number of top tokens, 0 for none) collects each token's
    ``TokenLogprob`` in ``gen.logprobs``. A ``constraint`` (decode/grammar.py) limits every
    token to what its grammar allows next."""
    gen = gen if gen is not None else Generation(prompt_tokens=list(prompt_tokens))
    loop = speculative.stream if getattr(engine, "draft", None) is not None else None
    kw = dict(
        sampler=Sampler(sampling),
        gen=gen,
        chunk=chunk,
        stop_at_end=stop_at_end,
        cancelled=cancelled,
        logprobs=logprobs,
        constraint=constraint,
    )
    t0 = time.perf_counter()
    try:
        # measured verify lengths (may time the steps first); a draft that cannot pay here
        # is left out
        lengths = getattr(engine, "verify_lengths", lambda: None)() if loop else None
        if lengths is not None and not lengths.drafts():
            loop = None
        if loop is None:
            yield from _plain(engine, prompt_tokens, max_tokens, **kw)
        else:
            yield from loop(engine, prompt_tokens, max_tokens, lengths=lengths, **kw)
        end(engine, gen)
    finally:
        t1 = gen.t_prefilled or time.perf_counter()
        t2 = time.perf_counter()
        prefill_ms, decode_ms = (t1 - t0) * 1e3, (t2 - t1) * 1e3
        gen.timings = Timings(
            round(prefill_ms, 3),
            round(decode_ms, 3),
            _rate(len(prompt_tokens), prefill_ms),
            _rate(max(len(gen.tokens) - 1, 0), decode_ms),
        )


def generate(
    engine,
    prompt_tokens: list[int],
    max_tokens: int,
    *,
    sampling: SamplingParams | None = None,
    chunk: int | None = None,
    stop_at_end: bool = True,
    constraint=None,
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
        constraint=constraint,
    ):
        pass
    if engine.tokenizer is not None:
        gen.text = engine.tokenizer.decode(gen.tokens)
    return gen
