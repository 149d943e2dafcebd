"""The Engine that the CLI, the server and the benchmarks use: a loaded model on its devices
(``runtime.engine``), its prefix cache (``cache``) and its generation loops (``decode``) behind
one entry point, ``generate``/``stream``. It sits above all three rooms, beside ``cli.py`` and
``bench.py``, so none of them imports upward.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from lucepy.cache.prefix import PrefixCache
from lucepy.decode import ar
from lucepy.runtime.config import RuntimeConfig
from lucepy.runtime.engine import Engine as RuntimeEngine


class Engine(RuntimeEngine):
    """A runtime Engine with the generation entry point. Keyword arguments are those of
    ``decode.ar.stream`` and ``decode.ar.generate``: ``sampling``, ``chunk``, ``stop_at_end``, and
    for ``stream`` also ``cancelled`` and ``gen``."""

    def stream(self, prompt_tokens: list[int], max_tokens: int, **kw) -> Iterator[int]:
        """Tokens one by one from a fresh sequence (through the prefix cache and the draft when
        there are); ``gen`` collects the finish reason, timings and acceptance stats."""
        return ar.stream(self, prompt_tokens, max_tokens, **kw)

    def generate(self, prompt_tokens: list[int], max_tokens: int, **kw) -> ar.Generation:
        """Up to ``max_tokens`` tokens (greedy unless ``sampling`` says otherwise), with text."""
        gen = ar.generate(self, prompt_tokens, max_tokens, **kw)
        gen.kv_pool = self.pool_report()
        return gen


def open_engine(model_path: str | os.PathLike, config: RuntimeConfig | None = None, **kw) -> Engine:
    """An Engine with the prefix cache its config asks for attached (``engine.prefix_cache``)."""
    engine = Engine(model_path, config, **kw)
    try:
        engine.prefix_cache = PrefixCache.for_engine(engine)
    except BaseException:
        engine.close()
        raise
    return engine
