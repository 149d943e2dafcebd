"""LLaMA-style decoders (GGUF ``llama``: LLaMA 2/3, SmolLM, Mistral): RoPE, grouped-query
attention, SwiGLU, an output head tied to the embedding or not.

The math follows ``src/models/llama.cpp`` and ``build_attn`` in ``src/llama-graph.cpp`` of the
pinned llama.cpp (0c1e57098): plain ("normal") RoPE with the optional llama3 ``rope_freqs``
factors, optional projection biases, and, when only the last token's logits are wanted, the row
picked inside the last layer before its residual add, as llama.cpp picks its output rows there.
Shapes are in ggml order (see ``models/base.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lucepy.errors import ConfigError
from lucepy.ggml import ffi
from lucepy.gguf import GGUFFile
from lucepy.models.base import (
    Architecture,
    DecoderParams,
    GraphSpec,
    ModelOptions,
    check_tensors,
    metadata,
)
from lucepy.models.batch import StepBatch, StepInput
from lucepy.models.builder import Builder, Tensor
from lucepy.models.state import LayerState

ROPE_NORMAL = 0  # LLAMA_ROPE_TYPE_NORM: rotate adjacent pairs
_MATMULS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
_BIASES = ("attn_q", "attn_k", "attn_v", "attn_output")
_QKV = "attn_qkv.stacked"  # the graph key of attn_q, attn_k and attn_v stacked (not a GGUF name)
_QKV_PARTS = ("attn_q", "attn_k", "attn_v")


@dataclass(frozen=True)
class Params(DecoderParams):
    rope_freq_scale: float  # 1 / linear scaling factor
    attn_scale: float  # 0: 1/sqrt(head_dim)

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> Params:
        key = metadata(f)
        scaling = key("rope.scaling.type", "none")
        if scaling not in ("none", "linear"):
            raise ConfigError(f"{f.path}: rope scaling {scaling!r} is not supported yet")
        factor = float(key("rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0
        return cls(
            **DecoderParams.common(f, int(key("block_count"))),
            rope_freq_scale=1.0 / factor if factor else 1.0,
            attn_scale=float(key("attention.scale", 0.0)),
        )


class Llama(Architecture):
    gguf_name = "llama"

    def __init__(self, params: Params, options: ModelOptions, optional: frozenset[str]):
        self.p, self.options = params, options
        self.optional = optional  # optional tensors the file has: biases, rope_freqs

    @classmethod
    def from_gguf(cls, f: GGUFFile, options: ModelOptions = ModelOptions()) -> Llama:  # noqa: B008
        p = Params.from_gguf(f)
        if any(".ffn_gate_inp." in n for n in f.tensors):
            raise ConfigError(f"{f.path}: mixture-of-experts llama files are not supported yet")
        if p.rope_dim != p.head_dim:
            raise ConfigError(f"{f.path}: partial RoPE ({p.rope_dim} of {p.head_dim}) in llama")
        optional = [f"blk.{i}.{m}.bias" for i in range(p.n_layer) for m in _BIASES]
        model = cls(
            p, options, frozenset(n for n in [*optional, "rope_freqs.weight"] if n in f.tensors)
        )
        check_tensors(f, model.weight_shapes(range(p.n_layer), f))
        return model

    # what a layer range owns
    def weight_shapes(self, layers: range, f: GGUFFile | None = None) -> dict[str, tuple]:
        out = self.end_shapes(layers, f)
        if "rope_freqs.weight" in self.optional:
            out["rope_freqs.weight"] = (self.p.rope_dim // 2,)
        for il in layers:
            out.update(self._layer_shapes(il))
        return out

    def _layer_shapes(self, il: int) -> dict[str, tuple]:
        p, b = self.p, f"blk.{il}."
        q, kv = p.head_dim * p.n_head, p.head_dim * p.n_head_kv
        out = {
            b + "attn_norm.weight": (p.n_embd,),
            b + "attn_q.weight": (p.n_embd, q),
            b + "attn_k.weight": (p.n_embd, kv),
            b + "attn_v.weight": (p.n_embd, kv),
            b + "attn_output.weight": (q, p.n_embd),
            b + "ffn_norm.weight": (p.n_embd,),
            b + "ffn_gate.weight": (p.n_embd, p.n_ff),
            b + "ffn_up.weight": (p.n_embd, p.n_ff),
            b + "ffn_down.weight": (p.n_ff, p.n_embd),
        }
        width = {"attn_q": q, "attn_k": kv, "attn_v": kv, "attn_output": p.n_embd}
        for m in _BIASES:
            if f"{b}{m}.bias" in self.optional:
                out[f"{b}{m}.bias"] = (width[m],)
        return out

    def matmul_weights(self, layers: range, f: GGUFFile) -> dict[str, str | tuple[str, ...]]:
        out: dict[str, str | tuple[str, ...]] = {
            f"blk.{il}.{m}.weight": f"blk.{il}.{m}.weight" for il in layers for m in _MATMULS
        }
        biased = ("attn_q.bias", "attn_k.bias", "attn_v.bias")
        if not any(n.endswith(biased) for n in self.optional):  # Q, K and V: one product
            out = self.stack_all(f, layers, {_QKV: _QKV_PARTS}, out)
        return out | self.head_matmul(layers, f)

    def make_state(self, layers: range, n_ctx: int) -> list[LayerState]:
        p = self.p
        return [self.options.kv_cache(il, p.head_dim, p.n_head_kv, n_ctx) for il in layers]

    def step_inputs(self, batch: StepBatch, names) -> dict[str, StepInput]:
        out = {"tokens": batch.tokens, "pos": batch.pos, "rows": batch.slots}
        if "mask" in names:
            out["mask"] = batch.mask_input()
        return {k: v for k, v in out.items() if k in names}

    # graph
    def build(self, g: Builder, w: dict, st: dict, layers: range, spec: GraphSpec) -> Tensor:
        """The forward of ``layers`` for ``spec.n_tokens`` tokens over ``spec.n_kv`` cache rows.
        Inputs: ``tokens`` (first shard) or ``x``, ``pos``, ``mask``, ``rows``. Outputs as
        qwen35's: logits (last shard) or the activation, ``argmax``, ``feat.L``."""
        p, L, c, T = self.p, g.lib, g.ctx, spec.n_tokens
        if T // max(spec.streams[0], 1) > spec.n_kv:  # each sequence's tokens in its window
            raise ConfigError(f"{T} tokens do not fit a {spec.n_kv}-row attention window")
        if layers.start == 0:
            x = L.ggml_get_rows(c, w["token_embd.weight"], g.input_i32("tokens", T))
        else:
            x = g.carried_f32("x", p.n_embd, T)  # [n_embd, T]
        g.input_i32("pos", T)
        g.input_f16("mask", spec.n_kv, T)  # 0 where a token may attend, -inf elsewhere
        g.input_i64("rows", T)
        last = spec.logits == "last" and layers.stop == p.n_layer
        # llama.cpp picks the output row inside the last layer; a draft that reads the final
        # residual needs every row, so then the row is picked after it
        last_only = last and p.n_layer not in spec.capture
        for il in layers:
            if il in spec.capture:
                g.output(f"feat.{il}", x)
            x = self._layer(g, w, st, il, x, last_only and il == p.n_layer - 1)
        if layers.stop < p.n_layer:
            return x
        if p.n_layer in spec.capture:
            g.output(f"feat.{p.n_layer}", x)
        if last and not last_only:
            x = g.last_row(x)
        x = g.rms_norm(x, w["output_norm.weight"], p.rms_eps)
        logits = L.ggml_mul_mat(c, w.get("output.weight", w.get("token_embd.weight")), x)
        g.output("argmax", L.ggml_argmax(c, logits))  # [T or 1] i32
        return logits  # [n_vocab, T or 1]

    def _layer(self, g: Builder, w: dict, st: dict, il: int, x: Tensor, pick: bool) -> Tensor:
        """One block; ``pick``: keep only the last token after attention (llama.cpp's output
        rows), so the last FFN runs on that row alone."""
        p, L, c, b = self.p, g.lib, g.ctx, f"blk.{il}."
        h = g.rms_norm(x, w[b + "attn_norm.weight"], p.rms_eps)
        h = self._attention(g, w, st, il, h)
        if pick:
            h, x = g.last_row(h), g.last_row(x)
        x = L.ggml_add(c, h, x)
        h = g.rms_norm(x, w[b + "ffn_norm.weight"], p.rms_eps)
        h = g.swiglu_ffn(
            h, w[b + "ffn_gate.weight"], w[b + "ffn_up.weight"], w[b + "ffn_down.weight"]
        )
        return L.ggml_add(c, h, x)

    def _proj(self, g: Builder, w: dict, name: str, x: Tensor) -> Tensor:
        out = g.lib.ggml_mul_mat(g.ctx, w[name + ".weight"], x)
        bias = w.get(name + ".bias")
        return out if bias is None else g.lib.ggml_add(g.ctx, out, bias)

    def _attention(self, g: Builder, w: dict, st: dict, il: int, x: Tensor) -> Tensor:
        p, b = self.p, f"blk.{il}."
        hd, nkv = p.head_dim, p.n_head_kv
        if b + _QKV in w:  # one product (no biases then): Q, K and V are parts of its rows
            rows = {"attn_q": hd * p.n_head, "attn_k": hd * nkv, "attn_v": hd * nkv}
            y = g.products(w, x, b, rows, {_QKV: _QKV_PARTS}, copy=False)
            q, k, v = (y[m] for m in _QKV_PARTS)
        else:
            q, k, v = (self._proj(g, w, b + m, x) for m in _QKV_PARTS)
        q, k, v = (g.heads(t, hd) for t in (q, k, v))  # [hd, heads, T] views
        q, k = self._rope(g, w, q), self._rope(g, w, k)
        cache = self.kv_state(il)
        scale = p.attn_scale or 1.0 / math.sqrt(hd)
        out = g.cached_attention(cache, st, q, k, v, scale, self.options.flash_attn)
        return self._proj(g, w, b + "attn_output", out)  # [n_embd, T]

    def _rope(self, g: Builder, w: dict, t: Tensor) -> Tensor:
        p = self.p
        factors = w.get("rope_freqs.weight", ffi.NULL)
        return g.lib.ggml_rope_ext(
            g.ctx,
            t,
            g.inputs["pos"],
            factors,
            p.rope_dim,
            ROPE_NORMAL,
            p.n_ctx_train,
            p.rope_theta,
            p.rope_freq_scale,
            0.0,  # ext_factor: no YaRN
            1.0,
            32.0,
            1.0,
        )
