// lucepy's own kernels (issue 19, decision 12), hooked into the pinned ggml-cuda: the host side of
// the gates and norms that the hooks take from ggml (through lucepy_cuda_fuse and
// lucepy_cuda_unary_mul, in lucepy-fuse.cu): a gated norm, an attention head's norm and rope
// with its cache write, a SiLU or sigmoid gate, and the CONT before a gate that they read in
// place; each writes its product's activations as it computes. Their kernels are
// lucepy-ops.cuh's (one column) and lucepy-records.cuh's (2-16).

#include "lucepy-host.cuh"

#include <algorithm>
#include <cstring>

#if !defined(GGML_USE_HIP) && !defined(GGML_USE_MUSA)

namespace lucepy {

// A gated norm from node i, an RMS_NORM (lucepy_cuda_fuse): the nodes after i computed, or 0.
// With `cont`, a CONT just before it that only the gate reads (through a view of it: a verify's
// z copied out of the stacked DeltaNet product): of 2-16 columns only, z then read from the
// CONT's source in place, its columns apart, and the CONT not computed (counted as a copy made).
int norm_gate_nodes(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph, int i,
                    const ggml_tensor * cont) {
    const ggml_tensor * norm = cgraph->nodes[i];
    const int i_mul = i + 1;
    const int i_act = i_mul < cgraph->n_nodes ? next_op(cgraph, i_mul) : i_mul;
    const int i_out = i_act < cgraph->n_nodes ? next_op(cgraph, i_act) : i_act;
    if (i_out >= cgraph->n_nodes) {
        return 0;
    }
    const ggml_tensor * mul = cgraph->nodes[i_mul];
    const ggml_tensor * act = cgraph->nodes[i_act];
    const ggml_tensor * out = cgraph->nodes[i_out];
    const bool ops = mul->op == GGML_OP_MUL && (mul->src[0] == norm || mul->src[1] == norm) &&
                     act->op == GGML_OP_UNARY &&
                     (ggml_get_unary_op(act) == GGML_UNARY_OP_SILU ||
                      ggml_get_unary_op(act) == GGML_UNARY_OP_SIGMOID) &&
                     out->op == GGML_OP_MUL &&
                     ((out->src[0] == mul && out->src[1] == act) ||
                      (out->src[0] == act && out->src[1] == mul));
    if (!ops) {
        return 0;
    }
    const ggml_tensor * x = norm->src[0];
    const ggml_tensor * w = mul->src[0] == norm ? mul->src[1] : mul->src[0];
    const ggml_tensor * z = act->src[0];
    const int64_t n = x->ne[0];
    const int64_t nrows = ggml_nrows(x);
    const bool rows = x->type == GGML_TYPE_F32 && x->nb[0] == sizeof(float) &&
                      x->nb[1] % sizeof(float) == 0 && x->nb[2] == x->nb[1] * size_t(x->ne[1]) &&
                      x->nb[3] == x->nb[2] * size_t(x->ne[2]);
    auto dense = [&](const ggml_tensor * t) { return dense_like(t, x); };
    const bool shapes = rows && (n == 64 || n == 128 || n == 256) && nrows * n / 32 < INT32_MAX &&
                        w->type == GGML_TYPE_F32 && ggml_is_contiguous(w) &&
                        ggml_nelements(w) == n && w->ne[0] == n && dense(mul) && dense(act) &&
                        dense(out) && dense(z);
    if (!shapes) {
        return 0;
    }
    ContextState & st = state_of(ctx);
    const Wanted * want = wanted(st, out);
    if (want == nullptr || ggml_nelements(want->src1) != ggml_nelements(out) ||
        (want->planes == 0 && want->src1->ne[0] % n != 0)) {
        return 0;  // (halves: a column of whole rows)
    }
    // z's columns: the CONT's source's where it is read in place (rows dense, columns apart, a
    // column of the product's `out` each), else z's own
    const ggml_tensor * z_at = z;
    int64_t z_stride = want->src1->ne[0];  // (read by the halves' kernel only)
    if (cont) {
        const ggml_tensor * src = cont->src[0];
        const bool in_place = want->planes == 0 && (z == cont || z->view_src == cont) &&
                              z->view_offs == 0 && columns_apart(src) &&
                              ggml_are_same_shape(src, cont) && src->ne[0] == want->src1->ne[0] &&
                              src->ne[1] == want->src1->ne[1] &&
                              !bytes_read(st, cgraph, cont, 0, ggml_nbytes(cont), act);
        if (!in_place) {
            return 0;
        }
        for (const ggml_tensor * o : {mul, act, out}) {
            if (!apart(span_of(o), span_of(src))) {
                return 0;
            }
        }
        z_at = src;
        z_stride = int64_t(src->nb[1] / sizeof(float));
    }
    // each result apart from the weight, and from x, z and the other results or at the same
    // address (the same element: read before it is written, by the same lane or, for x's rows,
    // the same CTA)
    const auto clear = apart_or_same;
    const bool x_dense = x->nb[1] == sizeof(float) * size_t(n);
    for (const ggml_tensor * o : {mul, act, out}) {
        const bool over_x = x_dense ? clear(o, x) : apart(span_of(o), span_of(x));
        if (!apart(span_of(o), span_of(w)) || !over_x || !clear(o, z)) {
            return 0;
        }
    }
    if (!clear(mul, act) || !clear(mul, out) || !clear(act, out)) {
        return 0;
    }
    float eps = 0.0f;
    std::memcpy(&eps, norm->op_params, sizeof(float));
    const int gate = ggml_get_unary_op(act) == GGML_UNARY_OP_SILU ? GATE_SILU : GATE_SIGMOID;
    if (want->planes <= 0) {  // 2-16 columns (a verify; halves where e4m3 records are wanted)
        const int64_t cols = want->src1->ne[1];
        const int64_t per_col = want->src1->ne[0] / 32;
        const Halves halves =
            halves_at(prepared(st, want->src1, per_col, 0), per_col, int(cols));
        const dim3 grid{unsigned(segments(int(per_col))), unsigned(padded_cols(int(cols)))};
        const auto params = ggml_cuda_kernel_launch_params(grid, GM_SEG * 32, 0, ctx.stream());
        auto launch = [&](auto kernel) {
            ggml_cuda_kernel_launch(kernel, params, static_cast<const float *>(x->data),
                                    int64_t(x->nb[1] / sizeof(float)),
                                    static_cast<const float *>(w->data),
                                    static_cast<const float *>(z_at->data), z_stride,
                                    static_cast<float *>(mul->data),
                                    static_cast<float *>(act->data),
                                    static_cast<float *>(out->data), int(per_col), int(cols), eps,
                                    gate, halves);
        };
        switch (n) {
            case 64: launch(norm_gate_halves<2>); break;
            case 128: launch(norm_gate_halves<4>); break;
            default: launch(norm_gate_halves<8>); break;
        }
        if (cont) {
            g_copies.fetch_add(1, std::memory_order_relaxed);
        }
        return i_out - i;
    }
    const int64_t npieces = ggml_nelements(out) / 32;
    const Planes quant =
        planes_at(prepared(st, want->src1, npieces, want->planes), npieces, 1, want->planes);
    const dim3 grid{unsigned((npieces + NORM_GATE_WARPS - 1) / NORM_GATE_WARPS)};
    const auto params =
        ggml_cuda_kernel_launch_params(grid, NORM_GATE_WARPS * 32, 0, ctx.stream());
    auto launch = [&](auto kernel) {
        ggml_cuda_kernel_launch(kernel, params, static_cast<const float *>(x->data),
                                int64_t(x->nb[1] / sizeof(float)),
                                static_cast<const float *>(w->data),
                                static_cast<const float *>(z->data),
                                static_cast<float *>(mul->data), static_cast<float *>(act->data),
                                static_cast<float *>(out->data),
                                int(nrows), eps, gate, want->planes, quant.xq, quant.xds);
    };
    switch (n) {
        case 64: launch(norm_gate_quantize<2>); break;
        case 128: launch(norm_gate_quantize<4>); break;
        default: launch(norm_gate_quantize<8>); break;
    }
    return i_out - i;
}

// An attention head's norm and rope from node i, an RMS_NORM (lucepy_cuda_fuse): the MUL by
// its weight right after it, the ROPE of an MROPE or IMROPE mode after that (each read by the
// next alone), and the SET_ROWS of the rope's result into an f16 cache where one comes next
// (a view of the rope between): norm_rope. The nodes after i computed, or 0.
int norm_rope_nodes(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph, int i) {
    const int i_mul = i + 1;
    const int i_rope = i_mul < cgraph->n_nodes ? next_op(cgraph, i_mul) : i_mul;
    if (i_rope >= cgraph->n_nodes) {
        return 0;
    }
    const ggml_tensor * norm = cgraph->nodes[i];
    const ggml_tensor * mul = cgraph->nodes[i_mul];
    const ggml_tensor * rope = cgraph->nodes[i_rope];
    if (mul->op != GGML_OP_MUL || (mul->src[0] != norm && mul->src[1] != norm) ||
        rope->op != GGML_OP_ROPE || rope->src[0] != mul) {
        return 0;
    }
    const int32_t * op = reinterpret_cast<const int32_t *>(rope->op_params);
    const int mode = op[2];
    const bool multi = (mode & GGML_ROPE_TYPE_MROPE) != 0 && mode != GGML_ROPE_TYPE_VISION;
    const ggml_tensor * x = norm->src[0];
    const ggml_tensor * w = mul->src[0] == norm ? mul->src[1] : mul->src[0];
    const ggml_tensor * pos = rope->src[1];
    const ggml_tensor * ff = rope->src[2];
    const int64_t n = x->ne[0], heads = x->ne[1], tokens = x->ne[2];
    const int n_dims = op[1], n_offs = op[15];
    const bool shapes =
        multi && x->type == GGML_TYPE_F32 && x->nb[0] == sizeof(float) &&
        x->nb[1] % sizeof(float) == 0 && x->nb[2] % sizeof(float) == 0 && x->ne[3] == 1 &&
        n <= NR_THREADS && n % 2 == 0 && n_dims % 2 == 0 && n_offs >= 0 &&
        n_offs + n_dims <= n && heads <= 65535 && tokens <= 65535 && w->type == GGML_TYPE_F32 &&
        ggml_is_contiguous(w) && ggml_nelements(w) == n && dense_like(mul, x) &&
        dense_like(rope, x) && pos->type == GGML_TYPE_I32 && ggml_is_contiguous(pos) &&
        ggml_nelements(pos) == 4 * tokens &&
        (ff == nullptr || (ff->type == GGML_TYPE_F32 && ggml_is_contiguous(ff) &&
                           ggml_nelements(ff) >= n_dims / 2));
    if (!shapes) {
        return 0;
    }
    ContextState & st = state_of(ctx);
    // the norm's and the weight's results not written: only the next reads each
    if (bytes_read(st, cgraph, norm, 0, ggml_nbytes(norm), mul) ||
        bytes_read(st, cgraph, mul, 0, ggml_nbytes(mul), rope)) {
        return 0;
    }
    // the rope's result apart from what the kernel reads (its CTAs read rows other CTAs write)
    const Span reads[] = {span_of(x), span_of(w), span_of(pos), ff ? span_of(ff) : Span{}};
    const Span rope_bytes[] = {span_of(rope)};
    if (spans_meet(rope_bytes, reads)) {
        return 0;
    }
    NormRope a = {};
    a.x = static_cast<const float *>(x->data);
    a.x_row = int64_t(x->nb[1] / sizeof(float));
    a.x_tok = int64_t(x->nb[2] / sizeof(float));
    a.w = static_cast<const float *>(w->data);
    a.dst = static_cast<float *>(rope->data);
    a.pos = static_cast<const int32_t *>(pos->data);
    a.freq_factors = ff ? static_cast<const float *>(ff->data) : nullptr;
    a.n = int(n);
    a.heads = int(heads);
    a.tokens = int(tokens);
    a.n_dims = n_dims;
    a.n_offs = n_offs;
    std::memcpy(&a.eps, norm->op_params, sizeof(float));
    float freq_base = 0.0f, beta_fast = 0.0f, beta_slow = 0.0f;
    std::memcpy(&freq_base, op + 5, sizeof(float));
    std::memcpy(&a.freq_scale, op + 6, sizeof(float));
    std::memcpy(&a.ext_factor, op + 7, sizeof(float));
    std::memcpy(&a.attn_factor, op + 8, sizeof(float));
    std::memcpy(&beta_fast, op + 9, sizeof(float));
    std::memcpy(&beta_slow, op + 10, sizeof(float));
    std::memcpy(a.sections, op + 11, sizeof(a.sections));
    a.imrope = mode == GGML_ROPE_TYPE_IMROPE;
    a.theta_scale = powf(freq_base, -2.0f / n_dims);
    float corr[2];
    ggml_rope_yarn_corr_dims(n_dims, op[4], freq_base, beta_fast, beta_slow, corr);
    a.corr0 = corr[0];
    a.corr1 = corr[1];
    if (a.sections[0] + a.sections[1] + a.sections[2] + a.sections[3] <= 0) {
        return 0;
    }
    // The SET_ROWS after it, where it writes the rope's result (a view of it, all of it, rows of
    // heads n) as f16 rows of its destination at I64 row numbers, apart from what the kernel
    // reads and from the rope's result
    int last = i_rope;
    const int i_set = next_op(cgraph, i_rope);
    const ggml_tensor * set = i_set < cgraph->n_nodes ? cgraph->nodes[i_set] : nullptr;
    if (set && set->op == GGML_OP_SET_ROWS) {
        const ggml_tensor * from = set->src[0];
        const ggml_tensor * rows = set->src[1];
        const bool taken =
            (from == rope || from->view_src == rope) && from->view_offs == 0 &&
            from->type == GGML_TYPE_F32 && ggml_is_contiguous(from) &&
            from->ne[0] == n * heads && from->ne[1] == tokens && from->ne[2] == 1 &&
            from->ne[3] == 1 && set->type == GGML_TYPE_F16 && set->nb[0] == sizeof(half) &&
            set->ne[0] == n * heads && set->nb[1] % sizeof(half) == 0 &&
            rows->type == GGML_TYPE_I64 && ggml_is_contiguous(rows) &&
            ggml_nelements(rows) == tokens;
        const Span set_bytes[] = {span_of(set)};
        const Span others[] = {span_of(rows), span_of(rope)};
        if (taken && !spans_meet(set_bytes, reads) && !spans_meet(set_bytes, others)) {
            a.cache = static_cast<half *>(set->data);
            a.cache_row = int64_t(set->nb[1] / sizeof(half));
            a.rows = static_cast<const int64_t *>(rows->data);
            last = i_set;
            g_joined.fetch_add(1, std::memory_order_relaxed);
        }
    }
    const dim3 grid{unsigned(heads), unsigned(tokens)};
    ggml_cuda_kernel_launch(norm_rope,
                            ggml_cuda_kernel_launch_params(grid, NR_THREADS, 0, ctx.stream()), a);
    g_ops.fetch_add(1, std::memory_order_relaxed);
    g_joined.fetch_add(1, std::memory_order_relaxed);  // the rope in the norm's kernel
    return last - i;
}

// A SiLU or sigmoid gate from node i, a UNARY, times the tensor that the MUL right after it
// takes (ggml-cuda fuses the two: lucepy_cuda_unary_mul), whose result a product reads: one
// column quantized (gate_quantize), 2-16 as halves (gate_halves). With `cont`, a CONT just
// before it that only the gate reads (a view copied out: qwen35's attention gate, each head's
// beside its query in the stacked product): z then read from the CONT's source in place, the
// CONT not computed (counted as a copy made). The nodes after i computed, or 0.
int gate_nodes(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph, int i,
               const ggml_tensor * cont) {
    if (i + 1 >= cgraph->n_nodes) {
        return 0;
    }
    const ggml_tensor * unary = cgraph->nodes[i];
    const ggml_tensor * mul = cgraph->nodes[i + 1];
    if (unary->op != GGML_OP_UNARY || mul->op != GGML_OP_MUL ||
        (mul->src[0] != unary && mul->src[1] != unary)) {
        return 0;
    }
    const ggml_unary_op op = ggml_get_unary_op(unary);
    if (op != GGML_UNARY_OP_SILU && op != GGML_UNARY_OP_SIGMOID) {
        return 0;
    }
    const ggml_tensor * z = unary->src[0];
    const ggml_tensor * x = mul->src[0] == unary ? mul->src[1] : mul->src[0];
    const int64_t n = ggml_nelements(mul);
    const bool fits = z->type == GGML_TYPE_F32 && x->type == GGML_TYPE_F32 &&
                      unary->type == GGML_TYPE_F32 && mul->type == GGML_TYPE_F32 &&
                      ggml_is_contiguous(z) && ggml_is_contiguous(x) && ggml_is_contiguous(mul) &&
                      ggml_are_same_shape(z, mul) && ggml_are_same_shape(x, mul) &&
                      n % 32 == 0 && n / 32 < INT32_MAX;
    if (!fits) {
        return 0;
    }
    ContextState & st = state_of(ctx);
    const Wanted * want = wanted(st, mul);
    if (want == nullptr || ggml_nelements(want->src1) != n || want->src1->ne[0] % 32 != 0) {
        return 0;
    }
    // the gate's own result read by the MUL alone; the result over x only element for element
    if (bytes_read(st, cgraph, unary, 0, ggml_nbytes(unary), mul) || !apart_or_same(mul, x)) {
        return 0;
    }
    const int64_t cols = want->planes > 0 ? 1 : want->src1->ne[1];
    const int64_t len = n / cols;  // a column's values
    GateAt at = {static_cast<const float *>(z->data), int(len), 0, len};
    if (cont) {  // z's elements where the CONT copied them from: rows of src->ne[0], columns
        const ggml_tensor * src = cont->src[0];
        const bool rows3 = src->ne[0] * src->ne[1] == len && src->ne[2] == cols;
        const bool rows2 = src->ne[0] == len && src->ne[1] == cols && src->ne[2] == 1;
        const bool in_place = z == cont && src->type == GGML_TYPE_F32 &&
                              src->nb[0] == sizeof(float) && src->ne[3] == 1 &&
                              (rows3 || rows2) && src->nb[1] % sizeof(float) == 0 &&
                              src->nb[2] % sizeof(float) == 0 &&
                              !bytes_read(st, cgraph, cont, 0, ggml_nbytes(cont), unary) &&
                              apart(span_of(mul), span_of(src));
        if (!in_place) {
            return 0;
        }
        const int64_t row = int64_t(src->nb[1] / sizeof(float));
        const int64_t col = int64_t(src->nb[2] / sizeof(float));
        at = rows3 ? GateAt{static_cast<const float *>(src->data), int(src->ne[0]), row, col}
                   : GateAt{static_cast<const float *>(src->data), int(len), 0, row};
    } else if (!apart_or_same(mul, z)) {
        return 0;
    }
    const int gate = op == GGML_UNARY_OP_SILU ? GATE_SILU : GATE_SIGMOID;
    const int64_t npieces = len / 32;  // a column's
    if (want->planes > 0) {  // one column (a decode)
        const Planes out =
            planes_at(prepared(st, want->src1, npieces, want->planes), npieces, 1, want->planes);
        constexpr int WARPS = 8;
        const dim3 grid{unsigned((npieces + WARPS - 1) / WARPS)};
        ggml_cuda_kernel_launch(gate_quantize,
                                ggml_cuda_kernel_launch_params(grid, WARPS * 32, 0, ctx.stream()),
                                at, static_cast<const float *>(x->data),
                                static_cast<float *>(mul->data), int(npieces), gate,
                                want->planes, out.xq, out.xds);
    } else {  // 2-16 columns (a verify)
        const Halves halves =
            halves_at(prepared(st, want->src1, npieces, 0), npieces, int(cols));
        const dim3 grid{unsigned(segments(int(npieces))), unsigned(padded_cols(int(cols)))};
        ggml_cuda_kernel_launch(gate_halves,
                                ggml_cuda_kernel_launch_params(grid, GM_SEG * 32, 0, ctx.stream()),
                                at, static_cast<const float *>(x->data), len,
                                static_cast<float *>(mul->data), int(npieces), int(cols), gate,
                                halves);
    }
    if (cont) {
        g_copies.fetch_add(1, std::memory_order_relaxed);
    }
    return 1;
}

// A CONT from node i that only the gated norm (a verify's DeltaNet z) or the gate (qwen35's
// attention gate) right after it reads: their kernel reads the CONT's source in place
// (norm_gate_nodes, gate_nodes). The nodes after i computed, or 0.
int cont_gate_nodes(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph, int i) {
    const int j = next_op(cgraph, i);
    if (j >= cgraph->n_nodes) {
        return 0;
    }
    const ggml_op op = cgraph->nodes[j]->op;
    const int took = op == GGML_OP_RMS_NORM ? norm_gate_nodes(ctx, cgraph, j, cgraph->nodes[i])
                     : op == GGML_OP_UNARY  ? gate_nodes(ctx, cgraph, j, cgraph->nodes[i])
                                            : 0;
    return took > 0 ? j + took - i : 0;
}

}  // namespace lucepy

#endif
