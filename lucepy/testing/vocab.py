"""Byte-level BPE vocab for the tiny qwen35 GGUFs, learned from a small built-in text.

Tokens are GPT-2 byte symbols, then merged tokens in merge order, then the qwen35 special tokens;
the chat template is ChatML. :func:`add_vocab` writes it as llama.cpp's gpt2 tokenizer reads it.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

import gguf

TOKENIZER_PRE = "qwen35"  # llama-vocab.cpp maps it to LLAMA_VOCAB_PRE_TYPE_QWEN35
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

_CORPUS = """\
The small model reads a line of text and tries to guess the word that comes next. It is not
clever, and it was never trained, but it has the same shape as a real one. That is all a test
needs: the same tensors, the same names, and the same order of work, so that two programs can be
compared step by step. When they agree on the first token, we check the second, and then the
third, until the whole sequence matches or one of them goes wrong.
Once upon a time there was a little house near the river. In the morning the people of the town
walked over the old bridge to the market, where they sold bread, apples, cheese and fish. The
children played in the water while their parents talked about the weather and the price of wood.
In the evening the lights came on, one window after another, and the town grew quiet again.
A good question has a short answer. What time is it? Where are you going? How many apples are
left in the basket? Why does the sun rise in the east? Who wrote this letter, and when did it
arrive? Please tell me what you think, and I will tell you what I know.
Hello world, this is a test. This is only a test of the system, and there is nothing to worry
about. If this had been a real message, you would have been told what to do. Thank you for your
patience, and have a nice day.
Numbers and signs appear too: 1, 2, 3, 10, 42, 100 and 2024; a + b = c; x * y - z; (one, two);
"quoted words"; it's, don't, we're, they've, I'm, you'll, he'd. Lists use dashes - like this -
and colons: first, second, third. Some lines end with a question mark? Others end with a dot.
The user asked the assistant for help with a problem. The assistant read the question, thought
about it for a while, and then wrote an answer in plain words. The user said thank you, and the
assistant said that it was happy to help and would be here if there were any other questions.
"""
# ASCII stand-in for the qwen35 pre-tokenizer regex in llama-vocab.cpp; only training uses it.
_PRETOKEN = re.compile(
    r"'(?:[sStTmMdD]|[rR][eE]|[vV][eE]|[lL][lL])|[^\r\nA-Za-z0-9]?[A-Za-z]+|[0-9]"
    r"| ?[^\sA-Za-z0-9]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class Vocab:
    tokens: tuple[str, ...]
    types: tuple[int, ...]  # gguf.TokenType values
    merges: tuple[str, ...]  # "left right", in rank order

    def id(self, token: str) -> int:
        return self.tokens.index(token)


@lru_cache(maxsize=1)
def _byte_symbols() -> tuple[str, ...]:
    """GPT-2's printable stand-in for each byte value, indexed by the byte."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    extra = iter(range(256, 512))
    return tuple(chr(b) if b in printable else chr(next(extra)) for b in range(256))


def _apply_merge(word: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out: list[str] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def _learn_merges(n: int) -> list[tuple[str, str]]:
    """Greedy BPE on the corpus; ties go to the larger pair, so the result never varies."""
    sym = _byte_symbols()
    words = Counter(tuple(sym[b] for b in w.encode()) for w in _PRETOKEN.findall(_CORPUS))
    merges: list[tuple[str, str]] = []
    while len(merges) < n:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:], strict=False):
                pairs[pair] += count
        best = max(pairs, key=lambda p: (pairs[p], p), default=None)
        if best is None:
            break
        merges.append(best)
        words = Counter({_apply_merge(word, best): c for word, c in words.items()})
    return merges


def _pad_merges(merges: list[tuple[str, str]], n: int) -> list[tuple[str, str]]:
    """Random extra merges, so that big vocabularies (bench) need no big corpus."""
    rng = random.Random(n)
    pool = [*_byte_symbols(), *(a + b for a, b in merges)]
    seen = {*pool, *SPECIAL_TOKENS}
    extra: list[tuple[str, str]] = []
    while len(extra) < n:
        a, b = rng.choice(pool), rng.choice(pool)
        if len(a + b) <= 12 and a + b not in seen:
            seen.add(a + b)
            pool.append(a + b)
            extra.append((a, b))
    return extra


@lru_cache(maxsize=8)
def build_vocab(n_vocab: int) -> Vocab:
    """The 256 byte symbols, then merged tokens in merge order, then the special tokens."""
    n_merges = n_vocab - 256 - len(SPECIAL_TOKENS)
    merges = _learn_merges(n_merges)
    merges += _pad_merges(merges, n_merges - len(merges))
    tokens = (*_byte_symbols(), *(a + b for a, b in merges), *SPECIAL_TOKENS)
    n_normal = len(tokens) - len(SPECIAL_TOKENS)
    types = (gguf.TokenType.NORMAL,) * n_normal + (gguf.TokenType.CONTROL,) * len(SPECIAL_TOKENS)
    return Vocab(tokens, tuple(int(t) for t in types), tuple(f"{a} {b}" for a, b in merges))


def add_vocab(w: gguf.GGUFWriter, v: Vocab) -> None:
    """Write the vocab as a gpt2 (byte-level BPE) tokenizer with the qwen35 pre-tokenizer."""
    endoftext, im_end = v.id("<|endoftext|>"), v.id("<|im_end|>")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(TOKENIZER_PRE)
    w.add_token_list(list(v.tokens))
    w.add_token_types(list(v.types))
    w.add_token_merges(list(v.merges))
    w.add_bos_token_id(endoftext)
    w.add_eos_token_id(im_end)
    w.add_eot_token_id(im_end)
    w.add_pad_token_id(endoftext)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
