"""From tokens to text a client may see: incremental detokenizing and stop sequences.

Both hold text back rather than take it back: a stream never emits a half UTF-8 character, nor
text that later turns out to begin a stop sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

_PARTIAL = "\ufffd"  # what a decoder returns for an incomplete UTF-8 sequence


class Detokenizer:
    """Turns tokens into text deltas, decoding a short window rather than the whole sequence.

    The window starts at the last point where the text was complete, so a character split over
    several byte tokens comes out whole once its last byte arrives.
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self._tokens: list[int] = []
        self._start = 0  # window start: text before it was emitted
        self._read = 0  # tokens[start:read] decode to text that was already emitted

    def push(self, token: int) -> str:
        self._tokens.append(token)
        done = self._decode(self._tokens[self._start : self._read])
        text = self._decode(self._tokens[self._start :])
        if len(text) <= len(done) or text.endswith(_PARTIAL):
            return ""
        self._start, self._read = self._read, len(self._tokens)
        return text[len(done) :]

    def flush(self) -> str:
        """What is still held back (a trailing partial character), as it decodes now."""
        done = self._decode(self._tokens[self._start : self._read])
        text = self._decode(self._tokens[self._start :])
        self._start = self._read = len(self._tokens)
        return text[len(done) :]


class StopFilter:
    """Cuts the text at the first stop sequence; holds back a tail that may begin one."""

    def __init__(self, stops: Iterable[str]):
        self.stops = tuple(s for s in stops if s)
        self._pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The text that is safe to emit now; sets ``stopped`` when a stop sequence matched."""
        if self.stopped:
            return ""
        pending = self._pending + text
        hits = [i for i in (pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self._pending = True, ""
            return pending[: min(hits)]
        keep = self._hold(pending)
        self._pending = pending[len(pending) - keep :] if keep else ""
        return pending[: len(pending) - keep]

    def _hold(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop sequence."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best

    def flush(self) -> str:
        """At the end of generation the held tail can no longer become a stop: emit it."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out
