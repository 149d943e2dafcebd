"""Tiny random-weight GGUF files of the llama.cpp ``qwen35`` architecture, for tests and benches.

Qwen3.5/3.6 dense hybrid: Gated DeltaNet (linear attention) layers, and every
``full_attention_interval``-th layer a gated full-attention layer with IMROPE. Keys, tensor names
and shapes follow ``src/models/qwen35.cpp`` (load_arch_hparams, load_arch_tensors) at the pinned
llama.cpp.

Tensor shapes here are ggml ``ne`` tuples, innermost first, as llama.cpp writes them; numpy arrays
are outermost first, so ggml ``{n_embd, n_out}`` is the numpy array ``(n_out, n_embd)``.

The ``bench`` preset has 105,980,688 parameters (see :func:`bench_spec`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf import LlamaFileType

from lucepy.errors import ConfigError
from lucepy.testing.encoders import K_BLOCK, encode
from lucepy.testing.vocab import CHAT_TEMPLATE as CHAT_TEMPLATE
from lucepy.testing.vocab import SPECIAL_TOKENS as SPECIAL_TOKENS
from lucepy.testing.vocab import TOKENIZER_PRE as TOKENIZER_PRE
from lucepy.testing.vocab import Vocab as Vocab
from lucepy.testing.vocab import add_vocab
from lucepy.testing.vocab import build_vocab as build_vocab

ARCH = "qwen35"
# weight_type -> (ggml type of the 2D matmul weights, general.file_type)
WEIGHT_TYPES = {
    "f32": (QType.F32, LlamaFileType.ALL_F32),
    "f16": (QType.F16, LlamaFileType.MOSTLY_F16),
    "q8_0": (QType.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "q4_0": (QType.Q4_0, LlamaFileType.MOSTLY_Q4_0),
    "q4_k": (QType.Q4_K, LlamaFileType.MOSTLY_Q4_K_M),  # every matmul weight Q4_K (no Q6_K mix)
    # Q4_K but the weights that llama-quantize's Q4_K_M gives a type of their own (the DeltaNet's
    # qkv Q5_K, some attention V Q6_K), here Q8_0: the products of one input that can be stacked
    # as Q4_K_M's can
    "q4_k_mix": (QType.Q4_K, LlamaFileType.MOSTLY_Q4_K_M),
    "q5_k": (QType.Q5_K, LlamaFileType.MOSTLY_Q5_K_M),  # every matmul weight of 256-value rows
    "q6_k": (QType.Q6_K, LlamaFileType.MOSTLY_Q6_K),  # every matmul weight of 256-value rows
}
# weight types whose some weights are of another type: the name endings, that type
_OTHER_TYPES = {"q4_k_mix": (("attn_qkv.weight", "attn_v.weight"), QType.Q8_0)}
_QBLOCK = 32  # q8_0 and q4_0 block length


@dataclass(frozen=True)
class Qwen35Spec:
    """Hyperparameters and weight knobs of a tiny qwen35 model; every field can be overridden."""

    n_vocab: int = 512  # 256 byte tokens + BPE merges + 3 special tokens
    n_embd: int = 64
    n_layer: int = 4
    n_ff: int = 128
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 64  # attention key/value length; CUDA flash attention has no 32
    full_attention_interval: int = 4  # layer i is full attention iff (i + 1) % interval == 0
    rope_dim: int = 16  # n_rot; Qwen3.5 rotates a quarter of each head
    rope_sections: tuple[int, int, int, int] | None = None  # None: like [11, 11, 10, 0]
    rope_theta: float = 10_000_000.0
    ssm_conv_kernel: int = 4
    ssm_state_size: int = 16  # delta-net head dim (k and v); CUDA takes 16, 32, 64, 128
    ssm_group_count: int = 2  # delta-net key heads
    ssm_time_step_rank: int = 4  # delta-net value heads, a multiple of the key heads
    rms_eps: float = 1e-6
    context_length: int = 4096
    weight_type: str = "f32"
    seed: int = 0
    weight_scale: float = 1.0  # matmul weights: std = weight_scale / sqrt(fan_in)
    embd_std: float = 1.0
    output_scale: float = 1.0  # lm head: std = output_scale / sqrt(n_embd)
    norm_jitter: float = 0.1  # norm weights are 1 + U(-jitter, jitter)
    dt_bias_std: float = 0.3
    # A "favoured" token: every embedding gets +favor_scale on dim 0, which the residual stream
    # carries to the head, where the token's row also has +favor_scale on dim 0. Greedy output
    # then picks it often, so a draft can agree with the target often (speculative tests).
    favor_token: int = -1
    favor_scale: float = 0.0

    def __post_init__(self) -> None:
        problem = _spec_problem(self)
        if problem:
            raise ConfigError(f"bad Qwen35Spec: {problem}")

    @property
    def sections(self) -> tuple[int, int, int, int]:
        """IMROPE sections in cos/sin pairs; they sum to rope_dim / 2 (ggml.h, ggml_rope_multi)."""
        if self.rope_sections is not None:
            return tuple(self.rope_sections)  # type: ignore[return-value]
        half = self.rope_dim // 2
        a = half * 11 // 32
        return (a, a, half - 2 * a, 0)

    @property
    def ssm_inner_size(self) -> int:
        return self.ssm_state_size * self.ssm_time_step_rank

    @property
    def ssm_conv_dim(self) -> int:
        """Channels of the fused q|k|v projection that the causal conv runs over."""
        return 2 * self.ssm_state_size * self.ssm_group_count + self.ssm_inner_size

    def is_attention(self, il: int) -> bool:
        return (il + 1) % self.full_attention_interval == 0


def _spec_problem(s: Qwen35Spec) -> str:
    ints = [
        f.name
        for f in dataclasses.fields(s)
        if f.type == "int" and f.name not in ("seed", "favor_token")
    ]
    bad = [name for name in ints if getattr(s, name) < 1]
    if bad:
        return f"{', '.join(bad)} must be at least 1"
    if s.favor_token >= s.n_vocab:
        return f"favor_token {s.favor_token} is outside the vocabulary of {s.n_vocab}"
    if s.seed < 0:
        return f"seed {s.seed} must not be negative"
    if s.weight_type not in WEIGHT_TYPES:
        return f"weight_type {s.weight_type!r} is not one of {', '.join(WEIGHT_TYPES)}"
    if s.n_vocab < 256 + len(SPECIAL_TOKENS):
        return f"n_vocab {s.n_vocab} is below the 259 byte and special tokens"
    if s.rope_dim % 2 or s.rope_dim > s.head_dim:
        return f"rope_dim {s.rope_dim} must be even and at most head_dim {s.head_dim}"
    if len(s.sections) != 4 or sum(s.sections) != s.rope_dim // 2:
        return f"rope_sections {s.sections} must be 4 ints summing to rope_dim / 2"
    if s.n_head % s.n_head_kv:
        return f"n_head {s.n_head} is not a multiple of n_head_kv {s.n_head_kv}"
    if s.ssm_time_step_rank % s.ssm_group_count:
        return f"ssm_time_step_rank {s.ssm_time_step_rank} is not a multiple of ssm_group_count"
    return ""


def bench_spec(**overrides: object) -> Qwen35Spec:
    """About 106M parameters (105,980,688): 12 layers of which 3 attend, n_embd 768, vocab 8192.

    Delta-net heads are 128 wide as in Qwen3.5; attention heads are 128 (Qwen3.5: 256).
    """
    base = Qwen35Spec(
        n_vocab=8192, n_embd=768, n_layer=12, n_ff=2048, n_head=8, n_head_kv=2, head_dim=128,
        rope_dim=32, ssm_state_size=128, ssm_group_count=4, ssm_time_step_rank=8,
        context_length=32768,
    )  # fmt: skip
    return dataclasses.replace(base, **overrides)


PRESETS = {"tiny": Qwen35Spec, "bench": bench_spec}


# --- tensors: plan (names, shapes, init) first, then values ---


@dataclass(frozen=True)
class TensorPlan:
    name: str
    ne: tuple[int, ...]  # ggml order, innermost first
    init: str  # "dense" (matmul weight), "norm", "conv", "dt_bias" or "ssm_a"
    std: float = 0.0

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy shape, outermost first."""
        return self.ne[::-1]


