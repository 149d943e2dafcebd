"""Which prefix snapshots go to disk (``--disk-prefix-cache``). See docs/prefix-cache.md.

- ``off``: none.
- ``full``: every snapshot the cache takes (end of each prompt, end of each generation).
- ``auto:N``: those of at least N tokens; shorter prefixes prefill faster than they load.
- ``N``: like ``full``, plus a snapshot every N prompt tokens, so a long prompt edited near its
  end still reuses its unchanged head.
"""

from __future__ import annotations

from dataclasses import dataclass

from lucepy.errors import ConfigError


@dataclass(frozen=True)
class DiskPolicy:
    enabled: bool
    min_tokens: int = 0
    interval: int = 0  # 0: no interval snapshots

    def wants(self, n_tokens: int) -> bool:
        return self.enabled and n_tokens >= self.min_tokens


def parse_policy(text: str) -> DiskPolicy:
    value = text.strip().lower()
    if value == "off":
        return DiskPolicy(False)
    if value == "full":
        return DiskPolicy(True)
    try:
        if value.startswith("auto:"):
            return DiskPolicy(True, min_tokens=_positive(value[5:]))
        return DiskPolicy(True, interval=_positive(value))
    except ValueError:
        raise ConfigError(
            f"--disk-prefix-cache takes off, full, auto:N or N (N > 0 tokens), got {text!r}"
        ) from None


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise ValueError(text)
    return n
