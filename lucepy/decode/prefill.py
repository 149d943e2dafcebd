"""The start and end of every generation: prefill through the prefix cache when there is one."""

from __future__ import annotations

import time


def begin(engine, prompt: list[int], gen, *, chunk: int | None, on_chunk=None):
    """Bring the engine to the end of ``prompt`` and return its last logits; ``gen.cache`` gets
    the cache report (None without a cache)."""
    cache = getattr(engine, "prefix_cache", None)
    if cache is None:
        engine.reset()
        logits = engine.prefill(prompt, chunk=chunk, on_chunk=on_chunk)
    else:
        logits, gen.cache = cache.start(list(prompt), chunk, on_chunk)
    gen.t_prefilled = time.perf_counter()
    return logits


def end(engine, gen) -> None:
    """After a finished generation, let the cache keep the state it reached."""
    cache = getattr(engine, "prefix_cache", None)
    if cache is not None:
        cache.finish(list(gen.prompt_tokens) + list(gen.tokens))