def _dense(name: str, n_in: int, n_out: int, scale: float) -> TensorPlan:
    return TensorPlan(name, (n_in, n_out), "dense", scale / math.sqrt(n_in))


def _norm(name: str, n: int, s: Qwen35Spec) -> TensorPlan:
    return TensorPlan(name, (n,), "norm", s.norm_jitter / math.sqrt(3))


def _plan_attention(p: str, s: Qwen35Spec) -> list[TensorPlan]:
    q_dim, kv_dim, w = s.head_dim * s.n_head, s.head_dim * s.n_head_kv, s.weight_scale
    return [
        _dense(p + "attn_q.weight", s.n_embd, 2 * q_dim, w),  # query and output gate, per head
        _dense(p + "attn_k.weight", s.n_embd, kv_dim, w),
        _dense(p + "attn_v.weight", s.n_embd, kv_dim, w),
        _dense(p + "attn_output.weight", q_dim, s.n_embd, w),
        _norm(p + "attn_q_norm.weight", s.head_dim, s),
        _norm(p + "attn_k_norm.weight", s.head_dim, s),
    ]


def _plan_delta_net(p: str, s: Qwen35Spec) -> list[TensorPlan]:
    n_v, w, k = s.ssm_time_step_rank, s.weight_scale, s.ssm_conv_kernel
    return [
        _dense(p + "attn_qkv.weight", s.n_embd, s.ssm_conv_dim, w),
        _dense(p + "attn_gate.weight", s.n_embd, s.ssm_inner_size, w),  # z
        TensorPlan(p + "ssm_conv1d.weight", (k, s.ssm_conv_dim), "conv", 1 / math.sqrt(k)),
        TensorPlan(p + "ssm_dt.bias", (n_v,), "dt_bias", s.dt_bias_std),
        TensorPlan(p + "ssm_a", (n_v,), "ssm_a"),
        _dense(p + "ssm_beta.weight", s.n_embd, n_v, w),
        _dense(p + "ssm_alpha.weight", s.n_embd, n_v, w),
        _norm(p + "ssm_norm.weight", s.ssm_state_size, s),
        _dense(p + "ssm_out.weight", s.ssm_inner_size, s.n_embd, w),
    ]


