"""torch models for tools/train_dflash.py: the target (a llama GGUF, dequantized), the draft.

The draft's math is lucepy's ``models/dflash.py`` (after the pinned ``src/models/dflash.cpp``):
per-head RMS norms on q and k, NeoX RoPE, V without a norm, SwiGLU, and the target's embedding
and head. Its logits were checked against lucepy's draft graph on the same features, weights
written by tools/dflash_gguf.py (docs/architecture.md, decision 5).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from dflash_gguf import DraftConfig
from torch import nn


def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float, neox: bool) -> torch.Tensor:
    """x [S, T, H, D] at positions pos [S, T]. NeoX pairs dims (i, i + D/2); llama's GGUF
    (ggml's normal mode) pairs (2i, 2i + 1)."""
    d = x.shape[-1]
    cos, sin = rope_angles(pos, theta, d)
    if not neox:
        return rope_cs(x, cos, sin)
    x32 = x.float()
    a, b = x32[..., : d // 2], x32[..., d // 2 :]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], -1).to(x.dtype)


def rope_angles(pos: torch.Tensor, theta: float, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos and sin [S, T, 1, D/2] of RoPE's angles at positions pos [S, T]."""
    inv = theta ** (-torch.arange(0, d, 2, device=pos.device, dtype=torch.float32) / d)
    ang = pos[..., None].float() * inv  # [S, T, D/2]
    return ang.cos()[:, :, None], ang.sin()[:, :, None]


def rope_cs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """ggml's normal RoPE (pairs 2i, 2i + 1) of x [S, T, H, D] with the angles' cos and sin
    [S, T, 1, D/2]."""
    x32 = x.float()
    a, b = x32[..., 0::2], x32[..., 1::2]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2).to(x.dtype)


def _field(r: gguf.GGUFReader, key: str):
    return r.get_field(key).contents()


class Target:
    """A llama GGUF in torch, f32 (TF32 matmuls on a GPU): greedy or sampled generation with a
    KV cache, and the features a DFlash draft reads (the residual entering given layers)."""

    def __init__(self, path: Path, device: str):
        r = gguf.GGUFReader(str(path))
        arch = _field(r, "general.architecture")
        self.n_layer = int(_field(r, f"{arch}.block_count"))
        self.n_head = int(_field(r, f"{arch}.attention.head_count"))
        self.n_kv = int(_field(r, f"{arch}.attention.head_count_kv"))
        self.eps = float(_field(r, f"{arch}.attention.layer_norm_rms_epsilon"))
        self.theta = float(_field(r, f"{arch}.rope.freq_base"))
        self.device = device
        self.w = {}
        for t in r.tensors:
            values = gguf.quants.dequantize(t.data, t.tensor_type)
            shape = tuple(int(n) for n in reversed(t.shape))
            values = np.array(values, dtype=np.float32).reshape(shape)  # a writable copy
            self.w[t.name] = torch.from_numpy(values).to(device)
        self.embd = self.w["token_embd.weight"]  # [n_vocab, n_embd]
        self.head = self.w.get("output.weight", self.embd)
        self.hd = self.embd.shape[1] // self.n_head
        self._cast: dict[torch.dtype, dict[str, torch.Tensor]] = {}

    def pad(self, seqs: list[tuple]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens [S, L] padded at the end, prompt lengths [S], lengths [S])."""
        L = max(len(s) for s, _ in seqs)
        tokens = torch.zeros(len(seqs), L, dtype=torch.long)
        for i, (s, _) in enumerate(seqs):
            tokens[i, : len(s)] = torch.tensor(s)
        dev = self.device
        plen = torch.tensor([p for _, p in seqs], device=dev)
        lens = torch.tensor([len(s) for s, _ in seqs], device=dev)
        return tokens.to(dev), plen, lens

    @torch.no_grad()
    def features(self, tokens: torch.Tensor, layers: tuple[int, ...]) -> torch.Tensor:
        """[S, L, len(layers) * n_embd]: the residual entering each of ``layers`` (n_layer: the
        last layer's output), layer-major, as lucepy's ``feat.L`` outputs are concatenated. The
        layers are generation's (``_gen_layer``, f32), over a causal mask, one K/V buffer for
        all of them (nothing reads a layer's cache after it)."""
        S, L = tokens.shape
        dev = tokens.device
        pos = torch.arange(L, device=dev).expand(S, L)
        cos, sin = rope_angles(pos, self.theta, self.hd)
        causal = torch.ones(L, L, dtype=torch.bool, device=dev).tril()
        bias = torch.zeros(L, L, device=dev).masked_fill_(~causal, -math.inf)
        kv = [torch.zeros(S, self.n_kv, L, self.hd, device=dev) for _ in "kv"]
        m = self._stacked(torch.float32)
        x, out = self.embd[tokens], {}
        for i in range(max(layers) + 1):
            if i in layers:
                out[i] = x
            if i < self.n_layer:
                x = self._gen_layer(i, x, cos, sin, {i: kv}, 0, bias, m)
        return torch.cat([out[i] for i in layers], -1)

    def _stacked(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Each layer's matrices in ``dtype`` for generation, Q/K/V and gate/up stacked (one
        product each), made once per dtype."""
        if dtype not in self._cast:
            w, out = self.w, {"head": self.head.to(dtype)}
            for i in range(self.n_layer):
                b = f"blk.{i}."
                parts = [w[b + f"attn_{n}.weight"] for n in "qkv"]
                out[b + "qkv"] = torch.cat(parts).to(dtype)
                out[b + "o"] = w[b + "attn_output.weight"].to(dtype)
                parts = [w[b + f"ffn_{n}.weight"] for n in ("gate", "up")]
                out[b + "gate_up"] = torch.cat(parts).to(dtype)
                out[b + "down"] = w[b + "ffn_down.weight"].to(dtype)
            self._cast[dtype] = out
        return self._cast[dtype]

    def _gen_layer(self, i: int, x, cos, sin, cache, t0: int, bias, m: dict):
        """One layer over x [S, T, e] (the residual, f32) at cache columns t0.., the products
        in the cache's dtype, attention written out so that the cache's columns are read in
        place: the query heads of one K/V head as rows, the scores plus ``bias`` [S, 1, 1, T,
        t0 + T] (0 or -inf)."""
        w, S, T, dt = self.w, x.shape[0], x.shape[1], cache[i][0].dtype
        nh, nkv, hd, b = self.n_head, self.n_kv, self.hd, f"blk.{i}."
        h = rms(x, w[b + "attn_norm.weight"], self.eps).to(dt)
        q, k, v = (h @ m[b + "qkv"].T).split([nh * hd, nkv * hd, nkv * hd], -1)
        q = rope_cs(q.view(S, T, nh, hd), cos, sin)
        cache[i][0][:, :, t0 : t0 + T] = rope_cs(k.view(S, T, nkv, hd), cos, sin).transpose(1, 2)
        cache[i][1][:, :, t0 : t0 + T] = v.view(S, T, nkv, hd).transpose(1, 2)
        keys, values = cache[i][0][:, :, : t0 + T], cache[i][1][:, :, : t0 + T]
        r = nh // nkv
        q = q.view(S, T, nkv, r, hd).permute(0, 2, 3, 1, 4).reshape(S, nkv, r * T, hd)
        scores = (q @ keys.transpose(-1, -2)).float() * hd**-0.5
        scores = scores.view(S, nkv, r, T, t0 + T) + bias
        att = torch.softmax(scores, -1).to(dt).view(S, nkv, r * T, t0 + T) @ values
        att = att.view(S, nkv, r, T, hd).permute(0, 3, 1, 2, 4).reshape(S, T, nh * hd)
        x = x + (att @ m[b + "o"].T).float()
        h = rms(x, w[b + "ffn_norm.weight"], self.eps).to(dt)
        gate, up = (h @ m[b + "gate_up"].T).chunk(2, -1)
        return x + ((F.silu(gate) * up) @ m[b + "down"].T).float()

    @torch.no_grad()
    def generate(
        self, prompts, n: int, temperature, stop, gen, top_k: int = 50, dtype=torch.float32
    ):
        """Up to ``n`` new tokens per prompt (batched, prompts left-padded), each list cut after
        ``stop`` where it appears. ``temperature``: one for all, or one per prompt; greedy at 0,
        else top-k sampling. ``dtype``: of the weights, the cache and the products (bf16 for
        training data: half the bytes a step; f32, TF32 products, for evaluation)."""
        S, P, dev = len(prompts), max((len(p) for p in prompts), default=0), self.device
        if S == 0:
            return []
        m = self._stacked(dtype)
        temps = torch.as_tensor(temperature, dtype=torch.float32, device=dev).expand(S)
        tokens = torch.zeros(S, P, dtype=torch.long)
        for i, p in enumerate(prompts):
            tokens[i, P - len(p) :] = torch.tensor(p)
        tokens, pad = tokens.to(dev), torch.tensor([P - len(p) for p in prompts], device=dev)
        cols = torch.arange(P + n, device=dev)
        valid = cols[None, :] >= pad[:, None]  # [S, P + n]: a key column holds a token
        cache = [
            [torch.zeros(S, self.n_kv, P + n, self.hd, device=dev, dtype=dtype) for _ in "kv"]
            for _ in range(self.n_layer)
        ]
        sampling = bool((temps > 0).any())
        out, done, t0, x = [], torch.zeros(S, dtype=torch.bool, device=dev), 0, tokens
        for step in range(n):
            T = x.shape[1]
            q_cols = cols[t0 : t0 + T]
            pos = (q_cols[None, :] - pad[:, None]).clamp(min=0)
            cos, sin = rope_angles(pos, self.theta, self.hd)
            keys = cols[None, None, : t0 + T]
            allowed = valid[:, None, : t0 + T] & (keys <= q_cols[:, None])
            allowed |= keys == q_cols[:, None]  # a padding row sees itself: no row is all -inf
            bias = torch.zeros(allowed.shape, device=dev).masked_fill_(~allowed, -math.inf)
            h = self.embd[x]
            for i in range(self.n_layer):
                h = self._gen_layer(i, h, cos, sin, cache, t0, bias[:, None, None], m)
            h = rms(h[:, -1], self.w["output_norm.weight"], self.eps).to(dtype)
            logits = (h @ m["head"].T).float()
            nxt = logits.argmax(-1)
            if sampling:
                top = logits.topk(top_k, -1)
                probs = torch.softmax(top.values / temps.clamp(min=1e-6)[:, None], -1)
                drawn = top.indices.gather(1, torch.multinomial(probs, 1, generator=gen))[:, 0]
                nxt = torch.where(temps > 0, drawn, nxt)
            out.append(nxt)
            t0, x = t0 + T, nxt[:, None]
            if stop is not None:
                done |= nxt == stop
                if step % 16 == 15 and bool(done.all()):  # a sync: not every step
                    break
        rows = torch.stack(out, 1).tolist()
        if stop is None:
            return rows
        return [r[: r.index(stop) + 1] if stop in r else r for r in rows]


@dataclass
class Blocks:
    """Blocks at anchors: row 0 the anchor's token, the rest the mask token."""

    tokens: torch.Tensor  # [S, M*B]
    pos: torch.Tensor  # [S, M*B]
    labels: torch.Tensor  # [S, M*B]: the token each row predicts; -100: none
    mask: torch.Tensor  # [S, 1, M*B, L + M*B] bool: the context before the anchor, its block
    ctx_pos: torch.Tensor  # [S, L]


def block_batch(tokens, lens, anchor, B: int, mask_token: int) -> Blocks:
    S, L = tokens.shape
    M, dev = anchor.shape[1], tokens.device
    k = torch.arange(B, device=dev)
    pos = anchor[:, :, None] + k  # [S, M, B]
    blk = torch.full((S, M, B), mask_token, dtype=torch.long, device=dev)
    blk[:, :, 0] = tokens.gather(1, anchor)
    valid = (k >= 1) & (pos < lens[:, None, None])
    labels = torch.where(
        valid, tokens.gather(1, pos.clamp(max=L - 1).flatten(1)).view(S, M, B), -100
    )
    row_anchor = anchor.repeat_interleave(B, 1)  # [S, M*B]
    ctx = torch.arange(L, device=dev)[None, None, :] < row_anchor[:, :, None]
    block_id = torch.arange(M, device=dev).repeat_interleave(B)
    own = (block_id[:, None] == block_id[None, :]).expand(S, -1, -1)
    return Blocks(
        tokens=blk.flatten(1),
        pos=pos.flatten(1),
        labels=labels.flatten(1),
        mask=torch.cat([ctx, own], -1)[:, None],
        ctx_pos=torch.arange(L, device=dev).expand(S, L),
    )


class DraftLayer(nn.Module):
    def __init__(self, c: DraftConfig):
        super().__init__()
        e, hd = c.n_embd, c.head_dim
        self.c = c
        self.attn_norm = nn.Parameter(torch.ones(e))
        self.attn_q = nn.Linear(e, hd * c.n_head, bias=False)
        self.attn_k = nn.Linear(e, hd * c.n_head_kv, bias=False)
        self.attn_v = nn.Linear(e, hd * c.n_head_kv, bias=False)
        self.attn_q_norm = nn.Parameter(torch.ones(hd))
        self.attn_k_norm = nn.Parameter(torch.ones(hd))
        self.attn_output = nn.Linear(hd * c.n_head, e, bias=False)
        self.ffn_norm = nn.Parameter(torch.ones(e))
        self.ffn_gate = nn.Linear(e, c.n_ff, bias=False)
        self.ffn_up = nn.Linear(e, c.n_ff, bias=False)
        self.ffn_down = nn.Linear(c.n_ff, e, bias=False)

    def kv(self, h, pos):
        """K (head-normed, roped) and V of h [S, T, e], as [S, n_head_kv, T, hd]."""
        c, (S, T) = self.c, h.shape[:2]
        k = self.attn_k(h).view(S, T, c.n_head_kv, c.head_dim)
        k = rope(rms(k, self.attn_k_norm, c.rms_eps), pos, c.rope_theta, True)
        v = self.attn_v(h).view(S, T, c.n_head_kv, c.head_dim)
        return k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, x, ctx, b: Blocks):
        c, (S, N) = self.c, x.shape[:2]
        ck, cv = self.kv(ctx, b.ctx_pos)
        h = rms(x, self.attn_norm, c.rms_eps)
        q = self.attn_q(h).view(S, N, c.n_head, c.head_dim)
        q = rope(rms(q, self.attn_q_norm, c.rms_eps), b.pos, c.rope_theta, True).transpose(1, 2)
        k, v = self.kv(h, b.pos)
        r = c.n_head // c.n_head_kv
        k = torch.cat([ck, k], 2).repeat_interleave(r, 1)
        v = torch.cat([cv, v], 2).repeat_interleave(r, 1)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=b.mask)
        x = x + self.attn_output(att.transpose(1, 2).reshape(S, N, -1))
        h = rms(x, self.ffn_norm, c.rms_eps)
        return x + self.ffn_down(F.silu(self.ffn_gate(h)) * self.ffn_up(h))


class Draft(nn.Module):
    """The trainable draft; ``embd`` is the target's (frozen) embedding and head."""

    def __init__(self, cfg: DraftConfig, embd: torch.Tensor, out_norm: torch.Tensor):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(len(cfg.target_layers) * cfg.n_embd, cfg.n_embd, bias=False)
        self.enc_norm = nn.Parameter(torch.ones(cfg.n_embd))
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.n_layer))
        # the target's final norm scales the residual to its head's logits: start from it
        self.out_norm = nn.Parameter(out_norm.detach().clone())
        self.register_buffer("embd", embd, persistent=False)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, feats: torch.Tensor, b: Blocks) -> torch.Tensor:
        """The final-normed hidden state of every block row, [S, M*B, n_embd]."""
        ctx = rms(self.fc(feats), self.enc_norm, self.cfg.rms_eps)
        x = self.embd[b.tokens].to(ctx.dtype)
        for layer in self.layers:
            x = layer(x, ctx, b)
        return rms(x, self.out_norm, self.cfg.rms_eps)

    def _gguf_names(self) -> dict[str, str]:
        """state_dict name -> GGUF tensor name."""
        names = {"enc_norm": "enc.output_norm.weight", "out_norm": "output_norm.weight"}
        out = {}
        for name in self.state_dict():
            gguf_name = names.get(name, name)
            if name.startswith("layers."):
                _, i, rest = name.split(".", 2)
                gguf_name = f"blk.{i}.{rest if rest.endswith('.weight') else rest + '.weight'}"
            out[name] = gguf_name
        return out

    def gguf_weights(self) -> dict[str, torch.Tensor]:
        state = self.state_dict()
        return {g: state[n].detach() for n, g in self._gguf_names().items()}

    def load_gguf_weights(self, weights: dict) -> int:
        """Loads a draft's weights. A draft deeper than they are keeps its last layers as new
        ones, each starting as the identity (its attention's and its FFN's output projections
        zero), so that it begins as the draft it grows from. Returns how many layers it grew."""
        names = self._gguf_names()
        extra = set(weights) - set(names.values())
        if extra:
            raise ValueError(f"weights this draft has no place for: {sorted(extra)[:4]}")
        state = {n: torch.as_tensor(weights[g]).float() for n, g in names.items() if g in weights}
        n_old = len({n.split(".")[1] for n in state if n.startswith("layers.")})
        grown = [n for n in names if n not in state]
        if any(not n.startswith("layers.") or int(n.split(".")[1]) < n_old for n in grown):
            raise ValueError(f"weights missing: {grown[:4]}")
        self.load_state_dict(state, strict=False)
        for layer in self.layers[n_old:]:
            nn.init.zeros_(layer.attn_output.weight)
            nn.init.zeros_(layer.ffn_down.weight)
        return len(self.layers) - n_old
