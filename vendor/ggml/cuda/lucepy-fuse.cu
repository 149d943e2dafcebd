// lucepy's own kernels (issue 19, decision 12), hooked into the pinned ggml-cuda: the host side of
// the ops around the products that the hooks take from ggml (lucepy_cuda_fuse and the others):
// RMS norms that write the next product's activations as they compute, residual sums, argmax,
// and the hook that hands each node to its file's function. lucepy-gates.cu has the gated norm,
// the heads' norm and rope and the gates, lucepy-deltanet.cu qwen35's DeltaNet conv step, gates
// and recurrence, lucepy-attn.cu attention of 1-16 queries, lucepy-mm.cu the products and the
// state a graph keeps; lucepy-host.cuh what they share.

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

// `t`'s data and each of its strides a multiple of n bytes (n-byte loads or copies at any of its
// rows)
bool strides_aligned(const ggml_tensor * t, size_t n) {
    return uintptr_t(t->data) % n == 0 && t->nb[1] % n == 0 && t->nb[2] % n == 0 &&
           t->nb[3] % n == 0;
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
