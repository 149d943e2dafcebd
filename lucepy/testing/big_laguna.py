"""Laguna-XS.2's shapes for a real-size random-weight GGUF, its router skewed as qwen35moe's
(``big_layouts.py``); ``big.py`` writes it."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import gguf
import numpy as np

from lucepy.testing.big_layouts import Layout, MoeSpec, router_values, stored_layout
from lucepy.testing.tiny import TensorPlan, add_decoder_hparams


@dataclass(frozen=True)
class LagunaSpec:
    """Laguna-XS.2's text decoder. From transformers' ``LagunaConfig`` defaults (its docstring
    names poolside/laguna-XS.2): vocabulary 100352, hidden 2048, 40 layers, the first dense (FFN
    8192), 8 KV heads of 128, window 512, a per-head gate, 256 experts of 512 (top 8) plus a
    shared one of 512, routed scale 1, RMS eps 1e-6, context 131072, untied; RoPE base 5e5 on
    half of a full layer's head (64 dims), 1e4 on all 128 of a sliding one. From the pinned
    llama.cpp (``src/models/laguna.cpp``): 48 query heads on full layers and 64 on sliding ones
    (so the total is 33.4B, the published count; the other way round it would be 33.3B), full
    attention at every 4th layer from 0, and YaRN on the full layers. Assumed, since neither
    gives it: YaRN's factor 32 over 4096 positions (131072 in all); it changes no shape or
    cost. The score-correction bias is small and random (trained ones are not zero)."""

    n_vocab: int = 100352
    n_embd: int = 2048
    n_layer: int = 40
    n_ff: int = 8192  # the dense layers'
    heads_full: int = 48
    heads_swa: int = 64
    n_head_kv: int = 8
    head_dim: int = 128
    window: int = 512
    full_every: int = 4  # layer il is full attention iff il % full_every == 0
    n_dense: int = 1
    rope_theta: float = 5e5
    rope_dim: int = 64
    rope_theta_swa: float = 1e4
    yarn_factor: float = 32.0
    yarn_orig_ctx: int = 4096
    rms_eps: float = 1e-6
    context_length: int = 131072
    weight_type: str = "q4_0"
    seed: int = 0

    def is_full(self, il: int) -> bool:
        return il % self.full_every == 0

    @property
    def n_head(self) -> tuple[int, ...]:
        """Query heads per layer (``add_decoder_hparams`` writes them as ``head_count``)."""
        heads = (self.heads_swa, self.heads_full)
        return tuple(heads[self.is_full(il)] for il in range(self.n_layer))


def laguna_xs2(
    weight_type: str = "q4_0", n_layer: int = 40, zipf: float = 0.3, **overrides: object
) -> tuple[LagunaSpec, MoeSpec]:
    spec = LagunaSpec(weight_type=weight_type, n_layer=n_layer)
    return dataclasses.replace(spec, **overrides), MoeSpec(zipf=zipf)


def _laguna_plans(s: LagunaSpec, moe: MoeSpec) -> list[TensorPlan]:
    E, hd, X, ff, sh = s.n_embd, s.head_dim, moe.n_expert, moe.n_ff_exp, moe.n_ff_shexp

    def dense(name: str, ne: tuple[int, ...]) -> TensorPlan:
        return TensorPlan(name, ne, "dense", 1 / math.sqrt(ne[0]))

    plans = [TensorPlan("token_embd.weight", (E, s.n_vocab), "dense", 1.0)]
    for il, nh in enumerate(s.n_head):
        b = f"blk.{il}."
        plans += [
            TensorPlan(b + "attn_norm.weight", (E,), "norm", 0.05),
            dense(b + "attn_q.weight", (E, hd * nh)),
            dense(b + "attn_k.weight", (E, hd * s.n_head_kv)),
            dense(b + "attn_v.weight", (E, hd * s.n_head_kv)),
            dense(b + "attn_output.weight", (hd * nh, E)),
            TensorPlan(b + "attn_q_norm.weight", (hd,), "norm", 0.05),
            TensorPlan(b + "attn_k_norm.weight", (hd,), "norm", 0.05),
            dense(b + "attn_gate.weight", (E, nh)),
            TensorPlan(b + "ffn_norm.weight", (E,), "norm", 0.05),
        ]
        if il < s.n_dense:
            plans += [dense(b + f"ffn_{n}.weight", (E, s.n_ff)) for n in ("gate", "up")]
            plans.append(dense(b + "ffn_down.weight", (s.n_ff, E)))
            continue
        plans += [
            TensorPlan(b + "ffn_gate_inp.weight", (E, X), "router", 1 / math.sqrt(E)),
            TensorPlan(b + "exp_probs_b.bias", (X,), "bias", 0.02),
            dense(b + "ffn_gate_exps.weight", (E, ff, X)),
            dense(b + "ffn_up_exps.weight", (E, ff, X)),
            dense(b + "ffn_down_exps.weight", (ff, E, X)),
            dense(b + "ffn_gate_shexp.weight", (E, sh)),
            dense(b + "ffn_up_shexp.weight", (E, sh)),
            dense(b + "ffn_down_shexp.weight", (sh, E)),
        ]
    return [
        *plans,
        TensorPlan("output_norm.weight", (E,), "norm", 0.05),
        dense("output.weight", (E, s.n_vocab)),
    ]


def _laguna_values(s: LagunaSpec, moe: MoeSpec, t: TensorPlan, index: int) -> np.ndarray:
    if t.init == "router":
        return router_values(t, moe, s.seed, index)
    rng = np.random.default_rng([s.seed, index])
    x = rng.uniform(-1.0, 1.0, t.shape).astype(np.float32) * np.float32(t.std * math.sqrt(3))
    return x + np.float32(1.0) if t.init == "norm" else x


def _laguna_hparams(w: gguf.GGUFWriter, s: LagunaSpec, moe: MoeSpec, n_params: int) -> None:
    """What the pinned converter writes for Laguna (``conversion/laguna.py``): no sliding-window
    pattern, so llama.cpp and lucepy assume the period 4."""
    add_decoder_hparams(w, f"lucepy random laguna {n_params / 1e9:.1f}B", s)
    w.add_head_count_kv(s.n_head_kv)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_layer_norm_rms_eps(s.rms_eps)
    w.add_sliding_window(s.window)
    w.add_rope_dimension_count(s.rope_dim)
    w.add_rope_dimension_count_swa(s.head_dim)
    w.add_rope_freq_base(s.rope_theta)
    w.add_rope_freq_base_swa(s.rope_theta_swa)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(s.yarn_factor)
    w.add_rope_scaling_orig_ctx_len(s.yarn_orig_ctx)
    w.add_leading_dense_block_count(s.n_dense)
    w.add_expert_count(moe.n_expert)
    w.add_expert_used_count(moe.n_expert_used)
    w.add_expert_feed_forward_length(moe.n_ff_exp)
    w.add_expert_shared_feed_forward_length(moe.n_ff_shexp)
    w.add_expert_weights_norm(True)
    w.add_expert_weights_scale(1.0)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)


def laguna_layout(spec: LagunaSpec, moe: MoeSpec) -> Layout:
    """Routers (``ffn_gate_inp``) and the selection bias in f32, as llama.cpp's quantize leaves
    them; the per-head gate quantized like any matmul weight."""
    return stored_layout(
        "laguna", spec, _laguna_plans(spec, moe), "output.weight",
        lambda w, n_params: _laguna_hparams(w, spec, moe, n_params),
        lambda t, i: _laguna_values(spec, moe, t, i),
    )  # fmt: skip
