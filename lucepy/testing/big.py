"""Random-weight GGUFs of real size, written at disk speed: qwen35 with Qwen3.6-27B's shapes,
qwen35moe with Qwen3.6-35B-A3B's (its router skewed), gemma4 with Gemma 4 31B's and laguna with
Laguna-XS.2's (its router skewed too); what each holds is ``big_layouts.py`` and
``big_laguna.py``.

A 27B model cannot be quantized from float values in reasonable time, so quantized weights are
written as random blocks: random bytes for the quants, and one f16 scale per block of constant
size and random sign, chosen so that dequantized weights have std ``1 / sqrt(fan_in)`` (as
``tiny.py``'s). Norms and other small tensors stay f32.

    python -m lucepy.testing.big OUT.gguf --arch qwen35|qwen35moe|gemma4|laguna --type q4_0 \\
        [--layers N]
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType

from lucepy.errors import ConfigError
from lucepy.testing.big_laguna import laguna_layout, laguna_xs2
from lucepy.testing.big_layouts import (
    Layout,
    gemma4_31b,
    gemma4_layout,
    qwen35_layout,
    qwen35moe_layout,
    qwen36_27b,
    qwen36_35b_a3b,
)
from lucepy.testing.encoders import encode
from lucepy.testing.tiny import Qwen35Spec, _add_tensor_info
from lucepy.testing.vocab import SPECIAL_TOKENS, Vocab, _byte_symbols, _learn_merges, add_vocab

CHUNK_BYTES = 32 << 20  # one unit of work for the generator threads
MAX_TOKEN_LEN = 12


# --- random quant blocks ---


@dataclass(frozen=True)
class BlockFormat:
    """Where a block keeps its f16 scale, and E[q^2] of its random quant values."""

    block_len: int  # weights per block
    block_bytes: int
    scale_at: int  # byte offset of the f16 scale d
    q_moment: float  # E[q^2]: weight std = |d| * sqrt(q_moment)


# E[q^2] of uniform random integers: q - 8 for 4-bit nibbles, int8 for bytes
_NIBBLE, _INT8 = 21.5, 5461.5
FORMATS = {
    QType.Q4_0: BlockFormat(32, 18, 0, _NIBBLE),
    QType.Q8_0: BlockFormat(32, 34, 0, _INT8),
    # ql[128] qh[64] int8 scales[16] d: 6-bit q - 32, sub-block scales kept in -8..7
    QType.Q6_K: BlockFormat(256, 210, 208, 341.5 * _NIBBLE),
}


def random_blocks(qtype: QType, n_blocks: int, std: float, seed: tuple[int, ...]) -> np.ndarray:
    """``n_blocks`` random blocks [n_blocks, block_bytes] whose weights have the given std."""
    fmt = FORMATS[qtype]
    rng = np.random.Generator(np.random.SFC64(seed))
    n_bytes = n_blocks * fmt.block_bytes
    words = rng.integers(0, 2**64, size=-(-n_bytes // 8), dtype=np.uint64)
    blocks = words.view(np.uint8)[:n_bytes].reshape(n_blocks, fmt.block_bytes)
    if qtype == QType.Q6_K:
        scales = blocks[:, 192:208]
        scales &= 0x0F
        scales -= 8  # as int8: -8..7
    d = int(np.float16(std / math.sqrt(fmt.q_moment)).view(np.uint16))
    blocks[:, fmt.scale_at] = d & 0xFF
    high = blocks[:, fmt.scale_at + 1]
    high &= 0x80  # a random sign per block keeps the weights' mean at zero
    high |= d >> 8
    return blocks


# --- the vocab: 248,320 tokens in about a second ---


def _grow_merges(merges: list[tuple[str, str]], n: int) -> list[tuple[str, str]]:
    """Random extra merges of a token and one byte symbol: linear time, unlike vocab.py's padding
    whose rejection sampling slows down as tokens near their length cap."""
    rng = random.Random(n)
    symbols = _byte_symbols()
    growable = [*symbols, *(a + b for a, b in merges)]
    seen = {*growable, *SPECIAL_TOKENS}
    extra: list[tuple[str, str]] = []
    while len(extra) < n:
        a, b = rng.choice(growable), rng.choice(symbols)
        if a + b in seen:
            continue
        seen.add(a + b)
        extra.append((a, b))
        if len(a) + 1 < MAX_TOKEN_LEN:
            growable.append(a + b)
    return extra


@lru_cache(maxsize=2)
def big_vocab(n_vocab: int) -> Vocab:
    """Like ``vocab.build_vocab``: byte symbols, merged tokens in merge order, special tokens."""
    n_merges = n_vocab - 256 - len(SPECIAL_TOKENS)
    merges = _learn_merges(n_merges)
    merges += _grow_merges(merges, n_merges - len(merges))
    tokens = (*_byte_symbols(), *(a + b for a, b in merges), *SPECIAL_TOKENS)
    n_normal = len(tokens) - len(SPECIAL_TOKENS)
    types = (int(gguf.TokenType.NORMAL),) * n_normal
    types += (int(gguf.TokenType.CONTROL),) * len(SPECIAL_TOKENS)
    return Vocab(tokens, types, tuple(f"{a} {b}" for a, b in merges))


# --- writing: every piece of the data section, produced on threads, written in order ---


def _padding(n: int, align: int) -> Callable[[], bytes]:
    return lambda: bytes(-n % align)


def _pieces(layout: Layout, align: int) -> Iterator[Callable[[], object]]:
    """The data section as callables, in file order: chunks of blocks, small f32 tensors, pads."""
    for i, (t, qtype) in enumerate(zip(layout.plans, layout.types, strict=True)):
        if qtype in FORMATS:
            fmt = FORMATS[qtype]
            n_blocks = math.prod(t.ne) // fmt.block_len
            per_chunk = CHUNK_BYTES // fmt.block_bytes
            for c, start in enumerate(range(0, n_blocks, per_chunk)):
                n = min(per_chunk, n_blocks - start)
                yield lambda q=qtype, n=n, std=t.std, s=(layout.seed, i, c): random_blocks(
                    q, n, std, s
                )
            nbytes = n_blocks * fmt.block_bytes
        else:
            yield lambda t=t, q=qtype, i=i: encode(layout.values(t, i), q)
            nbytes = math.prod(t.ne) * (4 if qtype == QType.F32 else 2)
        yield _padding(nbytes, align)


def _write_pieces(fout, pieces: Iterator[Callable[[], object]], threads: int) -> None:
    with ThreadPoolExecutor(threads) as pool:
        pending: deque = deque()
        for piece in pieces:
            pending.append(pool.submit(piece))
            if len(pending) > 2 * threads:
                fout.write(pending.popleft().result())
        while pending:
            fout.write(pending.popleft().result())


def write_random(
    path: str | Path, model: Qwen35Spec | Layout, *, threads: int | None = None
) -> Path:
    """Write a random-weight GGUF (quantized types only for matmul weights)."""
    layout = qwen35_layout(model) if isinstance(model, Qwen35Spec) else model
    if layout.weight_type not in ("q4_0", "q8_0"):
        raise ConfigError(f"big GGUFs are q4_0 or q8_0, not {layout.weight_type!r}")
    path = Path(path)
    w = gguf.GGUFWriter(None, layout.arch)
    layout.add_hparams(w)
    add_vocab(w, big_vocab(layout.n_vocab))
    for t, qtype in zip(layout.plans, layout.types, strict=True):
        _add_tensor_info(w, t, qtype)
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout = w.fout[0]
    fout.write(_padding(fout.tell(), w.data_alignment)())
    _write_pieces(fout, _pieces(layout, w.data_alignment), threads or os.cpu_count() or 2)
    w.close()
    return path


ARCHS = {  # spec, layers, least
    "qwen35": (qwen36_27b, 64, 4),
    "qwen35moe": (qwen36_35b_a3b, 40, 4),
    "gemma4": (gemma4_31b, 60, 6),
    "laguna": (laguna_xs2, 40, 2),
}
LAYOUTS = {
    "qwen35": qwen35_layout,
    "qwen35moe": lambda specs: qwen35moe_layout(*specs),
    "gemma4": gemma4_layout,
    "laguna": lambda specs: laguna_layout(*specs),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lucepy.testing.big", description=__doc__)
    ap.add_argument("out", type=Path, help="GGUF file to write")
    ap.add_argument("--arch", choices=sorted(ARCHS), default="qwen35")
    ap.add_argument("--type", choices=["q4_0", "q8_0"], default="q4_0")
    ap.add_argument(
        "--layers",
        type=int,
        help="layers: as in the real model (qwen35 64, qwen35moe 40, gemma4 60, laguna 40)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="generator threads (all cores)")
    args = ap.parse_args(argv)
    make_spec, layers, least = ARCHS[args.arch]
    layers = args.layers or layers
    try:
        if layers < least:
            # llama.cpp aborts on a model whose full-attention KV cache has no layer
            # (set_input_k_idxs): qwen35 attends every 4th layer, gemma4 every 6th; laguna's
            # sliding cache needs layer 1
            raise ConfigError(f"--layers {layers}: use at least {least}, so one layer attends")
        spec = make_spec(args.type, layers, seed=args.seed)
        layout = LAYOUTS[args.arch](spec)
        t0 = time.perf_counter()
        write_random(args.out, layout, threads=args.threads)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    secs = time.perf_counter() - t0
    size = args.out.stat().st_size
    print(
        f"wrote {args.out}: {args.arch}, {layout.n_params / 1e9:.2f}B parameters, {args.type}, "
        f"{size / 1e9:.2f} GB in {secs:.1f} s ({size / 1e9 / secs:.2f} GB/s)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
