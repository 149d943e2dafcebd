"""The GGUF's own vocabulary and chat template, through llama-cpp-python (vocab only)."""

from __future__ import annotations

import contextlib
import os

from lucepy.errors import ModelFileError, PromptError


def check_vocabulary(path: str | os.PathLike, tokens: list[str] | None) -> None:
    """What llama.cpp asserts of a vocabulary (aborting the process), checked first: every token
    string is distinct (src/llama-vocab.cpp)."""
    if not tokens:
        return
    seen: dict[str, int] = {}
    for i, token in enumerate(tokens):
        if token in seen:
            raise ModelFileError(
                f"{path}: tokens {seen[token]} and {i} of the vocabulary are the same string "
                f"{token!r}; the file is damaged"
            )
        seen[token] = i


class Tokenizer:
    def __init__(self, model_path: str | os.PathLike, tokens: list[str] | None = None):
        """``tokens``: the file's ``tokenizer.ggml.tokens``, checked before llama.cpp reads them."""
        import llama_cpp  # imported here: loading libllama costs time the plan and CLI help skip
        from jinja2 import TemplateError

        check_vocabulary(model_path, tokens)
        try:
            with open(os.devnull, "w") as null, contextlib.redirect_stderr(null):
                self._llama = llama_cpp.Llama(
                    model_path=str(model_path), vocab_only=True, verbose=False
                )
        except ValueError:  # llama.cpp refused the file: it says no more than that
            raise ModelFileError(
                f"{model_path}: llama.cpp cannot load this file's vocabulary (tokenizer.* "
                f"metadata); the file is damaged or was converted wrongly"
            ) from None
        except TemplateError as err:  # llama_cpp compiles every chat template it finds
            raise ModelFileError(
                f"{model_path}: the chat template (tokenizer.chat_template) does not parse: "
                f"{err.message}"
            ) from None
        self.eos = self._llama.token_eos()
        self.bos = self._llama.token_bos()
        meta = self._llama.metadata
        self.chat_template = meta.get("tokenizer.chat_template")
        self.add_bos = meta.get("tokenizer.ggml.add_bos_token", "false") == "true"

    def encode(self, text: str, special: bool = True, add_bos: bool | None = None) -> list[int]:
        if not text:
            raise PromptError("the prompt is empty; pass --prompt TEXT or --prompt-tokens 1,2,3")
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise PromptError(
                f"the text is not valid Unicode: character {err.start} is a lone surrogate "
                f"({text[err.start]!r}); send UTF-8 text"
            ) from None
        bos = self.add_bos if add_bos is None else add_bos and self.add_bos
        return self._llama.tokenize(data, add_bos=bos, special=special)

    def decode(self, tokens: list[int]) -> str:
        return self._llama.detokenize(tokens).decode("utf-8", errors="replace")

    def token_text(self, token: int) -> str:
        """A token's text, special tokens included (``<|im_end|>``); "" for no token (-1)."""
        if token < 0:
            return ""
        return self.token_bytes(token).decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes:
        """A token's bytes (a piece of a UTF-8 character for some byte tokens)."""
        return self._llama.detokenize([token], special=True)

    @property
    def vocab(self):
        """llama.cpp's vocabulary handle (llguidance builds its view of the tokens from it)."""
        return self._llama._model.vocab

    def is_end(self, token: int) -> bool:
        import llama_cpp

        return bool(llama_cpp.llama_vocab_is_eog(self._llama._model.vocab, token))

    def close(self) -> None:
        self._llama.close()
