"""Constrained decoding: a grammar's allowed next tokens, through llguidance (decision in
docs/architecture.md: chosen over xgrammar, which needs torch, transformers and triton).

A ``Constraint`` follows one generation: ``allowed()`` is the mask for the next token after the
tokens consumed so far, ``masked(logits)`` sets the others to -inf, and ``consume`` advances it.
The plain loop masks every step's logits; the speculative loop masks each verify row after
consuming the accepted tokens before it, so what it keeps is what the constrained target would
have produced (decode/speculative.py).
"""

from __future__ import annotations

import json
import threading
import warnings
import weakref
from typing import Any

import numpy as np

from lucepy.errors import PromptError


def json_grammar(schema: dict[str, Any] | None) -> str:
    """The grammar for JSON that validates against ``schema`` (any JSON object when None),
    compact: no whitespace between tokens, so a model cannot run on with blanks."""
    from llguidance import LLMatcher

    schema = {"type": "object"} if schema is None else schema
    options = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
    try:
        return LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=options)
    except (ValueError, TypeError) as err:
        raise PromptError(f"the JSON schema cannot be used: {err}") from None


def lark_grammar(lark: str) -> str:
    """The grammar a Lark text describes (llguidance's dialect: ``%json {schema}`` embeds a
    JSON schema)."""
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_lark(lark)


def regex_grammar(regex: str) -> str:
    """The grammar for text that matches ``regex`` whole."""
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_regex(regex)


_BUILT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def grammars_for(tokenizer, n_vocab: int) -> Grammars:
    """The Grammars of a runtime Tokenizer's vocabulary, built on first use and kept with it."""
    with _LOCK:
        built = _BUILT.get(tokenizer)
        if built is None:
            built = _BUILT[tokenizer] = Grammars(tokenizer.vocab, n_vocab, tokenizer.eos)
        return built


class Grammars:
    """The llguidance view of one model's vocabulary, built once (about a second for a large
    vocabulary), and checked grammars for it."""

    def __init__(self, llama_vocab, n_vocab: int, eos: int):
        from llguidance.llamacpp import lltokenizer_from_vocab

        self.n_vocab = n_vocab
        with warnings.catch_warnings():  # it calls llama_token_get_attr, deprecated by name only
            warnings.simplefilter("ignore", DeprecationWarning)
            self.tokenizer = lltokenizer_from_vocab(llama_vocab, n_vocab=n_vocab, eos_token=eos)

    def check(self, grammar: str) -> None:
        from llguidance import LLMatcher

        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise PromptError(f"the grammar cannot be used: {messages[0]}")

    def constraint(self, grammar: str) -> Constraint:
        return Constraint(self, grammar)


class Constraint:
    def __init__(self, grammars: Grammars, grammar: str):
        from llguidance import LLMatcher

        self.n_vocab = grammars.n_vocab
        self.matcher = LLMatcher(grammars.tokenizer, grammar, log_level=0)
        self._bits = np.zeros((self.n_vocab + 31) // 32, dtype=np.int32)
        self._raise_on_error()

    def _raise_on_error(self) -> None:
        if self.matcher.is_error():
            raise PromptError(f"the grammar failed: {self.matcher.get_error()}")

    def allowed(self) -> np.ndarray:
        """A bool per token: may it come next?"""
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        self._raise_on_error()
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")
        return bits[: self.n_vocab].astype(bool)

    def masked(self, logits: np.ndarray) -> np.ndarray:
        """A copy of ``logits`` with every token the grammar forbids next at -inf."""
        return np.where(self.allowed(), logits, np.float32(-np.inf)).astype(np.float32)

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            raise PromptError(f"token {token} breaks the grammar: {self.matcher.get_error()}")
