"""What every architecture shares: the shape convention, the builder handle (models/builder.py),
the registry.

ggml lists dimensions innermost first. A ggml tensor of shape ``[n_embd, n_tokens]`` has ``ne[0] =
n_embd`` contiguous floats per token, which numpy would call shape ``(n_tokens, n_embd)``. Every
shape comment in ``models/`` uses ggml order, in square brackets. ``mul_mat(w, x)`` with
``w: [k, m]`` and ``x: [k, n]`` gives ``[m, n]``: both operands are contracted over ``ne[0]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar, Protocol

from lucepy.errors import ConfigError, MissingTensor, TensorShapeMismatch, UnsupportedArchitecture
from lucepy.ggml import (
    GGML_TYPE_F16,
)
from lucepy.gguf import GGUFFile
from lucepy.models.batch import StepBatch, StepInput
from lucepy.models.builder import Builder, Tensor
from lucepy.models.state import (
    KVCache,
    LayerState,
    RingKVCache,
    pool_rows,
    quantized,
)


@dataclass(frozen=True)
class ModelOptions:
    """How to compute, chosen at run time (not by the GGUF): llama.cpp's ``-fa`` and
    ``-ctk``/``-ctv``."""

    flash_attn: bool = True  # llama.cpp's own default (-fa auto) resolves to on, CPU and CUDA
    cache_type_k: int = GGML_TYPE_F16  # KV cache types: f16 (llama.cpp's default) or q8_0
    cache_type_v: int = GGML_TYPE_F16
    max_step: int = 512  # the most tokens one step feeds (the prefill chunk); sizes KV rings
    kv_pool: int = 0  # tokens a full-attention cache holds under KV Flash's pager; 0: the context
    n_seq: int = 1  # sequences decoded together (--parallel): recurrent state holds one each
    # products of one input as one matrix (Architecture.stacked): on a GPU (runtime/plan.py's
    # _stacking) they save launches; on a CPU no faster, and f32 sums move in the last bits
    stack_matmuls: bool = False

    def kv_cache(
        self, layer: int, head_dim: int, n_head_kv: int, n_ctx: int, window: int = 0
    ) -> KVCache:
        """Full attention's cache of ``n_ctx`` rows; with ``window``, a ring of the window plus
        the longest step (no larger than ``n_ctx``)."""
        width = head_dim * n_head_kv
        blocks = quantized(self.cache_type_k) or quantized(self.cache_type_v)
        if blocks and head_dim % 32:  # q8_0 rows are whole 32-value blocks, per head
            raise ConfigError(
                f"a q8_0 KV cache needs a head size that is a multiple of 32; this model's is "
                f"{head_dim}; use --cache-type-k/-v f16"
            )
        types = (self.cache_type_k, self.cache_type_v, head_dim)
        if window:
            return RingKVCache(layer, width, self.ring_rows(window, n_ctx), *types)
        pooled = 0 < self.kv_pool < n_ctx  # KV Flash (a pool of the context or more: no pager)
        rows = pool_rows(self.kv_pool, self.max_step) if pooled else n_ctx
        return KVCache(layer, width, rows, *types)

    def ring_rows(self, window: int, n_ctx: int) -> int:
        """The window plus the longest step, padded to 256 rows as llama.cpp sizes its sliding
        cache (so the rows attended over match its own until the ring wraps)."""
        rows = -(-(window + self.max_step) // 256) * 256
        return min(rows, n_ctx) if n_ctx else rows


@dataclass(frozen=True)
class GraphSpec:
    """The shape bucket a graph is built for; graphs are cached and reused per spec."""

    n_tokens: int
    n_kv: int
    logits: str = "last"  # "last" or "all" rows of logits (last shard only)
    verify: bool = False  # keep what a rollback of the recurrent state reads (models/state.py)
    capture: tuple[int, ...] = ()  # layers whose entering residual stream is an output
    ring: int = 0  # rows of the sliding-window rings the step attends over (0: the model has none)
    queries: bool = False  # output each full-attention layer's query (``q.L``; KV Flash's QK rank)
    streams: tuple[int, int, int] = (0, 0, 0)  # StepBatch's streams, stream_rows, stream_first


def rope_args(n_ctx_train: int, theta: float) -> tuple:
    """The arguments after ``mode`` of ggml's rope calls, without YaRN: n_ctx_orig, freq_base,
    freq_scale 1, ext_factor 0, attn_factor 1, beta_fast 32, beta_slow 1 (llama.cpp's values
    when a model has no rope scaling)."""
    return (n_ctx_train, theta, 1.0, 0.0, 1.0, 32.0, 1.0)


def metadata(f: GGUFFile):
    """``key(name, default=required)``: the file's ``{arch}.{name}`` value, or the default."""
    arch = f.architecture

    def key(name: str, default: object = ...) -> object:
        full = f"{arch}.{name}"
        return f.require(full) if default is ... else f.get(full, default)

    return key


