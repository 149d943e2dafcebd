"""Random-weight GGUFs of real size, written at disk speed: qwen35 with Qwen3.6-27B's shapes,
qwen35moe with Qwen3.6-35B-A3B's (its router skewed), gemma4 with Gemma 4 31B's and laguna with
Laguna-XS.2's (its router skewed too).

A 27B model cannot be quantized from float values in reasonable time, so quantized weights are
written as random blocks: random bytes for the quants, and one f16 scale per block of constant
size and random sign, chosen so that dequantized weights have std ``1 / sqrt(fan_in)`` (as
``tiny.py``'s). Norms and other small tensors stay f32.

Tensor types follow llama.cpp's quantize defaults for the file type (``src/llama-quant.cpp`` at
the pinned commit): a Q4_0 file keeps ``token_embd`` in Q4_0 and stores ``output`` as Q6_K (a
tied embedding, which is also the output, as Q6_K); a Q8_0 file stores both as Q8_0.

    python -m lucepy.testing.big OUT.gguf --arch qwen35|qwen35moe|gemma4|laguna --type q4_0 \\
        [--layers N]
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
from lucepy.testing.encoders import encode
from lucepy.testing.tiny import (
    ARCH,
    WEIGHT_TYPES,
    Qwen35Spec,
    TensorPlan,
    _add_hparams,
    _add_tensor_info,
    add_decoder_hparams,
    param_count,
    plan_tensors,
    tensor_type,
    tensor_values,
)
from lucepy.testing.vocab import SPECIAL_TOKENS, Vocab, _byte_symbols, _learn_merges, add_vocab

CHUNK_BYTES = 32 << 20  # one unit of work for the generator threads
MAX_TOKEN_LEN = 12


@dataclass(frozen=True)
class Layout:
    """What ``write_random`` needs of a model: its tensors in file order with their stored types,
    the metadata, and the float values of the tensors that are not random blocks."""

    arch: str
    n_vocab: int
    weight_type: str  # q4_0 or q8_0
    seed: int
    plans: list[TensorPlan]
    types: list[QType]
    add_hparams: Callable[[gguf.GGUFWriter], None]
    values: Callable[[TensorPlan, int], np.ndarray]  # (plan, index in plans) -> f32 values

    @property
    def n_params(self) -> int:
        return sum(math.prod(t.ne) for t in self.plans)


def qwen36_27b(weight_type: str = "q4_0", n_layer: int = 64, **overrides: object) -> Qwen35Spec:
    """Qwen3.5/3.6-27B's shapes (shared/MODELS.md); fewer layers give a scaled-down variant."""
    base = Qwen35Spec(
        n_vocab=248320, n_embd=5120, n_layer=n_layer, n_ff=17408, n_head=24, n_head_kv=4,
        head_dim=256, rope_dim=64, rope_sections=(11, 11, 10, 0), rope_theta=1e7,
        ssm_conv_kernel=4, ssm_state_size=128, ssm_group_count=16, ssm_time_step_rank=48,
        rms_eps=1e-6, context_length=262144, weight_type=weight_type,
    )  # fmt: skip
    return dataclasses.replace(base, **overrides)


# --- qwen35moe: Qwen3.6-35B-A3B's shapes, with a skewed router ---


@dataclass(frozen=True)
class MoeSpec:
    """The routed experts of a qwen35moe layer. The router's rows are scaled by Zipf weights
    ``(rank + 1) ** -zipf`` in a random order per layer, so that a few experts take most tokens,
    as routing does in real models (0: unskewed)."""

    n_expert: int = 256
    n_expert_used: int = 8
    n_ff_exp: int = 512
    n_ff_shexp: int = 512
    zipf: float = 0.3


def qwen36_35b_a3b(
    weight_type: str = "q4_0", n_layer: int = 40, zipf: float = 0.3, **overrides: object
) -> tuple[Qwen35Spec, MoeSpec]:
    """Qwen3.5/3.6-35B-A3B's shapes (its public configuration)."""
    trunk = Qwen35Spec(
        n_vocab=248320, n_embd=2048, n_layer=n_layer, n_ff=512, n_head=16, n_head_kv=2,
        head_dim=256, rope_dim=64, rope_sections=(11, 11, 10, 0), rope_theta=1e7,
        ssm_conv_kernel=4, ssm_state_size=128, ssm_group_count=16, ssm_time_step_rank=32,
        rms_eps=1e-6, context_length=262144, weight_type=weight_type,
    )  # fmt: skip
    return dataclasses.replace(trunk, **overrides), MoeSpec(zipf=zipf)


