"""Routed experts, as ``build_moe_ffn`` in ``src/llama-graph.cpp`` of the pinned llama.cpp builds
them for softmax gating: top-k of the router's softmax, the chosen weights normalised to sum to
one (over a floor), each chosen expert's gated FFN, and their weighted sum.

Shapes are in ggml order: ``x`` [n_embd, T], expert weights [n_in, n_out, n_expert], the chosen
experts [k, T] (i32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lucepy.ggml import GGML_TYPE_I32, VIEW_OPS, address, ffi
from lucepy.models.builder import Builder, Tensor

WEIGHT_FLOOR = 6.103515625e-5  # build_moe_ffn's floor under the sum of the chosen weights


@dataclass(frozen=True)
class Route:
    chosen: Tensor  # [k, T] i32: the experts each token uses, best first
    weights: Tensor  # [1, k, T]: their weights


def route(g: Builder, logits: Tensor, k: int, scale: float = 0.0, *, layer: int) -> Route:
    """Softmax over the router's ``logits`` [n_expert, T], its top ``k``, their probabilities
    normalised to sum to one, then times ``scale`` (0 or 1: unscaled). The choice is kept in
    ``g.routes[layer]``: the graph outputs every layer's as ``routing`` (expert hotness)."""
    L, c = g.lib, g.ctx
    X, T = logits.ne[0], logits.ne[1]
    probs = L.ggml_soft_max(c, logits)
    chosen = L.ggml_argsort_top_k(c, probs, k)  # [k, T]
    g.routes[layer] = chosen
    weights = L.ggml_get_rows(c, L.ggml_reshape_3d(c, probs, 1, X, T), chosen)  # [1, k, T]
    weights = L.ggml_reshape_2d(c, weights, k, T)
    total = L.ggml_clamp(c, L.ggml_sum_rows(c, weights), WEIGHT_FLOOR, math.inf)
    weights = L.ggml_div(c, weights, total)
    if scale not in (0.0, 1.0):
        weights = L.ggml_scale(c, weights, scale)
    weights = L.ggml_reshape_3d(c, weights, 1, k, T)
    # in the graph now, in llama.cpp's order (softmax, reshape, argsort, view, get_rows, ...):
    # ggml-cuda fuses that run into one top-k kernel, but only in that order
    L.ggml_build_forward_expand(g.gf, weights)
    return Route(chosen, weights)


