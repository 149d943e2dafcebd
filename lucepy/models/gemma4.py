"""Gemma 4 (GGUF ``gemma4``): sliding-window and full attention layers with their own head sizes,
KV shared by the last layers, per-layer embeddings, GeGLU MLPs (double wide where sharing), an
optional MoE beside the MLP, and a final logit softcap.

The math follows ``src/models/gemma4.cpp``, ``build_moe_ffn`` and ``build_attn`` in
``src/llama-graph.cpp`` of the pinned llama.cpp (0c1e57098). Every feature is read from the
GGUF's metadata and tensors. Shapes are in ggml order (see ``models/base.py``).

Where the state lives:
- full layers keep a KV cache of the whole context; sliding layers a ring of the window plus the
  longest step (``RingKVCache``), so their memory does not grow with the context;
- the last ``shared_kv_layers`` layers keep nothing: each attends over the cache of the last
  earlier layer of its own kind (sliding or full), written in the same graph. ``split_points``
  keeps them on that layer's shard.

Between shards the activation carries the per-layer inputs of the layers still to come after the
residual stream: [n_embd + n_embd_per_layer * (n_layer - stop), T].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lucepy.errors import ConfigError
from lucepy.ggml import ffi
from lucepy.gguf import GGUFFile
from lucepy.models import moe
from lucepy.models.base import (
    Architecture,
    DecoderParams,
    GraphSpec,
    ModelOptions,
    check_tensors,
    metadata,
    rope_args,
)
from lucepy.models.builder import Builder, Tensor
from lucepy.models.sliding import SlidingWindow
from lucepy.models.state import KVCache, LayerState

ROPE_NEOX = 2  # LLAMA_ROPE_TYPE_NEOX: rotate the two halves of each head
_MATMULS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
_MATMULS += ("inp_gate", "proj", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
_MATMULS += ("ffn_gate_up_exps",)


@dataclass(frozen=True)
class Params(DecoderParams):
    """``head_dim`` and ``rope_dim`` are the full layers', ``n_head_kv`` and ``n_ff`` the
    largest; the per-layer tuples and ``head(il)`` are what each layer uses."""

    swa: tuple[bool, ...]  # per layer: sliding window (True) or full attention
    window: int
    head_dim_swa: int
    rope_dim_swa: int
    rope_theta_swa: float
    heads_kv: tuple[int, ...]  # per layer
    ffs: tuple[int, ...]  # per layer
    n_kv_shared: int  # the last this many layers reuse an earlier layer's KV
    n_embd_per_layer: int  # 0: no per-layer embeddings
    softcap: float  # 0: none
    n_expert: int
    n_expert_used: int
    n_ff_exp: int

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> Params:
        key = metadata(f)
        n_layer = int(key("block_count"))

        def per_layer(name: str, default: object = ...) -> tuple[int, ...]:
            value = key(name, default)
            values = list(value) if isinstance(value, list | tuple) else [value] * n_layer
            if len(values) != n_layer:
                raise ConfigError(f"{f.path}: {name} has {len(values)} values for {n_layer} layers")
            return tuple(int(v) for v in values)

        common = DecoderParams.common(f, n_layer)
        head_dim = int(key("attention.key_length"))
        if int(key("attention.value_length", head_dim)) != head_dim:
            raise ConfigError(f"{f.path}: gemma4 needs equal key and value head sizes")
        head_dim_swa = int(key("attention.key_length_swa"))
        return cls(
            **common,
            swa=tuple(bool(x) for x in per_layer("attention.sliding_window_pattern")),
            window=int(key("attention.sliding_window")),
            head_dim_swa=head_dim_swa,
            rope_dim_swa=int(key("rope.dimension_count_swa", head_dim_swa)),
            rope_theta_swa=float(key("rope.freq_base_swa", key("rope.freq_base", 10000.0))),
            heads_kv=per_layer("attention.head_count_kv", common["n_head"]),
            ffs=per_layer("feed_forward_length"),
            n_kv_shared=int(key("attention.shared_kv_layers", 0)),
            n_embd_per_layer=int(key("embedding_length_per_layer_input", 0)),
            softcap=float(key("final_logit_softcapping", 0.0) or 0.0),
            n_expert=int(key("expert_count", 0)),
            n_expert_used=int(key("expert_used_count", 0)),
            n_ff_exp=int(key("expert_feed_forward_length", 0)),
        )

    def head(self, il: int) -> int:
        return self.head_dim_swa if self.swa[il] else self.head_dim

    @property
    def first_shared(self) -> int:
        return self.n_layer - self.n_kv_shared

    def kv_source(self, il: int) -> int:
        """The layer whose KV layer ``il`` attends over: itself, or for a sharing layer the last
        layer before the sharing ones of the same kind (sliding or full)."""
        if il < self.first_shared:
            return il
        for src in range(self.first_shared - 1, -1, -1):
            if self.swa[src] == self.swa[il]:
                return src
        raise ConfigError(f"shared-KV layer {il} has no earlier layer of its kind to read")


class Gemma4(SlidingWindow, Architecture):
    gguf_name = "gemma4"

    def __init__(self, params: Params, options: ModelOptions, present: frozenset[str]):
        self.p, self.options = params, options
        self.present = present  # optional tensors the file has (attn_v, output scales, ...)

    @classmethod
    def from_gguf(cls, f: GGUFFile, options: ModelOptions = ModelOptions()) -> Gemma4:  # noqa: B008
        p = Params.from_gguf(f)
        if p.first_shared < 1:
            raise ConfigError(f"{f.path}: {p.n_kv_shared} shared-KV layers of {p.n_layer}")
        for il in range(p.first_shared, p.n_layer):
            p.kv_source(il)  # each sharing layer has a source of its kind, or a ConfigError
        if p.n_expert and not 0 < p.n_expert_used <= p.n_expert:
            raise ConfigError(f"{f.path}: {p.n_expert_used} of {p.n_expert} experts per token")
        optional = set()
        for il in range(p.n_layer):
            b = f"blk.{il}."
            optional |= {b + "attn_v.weight", b + "layer_output_scale.weight"}
            optional |= {b + "ffn_down_exps.scale", b + "ffn_gate_up_exps.weight"}
        model = cls(p, options, frozenset(n for n in optional if n in f.tensors))
        check_tensors(f, model.weight_shapes(range(p.n_layer), f))
        return model

    # what a layer range owns
    def weight_shapes(self, layers: range, f: GGUFFile | None = None) -> dict[str, tuple]:
        p, out = self.p, self.end_shapes(layers, f)
        pl = p.n_embd_per_layer
        if layers.start == 0 and pl:
            out["per_layer_token_embd.weight"] = (pl * p.n_layer, p.n_vocab)
            out["per_layer_model_proj.weight"] = (p.n_embd, pl * p.n_layer)
            out["per_layer_proj_norm.weight"] = (pl,)
        if any(not p.swa[il] for il in layers):
            out["rope_freqs.weight"] = (p.head_dim // 2,)
        for il in layers:
            out.update(self._layer_shapes(il))
        return out

    def _layer_shapes(self, il: int) -> dict[str, tuple]:
        p, b = self.p, f"blk.{il}."
        E, hd, nkv = p.n_embd, p.head(il), p.heads_kv[il]
        out = {
            b + "attn_norm.weight": (E,),
            b + "attn_q.weight": (E, hd * p.n_head),
            b + "attn_q_norm.weight": (hd,),
            b + "attn_output.weight": (hd * p.n_head, E),
            b + "post_attention_norm.weight": (E,),
            b + "ffn_norm.weight": (E,),
            b + "ffn_gate.weight": (E, p.ffs[il]),
            b + "ffn_up.weight": (E, p.ffs[il]),
            b + "ffn_down.weight": (p.ffs[il], E),
            b + "post_ffw_norm.weight": (E,),
        }
        if il < p.first_shared:
            out[b + "attn_k.weight"] = (E, hd * nkv)
            out[b + "attn_k_norm.weight"] = (hd,)
        if b + "attn_v.weight" in self.present:
            out[b + "attn_v.weight"] = (E, hd * nkv)
        if b + "layer_output_scale.weight" in self.present:
            out[b + "layer_output_scale.weight"] = (1,)
        if p.n_embd_per_layer:
            pl = p.n_embd_per_layer
            out[b + "inp_gate.weight"] = (E, pl)
            out[b + "proj.weight"] = (pl, E)
            out[b + "post_norm.weight"] = (E,)
        if p.n_expert:
            X, ff = p.n_expert, p.n_ff_exp
            out[b + "ffn_gate_inp.weight"] = (E, X)
            out[b + "ffn_gate_inp.scale"] = (E,)
            for norm in ("pre_ffw_norm_2", "post_ffw_norm_1", "post_ffw_norm_2"):
                out[f"{b}{norm}.weight"] = (E,)
            if b + "ffn_gate_up_exps.weight" in self.present:
                out[b + "ffn_gate_up_exps.weight"] = (E, 2 * ff, X)
            else:
                out[b + "ffn_gate_exps.weight"] = (E, ff, X)
                out[b + "ffn_up_exps.weight"] = (E, ff, X)
            out[b + "ffn_down_exps.weight"] = (ff, E, X)
            if b + "ffn_down_exps.scale" in self.present:
                out[b + "ffn_down_exps.scale"] = (X,)
        return out

    def matmul_weights(self, layers: range, f: GGUFFile) -> dict[str, str]:
        names = self.weight_shapes(layers, f)
        out = {
            n: n
            for n in names
            if n.startswith("blk.") and n.endswith(".weight") and n.split(".")[2] in _MATMULS
        }
        if "per_layer_model_proj.weight" in names:
            out["per_layer_model_proj.weight"] = "per_layer_model_proj.weight"
        return out | self.head_matmul(layers, f)

    def make_state(self, layers: range, n_ctx: int) -> list[LayerState]:
        """Per layer that owns KV: a ring (sliding) or a whole-context cache (full)."""
        p = self.p
        return [
            self.options.kv_cache(
                il, p.head(il), p.heads_kv[il], n_ctx, p.window if p.swa[il] else 0
            )
            for il in layers
            if il < p.first_shared
        ]

    def split_points(self) -> list[int]:
        """Boundaries that keep every sharing layer on the shard of the layer it reads."""
        p = self.p
        return [
            b
            for b in range(1, p.n_layer)
            if not any(p.kv_source(s) < b <= s for s in range(p.first_shared, p.n_layer))
        ]

    def split_reason(self) -> str:
        p = self.p
        pairs = ", ".join(f"{s}<-{p.kv_source(s)}" for s in range(p.first_shared, p.n_layer))
        return f"shared-KV layers stay with the layer whose KV they read ({pairs})"

    def memory_note(self, n_ctx: int) -> str:
        p = self.p
        return self.ring_note([il for il in range(p.first_shared) if p.swa[il]], n_ctx)

    def max_step(self) -> int:
        return self.options.max_step

    # graph
    def build(self, g: Builder, w: dict, st: dict, layers: range, spec: GraphSpec) -> Tensor:
        """The forward of ``layers`` for ``spec.n_tokens`` tokens over ``spec.n_kv`` cache rows.
        Inputs: ``tokens`` (first shard) or ``x`` (the residual and the per-layer inputs still
        to come), ``pos``, and for full layers ``mask``/``rows``, for sliding ones
        ``mask_swa``/``rows_swa`` (ring rows). Outputs as qwen35's."""
        p, L, c, T = self.p, g.lib, g.ctx, spec.n_tokens
        self.check_step(spec, True)
        pl, rest = p.n_embd_per_layer, p.n_layer - layers.start
        if layers.start == 0:
            tokens = g.input_i32("tokens", T)
            x = L.ggml_scale(c, L.ggml_get_rows(c, w["token_embd.weight"], tokens), p.n_embd**0.5)
            per_layer = self._per_layer_inputs(g, w, tokens, x) if pl else None
        else:
            inp = g.carried_f32("x", p.n_embd + pl * rest, T)
            x = L.ggml_cont(c, L.ggml_view_2d(c, inp, p.n_embd, T, inp.nb[1], 0))
            per_layer = None
            if pl:  # [pl, rest, T] after the residual
                off = L.ggml_row_size(inp.type, p.n_embd)
                per_layer = L.ggml_view_3d(c, inp, pl, rest, T, g.row_size(inp, pl), inp.nb[1], off)
        if per_layer is not None:  # [pl, T, rest]: one contiguous slice per layer
            per_layer = L.ggml_cont(c, L.ggml_permute(c, per_layer, 0, 2, 1, 3))
        g.input_i32("pos", T)
        self.kv_inputs(g, spec, {p.swa[p.kv_source(il)] for il in layers})
        kv: dict[int, tuple] = {}  # source layer -> its cache views after this step's write
        for il in layers:
            if il in spec.capture:
                g.output(f"feat.{il}", x)
            inp_l = None
            if per_layer is not None:
                i = il - layers.start
                size = per_layer.nb[2]
                inp_l = L.ggml_view_2d(c, per_layer, pl, T, per_layer.nb[1], i * size)
            x = self._layer(g, w, st, il, x, inp_l, kv)
        if layers.stop < p.n_layer:
            if per_layer is None:
                return x
            left = p.n_layer - layers.stop  # the per-layer inputs of the later shards
            after = L.ggml_view_3d(
                c, per_layer, pl, T, left, per_layer.nb[1], per_layer.nb[2],
                per_layer.nb[2] * (layers.stop - layers.start),
            )  # fmt: skip
            after = L.ggml_cont(c, L.ggml_permute(c, after, 0, 2, 1, 3))  # [pl, left, T]
            return L.ggml_concat(c, x, L.ggml_reshape_2d(c, after, pl * left, T), 0)
        if p.n_layer in spec.capture:
            g.output(f"feat.{p.n_layer}", x)
        if spec.logits == "last":
            x = g.last_row(x)
        x = g.rms_norm(x, w["output_norm.weight"], p.rms_eps)
        logits = L.ggml_mul_mat(c, w.get("output.weight", w.get("token_embd.weight")), x)
        if p.softcap:
            logits = L.ggml_scale(c, logits, 1.0 / p.softcap)
            logits = L.ggml_scale(c, L.ggml_tanh(c, logits), p.softcap)
        g.output("argmax", L.ggml_argmax(c, logits))
        return logits

    def _per_layer_inputs(self, g: Builder, w: dict, tokens: Tensor, x: Tensor) -> Tensor:
        """[pl, n_layer, T]: the per-layer token embedding plus the normed projection of the
        scaled embedding ``x``, halved in variance (llama.cpp's project_per_layer_inputs)."""
        p, L, c, T = self.p, g.lib, g.ctx, x.ne[1]
        pl = p.n_embd_per_layer
        emb = L.ggml_get_rows(c, w["per_layer_token_embd.weight"], tokens)
        emb = L.ggml_scale(c, L.ggml_reshape_3d(c, emb, pl, p.n_layer, T), pl**0.5)
        proj = L.ggml_mul_mat(c, w["per_layer_model_proj.weight"], x)
        proj = L.ggml_scale(c, proj, 1.0 / math.sqrt(p.n_embd))
        proj = g.rms_norm(
            L.ggml_reshape_3d(c, proj, pl, p.n_layer, T), w["per_layer_proj_norm.weight"], p.rms_eps
        )
        return L.ggml_scale(c, L.ggml_add(c, proj, emb), 1.0 / math.sqrt(2.0))

    def _layer(self, g: Builder, w: dict, st: dict, il: int, x, inp_l, kv: dict) -> Tensor:
        p, L, c, b = self.p, g.lib, g.ctx, f"blk.{il}."
        h = g.rms_norm(x, w[b + "attn_norm.weight"], p.rms_eps)
        h = self._attention(g, w, st, il, h, kv)
        h = g.rms_norm(h, w[b + "post_attention_norm.weight"], p.rms_eps)
        x = L.ggml_add(c, h, x)
        h = self._ffn(g, w, b, x)
        if p.n_expert:
            moe = self._moe(g, w, b, x)
            h = L.ggml_add(c, g.rms_norm(h, w[b + "post_ffw_norm_1.weight"], p.rms_eps), moe)
        h = g.rms_norm(h, w[b + "post_ffw_norm.weight"], p.rms_eps)
        x = L.ggml_add(c, h, x)
        if inp_l is not None:
            h = L.ggml_gelu(c, L.ggml_mul_mat(c, w[b + "inp_gate.weight"], x))
            h = L.ggml_mul_mat(c, w[b + "proj.weight"], L.ggml_mul(c, h, inp_l))
            x = L.ggml_add(c, x, g.rms_norm(h, w[b + "post_norm.weight"], p.rms_eps))
        scale = w.get(b + "layer_output_scale.weight")
        return x if scale is None else L.ggml_mul(c, x, scale)

    def _ffn(self, g: Builder, w: dict, b: str, x: Tensor) -> Tensor:
        L, c = g.lib, g.ctx
        h = g.rms_norm(x, w[b + "ffn_norm.weight"], self.p.rms_eps)
        gate = L.ggml_mul_mat(c, w[b + "ffn_gate.weight"], h)
        h = L.ggml_geglu_split(c, gate, L.ggml_mul_mat(c, w[b + "ffn_up.weight"], h))
        return L.ggml_mul_mat(c, w[b + "ffn_down.weight"], h)

    def _moe(self, g: Builder, w: dict, b: str, x: Tensor) -> Tensor:
        """The routed experts beside the MLP: softmax router over the normed, scaled residual,
        top-k experts with weights summing to one, GeGLU experts, the per-expert output scale."""
        p, L, c = self.p, g.lib, g.ctx
        r = L.ggml_scale(c, L.ggml_rms_norm(c, x, p.rms_eps), 1.0 / math.sqrt(p.n_embd))
        r = L.ggml_mul(c, r, w[b + "ffn_gate_inp.scale"])
        logits = L.ggml_mul_mat(c, w[b + "ffn_gate_inp.weight"], r)
        chosen = moe.route(g, logits, p.n_expert_used, layer=int(b.split(".")[1]))
        h = g.rms_norm(x, w[b + "pre_ffw_norm_2.weight"], p.rms_eps)
        out = moe.layer_experts(g, w, b, h, chosen, act="gelu")
        return g.rms_norm(out, w[b + "post_ffw_norm_2.weight"], p.rms_eps)

    def _attention(self, g: Builder, w: dict, st: dict, il: int, x: Tensor, kv: dict) -> Tensor:
        p, L, c, b, T = self.p, g.lib, g.ctx, f"blk.{il}.", x.ne[1]
        hd, nkv, swa = p.head(il), p.heads_kv[il], p.swa[il]
        q = L.ggml_reshape_3d(c, L.ggml_mul_mat(c, w[b + "attn_q.weight"], x), hd, p.n_head, T)
        q = self._rope(g, w, g.rms_norm(q, w[b + "attn_q_norm.weight"], p.rms_eps), il)
        src = p.kv_source(il)
        cache: KVCache = self.kv_state(src)
        mask = g.inputs["mask_swa" if swa else "mask"]
        if src == il:
            k_raw = L.ggml_mul_mat(c, w[b + "attn_k.weight"], x)
            v_w = w.get(b + "attn_v.weight")
            v_raw = k_raw if v_w is None else L.ggml_mul_mat(c, v_w, x)  # V = K without attn_v
            k = g.rms_norm(
                L.ggml_reshape_3d(c, k_raw, hd, nkv, T), w[b + "attn_k_norm.weight"], p.rms_eps
            )
            v = L.ggml_rms_norm(c, L.ggml_reshape_3d(c, v_raw, hd, nkv, T), p.rms_eps)
            k = self._rope(g, w, k, il)
            rows = g.inputs["rows_swa" if swa else "rows"]
            kv[il] = g.write_kv(cache, st, k, v, rows, mask.ne[0])
        elif src not in kv:
            raise ConfigError(f"layer {il} reads the KV of layer {src}, which is on another shard")
        out = g.attend_kv(cache, q, kv[src], mask, 1.0, self.options.flash_attn)
        return L.ggml_mul_mat(c, w[b + "attn_output.weight"], out)

    def _rope(self, g: Builder, w: dict, t: Tensor, il: int) -> Tensor:
        p = self.p
        if p.swa[il]:
            dims, theta, factors = p.rope_dim_swa, p.rope_theta_swa, ffi.NULL
        else:
            dims, theta, factors = p.rope_dim, p.rope_theta, w["rope_freqs.weight"]
        return g.lib.ggml_rope_ext(
            g.ctx, t, g.inputs["pos"], factors, dims, ROPE_NEOX, *rope_args(p.n_ctx_train, theta)
        )
