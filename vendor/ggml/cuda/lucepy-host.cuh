// lucepy's host side, shared by its eight files: lucepy-state.cu (the switches and counters, the
// state a context keeps, the graph's scan), lucepy-mm.cu (the products' routes, plans and
// launches), lucepy-repacked.cu (the repacked matrices' registry and products), lucepy-fuse.cu
// (the graph's other ops that the hooks take around the products: norms, residual sums,
// argmax), lucepy-gates.cu (the gates, the gated
// norm, the heads' norm and rope), lucepy-deltanet.cu (qwen35's DeltaNet conv step and gates),
// lucepy-recurrence.cu (its recurrence) and lucepy-attn.cu (attention of 1-16 queries). What one
// defines and another calls is declared here, with the kernels more than one launches (the
// headers below; lucepy-mm.cu and lucepy-repacked.cu alone include the repacked kernels' headers
// (through lucepy-launch.cuh, the launch templates they share), lucepy-deltanet.cu
// lucepy-deltanet.cuh, lucepy-recurrence.cu lucepy-recurrence.cuh, lucepy-attn.cu
// lucepy-attn.cuh, whose kernels they alone launch).

#pragma once

#include "lucepy-mm.cuh"

#define LUCEPY_PDL_SYNC() ggml_cuda_pdl_sync()
#define LUCEPY_PDL_LAUNCH() ggml_cuda_pdl_lc()
#include "lucepy-kernels.cuh"
#include "lucepy-ops.cuh"
#include "lucepy-gemm.cuh"

#include <atomic>
#include <cstdint>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#if !defined(GGML_USE_HIP) && !defined(GGML_USE_MUSA)

namespace lucepy {

constexpr int MAX_COLS = 16;  // one column: gemv; 2 to 16: gemm (a DFlash verify's rows)
constexpr int SLOTS = 4;      // quantized activations kept per context and graph
constexpr int F8_PLANES = -1;  // activations as gemm_f8's e4m3 records (lucepy-f8.cuh), not planes

// the hooks' counters (lucepy_cuda_kernels_calls and the others)
extern std::atomic<int64_t> g_calls;
extern std::atomic<int64_t> g_quantized;
extern std::atomic<int64_t> g_fused;
extern std::atomic<int64_t> g_ops;
extern std::atomic<int64_t> g_copies;
extern std::atomic<int64_t> g_joined;
extern std::atomic<int64_t> g_bulk;
extern std::atomic<int64_t> g_f8;
extern std::atomic<int64_t> g_paired;
extern std::atomic<int64_t> g_tailed;

// Whether the kernels take the products of one device (lucepy-state.cu)
bool enabled(int device);

// Quantized activations of one source tensor, kept for the rest of the graph: the key is the
// tensor (node and data) and the graph's number on its context, and only a tensor of the graph
// is kept (ggml's mul_mat_id fallback passes each expert a temporary tensor on its stack, at the
// same address and data for different contents). Buffers only grow; one that a captured CUDA
// graph may still use is kept, never freed.
struct Kept {
    const ggml_tensor * node = nullptr;
    const void * data = nullptr;
    int64_t ne0 = 0, ne1 = 0, nb1 = 0;
    int planes = 0;
    uint64_t graph = 0;
    uint64_t used = 0;
    uint8_t * buf = nullptr;
    size_t cap = 0;
};

// What a product of ours reads of a tensor: the product's own input (the tensor, or a reshape of
// it) and the planes it reads (int8 planes: one column; 0: halves, 2-16 columns; F8_PLANES: e4m3
// records, the products of gemm_f8 at 9-16 columns on Hopper).
struct Wanted {
    const ggml_tensor * src1;
    int planes;
};

struct ContextState;
void scan(ContextState & st);  // what the hooks ask of the graph, learnt once a graph
bool repacked_of(const ggml_tensor * t);  // a repacked matrix's bytes

struct ContextState {
    uint64_t graph = 1;
    uint64_t clock = 0;
    int device = 0;
    Kept slot[SLOTS];
    std::vector<uint8_t *> retired;
    const ggml_cgraph * cgraph = nullptr;  // the graph being computed
    bool scanned = false;                  // what `scan` learnt of it:
    std::unordered_set<const ggml_tensor *> members;        // its nodes and leafs
    std::unordered_map<const ggml_tensor *, Wanted> wants;  // see `wanted`
    std::unordered_map<const ggml_tensor *, int> reads;     // see `readers`
    struct Read {  // a node's read of bytes [from, to) of a tensor
        const ggml_tensor * by;
        size_t from, to;
    };
    std::unordered_map<const ggml_tensor *, std::vector<Read>> spans;  // see `bytes_read`
    int apart = -1;  // see `recurrences_apart`: not asked yet (-1), false, true
    int tail_slice = -1;  // its gemm_f8 tails' counts (lucepy-repacked.cu's f8_tail): not yet (-1)

