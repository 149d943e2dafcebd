// lucepy's own kernels (issue 19, decision 12), hooked into the pinned ggml-cuda: the host side of
// qwen35's DeltaNet recurrence that the hooks take from ggml (through lucepy_cuda_fuse, in
// lucepy-fuse.cu): a step's, a verify's with the state copy before it, a rollback's layers in
// one launch. Its kernels are lucepy-recurrence.cuh's; the gates and the conv step are
// lucepy-deltanet.cu's.

#include "lucepy-host.cuh"
#include "lucepy-recurrence.cuh"

#include <algorithm>
#include <cstring>
#include <unordered_map>
#include <utility>
#include <vector>

#if !defined(GGML_USE_HIP) && !defined(GGML_USE_MUSA)

namespace lucepy {

// Whether `cgraph` (the one `st` holds) computes only DeltaNet recurrences and copies (a
// rollback's: each layer's recurrence over the accepted tokens, its state's copy and the conv
// tail's), none reading or writing the bytes another writes. A recurrence and the copy of its
// result are one (delta_net's): they read the recurrence's inputs and write the copy's
// destination, and the recurrence's own result only where a node other than the copy reads it
// (where nothing does, the allocator lays every layer's result over the same bytes, which no
// kernel then writes). Then every kernel of it may run without waiting for the one before (PDL),
// and they may be one launch: none needs another's results, so none after it can need them
// through its wait either. Learnt once a graph, comparing every two nodes (a rollback's 48
// layers: 144).
bool recurrences_apart(ContextState & st, const ggml_cgraph * cgraph) {
    if (st.cgraph != cgraph) {
        return false;
    }
    if (st.apart >= 0) {
        return st.apart == 1;
    }
    st.apart = 0;
    struct Group {
        const ggml_tensor * op;
        const ggml_tensor * copy;  // of a recurrence's result, or null
        std::vector<Span> reads, writes;
    };
    std::vector<Group> groups;
    std::unordered_map<const ggml_tensor *, size_t> of;  // a recurrence's group
    for (int i = 0; i < cgraph->n_nodes; i++) {
        const ggml_tensor * node = cgraph->nodes[i];
        if (no_op(node)) {
            continue;
        }
        if (node->op != GGML_OP_GATED_DELTA_NET && node->op != GGML_OP_CPY) {
            return false;
        }
        const auto found = node->op == GGML_OP_CPY ? of.find(node->src[0]->view_src) : of.end();
        if (found != of.end() && groups[found->second].copy == nullptr) {
            groups[found->second].copy = node;  // it writes where it copies
            groups[found->second].writes.push_back(span_of(node));
            continue;
        }
        Group g = {node, nullptr, {}, {}};
        for (int k = 0; k < GGML_MAX_SRC && node->src[k]; k++) {
            g.reads.push_back(span_of(node->src[k]));
        }
        if (node->op == GGML_OP_CPY) {
            g.writes.push_back(span_of(node));
        } else {
            of[node] = groups.size();
        }
        groups.push_back(std::move(g));
    }
    for (Group & g : groups) {  // a recurrence's result, where a node but its copy reads it
        if (g.op->op == GGML_OP_GATED_DELTA_NET &&
            bytes_read(st, cgraph, g.op, 0, ggml_nbytes(g.op), g.copy)) {
            g.writes.push_back(span_of(g.op));
        }
    }
    for (size_t a = 0; a < groups.size(); a++) {
        for (size_t b = a + 1; b < groups.size(); b++) {
            const Group & ga = groups[a];
            const Group & gb = groups[b];
            if (spans_meet(ga.writes, gb.writes) || spans_meet(ga.writes, gb.reads) ||
                spans_meet(gb.writes, ga.reads)) {
                return false;
            }
        }
    }
    st.apart = 1;
    return true;
}

// qwen35's gated delta net from node i, a GATED_DELTA_NET, the copy of its new state that comes
// next, and the copy after that where it can, as delta_net's arguments `a` (`tail`: whether
// the second copy is theirs): the nodes after i they compute, or 0. With `dup`, the op's s0 is
// that copy of the state (a verify keeps the state before it for a rollback), which the kernel
// writes as it loads the state from the copy's source: the copy is not a node of its own.
int delta_net_args(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph, int i,
                   const ggml_tensor * dup, DeltaNetArgs & a, bool & tail_copied) {
    const ggml_tensor * dn = cgraph->nodes[i];
    const ggml_tensor * q = dn->src[0];
    const ggml_tensor * k = dn->src[1];
    const ggml_tensor * v = dn->src[2];
    const ggml_tensor * g = dn->src[3];
    const ggml_tensor * beta = dn->src[4];
    const ggml_tensor * s0 = dup ? dup->src[0] : dn->src[5];
    const int64_t S = v->ne[0], H = v->ne[1], T = v->ne[2], N = v->ne[3];
    const int i_cpy = next_op(cgraph, i);
    if (ggml_get_op_params_i32(dn, 0) != 1 || S != DN_S || i_cpy >= cgraph->n_nodes) {
        return 0;  // per-token snapshots, or another state size: ggml's
    }
    const ggml_tensor * cpy = cgraph->nodes[i_cpy];
    const ggml_tensor * from = cpy->src[0];
    const ggml_tensor * into = cpy->src[1];
    const size_t attn_bytes = sizeof(float) * size_t(S * H * T * N);
    const int64_t nstate = S * S * H * N;
    // 16-byte rows at 16-byte strides (cp.async's copies)
    auto rows16 = [](const ggml_tensor * t) {
        return t->type == GGML_TYPE_F32 && t->nb[0] == sizeof(float) && strides_aligned(t, 16);
    };
    auto a_state = [&](const ggml_tensor * t) {  // the new state's elements, dense
        return t->type == GGML_TYPE_F32 && ggml_is_contiguous(t) && ggml_nelements(t) == nstate;
    };
    auto gate = [&](const ggml_tensor * t) {
        return t->type == GGML_TYPE_F32 && ggml_is_contiguous(t) && t->ne[0] == 1 &&
               t->ne[1] == H && t->ne[2] == T && t->ne[3] == N;
    };
    const bool shapes =
        cpy->op == GGML_OP_CPY && from->view_src == dn && from->view_offs == attn_bytes &&
        a_state(from) && a_state(into) && rows16(q) && rows16(k) && rows16(v) &&
        q->ne[0] == S && ggml_are_same_shape(q, k) && ggml_are_same_stride(q, k) &&
        q->ne[2] == T && q->ne[3] >= 1 && N % q->ne[3] == 0 && gate(g) && gate(beta) &&
        s0->type == GGML_TYPE_F32 && ggml_is_contiguous(s0) && s0->ne[0] == S &&
        s0->ne[1] == S && s0->ne[2] == H && s0->ne[3] == N && dn->type == GGML_TYPE_F32 &&
        ggml_is_contiguous(dn) && H <= 65535 && N <= 65535 && T * N < INT32_MAX &&
        (!dup || (dn->src[5] == dup && dense_like(dup, s0)));
    if (!shapes) {
        return 0;
    }
    // bytes apart from every tensor the op reads or writes
    auto apart_from_op = [&](Span s) {
        for (const ggml_tensor * t : {q, k, v, g, beta, s0, into, dn}) {
            if (!apart(s, span_of(t))) {
                return false;
            }
        }
        return true;
    };
    if (dup && !apart_from_op(span_of(dup))) {  // the copy of the state
        return 0;
    }
    // The attention rows apart from every input; the new state apart from them but s0, which it
    // may be (each warp reads its column of s0 before it writes the same column).
    const Span s_attn = {static_cast<const char *>(dn->data),
                         static_cast<const char *>(dn->data) + attn_bytes};
    const Span s_into = span_of(into);
    for (const ggml_tensor * in : {q, k, v, g, beta}) {
        if (!apart(s_attn, span_of(in)) || !apart(s_into, span_of(in))) {
            return 0;
        }
    }
    const bool into_s0 = into->data == s0->data;
    if (!apart(s_attn, span_of(s0)) || !apart(s_attn, s_into) ||
        !(apart(s_into, span_of(s0)) || into_s0)) {
        return 0;
    }
    // the op's own copy of the state: only where anything but the copy reads it
    const bool keep = bytes_read(state_of(ctx), cgraph, dn, attn_bytes, ggml_nbytes(dn), cpy);
    // A copy that comes next (a rollback's copy of the conv's tail), of f32 rows (ne0 values,
    // rows nb1 apart) into dense f32, its bytes apart from everything the op reads or writes:
    // the kernel's threads make it too, one element each.
    const int i_tail = next_op(cgraph, i_cpy);
    const ggml_tensor * tail = i_tail < cgraph->n_nodes ? cgraph->nodes[i_tail] : nullptr;
    if (tail && tail->op == GGML_OP_CPY) {
        const ggml_tensor * from = tail->src[0];
        const Span s_to = span_of(tail), s_from = span_of(from);
        const bool ok = tail->type == GGML_TYPE_F32 && ggml_is_contiguous(tail) &&
                        columns_apart(from) && ggml_nelements(from) < INT32_MAX &&
                        ggml_nelements(from) == ggml_nelements(tail) && apart_from_op(s_to) &&
                        apart_from_op(s_from) && apart(s_to, s_from) &&
                        (!dup || (apart(s_to, span_of(dup)) && apart(s_from, span_of(dup))));
        tail = ok ? tail : nullptr;
    } else {
        tail = nullptr;
    }
    // The state read before the kernel waits for the ones before it (PDL), where nothing that
    // may still run then writes it: the graph is being captured (a graph launch waits for all
    // work before it) and no node before this one in it writes the state's bytes.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    CUDA_CHECK(cudaStreamIsCapturing(ctx.stream(), &capture));
    bool early = capture == cudaStreamCaptureStatusActive;
    for (int j = 0; early && j < i; j++) {
        early = no_op(cgraph->nodes[j]) || apart(span_of(cgraph->nodes[j]), span_of(s0));
    }
    a = {};
    a.early = early;
    a.alone = early && recurrences_apart(state_of(ctx), cgraph);
    a.q = static_cast<const float *>(q->data);
    a.k = static_cast<const float *>(k->data);
    a.sq1 = int64_t(q->nb[1] / sizeof(float));
    a.sq2 = int64_t(q->nb[2] / sizeof(float));
    a.sq3 = int64_t(q->nb[3] / sizeof(float));
    a.v = static_cast<const float *>(v->data);
    a.sv1 = int64_t(v->nb[1] / sizeof(float));
    a.sv2 = int64_t(v->nb[2] / sizeof(float));
    a.sv3 = int64_t(v->nb[3] / sizeof(float));
    a.g = static_cast<const float *>(g->data);
    a.beta = static_cast<const float *>(beta->data);
    a.sb1 = int64_t(beta->nb[1] / sizeof(float));
    a.sb2 = int64_t(beta->nb[2] / sizeof(float));
    a.sb3 = int64_t(beta->nb[3] / sizeof(float));
    a.s0 = static_cast<const float *>(s0->data);
    a.s0_copy = dup ? static_cast<float *>(dup->data) : nullptr;
    // the attention rows, where a node but the copy reads them (not a rollback's)
    const bool attn_read = bytes_read(state_of(ctx), cgraph, dn, 0, attn_bytes, cpy);
    a.attn = attn_read ? static_cast<float *>(dn->data) : nullptr;
    a.state = static_cast<float *>(into->data);
    a.state2 = keep ? static_cast<float *>(dn->data) + S * H * T * N : nullptr;
    a.H = int(H);
    a.N = int(N);
    a.T = int(T);
    a.hk = int(q->ne[1]);
    a.rq3 = int(N / q->ne[3]);
    a.scale = 1.0f / sqrtf(float(S));
    if (tail) {
        a.tail_from = static_cast<const float *>(tail->src[0]->data);
        a.tail_row = int(tail->src[0]->ne[0]);
        a.tail_stride = int64_t(tail->src[0]->nb[1] / sizeof(float));
        a.tail = static_cast<float *>(tail->data);
        a.tail_n = int(ggml_nelements(tail));
    }
    tail_copied = tail != nullptr;
    return (tail ? i_tail : i_cpy) - i;
}

// delta_net_args' recurrence from node i (lucepy_cuda_fuse), and where it is `alone` (a
// rollback's), the ones after it that are too, up to DN_LAYERS in one launch: the nodes after i
// computed, or 0
int delta_net_nodes(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph, int i,
                    const ggml_tensor * dup) {
    DeltaNetLayers b;
    bool tail = false;
    const int done = delta_net_args(ctx, cgraph, i, dup, b.a[0], tail);
    if (done == 0) {
        return 0;
    }
    b.n = 1;
    int last = i + done;  // the last node computed
    auto count = [](bool copied) {
        g_ops.fetch_add(1, std::memory_order_relaxed);
        g_copies.fetch_add(copied ? 1 : 0, std::memory_order_relaxed);
    };
    count(tail);
    const DeltaNetArgs & first = b.a[0];
    while (first.alone && b.n < DN_LAYERS) {
        const int j = next_op(cgraph, last);
        if (j >= cgraph->n_nodes || cgraph->nodes[j]->op != GGML_OP_GATED_DELTA_NET) {
            break;
        }
        DeltaNetArgs & more = b.a[b.n];
        const int more_done = delta_net_args(ctx, cgraph, j, nullptr, more, tail);
        if (more_done == 0 || !more.alone || more.H != first.H || more.N != first.N) {
            break;
        }
        count(tail);
        g_joined.fetch_add(1, std::memory_order_relaxed);
        b.n++;
        last = j + more_done;
    }
    if (b.n == 1) {
        const dim3 grid{unsigned(first.H), unsigned(first.N), unsigned(DnModel::z)};
        ggml_cuda_kernel_launch(delta_net<DnModel>,
                                ggml_cuda_kernel_launch_params(grid, DnModel::threads, 0,
                                                               ctx.stream()),
                                first);
    } else {
        const dim3 grid{unsigned(first.H), unsigned(first.N), unsigned(DnModel::z * b.n)};
        ggml_cuda_kernel_launch(delta_net_layers<DnModel>,
                                ggml_cuda_kernel_launch_params(grid, DnModel::threads, 0,
                                                               ctx.stream()),
                                b);
    }
    return last - i;
}

// node i, a DUP: the verify's copy of the DeltaNet state that the GATED_DELTA_NET after it reads
// (delta_net_nodes with `dup`), or 0
int dup_nodes(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph, int i) {
    const int i_dn = next_op(cgraph, i);
    if (i_dn >= cgraph->n_nodes || cgraph->nodes[i_dn]->op != GGML_OP_GATED_DELTA_NET) {
        return 0;
    }
    const int done = delta_net_nodes(ctx, cgraph, i_dn, cgraph->nodes[i]);
    if (done == 0) {
        return 0;
    }
    g_copies.fetch_add(1, std::memory_order_relaxed);
    return i_dn - i + done;
}

}  // namespace lucepy

#endif
