"""Laguna (poolside; GGUF ``laguna``: Laguna XS.2, M.1): attention with query heads per layer,
q/k RMS norms and a softplus output gate (one per head or one per element), leading dense layers,
then a mixture of experts with sigmoid routing and one always-on shared expert.

The math follows ``src/models/laguna.cpp``, ``build_moe_ffn`` and ``build_attn`` in
``src/llama-graph.cpp``, and the hyperparameter loading of ``src/llama-model.cpp`` and
``src/llama-context.cpp`` of the pinned llama.cpp (0c1e57098). Shapes are in ggml order (see
``models/base.py``).

- Routing: the top k of ``sigmoid(router) + exp_probs_b`` (the bias only chooses), weighted by the
  unbiased sigmoids, normalised to sum to one (``expert_weights_norm``) and scaled
  (``expert_weights_scale``); ``models/moe.route_sigmoid``.
- Sliding-window layers (XS.2) exist only when the file gives ``attention.sliding_window``. Which
  layers slide comes from ``attention.sliding_window_pattern`` (per-layer flags, or a period n:
  layer il slides unless ``il % n == 0``). The pinned converter writes no pattern; llama.cpp then
  assumes XS.2's period 4 (full attention at layers 0, 4, 8, ...), and so does lucepy. Sliding
  layers keep a ``RingKVCache`` (as gemma4's) and run plain RoPE with their own dims and base;
  full layers run the file's RoPE scaling (YaRN on XS.2).
- llama.cpp reads none of the ``rope.scaling.yarn_*`` keys the converter may write (beta_fast,
  beta_slow, ext_factor, attn_factor) for laguna: beta 32/1 always, and the magnitude factor that
  llama_context derives from the scaling factor (times the generic ``rope.scaling.attn_factor``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

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
)
from lucepy.models.builder import Builder, Tensor
from lucepy.models.sliding import SlidingWindow
from lucepy.models.state import LayerState

ROPE_NEOX = 2  # LLAMA_ROPE_TYPE_NEOX
SWA_PERIOD = 4  # llama.cpp's assumption without a pattern key: XS.2's (full at il % 4 == 0)
GATING_SIGMOID = 2  # LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID, laguna's default when the key is absent
_MATMULS = ("attn_q", "attn_k", "attn_v", "attn_output", "attn_gate", "ffn_gate", "ffn_up")
_MATMULS += ("ffn_down", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
_MATMULS += ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
# products of the attention input that the loader stacks into one (Architecture.stacked), the
# first that fits: Q, K, V and the output gate, or Q, K and V
_STACKS = {
    "attn_qkvg.stacked": ("attn_q", "attn_k", "attn_v", "attn_gate"),
    "attn_qkv.stacked": ("attn_q", "attn_k", "attn_v"),
}


@dataclass(frozen=True)
class Rope:
    """One layer kind's RoPE: rotated dims and ``ggml_rope_ext``'s arguments after ``mode``."""

    dims: int
    n_ctx_orig: int
    theta: float
    freq_scale: float = 1.0
    ext_factor: float = 0.0  # 1: YaRN
    attn_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    def args(self) -> tuple:
        return (
            self.n_ctx_orig, self.theta, self.freq_scale, self.ext_factor, self.attn_factor,
            self.beta_fast, self.beta_slow,
        )  # fmt: skip


@dataclass(frozen=True)
class Params(DecoderParams):
    """``n_head`` and ``n_head_kv`` are the largest; the per-layer tuples are what layers use."""

    heads: tuple[int, ...]  # query heads per layer
    heads_kv: tuple[int, ...]
    gate_per_head: tuple[bool, ...]  # per layer: one gate per head (XS.2) or per element (M.1)
    swa: tuple[bool, ...]  # per layer: sliding window (True) or full attention
    window: int  # 0: no sliding layers
    rope_full: Rope
    rope_swa: Rope
    n_dense: int  # the first n_dense layers have a dense FFN, the rest experts
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff_shexp: int
    expert_norm: bool  # the chosen weights normalised to sum to one
    expert_scale: float  # then times this (0 or 1: unscaled)

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> Params:
        key = metadata(f)
        n_layer = int(key("block_count"))
        common = DecoderParams.common(f, n_layer)

        def per_layer(name: str, default: object = ...) -> tuple[int, ...]:
            value = key(name, default)
            values = list(value) if isinstance(value, list | tuple) else [value] * n_layer
            if len(values) != n_layer:
                raise ConfigError(f"{f.path}: {name} has {len(values)} values for {n_layer} layers")
            return tuple(int(v) for v in values)

        if int(key("attention.value_length", common["head_dim"])) != common["head_dim"]:
            raise ConfigError(f"{f.path}: laguna needs equal key and value head sizes")
        heads = per_layer("attention.head_count")
        window = int(key("attention.sliding_window", 0))
        return cls(
            **common,
            heads=heads,
            heads_kv=per_layer("attention.head_count_kv", heads),
            gate_per_head=_gates(f, heads, common["head_dim"]),
            swa=_sliding(key, n_layer, window),
            window=window,
            rope_full=_full_rope(key, common),
            rope_swa=Rope(
                int(key("rope.dimension_count_swa", common["rope_dim"])),
                common["n_ctx_train"],
                float(key("rope.freq_base_swa", common["rope_theta"])),
                beta_fast=0.0,  # plain RoPE, as laguna.cpp passes it
                beta_slow=0.0,
            ),
            n_dense=int(key("leading_dense_block_count")),
            **_experts(f, key),
        )


def _experts(f: GGUFFile, key) -> dict:
    """The MoE fields, with llama.cpp's defaults: sigmoid gating, and a shared expert as wide as
    ``expert_shared_count`` routed ones when its own width is missing."""
    gating = int(key("expert_gating_func", 0) or GATING_SIGMOID)
    if gating != GATING_SIGMOID:
        raise ConfigError(f"{f.path}: expert gating function {gating}; laguna runs sigmoid (2)")
    ff = int(key("expert_feed_forward_length"))
    return {
        "n_expert": int(key("expert_count")),
        "n_expert_used": int(key("expert_used_count")),
        "n_ff_exp": ff,
        "n_ff_shexp": int(key("expert_shared_feed_forward_length", 0))
        or ff * int(key("expert_shared_count", 1)),
        "expert_norm": bool(key("expert_weights_norm", False)),
        "expert_scale": float(key("expert_weights_scale", 0.0)),
    }


def _gates(f: GGUFFile, heads: tuple[int, ...], head_dim: int) -> tuple[bool, ...]:
    """Per layer, whether ``attn_gate`` has one row per head (else one per element): llama.cpp
    tells the two apart by the tensor's width, and so must we."""
    out = []
    for il, nh in enumerate(heads):
        info = f.tensors.get(f"blk.{il}.attn_gate.weight")
        width = nh if info is None else int(info.shape[1])  # missing: check_tensors says so
        if width not in (nh, nh * head_dim):
            raise ConfigError(
                f"{f.path}: blk.{il}.attn_gate.weight is {width} wide; a laguna gate is {nh} "
                f"(per head) or {nh * head_dim} (per element)"
            )
        out.append(width == nh)
    return tuple(out)