def plan_tensors(s: Qwen35Spec) -> list[TensorPlan]:
    """Every tensor llama.cpp's qwen35 loader wants, in file order; no MTP layers."""
    plans = [TensorPlan("token_embd.weight", (s.n_embd, s.n_vocab), "dense", s.embd_std)]
    for il in range(s.n_layer):
        p = f"blk.{il}."
        plans += [_norm(p + "attn_norm.weight", s.n_embd, s)]
        plans += (_plan_attention if s.is_attention(il) else _plan_delta_net)(p, s)
        plans += [
            _norm(p + "post_attention_norm.weight", s.n_embd, s),
            _dense(p + "ffn_gate.weight", s.n_embd, s.n_ff, s.weight_scale),
            _dense(p + "ffn_up.weight", s.n_embd, s.n_ff, s.weight_scale),
            _dense(p + "ffn_down.weight", s.n_ff, s.n_embd, s.weight_scale),
        ]
    plans += [
        _norm("output_norm.weight", s.n_embd, s),
        _dense("output.weight", s.n_embd, s.n_vocab, s.output_scale),  # untied lm head
    ]
    return plans


def param_count(s: Qwen35Spec) -> int:
    return sum(math.prod(t.ne) for t in plan_tensors(s))


def tensor_type(t: TensorPlan, s: Qwen35Spec) -> QType:
    """Only 2D matmul weights with whole blocks per row (32 values, Q4_K's 256) are stored as
    weight_type."""
    qtype = WEIGHT_TYPES[s.weight_type][0]
    endings, other = _OTHER_TYPES.get(s.weight_type, ((), qtype))
    if t.name.endswith(endings):
        qtype = other
    block = K_BLOCK if qtype in (QType.Q4_K, QType.Q5_K, QType.Q6_K) else _QBLOCK
    if t.init == "dense" and len(t.ne) == 2 and t.ne[0] % block == 0:
        return qtype
    return QType.F32


def _uniform(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    # uniform draws are ~7x faster than normal ones, which matters at 100M parameters
    x = rng.random(shape, dtype=np.float32)
    x -= np.float32(0.5)
    x *= np.float32(std * 2 * math.sqrt(3))
    return x


def tensor_values(t: TensorPlan, s: Qwen35Spec, index: int) -> np.ndarray:
    """float32 values of one tensor, seeded by (seed, index) so each is independent of the rest."""
    rng = np.random.default_rng([s.seed, index])
    if t.init == "ssm_a":
        return -np.exp(rng.uniform(-1.0, 1.0, t.shape)).astype(np.float32)  # -exp(A_log)
    x = _uniform(rng, t.shape, t.std)
    if t.init == "norm":
        x += np.float32(1.0)
    if s.favor_token >= 0 and t.name == "token_embd.weight":
        x[:, 0] += np.float32(s.favor_scale)
    if s.favor_token >= 0 and t.name == "output.weight":
        x[s.favor_token, 0] += np.float32(s.favor_scale)
    return x


# --- writing ---


def add_decoder_hparams(w: gguf.GGUFWriter, name: str, s) -> None:
    """The keys every decoder writes alike, from a spec with ``weight_type``, ``context_length``,
    ``n_embd``, ``n_layer``, ``n_ff`` and ``n_head``."""
    w.add_name(name)
    w.add_file_type(int(WEIGHT_TYPES[s.weight_type][1]))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(s.context_length)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)


