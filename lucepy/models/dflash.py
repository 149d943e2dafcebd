"""DFlash drafts (GGUF ``dflash``): a small block-diffusion decoder conditioned on target features.

Follows ``src/models/dflash.cpp`` (the plain DFlash decoder) and the DFlash part of
``common/speculative.cpp`` of the pinned llama.cpp. Two graphs:

- inject: the target's captured features [n_target_layers * n_embd, T] go through ``fc`` and
  ``enc.output_norm``; each layer's K/V of that is written into the draft's KV cache at the
  tokens' positions ("KV injection").
- propose: the block ``[last, mask x (B-1)]`` at positions n..n+B-1 runs through the decoder,
  attending to the injected context and, non-causally, to the whole block. Rows 1..B-1 of its
  logits are the draft.

A draft without ``token_embd``/``output`` uses the target's (loaded from the target file).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from lucepy.errors import ConfigError, ModelFileError
from lucepy.ggml import GGML_TYPE_F16, ffi
from lucepy.gguf import GGUFFile
from lucepy.models.base import DecoderParams, check_tensors, metadata, rope_args
from lucepy.models.batch import StepBatch, StepInput
from lucepy.models.builder import Builder, Tensor
from lucepy.models.state import KVCache

GGML_ROPE_TYPE_NEOX = 2
GGML_ROPE_TYPE_MROPE = 8


@dataclass(frozen=True)
class DraftParams(DecoderParams):
    """``n_vocab`` is the draft file's vocabulary (the target's, which ``check_target`` uses)."""

    rope_sections: tuple[int, int, int, int]
    target_layers: tuple[int, ...]  # capture the residual entering these target layers
    block_size: int
    mask_token: int
    causal: bool  # block-internal attention (False for DFlash)
    attn_scale: float
    embd_scale: float

    @property
    def mrope(self) -> bool:
        return any(self.rope_sections)

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> DraftParams:
        if f.architecture != "dflash":
            raise ModelFileError(
                f"{f.path}: a draft must be a 'dflash' GGUF, got {f.architecture!r}"
            )

        key = metadata(f)
        if key("hidden_act", "silu") != "silu":
            raise ModelFileError(
                f"{f.path}: draft activation {key('hidden_act')!r} is not supported (silu only)"
            )
        common = DecoderParams.common(f, int(key("block_count")))
        head_dim = common["head_dim"]
        sections = list(key("rope.dimension_sections", [0, 0, 0, 0]))[:4]
        return cls(
            **common,
            rope_sections=tuple(sections + [0] * (4 - len(sections))),
            target_layers=tuple(int(x) for x in key("target_layers")),
            block_size=int(key("block_size", 16)),
            mask_token=int(f.require("tokenizer.ggml.mask_token_id")),
            causal=bool(key("attention.causal", False)),
            attn_scale=float(key("attention.scale", 0.0)) or 1.0 / math.sqrt(head_dim),
            embd_scale=float(key("embedding_scale", 0.0)),
        )


class DFlash:
    """The draft's tensors and graphs. ``w`` maps GGUF tensor names to tensors."""

    def __init__(self, params: DraftParams, f: GGUFFile):
        self.p = params
        self.own_embd = "token_embd.weight" in f.tensors
        self.own_head = "output.weight" in f.tensors or self.own_embd
        self.has_v = [f"blk.{i}.attn_v.weight" in f.tensors for i in range(params.n_layer)]

    @classmethod
    def from_gguf(cls, f: GGUFFile, target) -> DFlash:
        draft = cls(DraftParams.from_gguf(f), f)
        draft.check_target(f, target)
        check_tensors(f, draft.weight_shapes(target.p.n_vocab, target.p.n_embd))
        return draft

    def check_target(self, f: GGUFFile, target) -> None:
        """The draft fits this target: features, hidden size, vocabulary and mask token."""
        p, t = self.p, target.p
        bad = [L for L in p.target_layers if not 0 <= L <= t.n_layer]
        if bad:
            raise ConfigError(
                f"{f.path}: draft reads target layer {bad[0]}, but the target has "
                f"{t.n_layer} layers (0..{t.n_layer})"
            )
        fc = f.tensors.get("fc.weight")
        want = len(p.target_layers) * t.n_embd
        if fc is not None and fc.shape[0] != want:
            raise ConfigError(
                f"{f.path}: fc takes {fc.shape[0]} features, but "
                f"{len(p.target_layers)} target layers of {t.n_embd} give {want}"
            )
        if not self.own_embd and p.n_embd != t.n_embd:
            raise ConfigError(
                f"{f.path}: the draft (hidden {p.n_embd}) shares the target's "
                f"embeddings (hidden {t.n_embd}); they must match"
            )
        if not 0 <= p.mask_token < t.n_vocab:
            raise ConfigError(
                f"{f.path}: mask token {p.mask_token} is outside the target's "
                f"vocabulary of {t.n_vocab}"
            )
        if "d2t" in f.tensors:
            raise ConfigError(f"{f.path}: reduced-vocabulary drafts (d2t) are not supported yet")

    def weight_shapes(self, n_vocab: int, n_target_embd: int) -> dict[str, tuple]:
        """The draft's own tensors (the shared embedding and head come from the target)."""
        p, hd = self.p, self.p.head_dim
        out = {"fc.weight": (len(p.target_layers) * n_target_embd, p.n_embd)}
        if self.own_embd:
            out["token_embd.weight"] = (p.n_embd, n_vocab)
        out["enc.output_norm.weight"] = (p.n_embd,)
        out["output_norm.weight"] = (p.n_embd,)
        for i in range(p.n_layer):
            b = f"blk.{i}."
            out.update(
                {
                    b + "attn_norm.weight": (p.n_embd,),
                    b + "ffn_norm.weight": (p.n_embd,),
                    b + "attn_q.weight": (p.n_embd, hd * p.n_head),
                    b + "attn_k.weight": (p.n_embd, hd * p.n_head_kv),
                    b + "attn_output.weight": (hd * p.n_head, p.n_embd),
                    b + "attn_q_norm.weight": (hd,),
                    b + "attn_k_norm.weight": (hd,),
                    b + "ffn_gate.weight": (p.n_embd, p.n_ff),
                    b + "ffn_up.weight": (p.n_embd, p.n_ff),
                    b + "ffn_down.weight": (p.n_ff, p.n_embd),
                }
            )
            if self.has_v[i]:
                out[b + "attn_v.weight"] = (p.n_embd, hd * p.n_head_kv)
        return out

    def own_weights(self, f: GGUFFile) -> list[str]:
        """The draft file's tensors that its graphs read."""
        return [n for n in f.tensors if n != "d2t"]

    def target_weights(self, target: GGUFFile) -> list[str]:
        """The target's tensors the draft reads: its embedding, and its head unless the draft
        has its own (a tied target's head is its embedding)."""
        out = [] if self.own_embd else ["token_embd.weight"]
        if not self.own_head and "output.weight" in target.tensors:
            out.append("output.weight")
        return out

    def make_state(self, n_ctx: int) -> list[KVCache]:
        """The draft's KV per layer: rows are the target positions whose features it injected."""
        width = self.p.head_dim * self.p.n_head_kv
        f16 = GGML_TYPE_F16
        return [KVCache(i, width, n_ctx, f16, f16) for i in range(self.p.n_layer)]

    def step_inputs(self, batch: StepBatch, names) -> dict[str, StepInput]:
        """Positions (IMROPE's 4 sections when the draft uses them), the KV rows, and the block
        mask: every block row sees the context and the whole block (causal drafts: the block up
        to itself)."""
        pos = batch.pos
        if self.p.mrope:
            pos = np.concatenate([pos, pos, pos, np.zeros_like(pos)])
        out = {"tokens": batch.tokens, "pos": pos, "rows": batch.slots}
        if "mask" in names:
            out["mask"] = batch.mask_input(causal=self.p.causal)
        return {k: v for k, v in out.items() if k in names}

    # graphs
    def _positions(self, g: Builder, T: int) -> Tensor:
        return g.input_i32("pos", 4 * T if self.p.mrope else T)

    def _rope(self, g: Builder, t: Tensor) -> Tensor:
        p, L, pos = self.p, g.lib, g.inputs["pos"]
        tail = rope_args(p.n_ctx_train, p.rope_theta)
        if p.mrope:
            sections = ffi.new("int[4]", list(p.rope_sections))
            return L.ggml_rope_multi(
                g.ctx, t, pos, ffi.NULL, p.rope_dim, sections, GGML_ROPE_TYPE_MROPE, *tail
            )
        return L.ggml_rope_ext(g.ctx, t, pos, ffi.NULL, p.rope_dim, GGML_ROPE_TYPE_NEOX, *tail)

    def _kv(self, g: Builder, w: dict, i: int, x: Tensor, T: int) -> tuple[Tensor, Tensor]:
        """K (normed, roped) and V of ``x`` [n_embd, T] for layer i, as [hd, n_head_kv, T]."""
        p, L, c, b = self.p, g.lib, g.ctx, f"blk.{i}."
        k = L.ggml_reshape_3d(
            c, L.ggml_mul_mat(c, w[b + "attn_k.weight"], x), p.head_dim, p.n_head_kv, T
        )
        if self.has_v[i]:
            v = L.ggml_reshape_3d(
                c, L.ggml_mul_mat(c, w[b + "attn_v.weight"], x), p.head_dim, p.n_head_kv, T
            )
        else:  # shared K/V: V is K before its norm and rope, RMS-normed without a weight
            v = L.ggml_rms_norm(c, k, p.rms_eps)
        k = self._rope(g, g.rms_norm(k, w[b + "attn_k_norm.weight"], p.rms_eps))
        return k, v

    def _store(self, g: Builder, kv: dict, i: int, k: Tensor, v: Tensor, T: int) -> list[Tensor]:
        L, c, rows = g.lib, g.ctx, g.inputs["rows"]
        width = self.p.head_dim * self.p.n_head_kv
        return [
            L.ggml_set_rows(c, kv[f"{n}.{i}"], L.ggml_reshape_2d(c, t, width, T), rows)
            for n, t in (("k", k), ("v", v))
        ]

    def build_inject(self, g: Builder, w: dict, kv: dict, n_target_embd: int, T: int) -> None:
        p, L, c = self.p, g.lib, g.ctx
        parts = [g.carried_f32(f"feat.{j}", n_target_embd, T) for j in range(len(p.target_layers))]
        feats = parts[0]
        for part in parts[1:]:
            feats = L.ggml_concat(c, feats, part, 0)  # [n_layers * n_embd, T], layer-major rows
        self._positions(g, T)
        g.input_i64("rows", T)
        h = g.rms_norm(
            L.ggml_mul_mat(c, w["fc.weight"], feats), w["enc.output_norm.weight"], p.rms_eps
        )  # [n_embd, T]
        for i in range(p.n_layer):
            k, v = self._kv(g, w, i, h, T)
            for t in self._store(g, kv, i, k, v, T):
                L.ggml_build_forward_expand(g.gf, t)

    def build_propose(self, g: Builder, w: dict, kv: dict, T: int, n_kv: int) -> Tensor:
        p, L, c = self.p, g.lib, g.ctx
        x = L.ggml_get_rows(c, w["token_embd.weight"], g.input_i32("tokens", T))
        if p.embd_scale:
            x = L.ggml_scale(c, x, p.embd_scale)
        self._positions(g, T)
        g.input_i64("rows", T)
        g.input_f16("mask", n_kv, T)
        for i in range(p.n_layer):
            x = self._decoder_layer(g, w, kv, i, x, T, n_kv)
        x = g.rms_norm(x, w["output_norm.weight"], p.rms_eps)
        head = w.get("output.weight", w["token_embd.weight"])
        logits = L.ggml_mul_mat(c, head, x)  # [n_vocab, T]
        g.output("argmax", L.ggml_argmax(c, logits))
        return logits

    def _decoder_layer(
        self, g: Builder, w: dict, kv: dict, i: int, x: Tensor, T: int, n_kv: int
    ) -> Tensor:
        p, L, c, b, hd = self.p, g.lib, g.ctx, f"blk.{i}.", self.p.head_dim
        h = g.rms_norm(x, w[b + "attn_norm.weight"], p.rms_eps)
        q = L.ggml_reshape_3d(c, L.ggml_mul_mat(c, w[b + "attn_q.weight"], h), hd, p.n_head, T)
        q = self._rope(g, g.rms_norm(q, w[b + "attn_q_norm.weight"], p.rms_eps))
        k, v = self._kv(g, w, i, h, T)
        ks, vs = self._store(g, kv, i, k, v, T)
        views = [
            L.ggml_permute(
                c,
                L.ggml_view_3d(c, t, hd, p.n_head_kv, n_kv, g.row_size(t, hd), t.nb[1], 0),
                0,
                2,
                1,
                3,
            )
            for t in (ks, vs)
        ]  # [hd, n_kv, n_head_kv]
        q = L.ggml_permute(c, q, 0, 2, 1, 3)
        att = L.ggml_flash_attn_ext(
            c, q, views[0], views[1], g.inputs["mask"], p.attn_scale, 0.0, 0.0
        )
        L.ggml_flash_attn_ext_set_prec(att, L.GGML_PREC_F32)
        att = L.ggml_mul_mat(
            c, w[b + "attn_output.weight"], L.ggml_reshape_2d(c, att, hd * p.n_head, T)
        )
        if b + "post_attention_norm.weight" in w:
            att = g.rms_norm(att, w[b + "post_attention_norm.weight"], p.rms_eps)
        x = L.ggml_add(c, att, x)
        h = g.rms_norm(x, w[b + "ffn_norm.weight"], p.rms_eps)
        h = g.swiglu_ffn(
            h, w[b + "ffn_gate.weight"], w[b + "ffn_up.weight"], w[b + "ffn_down.weight"]
        )
        if b + "post_ffw_norm.weight" in w:
            h = g.rms_norm(h, w[b + "post_ffw_norm.weight"], p.rms_eps)
        return L.ggml_add(c, h, x)
