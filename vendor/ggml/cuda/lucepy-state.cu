// lucepy's own kernels (issue 19, decision 12): their state on the host. The switches and the
// counters (and the C exports that lucepy's Python side reads), each context's state with the
// activations it keeps for a graph, and the one scan of a graph that says what each product of
// ours reads. lucepy-mm.cu and lucepy-repacked.cu launch the products (the latter keeps the
// repacked matrices' registry), lucepy-fuse.cu and lucepy-deltanet.cu the other ops;
// lucepy-host.cuh declares what they share.

#include "lucepy-host.cuh"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <unordered_map>

namespace lucepy {
std::atomic<int> g_on{-2};  // -2: not yet read; -1: the default; 0 or 1: forced off or on
std::atomic<int64_t> g_calls{0};
std::atomic<int64_t> g_quantized{0};
std::atomic<int64_t> g_fused{0};
std::atomic<int64_t> g_ops{0};
std::atomic<int64_t> g_copies{0};  // copy nodes (DUP, CONT, CPY) a kernel of ours made as it ran
std::atomic<int64_t> g_joined{0};  // ops computed in another op's kernel (one launch less each)
std::atomic<int64_t> g_bulk{0};    // products of gemm_rb (bulk_product)
std::atomic<int64_t> g_f8{0};      // products of gemm_f8 (f8_pair)
std::atomic<int64_t> g_paired{0};  // products whose parts a cluster added (f8_paired)
std::atomic<int64_t> g_tailed{0};  // gemm_f8's products with a tail (f8_tail)
}  // namespace lucepy

#if !defined(GGML_USE_HIP) && !defined(GGML_USE_MUSA)