def layer_experts(g: Builder, w: dict, b: str, x: Tensor, r: Route, act: str = "silu") -> Tensor:
    """The routed experts of the layer whose tensors start with ``b``, weighted and summed
    [n_embd, T]. A layer split between the device and host RAM (``runtime/experts.py``) has its
    device experts under the usual names (then ``k`` all-zero padding experts), its host ones
    under ``NAME.cold``, f32 tables from expert to index in each part (``experts.hot`` /
    ``experts.cold``, 0 where the expert is not there) with 0/1 masks (``experts.hot_mask`` /
    ``experts.cold_mask``), and the padding indices ``experts.hot_pad`` [1, k]; the host part
    runs on the host CPU backend (``g.offload``). A layer whose cold experts the device reads in
    host RAM has one tensor per matrix, its hot experts first, and ``experts.order``, an f32
    table from expert to its place there; the device runs it all (``g.reads``)."""
    names = ("ffn_gate_exps", "ffn_up_exps", "ffn_gate_up_exps", "ffn_down_exps")
    scale = w.get(b + "ffn_down_exps.scale")
    L, c = g.lib, g.ctx
    E, T = x.ne[0], x.ne[1]
    k = r.chosen.ne[0]
    h = L.ggml_reshape_3d(c, x, E, 1, T)
    if b + "experts.order" in w:  # read from host RAM: one tensor, the hot experts first
        flat = L.ggml_reshape_1d(c, L.ggml_cont(c, r.chosen), k * T)
        ids = L.ggml_reshape_2d(c, L.ggml_get_rows(c, w[b + "experts.order"], flat), k, T)
        ids = L.ggml_cast(c, ids, GGML_TYPE_I32)
        g.reads += [w[f"{b}{n}.weight"] for n in names if f"{b}{n}.weight" in w]
        return _sum_slots(g, _part(g, w, b, "", names, h, ids, r.weights, act, scale, r))
    if b + "experts.cold" not in w:
        return _sum_slots(g, _part(g, w, b, "", names, h, r.chosen, r.weights, act, scale, r))
    flat = L.ggml_reshape_1d(c, L.ggml_cont(c, r.chosen), k * T)
    out = None
    for part in ("hot", "cold"):
        if part == "hot" and b + "ffn_down_exps.weight" not in w:
            continue  # every expert of the layer is in host RAM
        ids = L.ggml_get_rows(c, w[f"{b}experts.{part}"], flat)  # [1, k*T]
        mask = L.ggml_get_rows(c, w[f"{b}experts.{part}_mask"], flat)  # [1, k*T]
        weights = L.ggml_mul(c, r.weights, L.ggml_reshape_3d(c, mask, 1, k, T))
        ids = L.ggml_reshape_2d(c, ids, k, T)
        if part == "hot":
            # ggml-cuda's expert matmuls take a token's experts to be distinct: slot i of a
            # token whose expert is not here uses padding expert n_hot + i (all zero weights)
            other = L.ggml_get_rows(c, w[f"{b}experts.cold_mask"], flat)  # 1 - mask
            pad = L.ggml_mul(c, L.ggml_reshape_2d(c, other, k, T), w[f"{b}experts.hot_pad"])
            ids = L.ggml_add(c, L.ggml_mul(c, ids, L.ggml_reshape_2d(c, mask, k, T)), pad)
            ids = L.ggml_cast(c, ids, GGML_TYPE_I32)
            one = _part(g, w, b, "", names, h, ids, weights, act, scale, r)
        else:
            if out is not None:
                ids = _own_cold_expert(g, ids, L.ggml_get_rows(c, w[f"{b}experts.hot_mask"], flat))
            # what crosses to the host is whole tensors, not views (the scheduler copies those)
            h_in, ids = L.ggml_cont(c, h), L.ggml_cast(c, ids, GGML_TYPE_I32)
            for t in (h_in, ids, weights):  # in the graph before the host's ops: one trip there
                L.ggml_build_forward_expand(g.gf, t)
            one = _part(g, w, b, ".cold", names, h_in, ids, weights, act, scale, r)
            g.offload += _ops_between(g, one, (h_in, ids, weights))
            if out is None:  # and back: an op on the device reads it, not views of it
                one = L.ggml_cont(c, one)
        # per slot one part is the expert's output and the other exactly 0: the sum is exact
        out = one if out is None else L.ggml_add(c, out, one)
    return _sum_slots(g, out)


def _own_cold_expert(g: Builder, ids: Tensor, hot: Tensor) -> Tensor:
    """The host part's expert indices [k, T] (f32, 0 in the slots whose expert is on the device)
    with those slots set to the largest index among the token's own: a weight-0 row of an expert
    the host reads anyway, not a read of expert 0 that no slot chose (most decode steps)."""
    L, c = g.lib, g.ctx
    k, T = ids.ne[0], ids.ne[1]
    best = L.ggml_reshape_2d(c, L.ggml_argmax(c, ids), 1, T)  # [1, T] i32
    fill = L.ggml_get_rows(c, L.ggml_reshape_3d(c, ids, 1, k, T), best)  # [1, 1, T]
    fill = L.ggml_mul(c, L.ggml_reshape_2d(c, hot, k, T), L.ggml_reshape_2d(c, fill, 1, T))
    return L.ggml_add(c, ids, fill)


def _ops_between(g: Builder, out: Tensor, inputs: tuple) -> list[Tensor]:
    """The op nodes ``out`` depends on, down to ``inputs`` and leaves (weights), ``out`` too;
    not views, which read their source's memory where it is: the scheduler places those."""
    stop = {address(t) for t in inputs}
    seen: set[int] = set()
    found, todo = [], [out]
    while todo:
        t = todo.pop()
        key = address(t)
        if key in seen or key in stop or t.op == 0:  # GGML_OP_NONE: a leaf
            continue
        seen.add(key)
        if t.op not in VIEW_OPS:
            found.append(t)
        todo += [src for src in t.src if src != ffi.NULL]
    return found


def _part(
    g: Builder, w: dict, b: str, suffix: str, names: tuple, h: Tensor, ids: Tensor,
    weights: Tensor, act: str, scale: Tensor | None, r: Route,
) -> Tensor:  # fmt: skip
    """The chosen experts of one part ([E, k, T]), each output times its weight."""
    gate, up, gate_up, down = (w.get(f"{b}{n}.weight{suffix}") for n in names)
    out = experts(g, h, ids, down, gate=gate, up=up, gate_up=gate_up, act=act)
    if scale is not None:  # [X] -> the chosen experts' [1, k, T]
        L, c = g.lib, g.ctx
        X, T = scale.ne[0], h.ne[2]
        s = L.ggml_repeat_4d(c, L.ggml_reshape_3d(c, scale, 1, X, 1), 1, X, T, 1)
        out = L.ggml_mul(c, out, L.ggml_get_rows(c, s, r.chosen))
    return g.lib.ggml_mul(g.ctx, out, weights)


