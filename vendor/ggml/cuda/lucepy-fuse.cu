// lucepy's own kernels (issue 19, decision 12), hooked into the pinned ggml-cuda: the host side of
// the ops around the products that the hooks take from ggml (lucepy_cuda_fuse and the others):
// RMS norms and gates that write the next product's activations as they compute, residual sums,
// argmax. lucepy-deltanet.cu has qwen35's DeltaNet conv step, gates and recurrence,
// lucepy-attn.cu attention of 1-16 queries, lucepy-mm.cu the products and the state a graph
// keeps; lucepy-host.cuh what they share.

#include "lucepy-host.cuh"

#include <algorithm>
#include <cstring>

#if !defined(GGML_USE_HIP) && !defined(GGML_USE_MUSA)

bool lucepy_cuda_rms_norm_mul(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph,
                              int i) {
    using namespace lucepy;
    if (!enabled(ctx.device) || ctx.curr_stream_no != 0 || i + 1 >= cgraph->n_nodes) {
        return false;
    }
    const ggml_tensor * norm = cgraph->nodes[i];
    const ggml_tensor * mul = cgraph->nodes[i + 1];
    if (norm->op != GGML_OP_RMS_NORM || mul->op != GGML_OP_MUL ||
        (mul->src[0] != norm && mul->src[1] != norm)) {
        return false;
    }
    const ggml_tensor * x = norm->src[0];
    const ggml_tensor * w = mul->src[0] == norm ? mul->src[1] : mul->src[0];
    const int64_t n = x->ne[0];
    const int64_t ncols = x->ne[1];
    const bool shapes = x->ne[2] == 1 && x->ne[3] == 1 && ncols <= MAX_COLS && n % 32 == 0 &&
                        n / 32 < INT32_MAX && ggml_are_same_shape(mul, x) && w->ne[0] == n &&
                        ggml_nelements(w) == n;
    auto aligned = [](const ggml_tensor * t) {  // norm_halves' 16-byte loads and stores
        return uintptr_t(t->data) % 16 == 0 && t->nb[1] % 16 == 0;
    };
    const bool layouts = x->type == GGML_TYPE_F32 && w->type == GGML_TYPE_F32 &&
                         mul->type == GGML_TYPE_F32 && x->nb[0] == sizeof(float) &&
                         w->nb[0] == sizeof(float) && mul->nb[0] == sizeof(float) &&
                         aligned(x) && aligned(w) && aligned(mul);
    if (!shapes || !layouts) {
        return false;
    }
    ContextState & st = state_of(ctx);
    const Wanted * want = wanted(st, mul);
    if (want == nullptr || want->src1 != mul || (want->planes > 0) != (ncols == 1)) {
        return false;  // (a product of a reshape: its columns are not the norm's)
    }
    const int planes = std::max(want->planes, 0);  // (e4m3 records wanted: halves, from which
    float eps = 0.0f;                               // the product's own conversion reads the f32)
    std::memcpy(&eps, norm->op_params, sizeof(float));
    const int64_t npieces = n / 32;
    uint8_t * buf = prepared(st, mul, npieces, planes);
    const float * xd = static_cast<const float *>(x->data);
    const float * wd = static_cast<const float *>(w->data);
    float * dst = static_cast<float *>(mul->data);
    const int64_t x_stride = x->nb[1] / int64_t(sizeof(float));
    const int64_t dst_stride = mul->nb[1] / int64_t(sizeof(float));
    if (planes == 0) {
        launch_norm_halves(xd, x_stride, wd, dst, dst_stride, int(n), eps, int(ncols),
                           halves_at(buf, npieces, int(ncols)), ctx.stream());
        return true;
    }
    const dim3 grid{unsigned((npieces + NORM_THREADS / 32 - 1) / (NORM_THREADS / 32))};
    const Planes out = planes_at(buf, npieces, 1, planes);
    ggml_cuda_kernel_launch(
        norm_quantize, ggml_cuda_kernel_launch_params(grid, NORM_THREADS, 0, ctx.stream()), xd,
        x_stride, wd, dst, dst_stride, int(n), eps, 1, planes, out.xq, out.xds);
    return true;
}

namespace lucepy {
int gate_nodes(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph, int i,
               const ggml_tensor * cont);
}  // namespace lucepy

bool lucepy_cuda_unary_mul(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph, int i) {
    using namespace lucepy;
    if (!enabled(ctx.device) || ctx.curr_stream_no != 0) {
        return false;
    }
    return gate_nodes(ctx, cgraph, i, nullptr) > 0;
}

