"""Values as a GGUF file stores them (``encode``), with lucepy's own encoders of the K types
that gguf-py cannot quantize (Q4_K, Q5_K, Q6_K): plain fits, not ggml's searches, valid blocks
that the tests compare kernels on."""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType

K_BLOCK = 256  # a K-quant's super-block


def encode(values: np.ndarray, qtype: QType) -> np.ndarray:
    """Values as stored in the file; quantized types come back as uint8 rows of blocks."""
    if qtype == QType.F32:
        return values
    if qtype == QType.F16:
        return values.astype(np.float16)
    if qtype == QType.Q4_K:
        return encode_q4_k(values)
    if qtype == QType.Q5_K:
        return encode_q5_k(values)
    if qtype == QType.Q6_K:
        return encode_q6_k(values)
    return gguf.quants.quantize(values, qtype)


def _scale_min_fit(values: np.ndarray, top: int):
    """Rows of ``values`` (a multiple of 256 long) fitted as Q4_K's and Q5_K's super-blocks do:
    each 32-value piece's range as a scale and a min (value = d sc q - dmin m, q 0-``top``), sc
    and m 6-bit multiples of the block's d and dmin. A plain min/max fit, not ggml's search: any
    valid block serves the tests, which compare kernels on these bytes. Returns the super-blocks'
    first 16 bytes (d, dmin and the packed scales and mins, as both types start) [n, 16] and
    q [n, 8, 32]."""
    rows = values.reshape(-1, K_BLOCK).astype(np.float32)
    pieces = rows.reshape(len(rows), 8, 32)
    lo = np.minimum(pieces.min(axis=2), 0.0)  # the min to add back: -m, so m >= 0
    span = pieces.max(axis=2) - lo
    d = (span.max(axis=1) / top / 63).astype(np.float16)
    dmin = (-lo.min(axis=1) / 63).astype(np.float16)
    df = d.astype(np.float32)[:, None]
    mf = dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.rint(span / top / df), 0).clip(0, 63).astype(np.uint8)
        m = np.where(mf > 0, np.rint(-lo / mf), 0).clip(0, 63).astype(np.uint8)
        step = (df * sc)[:, :, None]
        q = np.where(step > 0, np.rint((pieces + (mf * m)[:, :, None]) / step), 0)
    q = q.clip(0, top).astype(np.uint8)
    scales = np.zeros((len(rows), 12), dtype=np.uint8)
    scales[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = (m[:, 0:4] & 63) | ((m[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((m[:, 4:8] & 0x0F) << 4)
    head = np.concatenate(
        [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales], axis=1
    )
    return head, q


def _k_nibbles(q: np.ndarray) -> np.ndarray:
    """Q4_K's and Q5_K's 128 bytes of low nibbles a super-block from q [n, 8, 32] (0-15):
    pieces 2j and 2j + 1 in the low and high nibbles of bytes 32j..32j + 31."""
    return (q[:, 0::2, :] | (q[:, 1::2, :] << 4)).reshape(len(q), 128)


def encode_q4_k(values: np.ndarray) -> np.ndarray:
    """Rows of ``values`` (a multiple of 256 long) as Q4_K blocks (gguf-py has no Q4_K encoder):
    _scale_min_fit's q of 0-15, packed as ggml's block_q4_K."""
    head, q = _scale_min_fit(values, 15)
    blocks = np.concatenate([head, _k_nibbles(q)], axis=1)
    return blocks.reshape(*values.shape[:-1], values.shape[-1] // K_BLOCK * 144)


def encode_q5_k(values: np.ndarray) -> np.ndarray:
    """Rows of ``values`` (a multiple of 256 long) as Q5_K blocks (gguf-py has no Q5_K encoder):
    _scale_min_fit's q of 0-31, packed as ggml's block_q5_K (the low nibbles as Q4_K's, value
    l of piece p's fifth bit in bit p of byte l of qh)."""
    head, q = _scale_min_fit(values, 31)
    qs = _k_nibbles(q & 0x0F)
    qh = ((q >> 4).astype(np.uint8) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(
        axis=1, dtype=np.uint8
    )  # the bits are apart: their sum is their or
    blocks = np.concatenate([head, qh, qs], axis=1)
    return blocks.reshape(*values.shape[:-1], values.shape[-1] // K_BLOCK * 176)


def encode_q6_k(values: np.ndarray) -> np.ndarray:
    """Rows of ``values`` (a multiple of 256 long) as Q6_K blocks (gguf-py has no Q6_K encoder):
    each 16-value half piece's largest magnitude over 31, rounded up to a multiple of the block's
    d (sc of 8 bits), as its step (value = d sc (q - 32), q 1-63), packed as ggml's block_q6_K
    (low nibbles, high bit pairs, scales, d). A plain fit, not ggml's search: any valid Q6_K
    serves the tests."""
    rows = values.reshape(-1, K_BLOCK).astype(np.float32)
    n = len(rows)
    subs = rows.reshape(n, 16, 16)
    amax = np.abs(subs).max(axis=2)
    d = (amax.max(axis=1) / 31 / 126).astype(np.float16)  # room for d's rounding to a half
    df = d.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(df > 0, np.ceil(amax / 31 / df), 0).clip(0, 127).astype(np.int8)
        step = (df * sc.astype(np.float32))[:, :, None]
        q = np.where(step > 0, np.rint(subs / step), 0)
    q6 = (q.clip(-32, 31) + 32).astype(np.uint8).reshape(n, 2, 4, 32)  # [half][quarter][l]
    ql = np.concatenate(
        [(q6[:, :, 0] & 0xF) | ((q6[:, :, 2] & 0xF) << 4),
         (q6[:, :, 1] & 0xF) | ((q6[:, :, 3] & 0xF) << 4)],
        axis=2,
    ).reshape(n, 128)  # fmt: skip
    qh = (q6[:, :, 0] >> 4) | ((q6[:, :, 1] >> 4) << 2) | ((q6[:, :, 2] >> 4) << 4)
    qh = (qh | ((q6[:, :, 3] >> 4) << 6)).reshape(n, 64)
    blocks = np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8).reshape(-1, 2)], axis=1)
    return blocks.reshape(*values.shape[:-1], values.shape[-1] // K_BLOCK * 210)