namespace lucepy {

// A switch of one of the kernels' choices, for comparison: on unless the environment sets
// `name` to 0 (callers keep the answer in a static: read once a process)
bool switched_on(const char * name) {
    const char * env = std::getenv(name);
    return !(env && env[0] == '0');
}

int switched_count(const char * name, int fallback) {
    const char * env = std::getenv(name);
    const int n = env ? std::atoi(env) : 1;
    return n == 1 ? fallback : n;
}

int mode() {
    int on = g_on.load(std::memory_order_relaxed);
    if (on == -2) {
        const char * env = std::getenv("LUCEPY_CUDA_KERNELS");
        on = (env && env[0] == '1') ? 1 : (env && env[0] == '0') ? 0 : -1;
        g_on.store(on, std::memory_order_relaxed);
    }
    return on;
}

// Whether the kernels take the products of one device: forced, or by default where they were
// measured (an NVIDIA GPU of compute capability 9.0 or newer).
bool enabled(int device) {
    const int on = mode();
    if (on >= 0) {
        return on == 1;
    }
    const int cc = ggml_cuda_info().devices[device].cc;
    return GGML_CUDA_CC_IS_NVIDIA(cc) && cc >= GGML_CUDA_CC_HOPPER;
}

std::mutex g_mutex;
std::unordered_map<const ggml_backend_cuda_context *, ContextState> g_states;

ContextState & state_of(const ggml_backend_cuda_context & ctx) {
    std::lock_guard<std::mutex> lock(g_mutex);
    return g_states[&ctx];
}

// The activations a product reads: `planes` int8 planes a piece (gemv), halves (planes 0:
// gemm's to_halves), or e4m3 records (F8_PLANES: gemm_f8's to_e4m3, 16 columns).
size_t quantized_bytes(int64_t npieces, int64_t ncols, int planes) {
    if (planes == F8_PLANES) {
        return size_t(f8_bytes(npieces));
    }
    if (planes == 0) {
        return size_t(halves_bytes(npieces, int(ncols)));
    }
    return size_t(npieces * ncols * planes) * (32 + sizeof(float2));
}

Planes planes_at(uint8_t * buf, int64_t npieces, int64_t ncols, int planes) {
    return {reinterpret_cast<int8_t *>(buf),
            reinterpret_cast<float2 *>(buf + npieces * ncols * planes * 32)};
}

// The slot that keeps src1's activations (`planes` planes, or halves) for the graph: its buffer,
// and whether it holds them already (`*fresh` false) or was just claimed for them (true: the
// caller fills it on ctx's stream).
uint8_t * claim(ContextState & st, const ggml_tensor * src1, int64_t npieces, int planes,
                bool * fresh) {
    const size_t need = quantized_bytes(npieces, src1->ne[1], planes);
    Kept * oldest = &st.slot[0];
    auto age = [&](const Kept & k) { return k.graph == st.graph ? k.used : 0; };  // stale first
    for (Kept & k : st.slot) {
        if (k.graph == st.graph && k.node == src1 && k.data == src1->data &&
            k.ne0 == src1->ne[0] && k.ne1 == src1->ne[1] && k.nb1 == src1->nb[1] &&
            k.planes == planes) {
            k.used = ++st.clock;
            *fresh = false;
            return k.buf;
        }
        if (age(k) < age(*oldest)) {
            oldest = &k;
        }
    }
    Kept & k = *oldest;
    if (k.cap < need) {
        if (k.buf) {
            st.retired.push_back(k.buf);
        }
        const size_t cap = std::max(need, size_t(1) << 20);
        CUDA_CHECK(cudaMalloc(reinterpret_cast<void **>(&k.buf), cap));
        k.cap = cap;
    }
    k.node = src1;
    k.data = src1->data;
    k.ne0 = src1->ne[0];
    k.ne1 = src1->ne[1];
    k.nb1 = src1->nb[1];
    k.planes = planes;
    k.graph = st.graph;
    k.used = ++st.clock;
    *fresh = true;
    return k.buf;
}

// The slot for src1's activations that the kernel before its product fills as it writes its
// result (an RMS norm, a gate), counted as quantized and as fused: its buffer.
uint8_t * prepared(ContextState & st, const ggml_tensor * src1, int64_t npieces, int planes) {
    bool fresh = false;  // (a kept slot or not: the result is new)
    uint8_t * buf = claim(st, src1, npieces, planes, &fresh);
    g_quantized.fetch_add(1, std::memory_order_relaxed);
    g_fused.fetch_add(1, std::memory_order_relaxed);
    return buf;
}

// One pass over the graph being computed, the first time a hook asks of it: its nodes and
// leafs, how many nodes read each tensor, which bytes of each tensor the nodes that compute
// something read (a view kept as an output counts as a read of its bytes), and what the first
// product of ours that reads a tensor (or a reshape of it) reads of it.
void scan(ContextState & st) {
    const ggml_cgraph * g = st.cgraph;
    if (st.scanned || g == nullptr) {
        return;
    }
    st.scanned = true;
    for (int i = 0; i < g->n_leafs; i++) {
        st.members.insert(g->leafs[i]);
    }
    for (int i = 0; i < g->n_nodes; i++) {
        const ggml_tensor * node = g->nodes[i];
        st.members.insert(node);
        for (int k = 0; k < GGML_MAX_SRC && node->src[k]; k++) {
            st.reads[node->src[k]]++;
            if (node->src[k]->view_src) {
                st.reads[node->src[k]->view_src]++;
            }
        }
        auto read = [&](const ggml_tensor * t) {
            const ggml_tensor * base = t->view_src ? t->view_src : t;
            const size_t from = t->view_src ? t->view_offs : 0;
            st.spans[base].push_back({node, from, from + ggml_nbytes(t)});
        };
        if (!no_op(node)) {
            for (int k = 0; k < GGML_MAX_SRC && node->src[k]; k++) {
                read(node->src[k]);
            }
        } else if (node->view_src && (node->flags & GGML_TENSOR_FLAG_OUTPUT)) {
            read(node);
        }
        int kind, chunk;
        if (node->op != GGML_OP_MUL_MAT || !kind_of(node->src[0]->type, kind, chunk)) {
            continue;
        }
        const ggml_tensor * src1 = node->src[1];
        const int64_t ncols = src1->ne[1];
        const bool repacked = repacked_of(node->src[0]);  // 1-16 columns read planes
        if (repacked ? ncols > MAX_COLS : !takes_cols(node->src[0], ncols, st.device)) {
            continue;  // or halves; a prefill's converts its own (to_halves_col)
        }
        const ggml_tensor * from = src1;  // a reshape's products read its source's bytes
        if (src1->op == GGML_OP_RESHAPE && src1->view_src && ggml_is_contiguous(src1) &&
            ggml_is_contiguous(src1->view_src) && src1->data == src1->view_src->data) {
            from = src1->view_src;
        }
        st.wants.emplace(from, Wanted{src1, ncols == 1 ? planes_of(kind) : 0});  // the first
    }
    // A product gemm_f8 takes alone (f8_single) reads e4m3 records where it is its input's only
    // reader: the kernel before it writes them (launch_sum_norm after a product in parts, the
    // FFN's GLU), else the product converts its input (to_e4m3)
    for (int i = 0; i < g->n_nodes; i++) {
        const ggml_tensor * node = g->nodes[i];
        const ggml_tensor * src1 = node->src[1];
        if (node->op != GGML_OP_MUL_MAT || !f8_single(node->src[0], src1->ne[1], st.device)) {
            continue;
        }
        const auto want = st.wants.find(src1);
        if (want != st.wants.end() && want->second.src1 == src1 && want->second.planes == 0 &&
            st.readers(src1) == 1) {
            want->second.planes = F8_PLANES;
        }
    }
    // An FFN's gate and up that glu_pair_nodes will take as one product on gemm_f8 read their
    // input as e4m3 records: the GLU's result read by a product of ours (the down's: halves, or
    // records that the GLU's kernel writes where gemm_f8 takes the down alone, as above), each
    // product's result by the GLU alone and not kept (glu_pair_nodes checks it all again)
    for (int i = 0; i < g->n_nodes; i++) {
        ggml_tensor * m2 = nullptr;
        ggml_tensor * glu = nullptr;
        const ggml_tensor * m1 = g->nodes[i];
        if (!glu_pair_at(g, i, m2, glu) || !f8_pair(m1, m2, st.device)) {
            continue;
        }
        const auto want = st.wants.find(m1->src[1]);
        const auto down = st.wants.find(glu);
        auto alone = [&](const ggml_tensor * m) {
            return (m->flags & GGML_TENSOR_FLAG_OUTPUT) == 0 && st.readers(m) == 1;
        };
        if (want != st.wants.end() && want->second.src1 == m1->src[1] &&
            want->second.planes == 0 && down != st.wants.end() &&
            (down->second.planes == 0 || down->second.planes == F8_PLANES) && alone(m1) &&
            alone(m2)) {
            want->second.planes = F8_PLANES;
        }
    }
}

// What the graph's first product of ours that reads `t` (or a reshape of it) reads of it, or
// null (for the kernels before the products that prepare their results for them: an RMS norm,
// a gate).
const Wanted * wanted(ContextState & st, const ggml_tensor * t) {
    scan(st);
    const auto found = st.wants.find(t);
    return found == st.wants.end() ? nullptr : &found->second;
}

}  // namespace lucepy

