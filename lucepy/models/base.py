"""What every architecture shares: the shape convention, the builder handle, the registry.

ggml lists dimensions innermost first. A ggml tensor of shape ``[n_embd, n_tokens]`` has ``ne[0] =
n_embd`` contiguous floats per token, which numpy would call shape ``(n_tokens, n_embd)``. Every
shape comment in ``models/`` uses ggml order, in square brackets. ``mul_mat(w, x)`` with
``w: [k, m]`` and ``x: [k, n]`` gives ``[m, n]``: both operands are contracted over ``ne[0]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar, Protocol

import numpy as np

from lucepy.errors import ConfigError, MissingTensor, TensorShapeMismatch, UnsupportedArchitecture
from lucepy.ggml import (
    GGML_TYPE_F16,
    GGML_TYPE_F32,
    GGML_TYPE_I32,
    GGML_TYPE_I64,
    Lib,
    alias_tensor,
    ffi,
)
from lucepy.gguf import GGUFFile
from lucepy.models.batch import StepBatch
from lucepy.models.state import (
    KVCache,
    LayerState,
    RingKVCache,
    hadamard,
    pool_rows,
    quantized,
)

Tensor = Any  # a cffi ``struct ggml_tensor *``


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
    # products of one input as one matrix (Architecture.stacked): on a GPU (runtime/engine.py's
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


class Builder:
    """The ggml context a graph is built in, with short helpers for what every model does."""

    MAX_INPUTS = 64  # step inputs, and constants, a graph may have (each kind has a context)

    def __init__(self, lib: Lib, ctx: Any, max_nodes: int, input_ctx: Any, constant_ctx: Any):
        """Ops go to ``ctx``; inputs the host writes each step to ``input_ctx`` and constants to
        ``constant_ctx`` (runtime gives each its own buffer, so a step writes them at once)."""
        self.lib, self.ctx = lib, ctx
        self._ctx_of = {"step": input_ctx, "constant": constant_ctx, "carried": ctx}
        self.gf = lib.ggml_new_graph_custom(ctx, max_nodes, False)
        self.inputs: dict[str, Tensor] = {}
        self.kinds: dict[str, str] = {}  # input -> "step", "constant" or "carried"
        self.outputs: dict[str, Tensor] = {}
        self.constants: dict[str, np.ndarray] = {}  # inputs whose value never changes
        self.routes: dict[int, Tensor] = {}  # layer -> the experts its tokens chose [k, T] i32
        self.offload: list[Tensor] = []  # nodes for the host CPU backend (cold experts)
        # expert weights the device reads from host RAM (RuntimeConfig.cold_experts "device"):
        # they stay with the device's ops
        self.reads: list[Tensor] = []
        self.queries = False  # output the queries of full attention (set from GraphSpec.queries)
        self.streams = (0, 0, 0)  # GraphSpec.streams

    def input(self, name: str, gtype: int, *shape: int, kind: str = "step") -> Tensor:
        """An input the host writes every step (runtime sends a graph's step inputs in one copy).
        ``kind`` "constant": written once; "carried": copied in from another backend."""
        if name in self.inputs:
            raise ValueError(f"graph input {name!r} made twice")
        if kind != "carried" and list(self.kinds.values()).count(kind) >= self.MAX_INPUTS:
            raise ValueError(f"more than {self.MAX_INPUTS} {kind} inputs in one graph")
        ne = ffi.new("int64_t[4]", list(shape) + [1] * (4 - len(shape)))
        t = self.lib.ggml_new_tensor(self._ctx_of[kind], gtype, len(shape), ne)
        self.lib.ggml_set_name(t, name.encode())
        self.lib.ggml_set_input(t)
        self.inputs[name], self.kinds[name] = t, kind
        return t

    def carried_f32(self, name: str, *shape: int) -> Tensor:
        """An f32 input copied in from a tensor on some backend (the previous shard's output,
        the target's captured features), not written from the host."""
        return self.input(name, GGML_TYPE_F32, *shape, kind="carried")

    def constant(self, name: str, value: np.ndarray) -> Tensor:
        """An f32 input holding ``value``, written once when the graph is compiled."""
        if name not in self.inputs:
            self.input(name, GGML_TYPE_F32, *value.shape[::-1], kind="constant")
            self.constants[name] = value
        return self.inputs[name]

    def rotate(self, t: Tensor, n: int) -> Tensor:
        """``t`` with every n-long run of ``ne[0]`` turned by the n x n Walsh-Hadamard matrix, as
        llama.cpp's ``llama_mul_mat_hadamard`` computes it (a hinted mul_mat)."""
        L, c = self.lib, self.ctx
        rot = self.constant(f"hadamard.{n}", hadamard(n))
        rows = L.ggml_nelements(t) // n
        if L.ggml_is_contiguous(t):
            flat = L.ggml_reshape_2d(c, t, n, rows)
        else:
            flat = L.ggml_cont_2d(c, t, n, rows)
        out = L.ggml_mul_mat(c, rot, flat)
        L.ggml_mul_mat_set_hint(out, L.GGML_HINT_SRC0_IS_HADAMARD)
        return L.ggml_reshape_4d(c, out, t.ne[0], t.ne[1], t.ne[2], t.ne[3])

    def output(self, name: str, t: Tensor) -> Tensor:
        """Keep ``t`` readable after compute (the allocator will not reuse its memory)."""
        self.lib.ggml_set_output(t)
        self.lib.ggml_build_forward_expand(self.gf, t)
        self.outputs[name] = t
        return t

    def pack_output(self, name: str, parts: list[Tensor]) -> Tensor:
        """One output [n, len(parts)] holding ``parts`` (n elements of one type each) side by
        side, so that a step reads them all at once."""
        L, c = self.lib, self.ctx
        n, ne0 = L.ggml_nelements(parts[0]), parts[0].ne[0]
        dst = L.ggml_new_tensor_2d(c, parts[0].type, n, len(parts))
        for i, t in enumerate(parts):
            rows = n // ne0
            view = L.ggml_view_2d(c, dst, ne0, rows, self.row_size(dst, ne0), i * dst.nb[1])
            L.ggml_build_forward_expand(self.gf, L.ggml_cpy(c, t, view))
        return self.output(name, dst)

    def alias(
        self, src: Tensor, shape: tuple[int, ...], strides: tuple[int, ...], offset: int
    ) -> Tensor:
        """A leaf over memory ``src`` already has (its data may come from another graph's run).

        Unlike a view, it carries no link to ``src``'s ops, so nothing upstream is recomputed.
        """
        return alias_tensor(self.lib, self.ctx, src, shape, strides, offset)

    def input_f32(self, name: str, *shape: int) -> Tensor:
        return self.input(name, GGML_TYPE_F32, *shape)

    def input_f16(self, name: str, *shape: int) -> Tensor:
        return self.input(name, GGML_TYPE_F16, *shape)

    def input_i32(self, name: str, *shape: int) -> Tensor:
        return self.input(name, GGML_TYPE_I32, *shape)

    def input_i64(self, name: str, *shape: int) -> Tensor:
        return self.input(name, GGML_TYPE_I64, *shape)

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return self.lib.ggml_mul(self.ctx, self.lib.ggml_rms_norm(self.ctx, x, eps), weight)

    def part(self, t: Tensor, first: int, n: int, copy: bool = True) -> Tensor:
        """Rows ``first..first+n`` of a product [rows, T] of stacked weights
        (``Architecture.stacked``) as a tensor [n, T]: a view for one token or without
        ``copy``, else a copy with rows back to back (reshapes and some CUDA ops need them
        so)."""
        L, c = self.lib, self.ctx
        view = L.ggml_view_2d(c, t, n, t.ne[1], t.nb[1], first * L.ggml_element_size(t))
        return view if t.ne[1] == 1 or not copy else L.ggml_cont(c, view)

    def products(
        self,
        w: dict,
        x: Tensor,
        b: str,
        rows: dict[str, int],
        stacks: dict[str, tuple[str, ...]],
        copy: bool = True,
        views: tuple[str, ...] = (),
    ) -> dict[str, Tensor]:
        """``x`` times layer ``b``'s weights ``rows`` (name -> its rows; the weight is
        ``b + name + ".weight"``), by name, one product per stack of them that the loader made
        (``stacks``: key -> the names stacked in row order; the stack is ``w[b + key]``,
        ``Architecture.stack_all``). Without ``copy`` a stack's parts are views of its product
        (rows ``nb[1]`` apart: ``heads`` takes them), and so are those named in ``views``
        (their readers take such strides)."""
        out = {}
        for key, parts in stacks.items():
            if b + key in w and set(parts) <= set(rows) and not set(parts) & set(out):
                y, first = self.lib.ggml_mul_mat(self.ctx, w[b + key], x), 0
                for name in parts:
                    out[name] = self.part(y, first, rows[name], copy and name not in views)
                    first += rows[name]
        for name in rows:
            if name not in out:
                out[name] = self.lib.ggml_mul_mat(self.ctx, w[f"{b}{name}.weight"], x)
        return out

    def heads(self, t: Tensor, hd: int) -> Tensor:
        """``t`` [hd * n, T] (its columns ``nb[1]`` apart, a stack's part) as [hd, n, T], a view:
        ggml's rope and set_rows read such strides, so a verify copies no part."""
        L = self.lib
        es = L.ggml_element_size(t)
        return L.ggml_view_3d(self.ctx, t, hd, t.ne[0] // hd, t.ne[1], es * hd, t.nb[1], 0)

    def swiglu_ffn(self, x: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
        L, c = self.lib, self.ctx
        h = L.ggml_swiglu_split(c, L.ggml_mul_mat(c, gate, x), L.ggml_mul_mat(c, up, x))
        return L.ggml_mul_mat(c, down, h)

    def attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, flash: bool):
        """Attention of ``q`` [hd, nh, T] over cache views ``k``, ``v`` [hd, nkv, n_kv] under
        ``mask`` [n_kv, T]; returns [hd*nh, T]. Both paths are llama.cpp's (``build_attn_mha`` in
        src/llama-graph.cpp): flash attention, or KQ at f32, ``soft_max_ext``, then V^T KQ."""
        L, c = self.lib, self.ctx
        hd, nh, T = q.ne[0], q.ne[1], q.ne[2]
        q = L.ggml_permute(c, q, 0, 2, 1, 3)  # [hd, T, nh]
        k = L.ggml_permute(c, k, 0, 2, 1, 3)  # [hd, n_kv, nkv]
        v = L.ggml_permute(c, v, 0, 2, 1, 3)
        if flash:
            out = L.ggml_flash_attn_ext(c, q, k, v, mask, scale, 0.0, 0.0)  # [hd, nh, T]
            L.ggml_flash_attn_ext_set_prec(out, L.GGML_PREC_F32)
            return L.ggml_reshape_2d(c, out, hd * nh, T)
        kq = L.ggml_mul_mat(c, k, q)  # [n_kv, T, nh]
        L.ggml_mul_mat_set_prec(kq, L.GGML_PREC_F32)
        kq = L.ggml_soft_max_ext(c, kq, mask, scale, 0.0)
        vt = L.ggml_cont(c, L.ggml_transpose(c, v))  # [n_kv, hd, nkv]
        out = L.ggml_permute(c, L.ggml_mul_mat(c, vt, kq), 0, 2, 1, 3)  # [hd, nh, T]
        return L.ggml_cont_2d(c, out, hd * nh, T)

    def cached_attention(self, cache: KVCache, st: dict, q, k, v, scale: float, flash: bool):
        """Write this step's ``k``, ``v`` [hd, nkv, T] into ``cache``'s rows (input ``rows``),
        then attend with ``q`` over the first n_kv rows under the input ``mask``."""
        mask = self.inputs["mask"]
        views = self.write_kv(cache, st, k, v, self.inputs["rows"], mask.ne[0])
        if self.streams[0]:
            return self._stream_attention(cache, q, views, mask, scale, flash)
        return self.attend_kv(cache, q, views, mask, scale, flash)

    def _stream_attention(self, cache: KVCache, q, views: tuple, mask, scale: float, flash: bool):
        """Attention of S sequences side by side (GraphSpec.streams), from sequence F on: ``q``
        [hd, nh, T] as [hd, nh, T/S, S], each sequence over its own window of the cache, ggml's
        4th dimension (llama.cpp's KV streams). Each token reads its own sequence's rows, not
        every row."""
        if cache.k_rot or cache.v_rot:
            raise ConfigError("batched sequences need an f16 KV cache (--cache-type-k/-v f16)")
        L, c = self.lib, self.ctx
        (S, stride, first), n_kv = self.streams, mask.ne[0]
        hd, nh, T = q.ne[0], q.ne[1], q.ne[2]
        t = T // S
        q4 = L.ggml_reshape_4d(c, q, hd, nh, t, S)
        kv = []
        for view in views:  # [hd, nkv, n_kv] of the written cache -> [hd, nkv, n_kv, S]
            row = view.nb[2]
            kv.append(
                L.ggml_view_4d(
                    c,
                    view,
                    hd,
                    view.ne[1],
                    n_kv,
                    S,
                    view.nb[1],
                    row,
                    row * stride,
                    row * stride * first,
                )  # fmt: skip
            )
        mask4 = L.ggml_reshape_4d(c, mask, n_kv, t, 1, S)
        q4 = L.ggml_permute(c, q4, 0, 2, 1, 3)  # [hd, t, nh, S]
        k4, v4 = (L.ggml_permute(c, x, 0, 2, 1, 3) for x in kv)  # [hd, n_kv, nkv, S]
        if flash:
            out = L.ggml_flash_attn_ext(c, q4, k4, v4, mask4, scale, 0.0, 0.0)  # [hd, nh, t, S]
            L.ggml_flash_attn_ext_set_prec(out, L.GGML_PREC_F32)
            return L.ggml_reshape_2d(c, out, hd * nh, T)
        kq = L.ggml_mul_mat(c, k4, q4)  # [n_kv, t, nh, S]
        L.ggml_mul_mat_set_prec(kq, L.GGML_PREC_F32)
        kq = L.ggml_soft_max_ext(c, kq, mask4, scale, 0.0)
        vt = L.ggml_cont(c, L.ggml_transpose(c, v4))  # [n_kv, hd, nkv, S]
        out = L.ggml_permute(c, L.ggml_mul_mat(c, vt, kq), 0, 2, 1, 3)  # [hd, nh, t, S]
        return L.ggml_cont_2d(c, out, hd * nh, T)

    def write_kv(self, cache: KVCache, st: dict, k, v, rows, n_rows: int) -> tuple:
        """Write ``k``, ``v`` [hd, nkv, T] into ``cache``'s ``rows``; return views of its first
        ``n_rows`` rows after the write, [hd, nkv, n_rows] each (what later layers may share)."""
        L, c = self.lib, self.ctx
        hd, nkv, T = k.ne[0], k.ne[1], k.ne[2]
        if cache.k_rot:
            k = self.rotate(k, cache.k_rot)
        if cache.v_rot:
            v = self.rotate(v, cache.v_rot)
        views = []
        for name, cur in ((cache.k, k), (cache.v, v)):  # st[name]: [hd*nkv, n_ctx]
            # a view, not a reshape: ggml-cuda fuses rope -> view -> set_rows (one kernel)
            flat = L.ggml_view_2d(c, cur, hd * nkv, T, cur.nb[2], 0)
            written = L.ggml_set_rows(c, st[name], flat, rows)
            row = written.nb[1]
            views.append(
                L.ggml_view_3d(c, written, hd, nkv, n_rows, self.row_size(written, hd), row, 0)
            )
        return tuple(views)

    def attend_kv(self, cache: KVCache, q, views: tuple, mask, scale: float, flash: bool):
        """Attention of ``q`` over cache ``views`` from ``write_kv``, turned as ``cache`` stores
        its heads; returns [hd*nh, T]."""
        if cache.k_rot:
            q = self.rotate(q, cache.k_rot)
        if self.queries and cache.appends and f"q.{cache.layer}" not in self.outputs:
            self.output(f"q.{cache.layer}", q)  # [hd, nh, T], turned as the cache's keys
        out = self.attention(q, views[0], views[1], mask, scale, flash)
        return self.rotate(out, cache.v_rot) if cache.v_rot else out  # V turned back

    def last_row(self, t: Tensor) -> Tensor:
        """The last column of ``t`` [n, T]: [n, 1]."""
        return self.lib.ggml_view_2d(self.ctx, t, t.ne[0], 1, t.nb[1], t.nb[1] * (t.ne[1] - 1))

    def row_size(self, t: Tensor, n: int) -> int:
        return self.lib.ggml_row_size(t.type, n)


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

    def step_inputs(self, batch: StepBatch, names) -> dict[str, np.ndarray]:
        """Host values of the graph inputs ``names`` for ``batch`` (tokens, positions, masks)."""


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
