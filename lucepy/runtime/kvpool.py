"""KV Flash's host side: what the pager (``runtime/pager.py``, ``PagedSlots``) decides, this
copies. Paged-out rows of every full-attention cache of every shard (a worker's over RPC), kept
in host memory as raw bytes, so a chunk comes back bit for bit; and, for the ``qk`` ranking,
one summary key per chunk and layer (the mean of its keys, taken when the chunk is sealed) and
the queries of the step before a ranking (the graphs' ``q.L`` outputs, read only then).

A chunk's score is the cosine of each query head with its group's summary key, the best head of
a layer, averaged over the layers.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lucepy.ggml import GGML_TYPE_F16, GGML_TYPE_F32, GGML_TYPE_Q8_0, ffi
from lucepy.runtime.pager import CHUNK

Key = tuple[int, str, int]  # (shard, tensor, sequence chunk)


def _dequantize(raw: np.ndarray, gtype: int, width: int) -> np.ndarray:
    """Rows of cache bytes [rows, row bytes] as f32 [rows, width]."""
    if gtype == GGML_TYPE_F16:
        return raw.view(np.float16).astype(np.float32)
    if gtype == GGML_TYPE_F32:
        return raw.view(np.float32)
    if gtype == GGML_TYPE_Q8_0:  # blocks of an f16 scale and 32 int8
        blocks = raw.reshape(raw.shape[0], width // 32, 34)
        scale = blocks[:, :, :2].copy().view(np.float16).astype(np.float32)
        values = blocks[:, :, 2:].view(np.int8).astype(np.float32)
        return (values * scale).reshape(raw.shape[0], width)
    raise ValueError(f"no key summaries for a cache of ggml type {gtype}")


class HostPool:
    """The ``Mover`` of a pipeline's pager. ``pipeline.shards`` own the caches; ``pipeline.last``
    holds the graphs of the step before a ranking."""

    def __init__(self, pipeline: Any, summarise: bool):
        self.pipeline, self.lib = pipeline, pipeline.lib
        self.summarise = summarise  # keep summary keys (the qk ranking needs them)
        self.rows: dict[Key, np.ndarray] = {}  # paged-out rows, raw
        self.keys: dict[int, dict[tuple[int, int], np.ndarray]] = {}  # chunk -> (shard, L) -> key

    def _caches(self):
        """(shard index, shard, tensor name, tensor, bytes a row) of every full-attention cache."""
        for i, shard in enumerate(self.pipeline.shards):
            for name in sorted(shard.state.appended()):
                t = shard.state.t[name]
                yield i, shard, name, t, self.lib.ggml_row_size(t.type, t.ne[0])

    def _get(self, t: Any, pool_chunk: int, row: int) -> np.ndarray:
        rows = np.empty((CHUNK, row), dtype=np.uint8)
        self.lib.ggml_backend_tensor_get(
            t, ffi.from_buffer(rows), pool_chunk * CHUNK * row, rows.nbytes
        )
        return rows

    # the pager's calls
    def seal(self, pool_chunk: int, chunk: int) -> None:
        if not self.summarise:
            return
        keys = {}
        for i, _, name, t, row in self._caches():
            if name.startswith("k."):
                rows = _dequantize(self._get(t, pool_chunk, row), int(t.type), int(t.ne[0]))
                keys[(i, int(name[2:]))] = rows.mean(axis=0)
        self.keys[chunk] = keys

    def page_out(self, pool_chunk: int, chunk: int) -> None:
        for i, _, name, t, row in self._caches():
            self.rows[(i, name, chunk)] = self._get(t, pool_chunk, row)

    def page_in(self, pool_chunk: int, chunk: int) -> None:
        for i, _, name, t, _ in self._caches():
            rows = self.rows[(i, name, chunk)]
            self.lib.ggml_backend_tensor_set(
                t, ffi.from_buffer(rows), pool_chunk * rows.nbytes, rows.nbytes
            )

    def scores(self, chunks: list[int]) -> np.ndarray | None:
        """Per chunk: mean over layers of the best query head's cosine with its group's summary
        key. None before any step has left queries to read."""
        queries = self._queries()
        if not queries:
            return None
        total = np.zeros(len(chunks))
        for (i, layer), q in queries.items():  # q [nh, hd]
            keys = np.stack([self.keys[c][(i, layer)] for c in chunks])  # [C, nkv*hd]
            keys = keys.reshape(len(chunks), -1, q.shape[1])
            keys /= np.linalg.norm(keys, axis=2, keepdims=True) + 1e-12
            group = q.shape[0] // keys.shape[1]
            heads = keys[:, np.arange(q.shape[0]) // group, :]  # [C, nh, hd]
            total += np.einsum("chd,hd->ch", heads, q).max(axis=1)
        return total / len(queries)

    def _queries(self) -> dict[tuple[int, int], np.ndarray]:
        """The last token's query of every full-attention layer, per head and normalised."""
        out = {}
        for shard, _, g in self.pipeline.last:
            i = self.pipeline.shards.index(shard)
            for name, t in g.outputs.items():
                if not name.startswith("q."):
                    continue
                hd, nh, T = int(t.ne[0]), int(t.ne[1]), int(t.ne[2])
                q = np.empty((nh, hd), dtype=np.float32)
                self.lib.ggml_backend_tensor_get(
                    t, ffi.from_buffer(q), (T - 1) * int(t.nb[2]), q.nbytes
                )
                out[(i, int(name[2:]))] = q / (np.linalg.norm(q, axis=1, keepdims=True) + 1e-12)
        return out

    # memory and snapshots
    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.rows.values())

    def clear(self) -> None:
        self.rows.clear()
        self.keys.clear()

    def state(self) -> dict[str, np.ndarray]:
        """Host rows and summary keys as named arrays (a snapshot's ``pager/`` part); the arrays
        are shared, not copied: nothing here changes an array once it is stored."""
        out = {f"rows/{i}/{name}/{c}": a for (i, name, c), a in self.rows.items()}
        for c, keys in self.keys.items():
            out.update({f"key/{c}/{i}/{layer}": k for (i, layer), k in keys.items()})
        return out

    def load(self, arrays: dict[str, np.ndarray]) -> None:
        self.clear()
        for name, a in arrays.items():
            kind, *rest = name.split("/")
            if kind == "rows":
                self.rows[(int(rest[0]), rest[1], int(rest[2]))] = a
            elif kind == "key":
                self.keys.setdefault(int(rest[0]), {})[(int(rest[1]), int(rest[2]))] = a


class PagerCopy:
    """KV Flash's part of a RAM snapshot: the mapping and the host rows (``Pipeline.pager_state``;
    host arrays, shared: none is changed once stored)."""

    def __init__(self, arrays: dict[str, np.ndarray]):
        self.arrays = arrays

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    def close(self) -> None:
        """Nothing to free on a backend."""

    abandon = close