def _sliding(key, n_layer: int, window: int) -> tuple[bool, ...]:
    """Which layers slide: none without a window; else the pattern's flags, or its period
    (llama.cpp's ``set_swa_pattern`` with the full layer first), 4 when the file has none."""
    if window <= 0:
        return (False,) * n_layer
    pattern = key("attention.sliding_window_pattern", SWA_PERIOD)
    if isinstance(pattern, list | tuple):  # layers past the list attend fully, as in llama.cpp
        flags = [bool(x) for x in list(pattern)[:n_layer]]
        return tuple(flags + [False] * (n_layer - len(flags)))
    n = int(pattern)
    return tuple(n == 0 or il % n != 0 for il in range(n_layer))


def _full_rope(key, common: dict) -> Rope:
    """The full layers' RoPE from the file's scaling keys, with llama_context's YaRN magnitude
    (``cparams.yarn_attn_factor``), computed in f32 as there."""
    kind = str(key("rope.scaling.type", "linear"))  # llama.cpp's default when the key is absent
    if kind not in ("none", "linear", "yarn"):
        raise ConfigError(f"rope scaling {kind!r} is not supported for laguna")
    factor = float(key("rope.scaling.factor", key("rope.scale_linear", 0.0)) or 0.0)
    f32 = np.float32
    freq_scale = f32(1.0) if kind == "none" or factor == 0.0 else f32(1.0) / f32(factor)
    attn = f32(1.0)
    if kind == "yarn":
        s = f32(1.0) / freq_scale
        mscale = f32(1.0) if s <= 1.0 else f32(0.1) * np.log(s) + f32(1.0)
        attn = mscale * (f32(1.0) / (f32(1.0) + f32(0.1) * np.log(s)))
    attn *= f32(key("rope.scaling.attn_factor", 1.0))
    return Rope(
        common["rope_dim"],
        int(key("rope.scaling.original_context_length", common["n_ctx_train"])),
        common["rope_theta"],
        float(freq_scale),
        1.0 if kind == "yarn" else 0.0,
        float(attn),
    )


