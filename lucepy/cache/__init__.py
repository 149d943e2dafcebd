"""Prefix snapshots: RAM slots, the disk format, and the policy that decides what to keep."""

from __future__ import annotations

import os

from lucepy.runtime.config import RuntimeConfig
from lucepy.runtime.engine import Engine


def open_engine(model_path: str | os.PathLike, config: RuntimeConfig | None = None, **kw) -> Engine:
    """An Engine with the prefix cache its config asks for attached (``engine.prefix_cache``).

    The CLI and the server open engines through this, so both get the same caching."""
    from lucepy.cache.prefix import PrefixCache

    engine = Engine(model_path, config, **kw)
    try:
        engine.prefix_cache = PrefixCache.for_engine(engine)
    except BaseException:
        engine.close()
        raise
    return engine