void lucepy_cuda_graph_begin(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph) {
    // ggml's kernels: nothing kept (the next begin with ours on bumps the graph's number)
    if (!lucepy::enabled(ctx.device)) {
        return;
    }
    lucepy::state_of(ctx).begin(cgraph, ctx.device);
}

void lucepy_cuda_context_free(ggml_backend_cuda_context & ctx) {
    using namespace lucepy;
    std::lock_guard<std::mutex> lock(g_mutex);
    const auto found = g_states.find(&ctx);
    if (found == g_states.end()) {
        return;
    }
    ggml_cuda_set_device(ctx.device);
    for (Kept & k : found->second.slot) {
        if (k.buf) {
            CUDA_CHECK(cudaFree(k.buf));
        }
    }
    for (uint8_t * buf : found->second.retired) {
        CUDA_CHECK(cudaFree(buf));
    }
    g_states.erase(found);
}

#else  // HIP and MUSA builds take ggml's kernels

void lucepy_cuda_graph_begin(ggml_backend_cuda_context &, const ggml_cgraph *) {}

void lucepy_cuda_context_free(ggml_backend_cuda_context &) {}

#endif

extern "C" {

void lucepy_cuda_kernels_set(int mode) {
    lucepy::g_on.store(mode < 0 ? -1 : mode ? 1 : 0, std::memory_order_relaxed);
}

int lucepy_cuda_kernels_get(int device) {
#if !defined(GGML_USE_HIP) && !defined(GGML_USE_MUSA)
    if (device < 0 || device >= ggml_cuda_info().device_count) {
        return 0;
    }
    return lucepy::enabled(device) ? 1 : 0;
#else
    return 0;
#endif
}

int64_t lucepy_cuda_kernels_calls(void) {
    return lucepy::g_calls.load(std::memory_order_relaxed);
}

int64_t lucepy_cuda_kernels_quantized(void) {
    return lucepy::g_quantized.load(std::memory_order_relaxed);
}

int64_t lucepy_cuda_kernels_fused(void) {
    return lucepy::g_fused.load(std::memory_order_relaxed);
}

int64_t lucepy_cuda_kernels_ops(void) {
    return lucepy::g_ops.load(std::memory_order_relaxed);
}

int64_t lucepy_cuda_kernels_copies(void) {
    return lucepy::g_copies.load(std::memory_order_relaxed);
}

int64_t lucepy_cuda_kernels_joined(void) {
    return lucepy::g_joined.load(std::memory_order_relaxed);
}

int64_t lucepy_cuda_kernels_bulk(void) {
    return lucepy::g_bulk.load(std::memory_order_relaxed);
}

int64_t lucepy_cuda_kernels_f8(void) {
    return lucepy::g_f8.load(std::memory_order_relaxed);
}

int64_t lucepy_cuda_kernels_paired(void) {
    return lucepy::g_paired.load(std::memory_order_relaxed);
}

int64_t lucepy_cuda_kernels_tailed(void) {
    return lucepy::g_tailed.load(std::memory_order_relaxed);
}

}  // extern "C"
