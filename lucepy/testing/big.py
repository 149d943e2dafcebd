"""Random-weight qwen35 GGUFs of real size (Qwen3.6-27B's shapes), written at disk speed.

A 27B model cannot be quantized from float values in reasonable time, so quantized weights are
written as random blocks: random bytes for the quants, and one f16 scale per block of constant
size and random sign, chosen so that dequantized weights have std ``1 / sqrt(fan_in)`` (as
``tiny.py``'s). Norms, ``ssm_a``, ``ssm_dt`` and ``ssm_conv1d`` stay f32, with tiny.py's values.

Tensor types follow llama.cpp's quantize defaults for the file type (``src/llama-quant.cpp`` at
the pinned commit): a Q4_0 file keeps ``token_embd`` in Q4_0 and stores ``output`` as Q6_K; a Q8_0
file stores both as Q8_0.

    python -m lucepy.testing.big OUT.gguf --type q4_0 [--layers N]
"""

from __future__ import annotations

import argparse
import dataclasses
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
from lucepy.testing.tiny import (
    ARCH,
    WEIGHT_TYPES,
    Qwen35Spec,
    TensorPlan,
    _add_hparams,
    _add_tensor_info,
    encode,
    param_count,
    plan_tensors,
    tensor_type,
    tensor_values,
)
from lucepy.testing.vocab import SPECIAL_TOKENS, Vocab, _byte_symbols, _learn_merges, add_vocab

CHUNK_BYTES = 32 << 20  # one unit of work for the generator threads
MAX_TOKEN_LEN = 12


def qwen36_27b(weight_type: str = "q4_0", n_layer: int = 64, **overrides: object) -> Qwen35Spec:
    """Qwen3.5/3.6-27B's shapes (shared/MODELS.md); fewer layers give a scaled-down variant."""
    base = Qwen35Spec(
        n_vocab=248320, n_embd=5120, n_layer=n_layer, n_ff=17408, n_head=24, n_head_kv=4,
        head_dim=256, rope_dim=64, rope_sections=(11, 11, 10, 0), rope_theta=1e7,
        ssm_conv_kernel=4, ssm_state_size=128, ssm_group_count=16, ssm_time_step_rank=48,
        rms_eps=1e-6, context_length=262144, weight_type=weight_type,
    )  # fmt: skip
    return dataclasses.replace(base, **overrides)


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


def output_type(spec: Qwen35Spec) -> QType:
    """llama.cpp's default for ``output.weight``: Q6_K unless the file is Q8_0 (or rows don't
    fit 256-blocks, then Q8_0)."""
    qtype = WEIGHT_TYPES[spec.weight_type][0]
    if qtype in (QType.F32, QType.F16, QType.Q8_0):
        return qtype
    return QType.Q6_K if spec.n_embd % 256 == 0 else QType.Q8_0


def file_types(spec: Qwen35Spec, plans: list[TensorPlan]) -> list[QType]:
    return [output_type(spec) if t.name == "output.weight" else tensor_type(t, spec) for t in plans]


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


def _pieces(spec: Qwen35Spec, plans, types, align: int) -> Iterator[Callable[[], object]]:
    """The data section as callables, in file order: chunks of blocks, small f32 tensors, pads."""
    for i, (t, qtype) in enumerate(zip(plans, types, strict=True)):
        if qtype in FORMATS:
            fmt = FORMATS[qtype]
            n_blocks = math.prod(t.ne) // fmt.block_len
            per_chunk = CHUNK_BYTES // fmt.block_bytes
            for c, start in enumerate(range(0, n_blocks, per_chunk)):
                n = min(per_chunk, n_blocks - start)
                yield lambda q=qtype, n=n, std=t.std, s=(spec.seed, i, c): random_blocks(
                    q, n, std, s
                )
            nbytes = n_blocks * fmt.block_bytes
        else:
            yield lambda t=t, q=qtype, i=i: encode(tensor_values(t, spec, i), q)
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


def write_random(path: str | Path, spec: Qwen35Spec, *, threads: int | None = None) -> Path:
    """Write a random-weight qwen35 GGUF for ``spec`` (quantized types only for matmul weights)."""
    if spec.weight_type not in ("q4_0", "q8_0"):
        raise ConfigError(f"big GGUFs are q4_0 or q8_0, not {spec.weight_type!r}")
    path = Path(path)
    plans = plan_tensors(spec)
    types = file_types(spec, plans)
    w = gguf.GGUFWriter(None, ARCH)
    _add_hparams(w, spec, name=f"lucepy random {ARCH} {param_count(spec) / 1e9:.1f}B")
    add_vocab(w, big_vocab(spec.n_vocab))
    for t, qtype in zip(plans, types, strict=True):
        _add_tensor_info(w, t, qtype)
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout = w.fout[0]
    fout.write(_padding(fout.tell(), w.data_alignment)())
    _write_pieces(
        fout, _pieces(spec, plans, types, w.data_alignment), threads or os.cpu_count() or 2
    )
    w.close()
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lucepy.testing.big", description=__doc__)
    ap.add_argument("out", type=Path, help="GGUF file to write")
    ap.add_argument("--type", choices=["q4_0", "q8_0"], default="q4_0")
    ap.add_argument(
        "--layers", type=int, default=64, help="layers: 64 in the real model, at least 4"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="generator threads (all cores)")
    args = ap.parse_args(argv)
    try:
        if args.layers < 4:
            # llama.cpp aborts on a hybrid model whose KV cache has no layer (set_input_k_idxs)
            raise ConfigError(f"--layers {args.layers}: use at least 4, so one layer attends")
        spec = qwen36_27b(args.type, args.layers, seed=args.seed)
        t0 = time.perf_counter()
        write_random(args.out, spec, threads=args.threads)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    secs = time.perf_counter() - t0
    size = args.out.stat().st_size
    print(
        f"wrote {args.out}: {param_count(spec) / 1e9:.2f}B parameters, {args.type}, "
        f"{size / 1e9:.2f} GB in {secs:.1f} s ({size / 1e9 / secs:.2f} GB/s)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
