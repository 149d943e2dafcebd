"""Routed experts, as ``build_moe_ffn`` in ``src/llama-graph.cpp`` of the pinned llama.cpp builds
them for softmax gating: top-k of the router's softmax, the chosen weights normalised to sum to
one (over a floor), each chosen expert's gated FFN, and their weighted sum.

Shapes are in ggml order: ``x`` [n_embd, T], expert weights [n_in, n_out, n_expert], the chosen
experts [k, T] (i32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lucepy.models.base import Builder, Tensor

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
    return Route(chosen, L.ggml_reshape_3d(c, weights, 1, k, T))


def experts(
    g: Builder,
    x: Tensor,
    r: Route,
    down: Tensor,
    *,
    gate: Tensor | None = None,
    up: Tensor | None = None,
    gate_up: Tensor | None = None,
    act: str = "silu",
    down_scale: Tensor | None = None,
) -> Tensor:
    """The weighted sum over the chosen experts of ``down(act(gate x) * up x)`` [n_embd, T].
    ``gate_up`` is the fused form (gate rows then up rows); ``down_scale`` [n_expert] scales each
    expert's output."""
    L, c = g.lib, g.ctx
    E, T = x.ne[0], x.ne[1]
    k = r.chosen.ne[0]
    h = L.ggml_reshape_3d(c, x, E, 1, T)
    if gate_up is not None:
        gu = L.ggml_mul_mat_id(c, gate_up, h, r.chosen)  # [2*ff, k, T]
        ff = gu.ne[0] // 2
        g_out = L.ggml_view_3d(c, gu, ff, k, T, gu.nb[1], gu.nb[2], 0)
        u_out = L.ggml_view_3d(c, gu, ff, k, T, gu.nb[1], gu.nb[2], ff * gu.nb[0])
    else:
        u_out = L.ggml_mul_mat_id(c, up, h, r.chosen)  # [ff, k, T]
        g_out = L.ggml_mul_mat_id(c, gate, h, r.chosen)
    glu = L.ggml_swiglu_split if act == "silu" else L.ggml_geglu_split
    out = L.ggml_mul_mat_id(c, down, glu(c, g_out, u_out), r.chosen)  # [E, k, T]
    if down_scale is not None:  # [X] -> the chosen experts' [1, k, T]
        X = down_scale.ne[0]
        s = L.ggml_repeat_4d(c, L.ggml_reshape_3d(c, down_scale, 1, X, 1), 1, X, T, 1)
        out = L.ggml_mul(c, out, L.ggml_get_rows(c, s, r.chosen))
    out = L.ggml_mul(c, out, r.weights)
    total = None
    for i in range(k):
        one = L.ggml_view_2d(c, out, E, T, out.nb[2], i * out.nb[1])
        total = one if total is None else L.ggml_add(c, total, one)
    return L.ggml_cont(c, total) if k == 1 else total