def _sum_slots(g: Builder, out: Tensor) -> Tensor:
    """[E, k, T] -> [E, T]: the k slots added in order, as build_moe_ffn adds them."""
    L, c = g.lib, g.ctx
    E, k, T = out.ne[0], out.ne[1], out.ne[2]
    slots = [L.ggml_view_2d(c, out, E, T, out.nb[2], i * out.nb[1]) for i in range(k)]
    for one in slots:  # the views first, then the adds in a row: ggml-cuda fuses such a row
        L.ggml_build_forward_expand(g.gf, one)
    total = slots[0]
    for one in slots[1:]:
        total = L.ggml_add(c, total, one)
        L.ggml_build_forward_expand(g.gf, total)
    return L.ggml_cont(c, total) if k == 1 else total


def experts(
    g: Builder,
    h: Tensor,
    ids: Tensor,
    down: Tensor,
    *,
    gate: Tensor | None = None,
    up: Tensor | None = None,
    gate_up: Tensor | None = None,
    act: str = "silu",
) -> Tensor:
    """Each token's experts ``ids`` [k, T] applied to its ``h`` [n_embd, 1, T]:
    ``down(act(gate h) * up h)`` [n_embd, k, T]. ``gate_up`` is the fused form (gate rows then
    up rows)."""
    L, c = g.lib, g.ctx
    k, T = ids.ne[0], ids.ne[1]
    if gate_up is not None:
        gu = L.ggml_mul_mat_id(c, gate_up, h, ids)  # [2*ff, k, T]
        ff = gu.ne[0] // 2
        g_out = L.ggml_view_3d(c, gu, ff, k, T, gu.nb[1], gu.nb[2], 0)
        u_out = L.ggml_view_3d(c, gu, ff, k, T, gu.nb[1], gu.nb[2], ff * gu.nb[0])
    else:
        u_out = L.ggml_mul_mat_id(c, up, h, ids)  # [ff, k, T]
        g_out = L.ggml_mul_mat_id(c, gate, h, ids)
    glu = L.ggml_swiglu_split if act == "silu" else L.ggml_geglu_split
    return L.ggml_mul_mat_id(c, down, glu(c, g_out, u_out), ids)  # [E, k, T]


def route_sigmoid(
    g: Builder, logits: Tensor, k: int, bias: Tensor | None, *, norm: bool, scale: float = 0.0,
    layer: int,
) -> Route:  # fmt: skip
    """Sigmoid gating as ``build_moe_ffn`` computes it (laguna, DeepSeek V3): the top ``k`` of
    ``sigmoid(logits) + bias`` over the router's ``logits`` [n_expert, T] (the bias, the
    score-correction ``exp_probs_b``, only chooses), weighted by their unbiased sigmoids,
    normalised to sum to one with ``norm`` (over the same floor as ``route``), then times
    ``scale`` (0 or 1: unscaled). The choice is kept in ``g.routes[layer]``, as ``route`` keeps
    it."""
    L, c = g.lib, g.ctx
    X, T = logits.ne[0], logits.ne[1]
    probs = L.ggml_sigmoid(c, logits)
    select = probs if bias is None else L.ggml_add(c, probs, bias)
    chosen = L.ggml_argsort_top_k(c, select, k)  # [k, T]
    g.routes[layer] = chosen
    weights = L.ggml_get_rows(c, L.ggml_reshape_3d(c, probs, 1, X, T), chosen)  # [1, k, T]
    if norm:
        weights = L.ggml_reshape_2d(c, weights, k, T)
        total = L.ggml_clamp(c, L.ggml_sum_rows(c, weights), WEIGHT_FLOOR, math.inf)
        weights = L.ggml_reshape_3d(c, L.ggml_div(c, weights, total), 1, k, T)
    if scale not in (0.0, 1.0):
        weights = L.ggml_scale(c, weights, scale)
    # in the graph now, in build_moe_ffn's order (sigmoid, reshape, add, argsort, view, get_rows,
    # ...), as route does for ggml-cuda's top-k fusion
    L.ggml_build_forward_expand(g.gf, weights)
    return Route(chosen, weights)