def _moe_plans(spec: Qwen35Spec, moe: MoeSpec) -> list[TensorPlan]:
    """qwen35's tensors with each dense FFN replaced by the router, experts and shared expert."""
    E, X, ff, sh = spec.n_embd, moe.n_expert, moe.n_ff_exp, moe.n_ff_shexp
    out = []
    for t in plan_tensors(spec):
        name = t.name
        if not name.endswith(("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")):
            out.append(t)
            continue
        if not name.endswith("ffn_gate.weight"):
            continue
        b = name[: -len("ffn_gate.weight")]
        out += [
            _plan(b + "ffn_gate_inp.weight", (E, X), "router", 1 / math.sqrt(E)),
            _plan(b + "ffn_gate_exps.weight", (E, ff, X), "dense", 1 / math.sqrt(E)),
            _plan(b + "ffn_up_exps.weight", (E, ff, X), "dense", 1 / math.sqrt(E)),
            _plan(b + "ffn_down_exps.weight", (ff, E, X), "dense", 1 / math.sqrt(ff)),
            _plan(b + "ffn_gate_inp_shexp.weight", (E, 1), "router", 1 / math.sqrt(E)),
            _plan(b + "ffn_gate_shexp.weight", (E, sh), "dense", 1 / math.sqrt(E)),
            _plan(b + "ffn_up_shexp.weight", (E, sh), "dense", 1 / math.sqrt(E)),
            _plan(b + "ffn_down_shexp.weight", (sh, E), "dense", 1 / math.sqrt(sh)),
        ]
    return out


def _moe_values(spec: Qwen35Spec, moe: MoeSpec, t: TensorPlan, index: int) -> np.ndarray:
    if t.init != "router":
        return tensor_values(t, spec, index)
    return _router_values(t, moe, spec.seed, index)


def _router_values(t: TensorPlan, moe: MoeSpec, seed: int, index: int) -> np.ndarray:
    """Gaussian router rows [X, E] (or a shared expert's gate [1, E]), the X expert rows scaled
    by ``moe``'s Zipf weights in a random order."""
    rng = np.random.default_rng([seed, index])
    x = rng.standard_normal(t.shape).astype(np.float32) * np.float32(t.std)
    if t.shape[0] == moe.n_expert and moe.zipf:
        weights = (np.arange(moe.n_expert) + 1.0) ** -moe.zipf
        weights /= np.sqrt(np.mean(weights**2))
        x *= weights[rng.permutation(moe.n_expert)][:, None].astype(np.float32)
    return x


def _moe_hparams(w: gguf.GGUFWriter, spec: Qwen35Spec, moe: MoeSpec, n_params: int) -> None:
    _add_hparams(w, spec, name=f"lucepy random qwen35moe {n_params / 1e9:.1f}B")
    w.add_expert_count(moe.n_expert)
    w.add_expert_used_count(moe.n_expert_used)
    w.add_expert_feed_forward_length(moe.n_ff_exp)
    w.add_expert_shared_feed_forward_length(moe.n_ff_shexp)


def qwen35moe_layout(spec: Qwen35Spec, moe: MoeSpec) -> Layout:
    """Tensor types as llama.cpp's quantize leaves them: routers (ffn_gate_inp*) in f32."""
    plans = _moe_plans(spec, moe)
    types = _stored_types(plans, spec.weight_type, spec.n_embd, head="output.weight")
    layout = Layout(
        "qwen35moe", spec.n_vocab, spec.weight_type, spec.seed, plans, types,
        lambda w: _moe_hparams(w, spec, moe, layout.n_params),
        lambda t, i: _moe_values(spec, moe, t, i),
    )  # fmt: skip
    return layout


def _stored_types(plans: list[TensorPlan], weight_type: str, n_embd: int, head: str):
    """Matmul weights in ``weight_type``, the lm head (``head``: the embedding when tied) in
    llama.cpp's output type, everything else f32."""
    out, weights = output_type(weight_type, n_embd), WEIGHT_TYPES[weight_type][0]
    return [out if t.name == head else weights if t.init == "dense" else QType.F32 for t in plans]


# --- gemma4: Gemma 4 31B's shapes ---


