"""What a real-size random-weight GGUF holds for qwen35 (Qwen3.6-27B's shapes), qwen35moe
(Qwen3.6-35B-A3B's, its router skewed) and gemma4 (Gemma 4 31B's): its tensors in file order,
their stored types, its metadata and the values of its small tensors (laguna's in
``big_laguna.py``); ``big.py`` writes them.

Tensor types follow llama.cpp's quantize defaults for the file type (``src/llama-quant.cpp`` at
the pinned commit): a Q4_0 file keeps ``token_embd`` in Q4_0 and stores ``output`` as Q6_K (a
tied embedding, which is also the output, as Q6_K); a Q8_0 file stores both as Q8_0.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType

from lucepy.testing.tiny import (
    ARCH,
    WEIGHT_TYPES,
    Qwen35Spec,
    TensorPlan,
    _add_hparams,
    add_decoder_hparams,
    param_count,
    plan_tensors,
    tensor_type,
    tensor_values,
)


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


def output_type(weight_type: str, n_embd: int) -> QType:
    """llama.cpp's default for ``output.weight``: Q6_K unless the file is Q8_0 (or rows don't
    fit 256-blocks, then Q8_0)."""
    qtype = WEIGHT_TYPES[weight_type][0]
    if qtype in (QType.F32, QType.F16, QType.Q8_0):
        return qtype
    return QType.Q6_K if n_embd % 256 == 0 else QType.Q8_0


def qwen36_27b(weight_type: str = "q4_0", n_layer: int = 64, **overrides: object) -> Qwen35Spec:
    """Qwen3.5/3.6-27B's shapes (shared/MODELS.md); fewer layers give a scaled-down variant."""
    base = Qwen35Spec(
        n_vocab=248320, n_embd=5120, n_layer=n_layer, n_ff=17408, n_head=24, n_head_kv=4,
        head_dim=256, rope_dim=64, rope_sections=(11, 11, 10, 0), rope_theta=1e7,
        ssm_conv_kernel=4, ssm_state_size=128, ssm_group_count=16, ssm_time_step_rank=48,
        rms_eps=1e-6, context_length=262144, weight_type=weight_type,
    )  # fmt: skip
    return dataclasses.replace(base, **overrides)


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
            TensorPlan(b + "ffn_gate_inp.weight", (E, X), "router", 1 / math.sqrt(E)),
            TensorPlan(b + "ffn_gate_exps.weight", (E, ff, X), "dense", 1 / math.sqrt(E)),
            TensorPlan(b + "ffn_up_exps.weight", (E, ff, X), "dense", 1 / math.sqrt(E)),
            TensorPlan(b + "ffn_down_exps.weight", (ff, E, X), "dense", 1 / math.sqrt(ff)),
            TensorPlan(b + "ffn_gate_inp_shexp.weight", (E, 1), "router", 1 / math.sqrt(E)),
            TensorPlan(b + "ffn_gate_shexp.weight", (E, sh), "dense", 1 / math.sqrt(E)),
            TensorPlan(b + "ffn_up_shexp.weight", (E, sh), "dense", 1 / math.sqrt(E)),
            TensorPlan(b + "ffn_down_shexp.weight", (sh, E), "dense", 1 / math.sqrt(sh)),
        ]
    return out


def _moe_values(spec: Qwen35Spec, moe: MoeSpec, t: TensorPlan, index: int) -> np.ndarray:
    if t.init != "router":
        return tensor_values(t, spec, index)
    return router_values(t, moe, spec.seed, index)


def router_values(t: TensorPlan, moe: MoeSpec, seed: int, index: int) -> np.ndarray:
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
    return stored_layout(
        "qwen35moe", spec, _moe_plans(spec, moe), "output.weight",
        lambda w, n_params: _moe_hparams(w, spec, moe, n_params),
        lambda t, i: _moe_values(spec, moe, t, i),
    )  # fmt: skip


def stored_types(plans: list[TensorPlan], weight_type: str, n_embd: int, head: str):
    """Matmul weights in ``weight_type``, the lm head (``head``: the embedding when tied) in
    llama.cpp's output type, everything else f32."""
    out, weights = output_type(weight_type, n_embd), WEIGHT_TYPES[weight_type][0]
    return [out if t.name == head else weights if t.init == "dense" else QType.F32 for t in plans]


def stored_layout(
    arch: str,
    spec: Any,
    plans: list[TensorPlan],
    head: str,
    hparams: Callable[[gguf.GGUFWriter, int], None],
    values: Callable[[TensorPlan, int], np.ndarray],
) -> Layout:
    """The layout of ``plans`` in ``stored_types``; ``spec`` gives the vocabulary, weight type,
    seed and width; ``hparams(writer, n_params)`` writes the metadata."""
    types = stored_types(plans, spec.weight_type, spec.n_embd, head=head)
    layout = Layout(
        arch, spec.n_vocab, spec.weight_type, spec.seed, plans, types,
        lambda w: hparams(w, layout.n_params), values,
    )  # fmt: skip
    return layout


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


def _gemma4_plans(s: Gemma4Spec) -> list[TensorPlan]:
    E = s.n_embd

    def dense(name: str, n_in: int, n_out: int) -> TensorPlan:
        return TensorPlan(name, (n_in, n_out), "dense", 1 / math.sqrt(n_in))

    plans = [
        TensorPlan("rope_freqs.weight", (s.head_dim // 2,), "rope_freqs"),
        TensorPlan("token_embd.weight", (E, s.n_vocab), "dense", 1.0),  # also the output (tied)
    ]
    for il in range(s.n_layer):
        b, full = f"blk.{il}.", s.is_full(il)
        hd = s.head_dim if full else s.head_dim_swa
        kv = hd * (s.n_head_kv if full else s.n_head_kv_swa)
        plans += [
            TensorPlan(b + "attn_norm.weight", (E,), "norm", 0.05),
            dense(b + "attn_q.weight", E, hd * s.n_head),
            dense(b + "attn_k.weight", E, kv),
            *([] if full else [dense(b + "attn_v.weight", E, kv)]),
            TensorPlan(b + "attn_q_norm.weight", (hd,), "norm", 0.05),
            TensorPlan(b + "attn_k_norm.weight", (hd,), "norm", 0.05),
            dense(b + "attn_output.weight", hd * s.n_head, E),
            TensorPlan(b + "post_attention_norm.weight", (E,), "norm", 0.05),
            TensorPlan(b + "ffn_norm.weight", (E,), "norm", 0.05),
            dense(b + "ffn_gate.weight", E, s.n_ff),
            dense(b + "ffn_up.weight", E, s.n_ff),
            dense(b + "ffn_down.weight", s.n_ff, E),
            TensorPlan(b + "post_ffw_norm.weight", (E,), "norm", 0.05),
            TensorPlan(b + "layer_output_scale.weight", (1,), "norm"),
        ]
    return [*plans, TensorPlan("output_norm.weight", (E,), "norm", 0.05)]


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
    return stored_layout(
        "gemma4", spec, _gemma4_plans(spec), "token_embd.weight",
        lambda w, n_params: _gemma4_hparams(w, spec, n_params),
        lambda t, i: _gemma4_values(spec, t, i),
    )  # fmt: skip
