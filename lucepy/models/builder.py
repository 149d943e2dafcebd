"""The ``Builder``: the ggml context a step's graph is built in, and the helpers every model
uses (inputs, constants, outputs, norms, products, attention and its caches). Shapes in ggml's
order, as models/base.py explains."""

from __future__ import annotations

from typing import Any

import numpy as np

from lucepy.errors import ConfigError
from lucepy.ggml import (
    GGML_TYPE_F16,
    GGML_TYPE_F32,
    GGML_TYPE_I32,
    GGML_TYPE_I64,
    Lib,
    alias_tensor,
    ffi,
)
from lucepy.models.state import KVCache, hadamard

Tensor = Any  # a cffi ``struct ggml_tensor *``


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
