"""The Engine: a loaded model, ready to prefill and decode. CLI, server and bench use only this."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from lucepy import ggml
from lucepy.errors import ConfigError, ContextOverflow
from lucepy.gguf import GGUFFile
from lucepy.models import architecture_for
from lucepy.runtime.config import RuntimeConfig
from lucepy.runtime.devices import open_backend
from lucepy.runtime.shard import Shard
from lucepy.runtime.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class Engine:
    """A model on its device(s) and one sequence's state. Not thread-safe: one request at a time."""

    def __init__(
        self,
        model_path: str | os.PathLike,
        config: RuntimeConfig | None = None,
        *,
        tokenizer: bool = True,
    ):
        self.config = config or RuntimeConfig()
        self.path = Path(model_path)
        self.file = GGUFFile(self.path)
        try:
            self.model = architecture_for(self.file).from_gguf(self.file)
            self.params = self.model.p
            self.n_ctx = self.config.context_for(self.params.n_ctx_train)
            self.lib = ggml.load()
            self.backend = open_backend(self.lib, self.config.device, self.config.thread_count())
            self.shard = Shard(
                self.lib,
                self.model,
                self.file,
                range(self.params.n_layer),
                self.backend,
                self.n_ctx,
            )
            self.tokenizer = Tokenizer(self.path) if tokenizer else None
        except BaseException:
            self.close()
            raise
        self.n_past = 0

    def reset(self) -> None:
        self.shard.reset()
        self.n_past = 0

    def prefill(
        self, tokens: list[int] | np.ndarray, *, chunk: int | None = None, all_logits: bool = False
    ) -> np.ndarray:
        """Feed ``tokens`` after what the sequence holds, in chunks. Returns the logits of the last
        token [n_vocab], or of every token [len(tokens), n_vocab] with ``all_logits``."""
        tokens = np.asarray(tokens, dtype=np.int32)
        if tokens.size == 0:
            raise ConfigError("nothing to prefill: the token list is empty")
        if self.n_past + tokens.size > self.n_ctx:
            raise ContextOverflow(
                f"{tokens.size} tokens after {self.n_past} exceed the context of {self.n_ctx}; "
                f"shorten the prompt or raise --max-ctx"
            )
        chunk = chunk or self.config.chunk
        outs = []
        for start in range(0, tokens.size, chunk):
            part = tokens[start : start + chunk]
            out = self.shard.forward(part, self.n_past, all_logits)
            self.n_past += part.size
            outs.append(out.copy() if all_logits else out)
        return np.concatenate(outs) if all_logits else outs[-1][-1]

    def decode(self, token: int) -> np.ndarray:
        """One token in, the next-token logits [n_vocab] out (a view reused by the next call)."""
        out = self.shard.forward(np.array([token], dtype=np.int32), self.n_past)
        self.n_past += 1
        return out[0]

    def close(self) -> None:
        for name in ("shard", "backend", "tokenizer", "file"):
            owner = getattr(self, name, None)
            if owner is not None:
                owner.close()
                setattr(self, name, None)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
