"""A LLaMA decoder in numpy (f64), for the f32 test files: the reference that KV Flash's pool is
held to. Attention runs over exactly the positions a step is told are visible, so a step of the
pool compares with exact attention over exactly its resident rows.

The math is that of ``models/llama.py`` (plain RoPE on adjacent pairs, grouped-query attention,
SwiGLU, RMS norms), with the roundings of ggml's attention without flash attention made here
too: the cache keeps K and V in f16, and the query and the softmax weights are rounded to f16
where ggml multiplies them with the f16 keys and values.
"""

from __future__ import annotations

import numpy as np

from lucepy.gguf import GGUFFile
from lucepy.models.llama import Params


class NumpyLlama:
    def __init__(self, path):
        with GGUFFile(path) as f:
            self.p = Params.from_gguf(f)
            if any(int(t.type) != 0 for t in f.tensors.values()):
                raise ValueError(f"{path}: the numpy reference reads f32 files only")
            self.w = {
                name: np.frombuffer(f.data(name), dtype=np.float32)
                .reshape(info.shape[::-1])
                .astype(np.float64)
                for name, info in f.tensors.items()
            }
        if "output.weight" not in self.w:
            self.w["output.weight"] = self.w["token_embd.weight"]
        self.k: list[dict[int, np.ndarray]] = [{} for _ in range(self.p.n_layer)]  # pos -> row
        self.v: list[dict[int, np.ndarray]] = [{} for _ in range(self.p.n_layer)]

    def _norm(self, x: np.ndarray, weight: str) -> np.ndarray:
        rms = np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.p.rms_eps)
        return x / rms * self.w[weight]

    def _rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """[T, heads, hd]: pairs (2i, 2i+1) turned by pos * theta^(-2i/hd)."""
        p = self.p
        freq = p.rope_theta ** (-np.arange(0, p.rope_dim, 2) / p.rope_dim) * p.rope_freq_scale
        angle = pos[:, None, None] * freq[None, None, :]
        cos, sin = np.cos(angle), np.sin(angle)
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
        return out

    def step(self, tokens: np.ndarray, pos0: int, visible, keep: bool = True) -> np.ndarray:
        """Logits [T, n_vocab] of ``tokens`` at ``pos0``.., each attending to the positions in
        ``visible`` (a set, which must hold the step's own) up to its own. ``keep``: remember
        their keys and values (else the step leaves no trace)."""
        p, T = self.p, len(tokens)
        hd, nh, nkv = p.head_dim, p.n_head, p.n_head_kv
        pos = np.arange(pos0, pos0 + T)
        x = self.w["token_embd.weight"][np.asarray(tokens)]
        saved = None if keep else [(dict(k), dict(v)) for k, v in zip(self.k, self.v, strict=True)]
        for il in range(p.n_layer):
            b = f"blk.{il}."
            h = self._norm(x, b + "attn_norm.weight")
            q = (h @ self.w[b + "attn_q.weight"].T).reshape(T, nh, hd)
            k = (h @ self.w[b + "attn_k.weight"].T).reshape(T, nkv, hd)
            v = (h @ self.w[b + "attn_v.weight"].T).reshape(T, nkv, hd)
            q, k = self._rope(q, pos), self._rope(k, pos)
            f16 = lambda a: a.astype(np.float16).astype(np.float64)  # noqa: E731
            for t in range(T):
                self.k[il][pos0 + t], self.v[il][pos0 + t] = f16(k[t]), f16(v[t])
            q = f16(q)
            out = np.empty((T, nh, hd))
            for t in range(T):
                seen = sorted(s for s in visible if s <= pos0 + t)
                keys = np.stack([self.k[il][s] for s in seen])  # [S, nkv, hd]
                vals = np.stack([self.v[il][s] for s in seen])
                for head in range(nh):
                    g = head // (nh // nkv)
                    score = keys[:, g] @ q[t, head] / np.sqrt(hd)
                    weight = np.exp(score - score.max())
                    out[t, head] = f16(weight / weight.sum()) @ vals[:, g]
            x = x + out.reshape(T, nh * hd) @ self.w[b + "attn_output.weight"].T
            h = self._norm(x, b + "ffn_norm.weight")
            gate = h @ self.w[b + "ffn_gate.weight"].T
            up = h @ self.w[b + "ffn_up.weight"].T
            x = x + (gate / (1 + np.exp(-gate)) * up) @ self.w[b + "ffn_down.weight"].T
        if saved is not None:
            self.k, self.v = [k for k, _ in saved], [v for _, v in saved]
        x = self._norm(x, "output_norm.weight")
        return x @ self.w["output.weight"].T