def _add_hparams(w: gguf.GGUFWriter, s: Qwen35Spec, name: str = f"lucepy tiny {ARCH}") -> None:
    add_decoder_hparams(w, name, s)
    w.add_head_count_kv(s.n_head_kv)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_layer_norm_rms_eps(s.rms_eps)
    w.add_rope_dimension_count(s.rope_dim)
    w.add_rope_dimension_sections([int(x) for x in s.sections])
    w.add_rope_freq_base(s.rope_theta)
    w.add_full_attention_interval(s.full_attention_interval)
    w.add_ssm_conv_kernel(s.ssm_conv_kernel)
    w.add_ssm_inner_size(s.ssm_inner_size)
    w.add_ssm_state_size(s.ssm_state_size)
    w.add_ssm_time_step_rank(s.ssm_time_step_rank)
    w.add_ssm_group_count(s.ssm_group_count)


def _add_tensor_info(w: gguf.GGUFWriter, t: TensorPlan, qtype: QType) -> None:
    if qtype in (QType.F32, QType.F16):
        dtype = np.dtype(np.float32 if qtype == QType.F32 else np.float16)
        w.add_tensor_info(t.name, t.shape, dtype, math.prod(t.shape) * dtype.itemsize)
        return
    byte_shape = gguf.quant_shape_to_byte_shape(t.shape, qtype)
    w.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), math.prod(byte_shape), qtype)


def write_qwen35(path: str | Path, spec: Qwen35Spec | None = None, **overrides: object) -> Path:
    """Write a random-weight qwen35 GGUF to ``path``; the same spec gives the same bytes."""
    spec = dataclasses.replace(spec if spec is not None else Qwen35Spec(), **overrides)
    qtypes = [tensor_type(t, spec) for t in plan_tensors(spec)]
    return _write(Path(path), spec, spec, qtypes, encode)


def write_dequantized_twin(
    path: str | Path, spec: Qwen35Spec | None = None, **overrides: object
) -> Path:
    """The weights ``write_qwen35`` stores for this (quantized) spec, rounded through their type
    and stored as f32: llama.cpp on this file is the exact math that the quantized one
    approximates, a yardstick for comparing two quantized kernels."""
    spec = dataclasses.replace(spec if spec is not None else Qwen35Spec(), **overrides)
    qtypes = [tensor_type(t, spec) for t in plan_tensors(spec)]

    def rounded(values: np.ndarray, qtype: QType) -> np.ndarray:
        if qtype in (QType.F32, QType.F16):
            return values.astype(np.float16).astype(np.float32) if qtype == QType.F16 else values
        return gguf.quants.dequantize(encode(values, qtype), qtype).reshape(values.shape)

    as_f32 = dataclasses.replace(spec, weight_type="f32")
    return _write(
        Path(path),
        spec,
        as_f32,
        [QType.F32] * len(qtypes),
        lambda values, i: rounded(values, qtypes[i]),
    )


def _write(path: Path, spec: Qwen35Spec, header: Qwen35Spec, qtypes: list, store) -> Path:
    plans = plan_tensors(spec)
    w = gguf.GGUFWriter(None, ARCH)
    _add_hparams(w, header)
    add_vocab(w, build_vocab(spec.n_vocab))
    for t, qtype in zip(plans, qtypes, strict=True):
        _add_tensor_info(w, t, qtype)
    # stream tensor by tensor: a 100M model never sits in memory whole
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for i, (t, qtype) in enumerate(zip(plans, qtypes, strict=True)):
        values = tensor_values(t, spec, i)
        w.write_tensor_data(store(values, qtype) if store is encode else store(values, i))
    w.close()
    return path


# --- command line: python -m lucepy.testing.tiny OUT.gguf [--preset] [--type] [--set k=v] ---


def _parse_value(base: Qwen35Spec, key: str, raw: str) -> object:
    if key == "rope_sections":
        return tuple(int(x) for x in raw.split(","))
    current = getattr(base, key)
    try:
        return type(current)(raw)
    except ValueError:
        raise ConfigError(f"--set {key}={raw}: expected a {type(current).__name__}") from None


def _spec_from_args(args: argparse.Namespace) -> Qwen35Spec:
    base = PRESETS[args.preset]()
    names = {f.name for f in dataclasses.fields(Qwen35Spec)}
    changes: dict[str, object] = {}
    for item in args.set:
        key, sep, raw = item.partition("=")
        if not sep or key not in names:
            raise ConfigError(f"--set {item!r}: use key=value with a key from {sorted(names)}")
        changes[key] = _parse_value(base, key, raw)
    if args.type:
        changes["weight_type"] = args.type
    return dataclasses.replace(base, **changes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lucepy.testing.tiny", description=__doc__)
    ap.add_argument("out", type=Path, help="GGUF file to write")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--type", choices=list(WEIGHT_TYPES), help="weight type of matmul weights")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    try:
        spec = _spec_from_args(args)
        write_qwen35(args.out, spec)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {param_count(spec):,} parameters, {spec.weight_type}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
