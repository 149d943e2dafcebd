// lucepy's own kernels (issue 19, decision 12), hooked into the pinned ggml-cuda: the host side.
// The kernels are lucepy-kernels.cuh; hooks.patch shows where ggml calls in.
//
// Measured on an H200 (docs/BENCHMARKS.md): on by default for compute capability 9.0 and newer
// (Hopper on), where they were measured; LUCEPY_CUDA_KERNELS=0 or =1 forces them off or on.

#include "lucepy-mm.cuh"

#define LUCEPY_PDL_SYNC() ggml_cuda_pdl_sync()
#define LUCEPY_PDL_LAUNCH() ggml_cuda_pdl_lc()
#include "lucepy-kernels.cuh"
#include "lucepy-gemm.cuh"
#include "lucepy-repack.cuh"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#if !defined(GGML_USE_HIP) && !defined(GGML_USE_MUSA)

namespace lucepy {

constexpr int MAX_COLS = 16;  // one column: gemv; 2 to 16: gemm (a DFlash verify's rows)
// 2 columns: gemm too. ggml's kernels (dp4a, like gemv) verified 2 tokens of the 27B-shaped Q4_0
// model on the H200 in 11.6 ms against gemm's 13.1 when gemm was new (session 17), so 2 was
// theirs; in session 41 the model with gemm at 3 columns took 8.64 ms (Q4_0 blocks) and 10.76
// (Q4_K_M) where 2 columns on ggml's took 9.12 and 11.79 (docs/BENCHMARKS.md).
constexpr int MIN_GEMM_COLS = 2;
// Up to GGML_VECTOR_COLS columns (ggml's MMVQ_MAX_BATCH_SIZE), a product too small to give gemm
// a CTA for each of the GPU's multiprocessors (row tiles times the most parts its pieces allow)
// is ggml's too: there its vector kernel is faster (SmolLM2-135M's products of 576-1,536 rows,
// 9-24 row tiles, verified 3 and 4 tokens in 1.81 and 1.86 ms on gemm against 1.70 and 1.71 on
// ggml's on the H200; docs/BENCHMARKS.md). The 27B-shaped model's products all have enough.
constexpr int GGML_VECTOR_COLS = 8;

bool gemm_fills(int64_t nrows, int64_t npieces, int device) {
    const int64_t parts = gemm_max_parts(npieces, gemm_chunk<Q4_0>());
    return row_tiles(nrows, GM_WARPS * 16) * parts >= ggml_cuda_info().devices[device].nsm;
}

// whether lucepy's kernels take a product of `ncols` columns with this weight (as far as its
// columns and size decide)
bool takes_cols(const ggml_tensor * src0, int64_t ncols, int device) {
    if (ncols == 1) {
        return true;
    }
    if (ncols < MIN_GEMM_COLS || ncols > MAX_COLS) {
        return false;
    }
    return ncols > GGML_VECTOR_COLS || gemm_fills(src0->ne[1], src0->ne[0] / 32, device);
}

constexpr int SLOTS = 4;     // quantized activations kept per context and graph

// --- host side ----------------------------------------------------------------------------------

std::atomic<int> g_on{-2};  // -2: not yet read; -1: the default; 0 or 1: forced off or on
std::atomic<int64_t> g_calls{0};
std::atomic<int64_t> g_quantized{0};
std::atomic<int64_t> g_fused{0};
std::atomic<int64_t> g_ops{0};
std::atomic<int64_t> g_copies{0};  // copy nodes (DUP, CONT, CPY) a kernel of ours made as it ran
std::atomic<int64_t> g_joined{0};  // ops computed in another op's kernel (one launch less each)
std::atomic<int64_t> g_bulk{0};    // products of gemm_rb (bulk_product)

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
// it) and the planes it reads (int8 planes: one column; 0: halves, 3-16 columns).
struct Wanted {
    const ggml_tensor * src1;
    int planes;
};

struct ContextState;
void scan(ContextState & st);  // what the hooks ask of the graph, learnt once a graph (below)
bool repacked_of(const ggml_tensor * t);  // a repacked matrix's bytes (below)

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

std::mutex g_mutex;
std::unordered_map<const ggml_backend_cuda_context *, ContextState> g_states;

ContextState & state_of(const ggml_backend_cuda_context & ctx) {
    std::lock_guard<std::mutex> lock(g_mutex);
    return g_states[&ctx];
}

// The activations a product reads: `planes` int8 planes a piece (gemv), or halves (planes 0:
// gemm's to_halves).
size_t quantized_bytes(int64_t npieces, int64_t ncols, int planes) {
    if (planes == 0) {
        return size_t(halves_bytes(npieces, int(ncols)));
    }
    return size_t(npieces * ncols * planes) * (32 + sizeof(float2));
}

// Where in a buffer of quantized_bytes the planes and their scales lie (`quantize`'s layout).
struct Planes {
    int8_t * xq;
    float2 * xds;
};

Planes planes_at(uint8_t * buf, int64_t npieces, int64_t ncols, int planes) {
    return {reinterpret_cast<int8_t *>(buf),
            reinterpret_cast<float2 *>(buf + npieces * ncols * planes * 32)};
}

void run_quantize(const ggml_tensor * src1, int64_t npieces, int planes, uint8_t * buf,
                  cudaStream_t stream) {
    const int64_t ncols = src1->ne[1];
    g_quantized.fetch_add(1, std::memory_order_relaxed);
    if (planes == 0) {
        const dim3 grid{unsigned(segments(int(npieces))), unsigned(padded_cols(int(ncols)))};
        ggml_cuda_kernel_launch(to_halves,
                                ggml_cuda_kernel_launch_params(grid, TH_THREADS, 0, stream),
                                static_cast<const float *>(src1->data),
                                src1->nb[1] / int64_t(sizeof(float)), int(npieces), int(ncols),
                                halves_at(buf, npieces, int(ncols)));
        return;
    }
    const Planes out = planes_at(buf, npieces, ncols, planes);
    constexpr int WARPS = 8;
    const dim3 grid(unsigned((npieces + WARPS - 1) / WARPS), unsigned(ncols));
    ggml_cuda_kernel_launch(quantize, ggml_cuda_kernel_launch_params(grid, WARPS * 32, 0, stream),
                            static_cast<const float *>(src1->data),
                            src1->nb[1] / int64_t(sizeof(float)), int(npieces), int(ncols), planes,
                            out.xq, out.xds);
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

// the quantized activations of src1 on ctx's stream: kept ones, or quantized now into a slot
uint8_t * kept_quantized(ContextState & st, ggml_backend_cuda_context & ctx,
                         const ggml_tensor * src1, int64_t npieces, int planes) {
    bool fresh = false;
    uint8_t * buf = claim(st, src1, npieces, planes, &fresh);
    if (fresh) {
        run_quantize(src1, npieces, planes, buf, ctx.stream());
    }
    return buf;
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

using Launch = void (*)(const Args &, cudaStream_t, int device);

// CTAs of `threads` threads and `smem` bytes of shared memory of a kernel that fit on a device
// at once, asked once per kernel, device and size (a product's activations set gemv's size: a few
// a model).
template <typename F> int64_t cta_slots(F kernel, int threads, int smem, int device) {
    struct Slots {
        F kernel;
        int device, smem;
        int64_t ctas;
    };
    static std::vector<Slots> known;
    static std::mutex mutex;
    std::lock_guard<std::mutex> lock(mutex);
    for (const Slots & s : known) {
        if (s.kernel == kernel && s.device == device && s.smem == smem) {
            return s.ctas;
        }
    }
    int per_sm = 0;
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
    const int64_t sms = ggml_cuda_info().devices[device].nsm;
    known.push_back({kernel, device, smem, std::max<int64_t>(1, int64_t(per_sm) * sms)});
    return known.back().ctas;
}

// warps of gemv that fit at once
template <typename F> int64_t warp_slots(F kernel, int smem, int device) {
    return cta_slots(kernel, GV_WARPS * 32, smem, device) * GV_WARPS;
}

// `raise` run once a device (the shared-memory limits a kernel is launched with: set per device)
template <typename F> void once_a_device(bool (&done)[GGML_CUDA_MAX_DEVICES], int device, F raise) {
    if (!done[device]) {
        raise();
        done[device] = true;
    }
}

template <int K, bool GATE, int R, int U, int SPLIT>
void launch_split(const Args & a, cudaStream_t stream) {
    const int64_t warps = int64_t((a.nrows + R - 1) / R) * SPLIT;
    const dim3 grid(unsigned((warps + GV_WARPS - 1) / GV_WARPS));
    const int smem = gemv_smem<K, GATE, R, U>(a.npieces, SPLIT);
    const auto params = ggml_cuda_kernel_launch_params(grid, GV_WARPS * 32, smem, stream);
    ggml_cuda_kernel_launch(gemv<K, GATE, R, U, SPLIT>, params, a);
}

// a warp for each R rows (or 2 or 4 for each, gemv_split), copies of U bytes
template <int K, bool GATE, int R, int U>
void launch(const Args & a, cudaStream_t stream, int device) {
    static bool raised[GGML_CUDA_MAX_DEVICES] = {};
    once_a_device(raised, device, [device] {  // every size that fits (lucepy_cuda_mul_mat checks)
        const int most = int(ggml_cuda_info().devices[device].smpbo);
        for (auto kernel :
             {gemv<K, GATE, R, U, 1>, gemv<K, GATE, R, U, 2>, gemv<K, GATE, R, U, 4>}) {
            CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            most));
        }
    });
    auto slots = [device](auto kernel, int smem) { return warp_slots(kernel, smem, device); };
    switch (gemv_pick<K, GATE, R, U>(a.nrows, a.npieces, slots)) {
        case 1: launch_split<K, GATE, R, U, 1>(a, stream); break;
        case 2: launch_split<K, GATE, R, U, 2>(a, stream); break;
        default: launch_split<K, GATE, R, U, 4>(a, stream); break;
    }
}

// one column: a warp per row (and its gate row)
template <int K, int U> Launch pick_unit(bool gate) {
    return gate ? &launch<K, true, 1, U> : &launch<K, false, 1, U>;
}

template <int K> Launch pick(bool gate, int unit) {
    return unit == 16 ? pick_unit<K, 16>(gate)
         : unit == 8  ? pick_unit<K, 8>(gate)
                      : pick_unit<K, 4>(gate);
}

// `kernel` in clusters of `cluster` CTAs along x, and with programmatic dependent launch where
// ggml_cuda_kernel_launch would use it
template <typename... Args>
void launch_clustered(void (*kernel)(Args...), dim3 grid, int threads, int cluster,
                      cudaStream_t stream, Args... args) {
    cudaLaunchAttribute attrs[2] = {cluster_attr(cluster)};
    unsigned nattrs = 1;
#if defined(GGML_CUDA_USE_PDL)
    static const bool pdl = [] {
        const char * env = getenv("GGML_CUDA_PDL");
        return env == nullptr || std::atoi(env) != 0;
    }();
    if (pdl && ggml_cuda_kernel_can_use_pdl(reinterpret_cast<const void *>(kernel))) {
        attrs[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attrs[1].val.programmaticStreamSerializationAllowed = 1;
        nattrs = 2;
    }
#endif
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(unsigned(threads));
    cfg.stream = stream;
    cfg.attrs = attrs;
    cfg.numAttrs = nattrs;
    CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

// norm_halves of `ncols` columns of x (16-byte aligned, as w and dst), a CTA a padded column
void launch_norm_halves(const float * x, int64_t x_stride, const float * w, float * dst,
                        int64_t dst_stride, int n, float eps, int ncols, const Halves & out,
                        cudaStream_t stream) {
    ggml_cuda_kernel_launch(norm_halves,
                            ggml_cuda_kernel_launch_params(dim3(unsigned(padded_cols(ncols))),
                                                           NORM_THREADS, 0, stream),
                            x, x_stride, w, dst, dst_stride, n, eps, ncols, out);
}

// glu_halves of `ncols` columns of `npieces` pieces (its arguments), a CTA a segment of a column
void launch_glu_halves(const float * a, const float * b, int64_t col_stride, int nparts,
                       int64_t part_stride, float * dst, int npieces, int ncols,
                       const Halves & out, cudaStream_t stream) {
    const dim3 grid{unsigned(segments(npieces)), unsigned(padded_cols(ncols))};
    ggml_cuda_kernel_launch(glu_halves,
                            ggml_cuda_kernel_launch_params(grid, GLU_WARPS * 32, 0, stream), a, b,
                            col_stride, nparts, part_stride, dst, npieces, ncols, out);
}

// The RMS norm times a weight after a product's residual ADD, whose result a product of ours
// reads as halves: sum_norm_halves computes it with the product's sums (mul_mat_add_nodes)
struct NormAfter {
    const ggml_tensor * mul;  // the MUL: its result, and the product after it that wants it
    const float * w;
    float eps;
};

// f(std::integral_constant<int, CL>) for the cluster size `cl` (2-8) of sum_norm_halves, and
// what f returns: the one switch from a column's size to the kernel's template
template <typename F> auto with_cluster(int64_t cl, F && f) {
    switch (cl) {
        case 2: return f(std::integral_constant<int, 2>{});
        case 3: return f(std::integral_constant<int, 3>{});
        case 4: return f(std::integral_constant<int, 4>{});
        case 5: return f(std::integral_constant<int, 5>{});
        case 6: return f(std::integral_constant<int, 6>{});
        case 7: return f(std::integral_constant<int, 7>{});
        case 8: return f(std::integral_constant<int, 8>{});
        default: GGML_ABORT("lucepy: sum_norm_halves in clusters of %d", int(cl));
    }
}

// Whether sum_norm_halves takes a column of n values on the device: a cluster of n /
// NORM_THREADS CTAs (2-8) that it can launch (asked once a device and size)
bool sum_norm_fits(int device, int64_t n) {
    const int64_t cl = n / NORM_THREADS;
    if (n % NORM_THREADS != 0 || cl < 2 || cl > 8 || ggml_cuda_info().devices[device].cc < 900) {
        return false;
    }
    static int fits[GGML_CUDA_MAX_DEVICES][9] = {};  // 0 not asked, 1 yes, 2 no
    int & known = fits[device][cl];
    if (known == 0) {
        cudaLaunchAttribute attr = cluster_attr(int(cl));
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(unsigned(cl), 16);
        cfg.blockDim = dim3(NORM_THREADS);
        cfg.attrs = &attr;
        cfg.numAttrs = 1;
        int clusters = 0;
        const void * kernel = with_cluster(cl, [](auto k) {
            return reinterpret_cast<const void *>(sum_norm_halves<decltype(k)::value>);
        });
        const bool ok = cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) == cudaSuccess;
        (void) cudaGetLastError();  // (a refusal is an answer, not an error to keep)
        known = ok && clusters > 0 ? 1 : 2;
    }
    return known == 1;
}

// The product `a` (its parts `parts`, at a.parts where more than one, else its sums with the
// residual at a.dst) as the ADD's result, then `norm` of it: in parts, one sum_norm_halves where
// gemm_sum and norm_halves ran; of one part (its tile's store wrote the sums), norm_halves alone,
// which sum_norm_halves took 1.27-1.28x the time of there (bench-kernels --sum-norm, H100)
void launch_sum_norm(ggml_backend_cuda_context & ctx, const GemmArgs & a, int parts,
                     const NormAfter & norm) {
    const int64_t npieces = a.nrows / 32;
    const Halves out =
        halves_at(prepared(state_of(ctx), norm.mul, npieces, 0), npieces, a.ncols);
    float * normed = static_cast<float *>(norm.mul->data);
    const int64_t normed_stride = norm.mul->nb[1] / int64_t(sizeof(float));
    cudaStream_t stream = ctx.stream();
    if (parts == 1) {
        launch_norm_halves(a.dst, a.dst_stride, norm.w, normed, normed_stride, a.nrows, norm.eps,
                           a.ncols, out, stream);
        return;
    }
    SumNorm s = {};
    s.src = a.parts;
    s.src_col = a.nrows;
    s.part_stride = int64_t(a.ncols) * a.nrows;
    s.nparts = parts;
    s.residual = a.residual;
    s.res_stride = a.res_stride;
    s.sum = a.dst;
    s.sum_stride = a.dst_stride;
    s.w = norm.w;
    s.normed = normed;
    s.normed_stride = normed_stride;
    s.n = a.nrows;
    s.ncols = a.ncols;
    s.eps = norm.eps;
    s.out = out;
    with_cluster(a.nrows / NORM_THREADS, [&](auto k) {
        constexpr int CL = decltype(k)::value;
        launch_clustered(sum_norm_halves<CL>, dim3(CL, unsigned(padded_cols(s.ncols))),
                         NORM_THREADS, CL, stream, s);
    });
    g_joined.fetch_add(1, std::memory_order_relaxed);  // gemm_sum's launch holds the norm
}

// 3 to 16 columns: gemm on to_halves' activations, in parts where its rows are few
// A tensor-core product of 4-warp CTAs of `smem` bytes (gemm, gemm_r) by `plan`, its parts
// added in order by gemm_sum, or with `norm` (the RMS norm after the product's residual ADD) by
// sum_norm_halves
template <typename F>
void launch_in_parts(ggml_backend_cuda_context & ctx, F kernel, int smem, const GemmPlan & plan,
                     const GemmArgs & base, const NormAfter * norm = nullptr) {
    const int parts = int(plan.grid.y);
    GemmArgs a = base;
    a.per_part = plan.per_part;
    cudaStream_t stream = ctx.stream();
    ggml_cuda_pool_alloc<float> sums(ctx.pool());
    if (parts > 1) {
        a.parts = sums.alloc(size_t(parts) * a.ncols * a.nrows);
    }
    ggml_cuda_kernel_launch(kernel,
                            ggml_cuda_kernel_launch_params(plan.grid, GM_WARPS * 32, smem, stream),
                            a);
    if (norm) {
        launch_sum_norm(ctx, a, parts, *norm);
    } else if (parts > 1) {
        const int64_t n = int64_t(a.nrows) * a.ncols;
        const dim3 sum_grid(unsigned((n + 255) / 256));
        ggml_cuda_kernel_launch(gemm_sum, ggml_cuda_kernel_launch_params(sum_grid, 256, 0, stream),
                                static_cast<const float *>(a.parts), parts, a.nrows, a.ncols, a.dst,
                                a.dst_stride, a.residual, a.res_stride);
    }
}

// CTAs of `kernel` (4 warps, `smem` bytes) at once on a device, asked once a device (`slots`:
// the kernel's own table)
template <typename F>
int64_t slots_of(F kernel, int smem, int device, int64_t (&slots)[GGML_CUDA_MAX_DEVICES]) {
    if (slots[device] == 0) {
        CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        slots[device] = cta_slots(kernel, GM_WARPS * 32, smem, device);
    }
    return slots[device];
}

template <int K, int NT>
void launch_gemm(ggml_backend_cuda_context & ctx, const GemmArgs & base, const NormAfter * norm) {
    constexpr int P = gemm_chunk<K>();
    using G = Gm<K, NT, P>;
    static int64_t slots[GGML_CUDA_MAX_DEVICES] = {};
    auto kernel = gemm<K, NT, P>;
    const int64_t room = slots_of(kernel, G::smem, ctx.device, slots);
    launch_in_parts(ctx, kernel, G::smem, gemm_plan(base.nrows, base.npieces, G::rows, P, room),
                    base, norm);
}

template <int K>
void run_gemm(ggml_backend_cuda_context & ctx, const GemmArgs & a, const NormAfter * norm) {
    if (a.ncols <= GM_COL_TILE) {
        launch_gemm<K, 1>(ctx, a, norm);
    } else {
        launch_gemm<K, 2>(ctx, a, norm);
    }
}

// whether a CTA fits the device's shared memory, fused or not (on an H200 the activations of a
// row of up to about 5,000 pieces, 170,000 values, do; of Q8_0's two planes, 2,500)
template <int K> int most_smem(int64_t npieces) {
    const int n = int(npieces);
    return std::max(gemv_smem<K, false, 1, 16>(n, 1), gemv_smem<K, true, 1, 16>(n, 1));
}

bool fits(int kind, int64_t npieces, int device) {
    if (npieces > INT32_MAX / 128) {
        return false;
    }
    const int smem =
        with_kind(kind, [&](auto k) { return most_smem<decltype(k)::value>(npieces); });
    return size_t(smem) <= ggml_cuda_info().devices[device].smpbo;
}

// the kind of a ggml type, and the bytes of gemv's chunk of a row; false for a type not ours
bool kind_of(ggml_type type, int & kind, int & chunk) {
    switch (type) {
        case GGML_TYPE_Q4_0: kind = Q4_0; break;
        case GGML_TYPE_Q8_0: kind = Q8_0; break;
        case GGML_TYPE_Q4_K: kind = Q4_K; break;
        case GGML_TYPE_Q6_K: kind = Q6_K; break;
        case GGML_TYPE_Q4_1: kind = Q4_1; break;
        case GGML_TYPE_Q5_1: kind = Q5_1; break;
        case GGML_TYPE_Q5_K: kind = Q5_K; break;
        case GGML_TYPE_IQ4_XS: kind = IQ4_XS; break;
        default: return false;
    }
    chunk = with_kind(kind, [](auto k) { return Gv<decltype(k)::value, false, 1, 16>::bytes; });
    return true;
}

// the widest copy (16, 8 or 4 bytes) that every row start, chunk start and row end allows, or 0
int copy_unit(const ggml_tensor * src0, const ggml_tensor * gate, int chunk) {
    const size_t row = ggml_row_size(src0->type, src0->ne[0]);
    for (int unit = 16; unit >= 4; unit /= 2) {
        const bool fits = src0->nb[1] % unit == 0 && chunk % unit == 0 && row % unit == 0 &&
                          uintptr_t(src0->data) % unit == 0 &&
                          (!gate || uintptr_t(gate->data) % unit == 0);
        if (fits) {
            return unit;
        }
    }
    return 0;
}

// a node that computes nothing: a view, a reshape, a permutation or an empty tensor
bool no_op(const ggml_tensor * t) {
    return ggml_is_empty(t) || t->op == GGML_OP_NONE || t->op == GGML_OP_VIEW ||
           t->op == GGML_OP_RESHAPE || t->op == GGML_OP_PERMUTE || t->op == GGML_OP_TRANSPOSE;
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
}

// src1 as a product's kernel reads it (`planes` int8 planes, or halves): kept for the graph's
// other products of it where it is a tensor of the graph, else into scratch (ggml's concurrent
// streams: nothing shared)
uint8_t * product_activations(ggml_backend_cuda_context & ctx, ContextState & st,
                              const ggml_tensor * src1, int64_t npieces, int planes,
                              ggml_cuda_pool_alloc<uint8_t> & scratch) {
    if (ctx.curr_stream_no == 0 && st.in_graph(src1)) {
        return kept_quantized(st, ctx, src1, npieces, planes);
    }
    uint8_t * buf = scratch.alloc(quantized_bytes(npieces, src1->ne[1], planes));
    run_quantize(src1, npieces, planes, buf, ctx.stream());
    return buf;
}

// --- Q4_0, Q4_K, Q5_K and Q6_K repacked (lucepy-layouts.cuh, lucepy-repack.cuh) ----------------
//
// lucepy_cuda_repack rewrites a Q4_0, Q4_K, Q5_K or Q6_K weight in place into lucepy's layout
// (Q5_K and Q6_K on compute capability 9.0 and newer: their 2-16 column kernel is gemm_rb) and
// records its bytes; from then on every product of them is ours (repacked_mul_mat), whatever
// LUCEPY_CUDA_KERNELS says, since ggml's kernels cannot read them.

struct Repacked {
    uintptr_t end;
    int64_t ne0;        // values a row
    int64_t row_bytes;  // of a row of blocks
    ggml_type type;     // the blocks' (Q4_0, Q4_K, Q5_K, Q6_K)
};

// whether lucepy-layouts.cuh's layouts take a matrix of these blocks
bool repackable_type(ggml_type type) {
    return type == GGML_TYPE_Q4_0 || type == GGML_TYPE_Q4_K || type == GGML_TYPE_Q5_K ||
           type == GGML_TYPE_Q6_K;
}

// f(L()) with L the layout (lucepy-layouts.cuh) of a repacked matrix of these blocks
template <typename F> void with_layout(ggml_type type, F && f) {
    switch (type) {
        case GGML_TYPE_Q4_K: f(RpQ4_K()); break;
        case GGML_TYPE_Q5_K: f(RpQ5_K()); break;
        case GGML_TYPE_Q6_K: f(RpQ6_K()); break;
        default: f(RpQ4_0());
    }
}

// whether the layout of these blocks needs gemm_rb (the TMA unit: compute capability 9.0 and
// newer) at 2-16 columns
bool bulk_only_type(ggml_type type) {
    bool only = false;
    with_layout(type, [&](auto layout) { only = !decltype(layout)::gemm_r; });
    return only;
}

std::mutex g_rp_mutex;
std::map<uintptr_t, Repacked> g_repacked;  // by the first byte
std::atomic<int> g_n_repacked{0};

// Whether a product's weights `t` lie in a repacked matrix: false, or true for a view that starts
// on a tile of 16 rows of it and spans whole tiles of 64 (gemm_rq's); a product's other read of
// them aborts, as no kernel could compute it. (Other ops' reads are not seen here: only a matrix
// that products alone read may be repacked.)
bool repacked_of(const ggml_tensor * t) {
    if (g_n_repacked.load(std::memory_order_relaxed) == 0 || !repackable_type(t->type) ||
        t->data == nullptr) {
        return false;
    }
    const uintptr_t at = uintptr_t(t->data);
    Repacked r;
    uintptr_t begin;
    {
        std::lock_guard<std::mutex> lock(g_rp_mutex);
        auto found = g_repacked.upper_bound(at);
        if (found == g_repacked.begin()) {
            return false;
        }
        --found;
        if (at >= found->second.end) {
            return false;
        }
        begin = found->first;
        r = found->second;
    }
    const bool whole_tiles = t->type == r.type && t->ne[0] == r.ne0 && t->nb[1] == r.row_bytes &&
                             (at - begin) % uintptr_t(RP_ROWS * r.row_bytes) == 0 &&
                             t->ne[1] % RP_ROWS == 0 && t->ne[2] == 1 && t->ne[3] == 1 &&
                             at + ggml_nbytes(t) <= r.end;
    if (!whole_tiles) {
        GGML_ABORT("lucepy: a read of a repacked matrix that is not whole tiles of 16 of its rows "
                   "in its type (%s); repack only matrices that products alone read",
                   t->name);
    }
    return true;
}

// The arguments of a one-column product (gemv, gemv_r) of src0 (and the fused gate) into dst,
// on activations quantized into `quantized`
Args gemv_args(const ggml_tensor * src0, const ggml_tensor * dst,
               const ggml_cuda_mm_fusion_args_host * fusion, const Planes & quantized) {
    const ggml_tensor * gate = fusion ? fusion->gate : nullptr;
    auto data = [](const ggml_tensor * t) {
        return t ? static_cast<const float *>(t->data) : nullptr;
    };
    Args a = {};
    a.w = static_cast<const uint8_t *>(src0->data);
    a.gate = gate ? static_cast<const uint8_t *>(gate->data) : nullptr;
    a.row_stride = src0->nb[1];
    a.xq = reinterpret_cast<const int *>(quantized.xq);
    a.xds = quantized.xds;
    a.dst = static_cast<float *>(dst->data);
    a.x_bias = data(fusion ? fusion->x_bias : nullptr);
    a.gate_bias = data(fusion ? fusion->gate_bias : nullptr);
    a.glu_op = fusion && fusion->glu_op == GGML_GLU_OP_GEGLU ? GLU_GEGLU : GLU_SWIGLU;
    a.nrows = int(src0->ne[1]);
    a.npieces = int(src0->ne[0] / 32);
    return a;
}

// The arguments of a product of 2 or more columns (gemm, gemm_r, gemm_rq) of src0 into dst, on
// the columns' halves `x`, plus `residual` (a tensor of dst's shape) or not
GemmArgs gemm_args(const ggml_tensor * src0, const ggml_tensor * dst, const Halves & x,
                   const ggml_tensor * residual) {
    GemmArgs g = {};
    if (residual) {
        g.residual = static_cast<const float *>(residual->data);
        g.res_stride = residual->nb[1] / int64_t(sizeof(float));
    }
    g.w = static_cast<const uint8_t *>(src0->data);
    g.row_stride = src0->nb[1];
    g.x = x;
    g.nrows = int(src0->ne[1]);
    g.npieces = int(src0->ne[0] / 32);
    g.ncols = int(dst->ne[1]);
    g.dst = static_cast<float *>(dst->data);
    g.dst_stride = dst->nb[1] / int64_t(sizeof(float));
    return g;
}

// Whether ggml's fusion around a product of src0 (`ncols` columns; `repacked`: repacked_of(src0),
// known to the caller) is one the kernels take: no scales, a SwiGLU or GeGLU gate of src0's type,
// shape and layout (repacked when src0 is), contiguous biases, and any of it on one column only
bool fusion_taken(const ggml_cuda_mm_fusion_args_host * fusion, const ggml_tensor * src0,
                  bool repacked, int64_t ncols) {
    if (!fusion) {
        return true;
    }
    const ggml_tensor * gate = fusion->gate;
    const bool plain_glu = !gate || fusion->glu_op == GGML_GLU_OP_SWIGLU ||
                           fusion->glu_op == GGML_GLU_OP_GEGLU;
    const bool same = !gate || (gate->type == src0->type && ggml_are_same_stride(gate, src0) &&
                                ggml_are_same_shape(gate, src0) &&
                                repacked_of(gate) == repacked);
    const bool biases = (!fusion->x_bias || ggml_is_contiguous(fusion->x_bias)) &&
                        (!fusion->gate_bias || (gate && ggml_is_contiguous(fusion->gate_bias)));
    const bool any = gate || fusion->x_bias || fusion->gate_bias;
    return !fusion->x_scale && !fusion->gate_scale && plain_glu && same && biases &&
           (!any || ncols == 1);
}

// SPLIT warps a tile of gemv_r on layout L (bench-kernels.cu on the 27B-shaped model's products,
// H200: Q4_0 4 at 1,088 tiles, 8 at 320-640, 32 at 64, with the fused gate 8 at 1,088; the K
// types a super-block a step: Q4_K's splits (session 42) Q5_K's best too where measured (session
// 44: 2 at 1,030-1,088 tiles, 4 at 640 and 2,176, 8 at 320), Q6_K's its own (session 43: 4 on the
// head, ffn down, qkv and attn out shapes, 2 at 1,024-2,047 tiles, 16 on 64))
template <bool GATE, class L = RpQ4_0> void launch_gemv_r(const Args & a, cudaStream_t stream) {
    const int64_t tiles = a.nrows / RP_ROWS;
    auto go = [&](auto kernel, int split) {
        const int warps = split > 4 ? split : 4;
        const dim3 grid(unsigned((tiles * split + warps - 1) / warps));
        ggml_cuda_kernel_launch(kernel, ggml_cuda_kernel_launch_params(grid, warps * 32, 0, stream),
                                a);
    };
    if constexpr (std::is_same_v<L, RpQ6_K>) {
        if (tiles < 128) {  // (with the gate 8: 16 warps of its registers spill)
            if constexpr (GATE) {
                go(gemv_r<8, 2, true, L>, 8);
            } else {
                go(gemv_r<16, 2, false, L>, 16);
            }
        } else if (tiles >= 1024 && tiles < 2048) {
            go(gemv_r<2, 2, GATE, L>, 2);
        } else {
            go(gemv_r<4, 2, GATE, L>, 4);
        }
        return;
    } else if constexpr (L::pair) {
        if (GATE || tiles >= 2048 || (tiles >= 512 && tiles < 1024)) {
            go(gemv_r<4, 2, GATE, L>, 4);
        } else if (tiles >= 1024) {
            go(gemv_r<2, 2, GATE, L>, 2);
        } else if (tiles >= 256) {
            go(gemv_r<8, 2, GATE, L>, 8);
        } else if constexpr (std::is_same_v<L, RpQ4_K>) {
            go(gemv_r<32, 2, GATE, L>, 32);
        } else {  // (Q5_K's registers spill at 32 warps a tile; 16 measured at 64 tiles)
            go(gemv_r<16, 2, GATE, L>, 16);
        }
        return;
    }
    if (tiles >= 1024 && !GATE) {
        go(gemv_r<4, 1, GATE>, 4);
    } else if (tiles >= 256) {
        go(gemv_r<8, 1, GATE>, 8);
    } else {
        go(gemv_r<32, 1, GATE>, 32);
    }
}

// The CTAs of build R (GemmR, GemmRB) that the device holds at once
template <typename R> int64_t slots_of_build(int device) {
    static_assert(R::warps == GM_WARPS, "lucepy-mm.cu launches CTAs of GM_WARPS warps");
    static int64_t slots[GGML_CUDA_MAX_DEVICES] = {};
    return slots_of(R::kernel(), R::smem, device, slots);
}

// The plan of build R for `a` (its rows, the second matrix's too): the parts
// gemm_parts_by_cost picks for R's CTAs an SM
template <typename R> GemmPlan gemm_r_plan(int device, const GemmArgs & a) {
    const int64_t room = slots_of_build<R>(device);
    constexpr int rows = GM_WARPS * 16;
    return gemm_plan_in(a.nrows, a.npieces, rows, 8,
                        gemm_parts_by_cost(a.nrows, a.npieces, a.ncols, rows, 8, room));
}

// Whether gemm_rb (its weights by the TMA unit: Hopper and newer) takes a product of NT column
// tiles: where each of its CTA slots gets at least 4 chunks at two tiles (5 CTAs an SM), 6 at
// one (73 registers: 6 CTAs an SM). The 27B-shaped model's products on an H200
// (docs/BENCHMARKS.md): at two tiles faster at about 5 chunks a slot and more, slower at 3
// (session 38); at one tile ffn down (6.9 a slot) 18.1-18.4 us where gemm_r takes 19.3-19.6 at
// 2-8 columns, qkv (4.0) within 1 %, attn out (2.4) 3-4 % slower, and the FFN stack is faster
// on gemm_r at 5 CTAs an SM (session 39).
template <int NT> bool bulk_product(int device, const GemmArgs & a) {
    if (ggml_cuda_info().devices[device].cc < 900) {
        return false;
    }
    return row_tiles(a.nrows, GM_WARPS * 16) * (a.npieces / 8) >=
           (NT == 2 ? 4 : 6) * slots_of_build<GemmRB<NT>>(device);
}

// 2-16 columns on layout L: gemm_r, or gemm_rb where bulk_product, in parts where its rows are
// few; gemm_rb always where gemm_r does not take the layout (Q5_K's, Q6_K's)
template <int NT, class L = RpQ4_0>
void launch_gemm_r(ggml_backend_cuda_context & ctx, const GemmArgs & base,
                   const NormAfter * norm = nullptr) {
    auto go = [&](auto build) {
        using R = decltype(build);
        launch_in_parts(ctx, R::kernel(), R::smem, gemm_r_plan<R>(ctx.device, base), base, norm);
    };
    if constexpr (!L::gemm_r) {
        go(GemmRB<NT, NT == 2 ? 5 : 6, L>());
        g_bulk.fetch_add(1, std::memory_order_relaxed);
    } else if (bulk_product<NT>(ctx.device, base)) {
        go(GemmRB<NT, 5, L>());
        g_bulk.fetch_add(1, std::memory_order_relaxed);
    } else {
        go(GemmR<NT, GM_WARPS, 16 / GM_WARPS, gemm_r_xch(NT), L>());
    }
}

// a prefill's columns on layout L: to_halves_col into scratch (whole tiles of 64 columns), then
// gemm_rq
template <int MT, class L = RpQ4_0>
void launch_gemm_rq(ggml_backend_cuda_context & ctx, const GemmArgs & a) {
    static bool raised[GGML_CUDA_MAX_DEVICES] = {};
    once_a_device(raised, ctx.device, [] {
        CUDA_CHECK(cudaFuncSetAttribute(gemm_rq<MT, L>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        gemm_rq_smem<MT, L>()));
    });
    const dim3 grid(unsigned((a.nrows + 64 * MT - 1) / (64 * MT)),
                    unsigned((a.ncols + RQ_COLS - 1) / RQ_COLS));
    ggml_cuda_kernel_launch(
        gemm_rq<MT, L>,
        ggml_cuda_kernel_launch_params(grid, 128, gemm_rq_smem<MT, L>(), ctx.stream()), a);
}

// repacked_mul_mat's products on layout L
template <class L>
void repacked_mul_mat_of(ggml_backend_cuda_context & ctx, const ggml_tensor * src0,
                         const ggml_tensor * src1, ggml_tensor * dst,
                         const ggml_cuda_mm_fusion_args_host * fusion, const ggml_tensor * residual,
                         const NormAfter * norm) {
    const int64_t ncols = src1->ne[1];
    const int64_t npieces = src0->ne[0] / 32;
    cudaStream_t stream = ctx.stream();
    ContextState & st = state_of(ctx);
    ggml_cuda_pool_alloc<uint8_t> scratch(ctx.pool());
    if (ncols == 1) {
        const Args a = gemv_args(
            src0, dst, fusion,
            planes_at(product_activations(ctx, st, src1, npieces, 1, scratch), npieces, 1, 1));
        a.gate ? launch_gemv_r<true, L>(a, stream) : launch_gemv_r<false, L>(a, stream);
        return;
    }
    if (ncols <= MAX_COLS) {
        const GemmArgs g = gemm_args(
            src0, dst,
            halves_at(product_activations(ctx, st, src1, npieces, 0, scratch), npieces,
                      int(ncols)),
            residual);
        if (ncols <= GM_COL_TILE) {
            launch_gemm_r<1, L>(ctx, g, norm);
        } else {
            launch_gemm_r<2, L>(ctx, g, norm);
        }
        return;
    }
    const int padded = int((ncols + RQ_COLS - 1) / RQ_COLS * RQ_COLS);
    uint8_t * buf = scratch.alloc(size_t(halves_bytes(npieces, padded)));
    const GemmArgs g = gemm_args(src0, dst, halves_at(buf, npieces, padded), nullptr);
    ggml_cuda_kernel_launch(to_halves_col,
                            ggml_cuda_kernel_launch_params(dim3(unsigned(ncols)), 256, 0, stream),
                            static_cast<const float *>(src1->data),
                            int64_t(src1->nb[1] / sizeof(float)), int(npieces), g.x);
    g.nrows % 128 == 0 ? launch_gemm_rq<2, L>(ctx, g) : launch_gemm_rq<1, L>(ctx, g);
}

void repacked_mul_mat(ggml_backend_cuda_context & ctx, const ggml_tensor * src0,
                      const ggml_tensor * src1, ggml_tensor * dst,
                      const ggml_cuda_mm_fusion_args_host * fusion, const ggml_tensor * residual,
                      const NormAfter * norm) {
    const int64_t ncols = src1->ne[1];
    const bool plain = src1->type == GGML_TYPE_F32 && dst->type == GGML_TYPE_F32 &&
                       src1->ne[0] == src0->ne[0] && dst->ne[0] == src0->ne[1] &&
                       dst->ne[1] == ncols && src1->ne[2] == 1 && src1->ne[3] == 1 &&
                       src1->nb[0] == sizeof(float) && dst->nb[0] == sizeof(float) &&
                       src1->nb[1] % sizeof(float) == 0 && dst->nb[1] % sizeof(float) == 0 &&
                       ncols >= 1 && ncols < INT32_MAX;
    if (!plain || !fusion_taken(fusion, src0, true, ncols)) {
        GGML_ABORT("lucepy: a product of a repacked matrix (%s) that its kernels do not take",
                   src0->name);
    }
    with_layout(src0->type, [&](auto layout) {
        repacked_mul_mat_of<decltype(layout)>(ctx, src0, src1, dst, fusion, residual, norm);
    });
}

// What the graph's first product of ours that reads `t` (or a reshape of it) reads of it, or
// null (for the kernels before the products that prepare their results for them: an RMS norm,
// a gate).
const Wanted * wanted(ContextState & st, const ggml_tensor * t) {
    scan(st);
    const auto found = st.wants.find(t);
    return found == st.wants.end() ? nullptr : &found->second;
}

// dst = src0 x src1 (with ggml's fusion, or plus `residual`, a tensor of dst's shape, for 2-16
// columns) by our kernels, true; or false, having done nothing
bool mul_mat(ggml_backend_cuda_context & ctx, const ggml_tensor * src0, const ggml_tensor * src1,
             ggml_tensor * dst, const ggml_cuda_mm_fusion_args_host * fusion,
             const ggml_tensor * residual, const NormAfter * norm = nullptr) {
    const int64_t ncols = src1->ne[1];
    if (residual && (fusion || ncols < 2 || ncols > MAX_COLS)) {
        return false;
    }
    if (repacked_of(src0)) {  // ours whatever the switch: ggml's kernels cannot read it
        repacked_mul_mat(ctx, src0, src1, dst, fusion, residual, norm);
        g_calls.fetch_add(1, std::memory_order_relaxed);
        return true;
    }
    int kind, chunk;
    if (!enabled(ctx.device) || !kind_of(src0->type, kind, chunk)) {
        return false;
    }
    const int64_t pieces_per_block =
        with_kind(kind, [](auto k) { return Layout<decltype(k)::value>::pieces; });
    const bool shapes = ncols >= 1 && ncols <= MAX_COLS && src1->ne[0] == src0->ne[0] &&
                        src0->ne[0] % (32 * pieces_per_block) == 0 && src0->ne[1] < INT32_MAX &&
                        src0->ne[0] / 32 < INT32_MAX && dst->ne[0] == src0->ne[1] &&
                        dst->ne[1] == ncols && src0->ne[2] == 1 && src0->ne[3] == 1 &&
                        src1->ne[2] == 1 && src1->ne[3] == 1;
    const bool layouts = src1->type == GGML_TYPE_F32 && dst->type == GGML_TYPE_F32 &&
                         src0->nb[0] == ggml_type_size(src0->type) &&
                         src1->nb[0] == sizeof(float) && dst->nb[0] == sizeof(float) &&
                         src1->nb[1] % sizeof(float) == 0 && dst->nb[1] % sizeof(float) == 0;
    // weights only: a compute buffer may pad a tensor with bytes that ggml clears first
    const bool weights = src0->buffer && ggml_backend_buffer_get_usage(src0->buffer) !=
                                             GGML_BACKEND_BUFFER_USAGE_COMPUTE;
    const int cc = ggml_cuda_info().devices[ctx.device].cc;
    if (!shapes || !layouts || !weights || !GGML_CUDA_CC_IS_NVIDIA(cc) || cc < GGML_CUDA_CC_DP4A) {
        return false;
    }
    if (!takes_cols(src0, ncols, ctx.device)) {
        return false;
    }
    if (!fusion_taken(fusion, src0, false, ncols)) {  // (not repacked: checked first)
        return false;
    }
    const ggml_tensor * gate = fusion ? fusion->gate : nullptr;
    const int64_t npieces = src0->ne[0] / 32;
    cudaStream_t stream = ctx.stream();
    ContextState & st = state_of(ctx);
    ggml_cuda_pool_alloc<uint8_t> scratch(ctx.pool());
    auto activations = [&](int planes) {
        return product_activations(ctx, st, src1, npieces, planes, scratch);
    };

    if (ncols >= MIN_GEMM_COLS) {  // gemm: rows at the alignment the kind's loads need
        const size_t align =
            with_kind(kind, [](auto k) { return Layout<decltype(k)::value>::align; });
        if (src0->nb[1] % align != 0 || uintptr_t(src0->data) % align != 0) {
            return false;
        }
        const GemmArgs g =
            gemm_args(src0, dst, halves_at(activations(0), npieces, int(ncols)), residual);
        with_kind(kind, [&](auto k) { run_gemm<decltype(k)::value>(ctx, g, norm); });
        g_calls.fetch_add(1, std::memory_order_relaxed);
        return true;
    }
    if (residual) {
        return false;
    }
    GGML_ASSERT(norm == nullptr);  // (with a residual only)

    const int unit = copy_unit(src0, gate, chunk);
    if (unit == 0 || !fits(kind, npieces, ctx.device)) {
        return false;
    }
    const int planes = planes_of(kind);
    const Args a =
        gemv_args(src0, dst, fusion, planes_at(activations(planes), npieces, ncols, planes));

    const Launch run =
        with_kind(kind, [&](auto k) { return pick<decltype(k)::value>(gate != nullptr, unit); });
    run(a, stream, ctx.device);
    g_calls.fetch_add(1, std::memory_order_relaxed);
    return true;
}

}  // namespace lucepy

bool lucepy_cuda_mul_mat(ggml_backend_cuda_context & ctx, const ggml_tensor * src0,
                         const ggml_tensor * src1, ggml_tensor * dst,
                         const ggml_cuda_mm_fusion_args_host * fusion) {
    return lucepy::mul_mat(ctx, src0, src1, dst, fusion, nullptr);
}

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
    const int planes = want->planes;
    float eps = 0.0f;
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

// the bytes a tensor spans
struct Span {
    const char * begin;
    const char * end;
};

Span span_of(const ggml_tensor * t) {
    const char * begin = static_cast<const char *>(t->data);
    return {begin, begin + ggml_nbytes(t)};
}

bool apart(Span a, Span b) {
    return a.begin == a.end || b.begin == b.end || a.end <= b.begin || b.end <= a.begin;
}

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

// apart, or at the same address: an element-wise kernel that reads each element before it
// writes it there
bool apart_or_same(const ggml_tensor * p, const ggml_tensor * q) {
    return apart(span_of(p), span_of(q)) || p->data == q->data;
}

// f32, contiguous and of `like`'s shape
bool dense_like(const ggml_tensor * t, const ggml_tensor * like) {
    return t->type == GGML_TYPE_F32 && ggml_is_contiguous(t) && ggml_are_same_shape(t, like);
}

// a dense f32 tensor of ne0 x ne1 x ne2 at the start of `t`'s bytes, element for element
bool dense_as(const ggml_tensor * t, int64_t ne0, int64_t ne1, int64_t ne2) {
    return t->type == GGML_TYPE_F32 && t->nb[0] == sizeof(float) &&
           t->nb[1] == sizeof(float) * size_t(ne0) && t->nb[2] == t->nb[1] * size_t(ne1) &&
           t->ne[0] == ne0 && t->ne[1] == ne1 && t->ne[2] == ne2 && t->ne[3] == 1;
}

// f32 columns (2D), each dense, the columns any whole number of floats apart (a part of a
// stacked product's result, its rows of all columns)
bool columns_apart(const ggml_tensor * t) {
    return t->type == GGML_TYPE_F32 && t->nb[0] == sizeof(float) &&
           t->nb[1] % sizeof(float) == 0 && t->ne[2] == 1 && t->ne[3] == 1;
}

// the next node after i that computes something (not a view or a no-op), or n_nodes
int next_op(const ggml_cgraph * cgraph, int i) {
    for (i++; i < cgraph->n_nodes; i++) {
        if (!no_op(cgraph->nodes[i])) {
            return i;
        }
    }
    return i;
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
    if (want->planes == 0) {  // 2-16 columns (a verify)
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
        want->src1 != mul || want->planes != 0 || !apart_or_same(mul, add) ||
        !(apart(span_of(mul), span_of(r)) || (mul->data == r->data && mul->nb[1] == r->nb[1]))) {
        return 0;
    }
    norm.mul = mul;
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

// An FFN's two products of one input and their SWIGLU from node i, a MUL_MAT (a verify's gate
// and up, 2-16 columns, both repacked matrices of one type and shape): one gemm_r over both
// matrices' rows (the GLU's first source's first), its parts added by glu_halves as it applies
// the gate and writes the GLU's result and the down product's halves. The products' results are
// never written (the GLU alone reads them). On the H200 one launch over the two took 44.8 us
// where two took 25.3 each, 16 columns (bench-kernels.cu's ffn_up|gate). The nodes after i
// computed, or 0.
int glu_pair_nodes(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph, int i) {
    const ggml_tensor * m1 = cgraph->nodes[i];
    const int i2 = next_op(cgraph, i);
    const int i_glu = i2 < cgraph->n_nodes ? next_op(cgraph, i2) : i2;
    if (i_glu >= cgraph->n_nodes) {
        return 0;
    }
    const ggml_tensor * m2 = cgraph->nodes[i2];
    ggml_tensor * glu = cgraph->nodes[i_glu];
    if (m2->op != GGML_OP_MUL_MAT || glu->op != GGML_OP_GLU ||
        ggml_get_glu_op(glu) != GGML_GLU_OP_SWIGLU || ggml_get_op_params_i32(glu, 1) != 0) {
        return 0;
    }
    const ggml_tensor * ma = glu->src[0];  // silu's
    const ggml_tensor * mb = glu->src[1];
    if (!((ma == m1 && mb == m2) || (ma == m2 && mb == m1))) {
        return 0;
    }
    const ggml_tensor * x = m1->src[1];
    const ggml_tensor * wa = ma->src[0];
    const ggml_tensor * wb = mb->src[0];
    const int64_t ncols = x->ne[1];
    const int64_t n = wa->ne[1];
    auto result = [&](const ggml_tensor * t) {  // a product's result or the GLU's: f32 n x ncols
        return t->type == GGML_TYPE_F32 && t->ne[0] == n && t->ne[1] == ncols && t->ne[2] == 1 &&
               t->ne[3] == 1;
    };
    auto unkept = [](const ggml_tensor * t) {  // a product's: its result is never written
        return (t->flags & GGML_TENSOR_FLAG_OUTPUT) == 0;
    };
    const bool shapes = m2->src[1] == x && ncols >= 2 && ncols <= MAX_COLS &&
                        x->type == GGML_TYPE_F32 && x->ne[0] == wa->ne[0] && x->ne[2] == 1 &&
                        x->ne[3] == 1 && x->nb[0] == sizeof(float) &&
                        x->nb[1] % sizeof(float) == 0 && wb->type == wa->type &&
                        ggml_are_same_shape(wa, wb) && ggml_are_same_stride(wa, wb) &&
                        n % (GM_WARPS * 16) == 0 && 2 * n < INT32_MAX && result(ma) &&
                        result(mb) && result(glu) && ggml_is_contiguous(glu) && unkept(ma) &&
                        unkept(mb);
    if (!shapes || !repacked_of(wa) || !repacked_of(wb)) {
        return 0;
    }
    ContextState & st = state_of(ctx);
    const Wanted * want = wanted(st, glu);
    if (st.readers(m1) != 1 || st.readers(m2) != 1 || want == nullptr || want->planes != 0 ||
        want->src1->ne[0] != n || want->src1->ne[1] != ncols) {
        return 0;  // (the down product's halves: a column of it is a column of the GLU's)
    }
    const int64_t npieces = wa->ne[0] / 32;
    ggml_cuda_pool_alloc<uint8_t> scratch(ctx.pool());
    GemmArgs g = gemm_args(
        wa, ma, halves_at(product_activations(ctx, st, x, npieces, 0, scratch), npieces, int(ncols)),
        nullptr);
    g.w2 = static_cast<const uint8_t *>(wb->data);
    g.rows2 = int(n);
    g.nrows = int(2 * n);
    const Halves out = halves_at(prepared(st, want->src1, n / 32, 0), n / 32, int(ncols));
    ggml_cuda_pool_alloc<float> sums(ctx.pool());
    auto go = [&](auto build) {  // a GemmR or GemmRB
        using R = decltype(build);
        const GemmPlan plan = gemm_r_plan<R>(ctx.device, g);
        const int parts = int(plan.grid.y);
        g.per_part = plan.per_part;
        float * buf = sums.alloc(size_t(parts) * ncols * 2 * n);
        g.parts = buf;  // split: the parts; one part: the sums straight, in the parts' layout
        g.dst = buf;
        g.dst_stride = 2 * n;
        ggml_cuda_kernel_launch(
            R::kernel(),
            ggml_cuda_kernel_launch_params(plan.grid, GM_WARPS * 32, R::smem, ctx.stream()), g);
        launch_glu_halves(buf, buf + n, 2 * n, parts, 2 * n * ncols,
                          static_cast<float *>(glu->data), int(n / 32), int(ncols), out,
                          ctx.stream());
    };
    // 5 CTAs an SM, a chunk of activations a stage: 96 registers, none spilled (on an H200 the
    // stack at 16 columns 41.2 us where 4 CTAs take 43.0, at 8 31.9 where 35.3; the other
    // products no faster so: docs/BENCHMARKS.md, session 37); at two column tiles gemm_rb
    // (39.5 us at 16 columns: session 38)
    // (Q4_K's layout the same builds; Q5_K's and Q6_K's gemm_rb's always)
    with_layout(wa->type, [&](auto layout) {
        using L = decltype(layout);
        if constexpr (!L::gemm_r) {
            ncols <= GM_COL_TILE ? go(GemmRB<1, 6, L>()) : go(GemmRB<2, 5, L>());
            g_bulk.fetch_add(1, std::memory_order_relaxed);
        } else if (ncols <= GM_COL_TILE) {
            go(GemmR<1, GM_WARPS, 5, 1, L>());
        } else if (bulk_product<2>(ctx.device, g)) {
            go(GemmRB<2, 5, L>());
            g_bulk.fetch_add(1, std::memory_order_relaxed);
        } else {
            go(GemmR<2, GM_WARPS, 5, 1, L>());
        }
    });
    g_calls.fetch_add(2, std::memory_order_relaxed);
    g_ops.fetch_add(1, std::memory_order_relaxed);
    return i_glu - i;
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
        return t->type == GGML_TYPE_F32 && t->nb[0] == sizeof(float) &&
               reinterpret_cast<uintptr_t>(t->data) % 16 == 0 && t->nb[1] % 16 == 0 &&
               t->nb[2] % 16 == 0 && t->nb[3] % 16 == 0;
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
                    const ggml_tensor * dup = nullptr) {
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
    if (want == nullptr || want->planes != 0 || ggml_nelements(want->src1) != n) {
        return false;  // 2-16 columns only (a verify; a decode's GLU is its product's)
    }
    const int64_t cols = want->src1->ne[1];
    const int64_t per_col = want->src1->ne[0] / 32;
    const Halves halves = halves_at(prepared(st, want->src1, per_col, 0), per_col, int(cols));
    launch_glu_halves(static_cast<const float *>(a->data), static_cast<const float *>(b->data),
                      per_col * 32, 1, 0, static_cast<float *>(dst->data), int(per_col),
                      int(cols), halves, ctx.stream());
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
        case GGML_OP_MUL_MAT: {
            const int pair = glu_pair_nodes(ctx, cgraph, i);
            return pair > 0 ? pair : mul_mat_add_nodes(ctx, cgraph, i);
        }
        default: return 0;
    }
}

void lucepy_cuda_graph_begin(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph) {
    // ggml's kernels: nothing kept (the next begin with ours on bumps the graph's number)
    if (!lucepy::enabled(ctx.device)) {
        return;
    }
    lucepy::state_of(ctx).begin(cgraph, ctx.device);
}

void lucepy_cuda_bytes_gone(const void * ptr, size_t size) {
    using namespace lucepy;
    if (g_n_repacked.load(std::memory_order_relaxed) == 0) {
        return;
    }
    const uintptr_t from = uintptr_t(ptr);
    const uintptr_t to = from + size;
    std::lock_guard<std::mutex> lock(g_rp_mutex);
    auto it = g_repacked.upper_bound(from);
    if (it != g_repacked.begin() && std::prev(it)->second.end > from) {
        --it;  // a matrix that begins before the range and reaches into it
    }
    while (it != g_repacked.end() && it->first < to) {
        it = g_repacked.erase(it);
        g_n_repacked.fetch_sub(1, std::memory_order_relaxed);
    }
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

bool lucepy_cuda_mul_mat(ggml_backend_cuda_context &, const ggml_tensor *, const ggml_tensor *,
                         ggml_tensor *, const ggml_cuda_mm_fusion_args_host *) {
    return false;
}

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

void lucepy_cuda_graph_begin(ggml_backend_cuda_context &, const ggml_cgraph *) {}

void lucepy_cuda_context_free(ggml_backend_cuda_context &) {}

void lucepy_cuda_bytes_gone(const void *, size_t) {}

namespace lucepy {
std::atomic<int> g_on{0};
std::atomic<int64_t> g_calls{0};
std::atomic<int64_t> g_quantized{0};
std::atomic<int64_t> g_fused{0};
std::atomic<int64_t> g_ops{0};
std::atomic<int64_t> g_copies{0};  // copy nodes (DUP, CONT, CPY) a kernel of ours made as it ran
std::atomic<int64_t> g_joined{0};  // ops computed in another op's kernel (one launch less each)
std::atomic<int64_t> g_bulk{0};    // products of gemm_rb (bulk_product)
}  // namespace lucepy

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

int lucepy_cuda_repack(struct ggml_tensor * t) {
#if !defined(GGML_USE_HIP) && !defined(GGML_USE_MUSA)
    using namespace lucepy;
    const bool shape = repackable_type(t->type) && t->view_src == nullptr && t->data &&
                       ggml_is_contiguous(t) && t->ne[2] == 1 && t->ne[3] == 1 &&
                       t->ne[1] % RP_ROWS == 0 && t->ne[0] % (32 * 8) == 0 &&
                       t->ne[0] / 32 < INT32_MAX && t->ne[1] < INT32_MAX;
    if (!shape || repacked_of(t)) {
        return 0;
    }
    cudaPointerAttributes attr;
    if (cudaPointerGetAttributes(&attr, t->data) != cudaSuccess ||
        attr.type != cudaMemoryTypeDevice || !enabled(attr.device)) {
        (void) cudaGetLastError();
        return 0;
    }
    if (bulk_only_type(t->type) && ggml_cuda_info().devices[attr.device].cc < 900) {
        return 0;  // (its 2-16 column kernel takes its weights by the TMA unit)
    }
    ggml_cuda_set_device(attr.device);
    const size_t n = ggml_nbytes(t);
    uint8_t * copy = nullptr;
    CUDA_CHECK(cudaMalloc(&copy, n));
    CUDA_CHECK(cudaMemcpy(copy, t->data, n, cudaMemcpyDeviceToDevice));
    const int ngroups = int(t->ne[0] / 32 / RP_GROUP);
    const unsigned tiles = unsigned(t->ne[1] / RP_ROWS);
    with_layout(t->type, [&](auto layout) {  // a CTA a tile's group, or super-block (two groups)
        using L = decltype(layout);
        const dim3 grid(unsigned(L::pair ? ngroups / 2 : ngroups), tiles);
        L::repack<<<grid, L::pair ? 128 : 64>>>(copy, int64_t(t->nb[1]), ngroups,
                                                static_cast<uint8_t *>(t->data));
    });
    CUDA_CHECK(cudaGetLastError());
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaFree(copy));
    std::lock_guard<std::mutex> lock(g_rp_mutex);
    g_repacked[uintptr_t(t->data)] = {uintptr_t(t->data) + n, t->ne[0], int64_t(t->nb[1]),
                                      t->type};
    g_n_repacked.fetch_add(1, std::memory_order_relaxed);
    return 1;
#else
    (void) t;
    return 0;
#endif
}
}