    // How many of the graph's nodes read `t`, directly or through a view of it (a node reading
    // two views of it counts twice).
    int readers(const ggml_tensor * t) {
        scan(*this);
        const auto found = reads.find(t);
        return found == reads.end() ? 0 : found->second;
    }

    bool in_graph(const ggml_tensor * t) {
        scan(*this);
        return members.count(t) != 0;
    }

    // `g` begins on `dev`: nothing learnt of it yet, and what was kept for the graph before is
    // stale
    void begin(const ggml_cgraph * g, int dev) {
        graph++;
        device = dev;
        cgraph = g;
        scanned = false;
        members.clear();
        wants.clear();
        reads.clear();
        spans.clear();
        apart = -1;
    }
};

ContextState & state_of(const ggml_backend_cuda_context & ctx);

// What the graph's first product of ours that reads `t` (or a reshape of it) reads of it, or
// null (lucepy-state.cu)
const Wanted * wanted(ContextState & st, const ggml_tensor * t);

// Where in a buffer of quantized_bytes the planes and their scales lie (`quantize`'s layout).
struct Planes {
    int8_t * xq;
    float2 * xds;
};

Planes planes_at(uint8_t * buf, int64_t npieces, int64_t ncols, int planes);

// The bytes of a product's activations: `planes` int8 planes a piece (gemv), halves (planes 0),
// or e4m3 records (F8_PLANES); and the slot that keeps src1's for the graph: its buffer, and
// whether it holds them already (`*fresh` false) or was just claimed for them (lucepy-state.cu)
size_t quantized_bytes(int64_t npieces, int64_t ncols, int planes);
uint8_t * claim(ContextState & st, const ggml_tensor * src1, int64_t npieces, int planes,
                bool * fresh);

// A switch of one of the kernels' choices, for comparison: on unless the environment sets
// `name` to 0; and a count of one: `fallback` where `name` is unset or 1, else its number (0 or
// an unreadable value: off) (lucepy-state.cu; callers keep the answer in a static)
bool switched_on(const char * name);
int switched_count(const char * name, int fallback);

// What the scan asks of the products' routes (lucepy-mm.cu): the kernels' kind of a block type
// and its chunk; whether they take `ncols` columns of src0; whether gemm_f8 takes w alone at
// ncols columns, or an FFN's gate and up m1, m2 as one product; the GLU's node index where node
// i and the two after it are an FFN's gate, up and SWIGLU (else 0)
bool kind_of(ggml_type type, int & kind, int & chunk);
bool takes_cols(const ggml_tensor * src0, int64_t ncols, int device);
bool f8_single(const ggml_tensor * w, int64_t ncols, int device);
bool f8_pair(const ggml_tensor * m1, const ggml_tensor * m2, int device);
int glu_pair_at(const ggml_cgraph * g, int i, ggml_tensor *& m2, ggml_tensor *& glu);

// The slot for src1's activations that the kernel before its product fills as it writes its
// result (an RMS norm, a gate), counted as quantized and as fused: its buffer (lucepy-state.cu)
uint8_t * prepared(ContextState & st, const ggml_tensor * src1, int64_t npieces, int planes);

// a node that computes nothing: a view, a reshape, a permutation or an empty tensor
bool no_op(const ggml_tensor * t);

// the next node after i that computes something (not a view or a no-op), or n_nodes
inline int next_op(const ggml_cgraph * cgraph, int i) {
    for (i++; i < cgraph->n_nodes; i++) {
        if (!no_op(cgraph->nodes[i])) {
            return i;
        }
    }
    return i;
}

// The RMS norm times a weight after a product's residual ADD, whose result a product of ours
// reads as halves: sum_norm_halves computes it with the product's sums (mul_mat_add_nodes)
struct NormAfter {
    const ggml_tensor * mul;  // the MUL: its result, and the product after it that wants it
    const float * w;
    float eps;
    int planes;  // what that product reads: halves (0) or e4m3 records (F8_PLANES)
};

void launch_norm_halves(const float * x, int64_t x_stride, const float * w, float * dst,
                        int64_t dst_stride, int n, float eps, int ncols, const Halves & out,
                        cudaStream_t stream);
void launch_glu_halves(const float * a, const float * b, int64_t col_stride, int nparts,
                       int64_t part_stride, float * dst, int npieces, int ncols,
                       const Halves & out, cudaStream_t stream, bool f8 = false);
bool sum_norm_fits(int device, int64_t n);

// dst = src0 x src1 by our kernels (lucepy-mm.cu's mul_mat says how), true; or false, having
// done nothing
bool mul_mat(ggml_backend_cuda_context & ctx, const ggml_tensor * src0, const ggml_tensor * src1,
             ggml_tensor * dst, const ggml_cuda_mm_fusion_args_host * fusion,
             const ggml_tensor * residual, const NormAfter * norm = nullptr);

// a verify's FFN gate and up products and their SWIGLU from node i as one product
// (lucepy-repacked.cu)
int glu_pair_nodes(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph, int i);

// the bytes a tensor spans, and what the hooks ask of them before they join nodes (lucepy-fuse.cu)
struct Span {
    const char * begin;
    const char * end;
};

Span span_of(const ggml_tensor * t);
bool apart(Span a, Span b);

// whether any span of `a` shares a byte with any of `b` (lists or arrays of Span)
template <typename A, typename B> bool spans_meet(const A & a, const B & b) {
    for (const Span & x : a) {
        for (const Span & y : b) {
            if (!apart(x, y)) {
                return true;
            }
        }
    }
    return false;
}

bool apart_or_same(const ggml_tensor * p, const ggml_tensor * q);
bool dense_like(const ggml_tensor * t, const ggml_tensor * like);
bool columns_apart(const ggml_tensor * t);
bool strides_aligned(const ggml_tensor * t, size_t n);
bool bytes_read(ContextState & st, const ggml_cgraph * cgraph, const ggml_tensor * t,
                size_t from, size_t to, const ggml_tensor * skip);

// `raise` run once a device (the shared-memory limits a kernel is launched with: set per device)
template <typename F> void once_a_device(bool (&done)[GGML_CUDA_MAX_DEVICES], int device, F raise) {
    if (!done[device]) {
        raise();
        done[device] = true;
    }
}

// The gates and norms from node i (lucepy-gates.cu): the nodes after i computed, or 0. A gated
// norm from an RMS_NORM (with `cont`, the CONT before it whose source its gate reads in place),
// a head's norm and rope from an RMS_NORM, a gate from a UNARY (with `cont` the same), and from
// a CONT the gated norm or gate after it.
int norm_gate_nodes(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph, int i,
                    const ggml_tensor * cont = nullptr);
int norm_rope_nodes(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph, int i);
int gate_nodes(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph, int i,
               const ggml_tensor * cont);
int cont_gate_nodes(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph, int i);

// qwen35's DeltaNet ops from node i (lucepy-deltanet.cu, the recurrence's lucepy-recurrence.cu):
// the nodes after i computed, or 0. The conv step from a CONCAT, the gates from an ADD, the
// recurrence from a GATED_DELTA_NET (with `dup`, the verify's state copy before it, a DUP's
// node), and from a DUP the two.
int conv_step_nodes(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph, int i);
int delta_gate_nodes(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph, int i);
int delta_net_nodes(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph, int i,
                    const ggml_tensor * dup = nullptr);
int dup_nodes(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph, int i);

// a FLASH_ATTN_EXT of 1-16 queries over an f16 cache at node i (lucepy-attn.cu): 1, or 0
int attn_nodes(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph, int i);

}  // namespace lucepy

#endif