@dataclass(frozen=True)
class Gemma4Spec:
    """Gemma 4 31B's text decoder (its public config.json): five sliding-window layers, then a
    full layer with its own head size, 4 KV heads and V = K (no ``attn_v``); proportional RoPE
    on a quarter of the full heads; tied embeddings; no per-layer inputs, shared KV or experts."""

    n_vocab: int = 262144
    n_embd: int = 5376
    n_layer: int = 60
    n_ff: int = 21504
    n_head: int = 32
    n_head_kv: int = 4  # full layers
    n_head_kv_swa: int = 16
    head_dim: int = 512  # full layers
    head_dim_swa: int = 256
    window: int = 1024
    full_every: int = 6  # layer il is full attention iff (il + 1) % full_every == 0
    rope_theta: float = 1e6
    rope_theta_swa: float = 1e4
    rope_partial: float = 0.25  # the share of a full head that rotates
    softcap: float = 30.0
    rms_eps: float = 1e-6
    context_length: int = 262144
    weight_type: str = "q4_0"
    seed: int = 0

    def is_full(self, il: int) -> bool:
        return (il + 1) % self.full_every == 0


def gemma4_31b(weight_type: str = "q4_0", n_layer: int = 60, **overrides: object) -> Gemma4Spec:
    return dataclasses.replace(Gemma4Spec(weight_type=weight_type, n_layer=n_layer), **overrides)


def _plan(name: str, ne: tuple[int, ...], init: str, std: float = 0.0) -> TensorPlan:
    return TensorPlan(name, ne, init, std)