@dataclass(frozen=True)
class DecoderParams:
    """The hyperparameters every decoder here reads the same way from its GGUF; an architecture's
    ``Params`` adds its own. Keys a file may give per layer (``feed_forward_length``,
    ``attention.head_count``, ``attention.head_count_kv``) hold their largest value here."""

    n_vocab: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    rms_eps: float
    rope_dim: int
    rope_theta: float
    n_ctx_train: int

    @staticmethod
    def common(f: GGUFFile, n_layer: int) -> dict[str, Any]:
        """The fields above, from ``f``'s metadata (``n_layer`` as the architecture counts it)."""
        key = metadata(f)
        n_embd, heads = int(key("embedding_length")), key("attention.head_count")
        first = int(heads[0] if isinstance(heads, list | tuple) else heads)
        head_dim = int(key("attention.key_length", n_embd // first))  # as llama.cpp: layer 0's
        tokens, embd = f.get("tokenizer.ggml.tokens", []), f.tensors.get("token_embd.weight")
        return {
            # without a vocabulary, the embedding's rows (0 without one: check_tensors says so)
            "n_vocab": len(tokens) or (embd.shape[1] if embd is not None else 0),
            "n_embd": n_embd,
            "n_layer": n_layer,
            "n_ff": _largest(key("feed_forward_length", 0)),  # 0: experts only
            "n_head": _largest(heads),
            "n_head_kv": _largest(key("attention.head_count_kv", heads)),
            "head_dim": head_dim,
            "rms_eps": float(key("attention.layer_norm_rms_epsilon")),
            "rope_dim": int(key("rope.dimension_count", head_dim)),
            "rope_theta": float(key("rope.freq_base", 10000.0)),
            "n_ctx_train": int(key("context_length", 4096)),
        }


def _largest(value: object) -> int:
    """A per-layer key's value, or its largest when the file gives one per layer."""
    return int(max(value)) if isinstance(value, list | tuple) else int(value)


def check_tensors(f: GGUFFile, expected: dict[str, tuple[int, ...]]) -> None:
    """Every expected tensor is in the file with the shape the metadata implies."""
    for name, shape in expected.items():
        info = f.tensors.get(name)
        if info is None:
            raise MissingTensor(
                f"{f.path}: tensor {name!r} is missing; the file is incomplete or "
                f"was converted for another architecture"
            )
        if tuple(info.shape) != tuple(shape):
            raise TensorShapeMismatch(
                f"{f.path}: tensor {name!r} has shape {list(info.shape)} but the metadata implies "
                f"{list(shape)}; the file's metadata and weights disagree"
            )


class ArchitectureProtocol(Protocol):
    """All that runtime may ask of a model (decision 9). Shapes are ggml order."""

    p: Any  # the frozen Params read from the GGUF; runtime reads only ``p.n_layer``, ``p.n_vocab``,
    # ``p.n_embd`` and ``p.n_ctx_train``

    def weight_shapes(self, layers: range, f: GGUFFile) -> dict[str, tuple[int, ...]]:
        """The GGUF tensors ``layers`` need (the embedding with layer 0, the head with the last)."""

    def matmul_weights(self, layers: range, f: GGUFFile) -> dict[str, str | tuple[str, ...]]:
        """Graph key -> GGUF tensor of the weights used only as mul_mat's first operand, or
        tensors whose rows the loader stacks into one (``Architecture.stacked``)."""

    def make_state(self, layers: range, n_ctx: int) -> list[LayerState]:
        """The per-layer state of ``layers`` for a context of ``n_ctx`` tokens."""

    def split_points(self) -> list[int]:
        """The layer boundaries a split may cut at (b: layers < b on one shard, the rest after)."""

    def build(self, g: Builder, w: dict, st: dict, layers: range, spec: GraphSpec) -> Tensor:
        """The forward of ``layers`` for ``spec``: logits on the last shard, else the activation."""

    def step_inputs(self, batch: StepBatch, names) -> dict[str, StepInput]:
        """Host values of the graph inputs ``names`` for ``batch`` (tokens, positions, masks), or
        ``Fill``s that write them into the graph's array of each (``StepBatch.mask_input``)."""


class Architecture:
    """Base of a model family; subclasses register themselves under their GGUF name, which is all
    that registering an architecture takes."""

    registry: ClassVar[dict[str, type[Architecture]]] = {}
    gguf_name: ClassVar[str] = ""
    p: Any
    options: ModelOptions

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if cls.gguf_name:
            Architecture.registry[cls.gguf_name] = cls

    def split_points(self) -> list[int]:
        return list(range(1, self.p.n_layer))

    def split_reason(self) -> str:
        """Why ``split_points`` leaves some boundaries out (a plan's notes say it)."""
        return "the model's split points"

    def memory_note(self, n_ctx: int) -> str:
        """A line on state that does not scale with the context (a plan shows it); "" if none."""
        return ""

    def ring_span(self, batch: StepBatch) -> int:
        """Rows of the sliding-window rings a step attends over (``GraphSpec.ring``); 0: none."""
        return 0

    def max_step(self) -> int | None:
        """The most tokens one step may feed (a KV ring's margin); None: no limit."""
        return None

    def kv_state(self, il: int) -> KVCache:
        """Layer ``il``'s KV cache as ``make_state`` declares it (its tensor names, types and
        rotations), for graph code; the tensors themselves come with the state dict."""
        return self._kv_states[il]

    @cached_property
    def _kv_states(self) -> dict[int, KVCache]:
        states = self.make_state(range(self.p.n_layer), 0)
        return {s.layer: s for s in states if isinstance(s, KVCache)}

    def end_shapes(self, layers: range, f: GGUFFile | None) -> dict[str, tuple]:
        """The embedding (with layer 0) and the final norm and head (with the last layer); a file
        without ``output.weight`` ties the head to the embedding."""
        p, out = self.p, {}
        if layers.start == 0:
            out["token_embd.weight"] = (p.n_embd, p.n_vocab)
        if layers.stop == p.n_layer:
            out["output_norm.weight"] = (p.n_embd,)
            tied = f is not None and "output.weight" not in f.tensors
            out["token_embd.weight" if tied else "output.weight"] = (p.n_embd, p.n_vocab)
        return out

    def stacked(self, f: GGUFFile, key: str, parts: tuple[str, ...]) -> dict[str, tuple]:
        """``{key: parts}`` when the weights ``parts`` of products of one input can be one matrix
        (the same type and row length: rows stacked in this order, so one product and one launch
        instead of several, each part a view of the result); else nothing. llama.cpp's own
        converters stack some (qwen35's attn_qkv); this stacks the rest at load time."""
        if not self.options.stack_matmuls or not all(n in f.tensors for n in parts):
            return {}
        kinds = {(int(f.tensors[n].type), f.tensors[n].shape[0]) for n in parts}
        return {key: parts} if len(kinds) == 1 else {}

    def stack_all(
        self, f: GGUFFile, layers: range, stacks: dict[str, tuple[str, ...]], out: dict
    ) -> dict:
        """``out`` (graph key -> source) with each layer's ``stacks`` (key suffix -> the weight
        names stacked, ``.weight`` left off), the first that can be of those sharing a weight,
        in place of their parts."""
        for il in layers:
            b, claimed = f"blk.{il}.", set()
            for key, names in stacks.items():
                parts = tuple(f"{b}{n}.weight" for n in names)
                if claimed & set(parts):
                    continue
                found = self.stacked(f, b + key, parts)
                if found:
                    claimed |= set(parts)
                    out = {k: v for k, v in out.items() if k not in parts} | found
        return out

    def head_matmul(self, layers: range, f: GGUFFile) -> dict[str, str]:
        """The head as a matmul weight (graph key -> GGUF tensor), on the last shard. A tied head
        where layer 0's get_rows also reads the embedding is ``output.weight``: the loader keeps
        one tensor for both unless the head lands in a repacked buffer type."""
        if layers.stop != self.p.n_layer:
            return {}
        tied = "output.weight" not in f.tensors
        head = "token_embd.weight" if tied else "output.weight"
        return {"output.weight" if tied and layers.start == 0 else head: head}


def architecture_for(f: GGUFFile) -> type[Architecture]:
    arch = f.architecture
    try:
        return Architecture.registry[arch]
    except KeyError:
        names = ", ".join(sorted(Architecture.registry))
        raise UnsupportedArchitecture(
            f"{f.path}: architecture {arch!r} is not supported; lucepy runs: {names}"
        ) from None
