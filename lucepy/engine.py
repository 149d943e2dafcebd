"""The Engine that the CLI, the server and the benchmarks use: a loaded model on its devices
(``runtime.engine``), its prefix cache (``cache``) and its generation loops (``decode``) behind
one entry point, ``generate``/``stream``. It sits above all three rooms, beside ``cli.py`` and
``bench.py``, so none of them imports upward.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator

from lucepy.cache.prefix import PrefixCache
from lucepy.decode import ar
from lucepy.decode.verify_len import StepCosts, VerifyLength, measurable, measure
from lucepy.ggml.lib import build_identity
from lucepy.runtime.backends import cache_root
from lucepy.runtime.config import RuntimeConfig
from lucepy.runtime.engine import Engine as RuntimeEngine

log = logging.getLogger(__name__)


class Engine(RuntimeEngine):
    """A runtime Engine with the generation entry point. Keyword arguments are those of
    ``decode.ar.stream`` and ``decode.ar.generate``: ``sampling``, ``chunk``, ``stop_at_end``, and
    for ``stream`` also ``cancelled`` and ``gen``."""

    def stream(self, prompt_tokens: list[int], max_tokens: int, **kw) -> Iterator[int]:
        """Tokens one by one from a fresh sequence (through the prefix cache and the draft when
        there are); ``gen`` collects the finish reason, timings and acceptance stats."""
        return ar.stream(self, prompt_tokens, max_tokens, **kw)

    def verify_lengths(self) -> VerifyLength | None:
        """The chooser of each speculative step's length (``verify_len="auto"``), one per
        engine so that its acceptance rates run across requests; None: fixed blocks."""
        if self.config.verify_len != "auto" or self.draft is None:
            return None
        if not measurable(self.n_ctx, self.draft.block):
            log.warning("a context of %d is too small to time verify lengths: fixed", self.n_ctx)
            return None
        lengths = getattr(self, "_lengths", None)
        if lengths is None or lengths.costs.block != self.draft.block:
            lengths = self._lengths = VerifyLength(self._step_costs())
        return lengths

    def _step_costs(self) -> StepCosts:
        """Measured once per model, draft, devices, threads and ggml build (its kernels decide
        the costs), then read from lucepy's cache."""
        cfg = self.config
        key = ["steps and greedy decode runs"]  # what is measured (timed otherwise: anew)
        key += [self.file.identity(), self.draft.file.identity(), cfg.device, cfg.draft_device]
        key += [cfg.threads, cfg.flash_attn, cfg.batch_invariant, self.draft.block]
        key += [os.environ.get("LUCEPY_GGML_LIB"), build_identity(self.lib)]
        name = hashlib.sha256(json.dumps(key, default=str).encode()).hexdigest()[:16]
        path = cache_root() / "step-costs" / f"{name}.json"
        if path.is_file():
            try:
                return StepCosts.from_dict(json.loads(path.read_text()))
            except (ValueError, KeyError, TypeError) as e:  # cut short or edited: measure anew
                log.warning("measured step costs in %s unreadable (%s): measuring again", path, e)
        log.info("measuring the cost of verify lengths 1..%d (once)", self.draft.block)
        costs = measure(self)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(costs.to_dict()) + "\n")
        return costs

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