def _gemma4_plans(s: Gemma4Spec) -> list[TensorPlan]:
    E = s.n_embd

    def dense(name: str, n_in: int, n_out: int) -> TensorPlan:
        return _plan(name, (n_in, n_out), "dense", 1 / math.sqrt(n_in))

    plans = [
        _plan("rope_freqs.weight", (s.head_dim // 2,), "rope_freqs"),
        _plan("token_embd.weight", (E, s.n_vocab), "dense", 1.0),  # also the output (tied)
    ]
    for il in range(s.n_layer):
        b, full = f"blk.{il}.", s.is_full(il)
        hd = s.head_dim if full else s.head_dim_swa
        kv = hd * (s.n_head_kv if full else s.n_head_kv_swa)
        plans += [
            _plan(b + "attn_norm.weight", (E,), "norm", 0.05),
            dense(b + "attn_q.weight", E, hd * s.n_head),
            dense(b + "attn_k.weight", E, kv),
            *([] if full else [dense(b + "attn_v.weight", E, kv)]),
            _plan(b + "attn_q_norm.weight", (hd,), "norm", 0.05),
            _plan(b + "attn_k_norm.weight", (hd,), "norm", 0.05),
            dense(b + "attn_output.weight", hd * s.n_head, E),
            _plan(b + "post_attention_norm.weight", (E,), "norm", 0.05),
            _plan(b + "ffn_norm.weight", (E,), "norm", 0.05),
            dense(b + "ffn_gate.weight", E, s.n_ff),
            dense(b + "ffn_up.weight", E, s.n_ff),
            dense(b + "ffn_down.weight", s.n_ff, E),
            _plan(b + "post_ffw_norm.weight", (E,), "norm", 0.05),
            _plan(b + "layer_output_scale.weight", (1,), "norm"),
        ]
    return [*plans, _plan("output_norm.weight", (E,), "norm", 0.05)]


def _gemma4_values(s: Gemma4Spec, t: TensorPlan, index: int) -> np.ndarray:
    if t.init == "rope_freqs":  # 1 for the rotated pairs, 1e30 (no rotation) for the rest
        n_rot = int(s.head_dim * s.rope_partial / 2)
        return np.array([1.0] * n_rot + [1e30] * (t.ne[0] - n_rot), np.float32)
    rng = np.random.default_rng([s.seed, index])
    x = rng.uniform(-1.0, 1.0, t.shape).astype(np.float32) * np.float32(t.std * math.sqrt(3))
    return x + np.float32(1.0) if t.init == "norm" else x


def _gemma4_hparams(w: gguf.GGUFWriter, s: Gemma4Spec, n_params: int) -> None:
    add_decoder_hparams(w, f"lucepy random gemma4 {n_params / 1e9:.1f}B", s)
    full = [s.is_full(il) for il in range(s.n_layer)]
    w.add_head_count_kv([s.n_head_kv if f else s.n_head_kv_swa for f in full])
    w.add_sliding_window_pattern([not f for f in full])
    w.add_sliding_window(s.window)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_key_length_swa(s.head_dim_swa)
    w.add_value_length_swa(s.head_dim_swa)
    w.add_rope_dimension_count(s.head_dim)  # proportional: rope_freqs stops the rest rotating
    w.add_rope_dimension_count_swa(s.head_dim_swa)
    w.add_rope_freq_base(s.rope_theta)
    w.add_rope_freq_base_swa(s.rope_theta_swa)
    w.add_layer_norm_rms_eps(s.rms_eps)
    w.add_final_logit_softcapping(s.softcap)
    w.add_shared_kv_layers(0)
    w.add_embedding_length_per_layer_input(0)


def gemma4_layout(spec: Gemma4Spec) -> Layout:
    plans = _gemma4_plans(spec)
    types = _stored_types(plans, spec.weight_type, spec.n_embd, head="token_embd.weight")
    layout = Layout(
        "gemma4", spec.n_vocab, spec.weight_type, spec.seed, plans, types,
        lambda w: _gemma4_hparams(w, spec, layout.n_params),
        lambda t, i: _gemma4_values(spec, t, i),
    )  # fmt: skip
    return layout


# --- laguna: Laguna-XS.2's shapes, with a skewed router ---


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
        return _plan(name, ne, "dense", 1 / math.sqrt(ne[0]))

    plans = [_plan("token_embd.weight", (E, s.n_vocab), "dense", 1.0)]
    for il, nh in enumerate(s.n_head):
        b = f"blk.{il}."
        plans += [
            _plan(b + "attn_norm.weight", (E,), "norm", 0.05),
            dense(b + "attn_q.weight", (E, hd * nh)),
            dense(b + "attn_k.weight", (E, hd * s.n_head_kv)),
            dense(b + "attn_v.weight", (E, hd * s.n_head_kv)),
            dense(b + "attn_output.weight", (hd * nh, E)),
            _plan(b + "attn_q_norm.weight", (hd,), "norm", 0.05),
            _plan(b + "attn_k_norm.weight", (hd,), "norm", 0.05),
            dense(b + "attn_gate.weight", (E, nh)),
            _plan(b + "ffn_norm.weight", (E,), "norm", 0.05),
        ]
        if il < s.n_dense:
            plans += [dense(b + f"ffn_{n}.weight", (E, s.n_ff)) for n in ("gate", "up")]
            plans.append(dense(b + "ffn_down.weight", (s.n_ff, E)))
            continue
        plans += [
            _plan(b + "ffn_gate_inp.weight", (E, X), "router", 1 / math.sqrt(E)),
            _plan(b + "exp_probs_b.bias", (X,), "bias", 0.02),
            dense(b + "ffn_gate_exps.weight", (E, ff, X)),
            dense(b + "ffn_up_exps.weight", (E, ff, X)),
            dense(b + "ffn_down_exps.weight", (ff, E, X)),
            dense(b + "ffn_gate_shexp.weight", (E, sh)),
            dense(b + "ffn_up_shexp.weight", (E, sh)),
            dense(b + "ffn_down_shexp.weight", (sh, E)),
        ]
    return [
        *plans,
        _plan("output_norm.weight", (E,), "norm", 0.05),
        dense("output.weight", (E, s.n_vocab)),
    ]


def _laguna_values(s: LagunaSpec, moe: MoeSpec, t: TensorPlan, index: int) -> np.ndarray:
    if t.init == "router":
        return _router_values(t, moe, s.seed, index)
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
    plans = _laguna_plans(spec, moe)
    types = _stored_types(plans, spec.weight_type, spec.n_embd, head="output.weight")
    layout = Layout(
        "laguna", spec.n_vocab, spec.weight_type, spec.seed, plans, types,
        lambda w: _laguna_hparams(w, spec, moe, layout.n_params),
        lambda t, i: _laguna_values(spec, moe, t, i),
    )  # fmt: skip
    return layout


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


def output_type(weight_type: str, n_embd: int) -> QType:
    """llama.cpp's default for ``output.weight``: Q6_K unless the file is Q8_0 (or rows don't
    fit 256-blocks, then Q8_0)."""
    qtype = WEIGHT_TYPES[weight_type][0]
    if qtype in (QType.F32, QType.F16, QType.Q8_0):
        return qtype
    return QType.Q6_K if n_embd % 256 == 0 else QType.Q8_0


def qwen35_layout(spec: Qwen35Spec) -> Layout:
    plans = plan_tensors(spec)
    out = output_type(spec.weight_type, spec.n_embd)
    types = [out if t.name == "output.weight" else tensor_type(t, spec) for t in plans]
    name = f"lucepy random {ARCH} {param_count(spec) / 1e9:.1f}B"
    return Layout(
        ARCH, spec.n_vocab, spec.weight_type, spec.seed, plans, types,
        lambda w: _add_hparams(w, spec, name=name),
        lambda t, i: tensor_values(t, spec, i),
    )  # fmt: skip


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


def _pieces(layout: Layout, align: int) -> Iterator[Callable[[], object]]:
    """The data section as callables, in file order: chunks of blocks, small f32 tensors, pads."""
    for i, (t, qtype) in enumerate(zip(layout.plans, layout.types, strict=True)):
        if qtype in FORMATS:
            fmt = FORMATS[qtype]
            n_blocks = math.prod(t.ne) // fmt.block_len
            per_chunk = CHUNK_BYTES // fmt.block_bytes
            for c, start in enumerate(range(0, n_blocks, per_chunk)):
                n = min(per_chunk, n_blocks - start)
                yield lambda q=qtype, n=n, std=t.std, s=(layout.seed, i, c): random_blocks(
                    q, n, std, s
                )
            nbytes = n_blocks * fmt.block_bytes
        else:
            yield lambda t=t, q=qtype, i=i: encode(layout.values(t, i), q)
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


def write_random(
    path: str | Path, model: Qwen35Spec | Layout, *, threads: int | None = None
) -> Path:
    """Write a random-weight GGUF (quantized types only for matmul weights)."""
    layout = qwen35_layout(model) if isinstance(model, Qwen35Spec) else model
    if layout.weight_type not in ("q4_0", "q8_0"):
        raise ConfigError(f"big GGUFs are q4_0 or q8_0, not {layout.weight_type!r}")
    path = Path(path)
    w = gguf.GGUFWriter(None, layout.arch)
    layout.add_hparams(w)
    add_vocab(w, big_vocab(layout.n_vocab))
    for t, qtype in zip(layout.plans, layout.types, strict=True):
        _add_tensor_info(w, t, qtype)
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout = w.fout[0]
    fout.write(_padding(fout.tell(), w.data_alignment)())
    _write_pieces(fout, _pieces(layout, w.data_alignment), threads or os.cpu_count() or 2)
    w.close()
    return path


ARCHS = {  # spec, layers, least
    "qwen35": (qwen36_27b, 64, 4),
    "qwen35moe": (qwen36_35b_a3b, 40, 4),
    "gemma4": (gemma4_31b, 60, 6),
    "laguna": (laguna_xs2, 40, 2),
}
LAYOUTS = {
    "qwen35": qwen35_layout,
    "qwen35moe": lambda specs: qwen35moe_layout(*specs),
    "gemma4": gemma4_layout,
    "laguna": lambda specs: laguna_layout(*specs),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lucepy.testing.big", description=__doc__)
    ap.add_argument("out", type=Path, help="GGUF file to write")
    ap.add_argument("--arch", choices=sorted(ARCHS), default="qwen35")
    ap.add_argument("--type", choices=["q4_0", "q8_0"], default="q4_0")
    ap.add_argument(
        "--layers",
        type=int,
        help="layers: as in the real model (qwen35 64, qwen35moe 40, gemma4 60, laguna 40)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="generator threads (all cores)")
    args = ap.parse_args(argv)
    make_spec, layers, least = ARCHS[args.arch]
    layers = args.layers or layers
    try:
        if layers < least:
            # llama.cpp aborts on a model whose full-attention KV cache has no layer
            # (set_input_k_idxs): qwen35 attends every 4th layer, gemma4 every 6th; laguna's
            # sliding cache needs layer 1
            raise ConfigError(f"--layers {layers}: use at least {least}, so one layer attends")
        spec = make_spec(args.type, layers, seed=args.seed)
        layout = LAYOUTS[args.arch](spec)
        t0 = time.perf_counter()
        write_random(args.out, layout, threads=args.threads)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    secs = time.perf_counter() - t0
    size = args.out.stat().st_size
    print(
        f"wrote {args.out}: {args.arch}, {layout.n_params / 1e9:.2f}B parameters, {args.type}, "
        f"{size / 1e9:.2f} GB in {secs:.1f} s ({size / 1e9 / secs:.2f} GB/s)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