class Laguna(SlidingWindow, Architecture):
    gguf_name = "laguna"

    def __init__(self, params: Params, options: ModelOptions = ModelOptions()):  # noqa: B008
        self.p, self.options = params, options

    @classmethod
    def from_gguf(cls, f: GGUFFile, options: ModelOptions = ModelOptions()) -> Laguna:  # noqa: B008
        p = Params.from_gguf(f)
        if not 0 < p.n_expert_used <= p.n_expert:
            raise ConfigError(f"{f.path}: {p.n_expert_used} of {p.n_expert} experts per token")
        bad = [il for il in range(p.n_layer) if p.heads[il] % p.heads_kv[il]]
        if bad:
            raise ConfigError(f"{f.path}: layer {bad[0]}'s query heads are no multiple of its KV's")
        model = cls(p, options)
        check_tensors(f, model.weight_shapes(range(p.n_layer), f))
        return model

    # what a layer range owns
    def weight_shapes(self, layers: range, f: GGUFFile | None = None) -> dict[str, tuple]:
        out = self.end_shapes(layers, f)
        for il in layers:
            out.update(self._layer_shapes(il))
        return out

    def _layer_shapes(self, il: int) -> dict[str, tuple]:
        p, b = self.p, f"blk.{il}."
        E, hd, nh, nkv = p.n_embd, p.head_dim, p.heads[il], p.heads_kv[il]
        out = {
            b + "attn_norm.weight": (E,),
            b + "attn_q.weight": (E, hd * nh),
            b + "attn_k.weight": (E, hd * nkv),
            b + "attn_v.weight": (E, hd * nkv),
            b + "attn_output.weight": (hd * nh, E),
            b + "attn_q_norm.weight": (hd,),
            b + "attn_k_norm.weight": (hd,),
            b + "attn_gate.weight": (E, nh if p.gate_per_head[il] else hd * nh),
            b + "ffn_norm.weight": (E,),
        }
        if il < p.n_dense:
            return out | {
                b + "ffn_gate.weight": (E, p.n_ff),
                b + "ffn_up.weight": (E, p.n_ff),
                b + "ffn_down.weight": (p.n_ff, E),
            }
        X, ff, sh = p.n_expert, p.n_ff_exp, p.n_ff_shexp
        return out | {
            b + "ffn_gate_inp.weight": (E, X),
            b + "exp_probs_b.bias": (X,),
            b + "ffn_gate_exps.weight": (E, ff, X),
            b + "ffn_up_exps.weight": (E, ff, X),
            b + "ffn_down_exps.weight": (ff, E, X),
            b + "ffn_gate_shexp.weight": (E, sh),
            b + "ffn_up_shexp.weight": (E, sh),
            b + "ffn_down_shexp.weight": (sh, E),
        }

    def matmul_weights(self, layers: range, f: GGUFFile) -> dict[str, str | tuple[str, ...]]:
        out = {
            n: n
            for n in self.weight_shapes(layers, f)
            if n.startswith("blk.") and n.endswith(".weight") and n.split(".")[2] in _MATMULS
        }
        return self.stack_all(f, layers, _STACKS, out) | self.head_matmul(layers, f)

    def make_state(self, layers: range, n_ctx: int) -> list[LayerState]:
        """Per layer: a ring of the window plus the longest step (sliding), or the context."""
        p = self.p
        return [
            self.options.kv_cache(
                il, p.head_dim, p.heads_kv[il], n_ctx, p.window if p.swa[il] else 0
            )
            for il in layers
        ]

    def memory_note(self, n_ctx: int) -> str:
        return self.ring_note([il for il in range(self.p.n_layer) if self.p.swa[il]], n_ctx)

    def max_step(self) -> int | None:
        return self.options.max_step if any(self.p.swa) else None

    # graph
    def build(self, g: Builder, w: dict, st: dict, layers: range, spec: GraphSpec) -> Tensor:
        """The forward of ``layers`` for ``spec.n_tokens`` tokens over ``spec.n_kv`` cache rows.
        Inputs: ``tokens`` (first shard) or ``x``, ``pos``, and for full layers ``mask``/``rows``,
        for sliding ones ``mask_swa``/``rows_swa`` (ring rows). Outputs as qwen35's."""
        p, L, c, T = self.p, g.lib, g.ctx, spec.n_tokens
        self.check_step(spec, any(p.swa))
        if layers.start == 0:
            x = L.ggml_get_rows(c, w["token_embd.weight"], g.input_i32("tokens", T))
        else:
            x = g.carried_f32("x", p.n_embd, T)  # [n_embd, T]
        g.input_i32("pos", T)
        self.kv_inputs(g, spec, {p.swa[il] for il in layers})
        for il in layers:
            if il in spec.capture:
                g.output(f"feat.{il}", x)
            x = self._layer(g, w, st, il, x)
        if layers.stop < p.n_layer:
            return x
        if p.n_layer in spec.capture:
            g.output(f"feat.{p.n_layer}", x)
        if spec.logits == "last":
            x = g.last_row(x)
        x = g.rms_norm(x, w["output_norm.weight"], p.rms_eps)
        logits = L.ggml_mul_mat(c, w.get("output.weight", w.get("token_embd.weight")), x)
        g.output("argmax", L.ggml_argmax(c, logits))  # [T or 1] i32
        return logits  # [n_vocab, T or 1]

    def _layer(self, g: Builder, w: dict, st: dict, il: int, x: Tensor) -> Tensor:
        """Pre-norm attention and FFN, each added to the residual (no post norms)."""
        p, L, c, b = self.p, g.lib, g.ctx, f"blk.{il}."
        h = self._attention(g, w, st, il, g.rms_norm(x, w[b + "attn_norm.weight"], p.rms_eps))
        x = L.ggml_add(c, h, x)
        h = g.rms_norm(x, w[b + "ffn_norm.weight"], p.rms_eps)
        return L.ggml_add(c, self._ffn(g, w, il, h), x)

    def _ffn(self, g: Builder, w: dict, il: int, x: Tensor) -> Tensor:
        """A dense SwiGLU (leading layers), or the routed experts plus the shared expert."""
        p, L, c, b = self.p, g.lib, g.ctx, f"blk.{il}."
        if il < p.n_dense:
            return g.swiglu_ffn(
                x, w[b + "ffn_gate.weight"], w[b + "ffn_up.weight"], w[b + "ffn_down.weight"]
            )
        logits = L.ggml_mul_mat(c, w[b + "ffn_gate_inp.weight"], x)  # [n_expert, T]
        bias = w[b + "exp_probs_b.bias"]
        r = moe.route_sigmoid(
            g, logits, p.n_expert_used, bias, norm=p.expert_norm, scale=p.expert_scale, layer=il
        )
        routed = moe.layer_experts(g, w, b, x, r)
        shared = g.swiglu_ffn(
            x, w[b + "ffn_gate_shexp.weight"], w[b + "ffn_up_shexp.weight"],
            w[b + "ffn_down_shexp.weight"],
        )  # fmt: skip
        return L.ggml_add(c, routed, shared)

    def _attention(self, g: Builder, w: dict, st: dict, il: int, x: Tensor) -> Tensor:
        p, L, c, b, T = self.p, g.lib, g.ctx, f"blk.{il}.", x.ne[1]
        hd, nh, nkv = p.head_dim, p.heads[il], p.heads_kv[il]
        rows = {"attn_q": hd * nh, "attn_k": hd * nkv, "attn_v": hd * nkv}
        rows["attn_gate"] = nh if p.gate_per_head[il] else hd * nh
        y = g.products(w, x, b, rows, _STACKS)
        q = L.ggml_reshape_3d(c, y["attn_q"], hd, nh, T)
        k = L.ggml_reshape_3d(c, y["attn_k"], hd, nkv, T)
        v = L.ggml_reshape_3d(c, y["attn_v"], hd, nkv, T)
        gate = y["attn_gate"]  # [nh or hd*nh, T]: from the input
        q = self._rope(g, g.rms_norm(q, w[b + "attn_q_norm.weight"], p.rms_eps), il)
        k = self._rope(g, g.rms_norm(k, w[b + "attn_k_norm.weight"], p.rms_eps), il)
        cache, scale, flash = self.kv_state(il), 1.0 / math.sqrt(hd), self.options.flash_attn
        if p.swa[il]:
            mask = g.inputs["mask_swa"]
            views = g.write_kv(cache, st, k, v, g.inputs["rows_swa"], mask.ne[0])
            out = g.attend_kv(cache, q, views, mask, scale, flash)  # [hd*nh, T]
        else:
            out = g.cached_attention(cache, st, q, k, v, scale, flash)
        gate = L.ggml_softplus(c, gate)
        if p.gate_per_head[il]:  # one gate per head, broadcast over the head's elements
            out = L.ggml_mul(
                c, L.ggml_reshape_3d(c, out, hd, nh, T), L.ggml_reshape_3d(c, gate, 1, nh, T)
            )
            out = L.ggml_reshape_2d(c, out, hd * nh, T)
        else:
            out = L.ggml_mul(c, out, gate)
        return L.ggml_mul_mat(c, w[b + "attn_output.weight"], out)  # [n_embd, T]

    def _rope(self, g: Builder, t: Tensor, il: int) -> Tensor:
        r = self.p.rope_swa if self.p.swa[il] else self.p.rope_full
        return g.lib.ggml_rope_ext(
            g.ctx, t, g.inputs["pos"], ffi.NULL, r.dims, ROPE_NEOX, *r.args()
        )