namespace lucepy {

Span span_of(const ggml_tensor * t) {
    const char * begin = static_cast<const char *>(t->data);
    return {begin, begin + ggml_nbytes(t)};
}

bool apart(Span a, Span b) {
    return a.begin == a.end || b.begin == b.end || a.end <= b.begin || b.end <= a.begin;
}

// apart, or at the same address: an element-wise kernel that reads each element before it
// writes it there
bool apart_or_same(const ggml_tensor * p, const ggml_tensor * q) {
    return apart(span_of(p), span_of(q)) || p->data == q->data;
}

// f32, contiguous and of `like`'s shape
bool dense_like(const ggml_tensor * t, const ggml_tensor * like) {
    return t->type == GGML_TYPE_F32 && ggml_is_contiguous(t) && ggml_are_same_shape(t, like);
}

// f32 columns (2D), each dense, the columns any whole number of floats apart (a part of a
// stacked product's result, its rows of all columns)
bool columns_apart(const ggml_tensor * t) {
    return t->type == GGML_TYPE_F32 && t->nb[0] == sizeof(float) &&
           t->nb[1] % sizeof(float) == 0 && t->ne[2] == 1 && t->ne[3] == 1;
}

// Whether a node of `cgraph` other than `skip` reads bytes [from, to) of `t`'s, directly or
// through a view, or the graph keeps them (an output); true, to be safe, for a graph that is
// not the one that began
bool bytes_read(ContextState & st, const ggml_cgraph * cgraph, const ggml_tensor * t,
                size_t from, size_t to, const ggml_tensor * skip) {
    if ((t->flags & GGML_TENSOR_FLAG_OUTPUT) || st.cgraph != cgraph) {
        return true;
    }
    scan(st);
    const auto found = st.spans.find(t);
    if (found != st.spans.end()) {
        for (const ContextState::Read & r : found->second) {
            if (r.by != skip && r.from < to && from < r.to) {
                return true;
            }
        }
    }
    return false;
}

// A gated norm from node i, an RMS_NORM (lucepy_cuda_fuse): the nodes after i computed, or 0.
// With `cont`, a CONT just before it that only the gate reads (through a view of it: a verify's
// z copied out of the stacked DeltaNet product): of 2-16 columns only, z then read from the
// CONT's source in place, its columns apart, and the CONT not computed (counted as a copy made).
int norm_gate_nodes(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph, int i,
                    const ggml_tensor * cont = nullptr) {
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

// After a product's residual ADD (node i_add, residual r): the RMS_NORM of the sum and its MUL
// by a weight vector, the MUL's result a product of ours reads as halves (the next block's
// input norm), which launch_sum_norm computes with the product's sums. The MUL's node, `norm`
// filled in, or 0.
int norm_after_add(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph, int i_add,
                   const ggml_tensor * r, NormAfter & norm) {
    const ggml_tensor * add = cgraph->nodes[i_add];
    const int i_norm = next_op(cgraph, i_add);
    const int i_mul = i_norm < cgraph->n_nodes ? next_op(cgraph, i_norm) : i_norm;
    if (i_mul >= cgraph->n_nodes) {
        return 0;
    }
    const ggml_tensor * rms = cgraph->nodes[i_norm];
    const ggml_tensor * mul = cgraph->nodes[i_mul];
    if (rms->op != GGML_OP_RMS_NORM || rms->src[0] != add || mul->op != GGML_OP_MUL ||
        (mul->src[0] != rms && mul->src[1] != rms)) {
        return 0;
    }
    const ggml_tensor * w = mul->src[0] == rms ? mul->src[1] : mul->src[0];
    const int64_t n = add->ne[0];
    auto aligned = [](const ggml_tensor * t) {  // norm_halves' 16-byte loads and stores (one part)
        return uintptr_t(t->data) % 16 == 0 && t->nb[1] % 16 == 0;
    };
    const bool shapes = ggml_are_same_shape(mul, add) && dense_like(mul, add) &&
                        w->type == GGML_TYPE_F32 && w->ne[0] == n && ggml_nelements(w) == n &&
                        w->nb[0] == sizeof(float) && add->nb[0] == sizeof(float) &&
                        aligned(add) && aligned(w) && aligned(mul);
    if (!shapes || !sum_norm_fits(ctx.device, n)) {
        return 0;
    }
    // the norm's own result never written (the MUL alone reads it); the MUL's over the sum or
    // the residual only element for element (each read by the thread that writes it)
    ContextState & st = state_of(ctx);
    const Wanted * want = wanted(st, mul);
    if (st.readers(rms) != 1 || (rms->flags & GGML_TENSOR_FLAG_OUTPUT) != 0 || want == nullptr ||
        want->src1 != mul || (want->planes != 0 && want->planes != F8_PLANES) ||
        !apart_or_same(mul, add) ||
        !(apart(span_of(mul), span_of(r)) || (mul->data == r->data && mul->nb[1] == r->nb[1]))) {
        return 0;
    }
    norm.mul = mul;
    norm.planes = want->planes;
    norm.w = static_cast<const float *>(w->data);
    std::memcpy(&norm.eps, rms->op_params, sizeof(float));
    return i_mul;
}

// A product of 2-16 columns from node i, a MUL_MAT, and the residual ADD after it (a verify's
// attention, DeltaNet or FFN output plus the layer's input; ggml fuses such an ADD into the
// product for one column only), where nothing else reads the product: our product writes the
// sum into the ADD's result (`gemm_sum` or the tile's store adds the residual, the product's
// f32 sum first, as the ADD would); and where the next block's RMS norm follows it, that too
// (norm_after_add). The nodes after i computed, or 0.
int mul_mat_add_nodes(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph, int i) {
    const ggml_tensor * mm = cgraph->nodes[i];
    const int64_t ncols = mm->ne[1];
    const int i_add = next_op(cgraph, i);
    if (ncols < 2 || ncols > MAX_COLS || i_add >= cgraph->n_nodes) {
        return 0;  // (one column: ggml fuses the ADD into its own product)
    }
    ggml_tensor * add = cgraph->nodes[i_add];
    if (add->op != GGML_OP_ADD || (add->src[0] != mm && add->src[1] != mm)) {
        return 0;
    }
    const ggml_tensor * r = add->src[0] == mm ? add->src[1] : add->src[0];
    const bool shapes = r != mm && mm->type == GGML_TYPE_F32 && dense_like(add, mm) &&
                        r->type == GGML_TYPE_F32 && ggml_are_same_shape(r, mm) &&
                        r->nb[0] == sizeof(float) && r->nb[1] % sizeof(float) == 0 &&
                        r->ne[2] == 1 && r->ne[3] == 1;
    if (!shapes || (mm->flags & GGML_TENSOR_FLAG_OUTPUT) != 0) {
        return 0;
    }
    ContextState & st = state_of(ctx);
    // the product's result read by the ADD alone; the sum written apart from what the product
    // reads, over the residual only element for element (each read by the thread that writes it)
    const ggml_tensor * src1 = mm->src[1];
    if (st.readers(mm) != 1 || !apart(span_of(add), span_of(src1)) ||
        !apart(span_of(add), span_of(mm->src[0])) || !apart_or_same(add, r)) {
        return 0;
    }
    NormAfter norm = {};
    const int i_mul = norm_after_add(ctx, cgraph, i_add, r, norm);
    if (!mul_mat(ctx, mm->src[0], src1, add, nullptr, r, i_mul > 0 ? &norm : nullptr)) {
        return 0;
    }
    g_ops.fetch_add(1, std::memory_order_relaxed);
    return (i_mul > 0 ? i_mul : i_add) - i;
}

}  // namespace lucepy

bool lucepy_cuda_argmax(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    using namespace lucepy;
    const ggml_tensor * x = dst->src[0];
    const int64_t ncols = x->ne[0];
    const int64_t nrows = ggml_nrows(x);
    const bool fits = enabled(ctx.device) && x->type == GGML_TYPE_F32 &&
                      dst->type == GGML_TYPE_I32 && ggml_is_contiguous(dst) &&
                      x->nb[0] == sizeof(float) && ggml_is_contiguous_rows(x) &&
                      x->nb[2] == x->nb[1] * size_t(x->ne[1]) &&
                      x->nb[3] == x->nb[2] * size_t(x->ne[2]) && ncols >= 8 * ARGMAX_SLICE &&
                      ncols < INT32_MAX && nrows <= 65535;
    if (!fits) {
        return false;  // short rows (a MoE router's): one CTA a row is ggml's and enough
    }
    const int nslices = int((ncols + ARGMAX_SLICE - 1) / ARGMAX_SLICE);
    ggml_cuda_pool_alloc<Best> parts(ctx.pool(), size_t(nslices) * nrows);
    cudaStream_t stream = ctx.stream();
    const dim3 grid{unsigned(nslices), unsigned(nrows)};
    ggml_cuda_kernel_launch(argmax_part,
                            ggml_cuda_kernel_launch_params(grid, ARGMAX_THREADS, 0, stream),
                            static_cast<const float *>(x->data), int64_t(x->nb[1] / sizeof(float)),
                            int(ncols), parts.get());
    const dim3 rows{unsigned(nrows)};
    ggml_cuda_kernel_launch(argmax_rows,
                            ggml_cuda_kernel_launch_params(rows, ARGMAX_THREADS, 0, stream),
                            static_cast<const Best *>(parts.get()), nslices,
                            static_cast<int32_t *>(dst->data));
    g_ops.fetch_add(1, std::memory_order_relaxed);
    return true;
}

bool lucepy_cuda_glu(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    using namespace lucepy;
    if (!enabled(ctx.device) || ctx.curr_stream_no != 0 ||
        ggml_get_glu_op(dst) != GGML_GLU_OP_SWIGLU) {
        return false;
    }
    const ggml_tensor * a = dst->src[0];
    const ggml_tensor * b = dst->src[1];
    const int64_t n = ggml_nelements(dst);
    if (b == nullptr || !dense_like(a, dst) || !dense_like(b, dst) || !dense_like(dst, dst) ||
        !apart_or_same(dst, a) || !apart_or_same(dst, b) || n % 32 != 0) {
        return false;
    }
    ContextState & st = state_of(ctx);
    const Wanted * want = wanted(st, dst);
    if (want == nullptr || (want->planes != 0 && want->planes != F8_PLANES) ||
        ggml_nelements(want->src1) != n) {
        return false;  // 2-16 columns only (a verify; a decode's GLU is its product's)
    }
    const int64_t cols = want->src1->ne[1];
    const int64_t per_col = want->src1->ne[0] / 32;
    const bool f8 = want->planes == F8_PLANES;  // (the down on gemm_f8: its records)
    uint8_t * buf = prepared(st, want->src1, per_col, want->planes);
    const Halves out = f8 ? f8_at(buf, per_col) : halves_at(buf, per_col, int(cols));
    launch_glu_halves(static_cast<const float *>(a->data), static_cast<const float *>(b->data),
                      per_col * 32, 1, 0, static_cast<float *>(dst->data), int(per_col),
                      int(cols), out, ctx.stream(), f8);
    return true;
}

int lucepy_cuda_fuse(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph, int i) {
    using namespace lucepy;
    if (!enabled(ctx.device) || ctx.curr_stream_no != 0) {
        return 0;
    }
    switch (cgraph->nodes[i]->op) {
        case GGML_OP_CONCAT: return conv_step_nodes(ctx, cgraph, i);
        case GGML_OP_RMS_NORM: {
            const int gated = norm_gate_nodes(ctx, cgraph, i);
            return gated > 0 ? gated : norm_rope_nodes(ctx, cgraph, i);
        }
        case GGML_OP_ADD: return delta_gate_nodes(ctx, cgraph, i);
        case GGML_OP_GATED_DELTA_NET: return delta_net_nodes(ctx, cgraph, i);
        case GGML_OP_DUP: return dup_nodes(ctx, cgraph, i);
        case GGML_OP_CONT: return cont_gate_nodes(ctx, cgraph, i);
        case GGML_OP_FLASH_ATTN_EXT: return attn_nodes(ctx, cgraph, i);
        case GGML_OP_MUL_MAT: {
            const int pair = glu_pair_nodes(ctx, cgraph, i);
            return pair > 0 ? pair : mul_mat_add_nodes(ctx, cgraph, i);
        }
        default: return 0;
    }
}

#else  // HIP and MUSA builds take ggml's kernels

bool lucepy_cuda_rms_norm_mul(ggml_backend_cuda_context &, const ggml_cgraph *, int) {
    return false;
}

bool lucepy_cuda_unary_mul(ggml_backend_cuda_context &, const ggml_cgraph *, int) {
    return false;
}

bool lucepy_cuda_glu(ggml_backend_cuda_context &, ggml_tensor *) {
    return false;
}

int lucepy_cuda_fuse(ggml_backend_cuda_context &, const ggml_cgraph *, int) {
    return 0;
}

bool lucepy_cuda_argmax(ggml_backend_cuda_context &, ggml_tensor *) {
    return false;
}

#endif
