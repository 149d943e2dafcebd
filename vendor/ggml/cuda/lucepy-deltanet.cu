// lucepy's own kernels (issue 19, decision 12), hooked into the pinned ggml-cuda: the host side of
// qwen35's Gated DeltaNet ops that the hooks take from ggml (through lucepy_cuda_fuse, in
// lucepy-fuse.cu): its gates and its conv step with q's and k's norms (the recurrence is
// lucepy-recurrence.cu's). Their kernels are lucepy-deltanet.cuh's; what this file shares with
// the others, lucepy-host.cuh's.

#include "lucepy-host.cuh"
#include "lucepy-deltanet.cuh"

#include <algorithm>
#include <cstring>
#include <unordered_map>
#include <utility>
#include <vector>

#if !defined(GGML_USE_HIP) && !defined(GGML_USE_MUSA)

namespace lucepy {

// a dense f32 tensor of ne0 x ne1 x ne2 at the start of `t`'s bytes, element for element
bool dense_as(const ggml_tensor * t, int64_t ne0, int64_t ne1, int64_t ne2) {
    return t->type == GGML_TYPE_F32 && t->nb[0] == sizeof(float) &&
           t->nb[1] == sizeof(float) * size_t(ne0) && t->nb[2] == t->nb[1] * size_t(ne1) &&
           t->ne[0] == ne0 && t->ne[1] == ne1 && t->ne[2] == ne2 && t->ne[3] == 1;
}

// qwen35's DeltaNet gates from node i, an ADD: what `delta_gates` computes for them, and the
// bytes it reads and writes; nothing launched
struct GatesPlan {
    DeltaGates g = {};
    int last = -1;      // the last node they take, or -1: not the gates
    bool cont = false;  // beta read from a CONT's source (the copy made)
    Span reads[4] = {}, writes[4] = {};  // (empty spans where beta's sigmoid is not theirs)
};

GatesPlan plan_delta_gates(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph, int i) {
    GatesPlan plan;
    const ggml_tensor * add = cgraph->nodes[i];
    const int i_soft = next_op(cgraph, i);
    const int i_mul = i_soft < cgraph->n_nodes ? next_op(cgraph, i_soft) : i_soft;
    if (i_mul >= cgraph->n_nodes) {
        return plan;
    }
    const ggml_tensor * soft = cgraph->nodes[i_soft];
    const ggml_tensor * mul = cgraph->nodes[i_mul];
    if (soft->op != GGML_OP_UNARY || ggml_get_unary_op(soft) != GGML_UNARY_OP_SOFTPLUS ||
        soft->src[0] != add || mul->op != GGML_OP_MUL ||
        (mul->src[0] != soft && mul->src[1] != soft)) {
        return plan;
    }
    const ggml_tensor * alpha = add->src[0];
    const ggml_tensor * bias = add->src[1];
    const ggml_tensor * a = mul->src[0] == soft ? mul->src[1] : mul->src[0];
    const int64_t n = ggml_nelements(add), period = add->ne[0];
    auto dense = [&](const ggml_tensor * t) { return dense_like(t, add); };
    auto row = [&](const ggml_tensor * t) {  // one row of add's, repeated over its rows
        return t->type == GGML_TYPE_F32 && ggml_is_contiguous(t) && t->ne[0] == period &&
               ggml_nelements(t) == period;
    };
    // alpha dense, or columns of add's rows apart (a view of a stacked product's part)
    const bool alpha_dense = dense(alpha);
    const bool alpha_columns = columns_apart(alpha) && ggml_are_same_shape(alpha, add);
    if (!dense(add) || !(alpha_dense || alpha_columns) || !dense(soft) || !dense(mul) ||
        !row(bias) || !row(a) || n >= INT32_MAX) {
        return plan;
    }
    // each result apart from the rows (read by every thread), and from the others or at the same
    // address (the same element: read first by the thread that writes it); from alpha so too
    // where it is dense, else apart
    const auto clear = apart_or_same;
    for (const ggml_tensor * o : {add, soft, mul}) {
        if (!apart(span_of(o), span_of(bias)) || !apart(span_of(o), span_of(a)) ||
            !(alpha_dense ? clear(o, alpha) : apart(span_of(o), span_of(alpha)))) {
            return plan;
        }
    }
    if (!clear(add, soft) || !clear(add, mul) || !clear(soft, mul)) {
        return plan;
    }
    DeltaGates & g = plan.g;
    g.alpha = static_cast<const float *>(alpha->data);
    g.alpha_stride = int64_t(alpha->nb[1] / sizeof(float));
    g.bias = static_cast<const float *>(bias->data);
    g.a = static_cast<const float *>(a->data);
    g.sum = static_cast<float *>(add->data);
    g.soft = static_cast<float *>(soft->data);
    g.decay = static_cast<float *>(mul->data);
    g.n = int(n);
    g.period = int(period);
    int i_last = i_mul;
    // beta's sigmoid where it comes next (its own elements, apart from all of the above): of a
    // dense beta, or of a CONT that only the sigmoid reads (a verify's beta, copied out of a
    // stacked product's part), read from the CONT's source, columns apart, the CONT not computed
    int i_sig = next_op(cgraph, i_mul);
    const ggml_tensor * cont = nullptr;
    if (i_sig < cgraph->n_nodes && cgraph->nodes[i_sig]->op == GGML_OP_CONT) {
        cont = cgraph->nodes[i_sig];
        i_sig = next_op(cgraph, i_sig);
    }
    if (i_sig < cgraph->n_nodes) {
        const ggml_tensor * sig = cgraph->nodes[i_sig];
        const ggml_tensor * beta = sig->op == GGML_OP_UNARY ? sig->src[0] : nullptr;
        bool fits = beta && ggml_get_unary_op(sig) == GGML_UNARY_OP_SIGMOID &&
                    beta->type == GGML_TYPE_F32 && sig->type == GGML_TYPE_F32 &&
                    ggml_is_contiguous(beta) && ggml_is_contiguous(sig) &&
                    ggml_are_same_shape(beta, sig) && ggml_nelements(sig) < INT32_MAX;
        int64_t period_b = ggml_nelements(sig), stride_b = period_b;
        if (fits && cont) {  // the CONT's source: [rows, columns], rows dense, columns apart
            ContextState & st = state_of(ctx);
            const ggml_tensor * src = cont->src[0];
            fits = beta == cont && !bytes_read(st, cgraph, cont, 0, ggml_nbytes(cont), sig) &&
                   columns_apart(src) && ggml_are_same_shape(src, sig);
            beta = src;
            period_b = src->ne[0];
            stride_b = int64_t(src->nb[1] / sizeof(float));
        }
        // (beta may share bytes with alpha, bias or a, all only read: parts of one product)
        bool apart_all = fits && (cont ? apart(span_of(sig), span_of(beta)) : clear(sig, beta));
        for (const ggml_tensor * t : {alpha, bias, a, add, soft, mul}) {
            apart_all = apart_all && apart(span_of(sig), span_of(t));
        }
        for (const ggml_tensor * t : {add, soft, mul}) {
            apart_all = apart_all && apart(span_of(beta), span_of(t));
        }
        if (apart_all) {
            g.beta = static_cast<const float *>(beta->data);
            g.beta_period = int(period_b);
            g.beta_stride = stride_b;
            g.sig = static_cast<float *>(sig->data);
            g.nbeta = int(ggml_nelements(sig));
            i_last = i_sig;
            plan.cont = cont != nullptr;
            plan.reads[3] = span_of(beta);
            plan.writes[3] = span_of(sig);
        }
    }
    plan.reads[0] = span_of(alpha), plan.reads[1] = span_of(bias), plan.reads[2] = span_of(a);
    plan.writes[0] = span_of(add), plan.writes[1] = span_of(soft), plan.writes[2] = span_of(mul);
    plan.last = i_last;
    return plan;
}

// the gates' elements (a thread each)
int64_t gate_elements(const DeltaGates & g) {
    return std::max<int64_t>(g.n, g.nbeta);
}

// the gates of `plan` computed: an op, and beta's copy where it was not made
void count_gates(const GatesPlan & plan) {
    g_ops.fetch_add(1, std::memory_order_relaxed);
    g_copies.fetch_add(plan.cont ? 1 : 0, std::memory_order_relaxed);
}

// qwen35's conv step from node i, a CONCAT (lucepy_cuda_fuse): the nodes after i computed, or 0
int conv_step_nodes(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph, int i) {
    const ggml_tensor * x = cgraph->nodes[i];
    const int i_cpy = next_op(cgraph, i);
    const int i_conv = i_cpy < cgraph->n_nodes ? next_op(cgraph, i_cpy) : i_cpy;
    if (x->op != GGML_OP_CONCAT || ggml_get_op_params_i32(x, 0) != 0 || i_conv >= cgraph->n_nodes) {
        return 0;
    }
    const ggml_tensor * cpy = cgraph->nodes[i_cpy];
    const ggml_tensor * conv = cgraph->nodes[i_conv];
    if (cpy->op != GGML_OP_CPY || conv->op != GGML_OP_SSM_CONV || conv->src[0] != x) {
        return 0;
    }
    const int i_act = next_op(cgraph, i_conv);
    const ggml_tensor * act = i_act < cgraph->n_nodes ? cgraph->nodes[i_act] : nullptr;
    if (act && !(act->op == GGML_OP_UNARY && ggml_get_unary_op(act) == GGML_UNARY_OP_SILU &&
                 act->src[0] == conv)) {
        act = nullptr;
    }
    const ggml_tensor * saved = x->src[0];
    const ggml_tensor * steps = x->src[1];
    const ggml_tensor * tail = cpy->src[0];
    const ggml_tensor * into = cpy->src[1];
    const ggml_tensor * w = conv->src[1];
    const int64_t K1 = saved->ne[0], C = saved->ne[1], N = saved->ne[2], t = steps->ne[0];
    const bool shapes = tail->view_src == x && tail->view_offs == size_t(t) * x->nb[0] &&
                        tail->ne[0] == K1 && tail->ne[1] == C && tail->ne[2] == N &&
                        tail->nb[1] == x->nb[1] && tail->nb[2] == x->nb[2];
    if (!shapes || K1 != 3 || t < 1 || t > CONV_MAX_T || C >= INT32_MAX || N > 65535) {
        return 0;
    }
    auto floats = [](const ggml_tensor * u) {  // (any strides: the new columns are permuted)
        return u->type == GGML_TYPE_F32 && u->ne[3] == 1 && u->nb[0] % sizeof(float) == 0 &&
               u->nb[1] % sizeof(float) == 0 && u->nb[2] % sizeof(float) == 0;
    };
    const bool layouts =
        floats(saved) && saved->nb[0] == sizeof(float) && floats(steps) && steps->ne[1] == C &&
        steps->ne[2] == N && dense_as(x, K1 + t, C, N) &&
        dense_as(w, K1 + 1, C, 1) && dense_as(conv, C, t, N) &&
        (!act || dense_as(act, C, t, N)) && into->type == GGML_TYPE_F32 &&
        ggml_is_contiguous(into) && ggml_nelements(into) == K1 * C * N;
    if (!layouts) {
        return 0;
    }
    // the joined columns are written only where something else reads them (a verify keeps them
    // for its rollback): in a decode they are dead once the conv has read them, and ggml's
    // allocator may place a later result of the group over them. Their readers in the group:
    // the tail's view, the copy (through it) and the conv.
    ContextState & st = state_of(ctx);
    const bool x_read = (x->flags & GGML_TENSOR_FLAG_OUTPUT) != 0 || st.cgraph != cgraph ||
                        st.readers(x) > 3;
    // what is written aliases nothing read, or only what the kernel reads first (conv_step)
    const Span s_saved = span_of(saved), s_steps = span_of(steps), s_w = span_of(w);
    const Span s_tail = span_of(into), s_conv = span_of(conv);
    const Span s_x = x_read ? span_of(x) : Span{nullptr, nullptr};  // (apart from all: unwritten)
    const bool steps_dense = steps->nb[0] == sizeof(float) * size_t(C) &&
                             steps->nb[1] == sizeof(float) && steps->nb[2] == steps->nb[0] * t;
    auto over_steps = [&](const ggml_tensor * out) {  // the same element, the same thread
        return apart(span_of(out), s_steps) || (steps_dense && out->data == steps->data);
    };
    const bool tail_ok = apart(s_tail, s_saved) ||
                         (into->data == saved->data && dense_as(saved, K1, C, N));
    bool ok = tail_ok && apart(s_tail, s_steps) && apart(s_tail, s_w) && apart(s_tail, s_x) &&
              apart(s_tail, s_conv) && apart(s_x, s_saved) && apart(s_x, s_steps) &&
              apart(s_x, s_w) && apart(s_x, s_conv) && apart(s_conv, s_saved) &&
              apart(s_conv, s_w) && over_steps(conv);
    if (act) {
        const Span s_act = span_of(act);
        ok = ok && apart_or_same(act, conv) && apart(s_act, s_saved) &&
             apart(s_act, s_w) && apart(s_act, s_x) && apart(s_act, s_tail) && over_steps(act);
    }
    if (!ok) {
        return 0;
    }
    // qwen35's l2 norm of q and k after the SiLU: an RMS norm of its first heads of
    // CONV_THREADS channels (a view of the SiLU's 2D reshape), then a SCALE
    int heads = 0;
    const ggml_tensor * normed = nullptr;
    const ggml_tensor * scaled = nullptr;
    int i_last = act ? i_act : i_conv;
    const int i_norm = act ? next_op(cgraph, i_act) : cgraph->n_nodes;
    const int i_scale = i_norm < cgraph->n_nodes ? next_op(cgraph, i_norm) : i_norm;
    if (i_scale < cgraph->n_nodes && cgraph->nodes[i_norm]->op == GGML_OP_RMS_NORM &&
        cgraph->nodes[i_scale]->op == GGML_OP_SCALE &&
        cgraph->nodes[i_scale]->src[0] == cgraph->nodes[i_norm]) {
        const ggml_tensor * norm = cgraph->nodes[i_norm];
        const ggml_tensor * sc = cgraph->nodes[i_scale];
        const ggml_tensor * qk = norm->src[0];
        const int64_t h = qk->ne[1];
        const size_t row = sizeof(float) * size_t(C);
        float bias = 0.0f;
        std::memcpy(&bias, sc->op_params + 1, sizeof(float));
        const bool fits = qk->view_src == act && qk->view_offs == 0 && qk->type == GGML_TYPE_F32 &&
                          qk->ne[0] == CONV_THREADS && h >= 1 && h * CONV_THREADS <= C &&
                          qk->ne[2] == t && qk->ne[3] == N && qk->nb[0] == sizeof(float) &&
                          qk->nb[1] == sizeof(float) * CONV_THREADS && qk->nb[2] == row &&
                          qk->nb[3] == row * size_t(t) && norm->type == GGML_TYPE_F32 &&
                          ggml_is_contiguous(norm) && ggml_are_same_shape(norm, qk) &&
                          sc->type == GGML_TYPE_F32 && ggml_is_contiguous(sc) &&
                          ggml_are_same_shape(sc, qk) && bias == 0.0f;
        const Span s_norm = span_of(norm), s_sc = span_of(sc);
        auto clear_of_all = [&](Span o) {
            return apart(o, s_saved) && apart(o, s_steps) && apart(o, s_w) && apart(o, s_x) &&
                   apart(o, s_tail) && apart(o, s_conv) && apart(o, span_of(act));
        };
        if (fits && clear_of_all(s_norm) && clear_of_all(s_sc) &&
            apart_or_same(norm, sc)) {
            heads = int(h);
            normed = norm;
            scaled = sc;
            i_last = i_scale;
        }
    }
    ConvArgs a;
    a.heads = heads;
    a.normed = normed ? static_cast<float *>(normed->data) : nullptr;
    a.scaled = scaled ? static_cast<float *>(scaled->data) : nullptr;
    a.eps = 0.0f;
    a.scale = 1.0f;
    if (normed) {
        std::memcpy(&a.eps, normed->op_params, sizeof(float));
        std::memcpy(&a.scale, scaled->op_params, sizeof(float));
    }
    a.saved = static_cast<const float *>(saved->data);
    a.s_c = saved->nb[1] / int64_t(sizeof(float));
    a.s_n = saved->nb[2] / int64_t(sizeof(float));
    a.steps = static_cast<const float *>(steps->data);
    a.x_t = steps->nb[0] / int64_t(sizeof(float));
    a.x_c = steps->nb[1] / int64_t(sizeof(float));
    a.x_n = steps->nb[2] / int64_t(sizeof(float));
    a.w = static_cast<const float *>(w->data);
    a.x = x_read ? static_cast<float *>(x->data) : nullptr;
    a.tail = static_cast<float *>(into->data);
    a.conv = static_cast<float *>(conv->data);
    a.act = act ? static_cast<float *>(act->data) : nullptr;
    a.C = int(C);
    a.t = int(t);
    // groups of CONV_GROUP tokens where no result lies over the new columns (a later group's
    // CTA reads those of the group before it); else one
    const bool apart_steps = apart(s_conv, s_steps) && (!act || apart(span_of(act), s_steps));
    a.per_group = apart_steps ? CONV_GROUP : int(t);
    // The DeltaNet gates where they come next, in the same kernel (its CTAs past the channels'):
    // they read and write no bytes the step writes, nor write any it reads.
    DeltaGates gates = {};
    int gate_tiles = 0;
    const int j = next_op(cgraph, i_last);
    if (j < cgraph->n_nodes && cgraph->nodes[j]->op == GGML_OP_ADD) {
        const GatesPlan plan = plan_delta_gates(ctx, cgraph, j);
        const Span step_reads[] = {s_saved, s_steps, s_w};
        const Span step_writes[] = {s_tail, s_conv, s_x, act ? span_of(act) : Span{},
                                    normed ? span_of(normed) : Span{},
                                    scaled ? span_of(scaled) : Span{}};
        const bool join = plan.last >= 0 && !spans_meet(step_writes, plan.reads) &&
                          !spans_meet(step_writes, plan.writes) &&
                          !spans_meet(step_reads, plan.writes);
        if (join) {
            gates = plan.g;
            gate_tiles = int((gate_elements(gates) + CONV_THREADS - 1) / CONV_THREADS);
            i_last = plan.last;
            count_gates(plan);
            g_joined.fetch_add(1, std::memory_order_relaxed);
        }
    }
    g_ops.fetch_add(1, std::memory_order_relaxed);
    const dim3 grid{unsigned((C + CONV_THREADS - 1) / CONV_THREADS + gate_tiles), unsigned(N),
                    unsigned((t + a.per_group - 1) / a.per_group)};
    ggml_cuda_kernel_launch(conv_step<4>,
                            ggml_cuda_kernel_launch_params(grid, CONV_THREADS, 0, ctx.stream()), a,
                            gates);
    return i_last - i;
}

// qwen35's DeltaNet gates from node i, an ADD (lucepy_cuda_fuse): the nodes after i computed,
// or 0
int delta_gate_nodes(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph, int i) {
    const GatesPlan plan = plan_delta_gates(ctx, cgraph, i);
    if (plan.last < 0) {
        return 0;
    }
    constexpr int THREADS = 256;
    const dim3 grid{unsigned((gate_elements(plan.g) + THREADS - 1) / THREADS)};
    ggml_cuda_kernel_launch(delta_gates,
                            ggml_cuda_kernel_launch_params(grid, THREADS, 0, ctx.stream()),
                            plan.g);
    count_gates(plan);
    return plan.last - i;
}

}  // namespace lucepy

#endif
