// lucepy's own kernels (issue 19, decision 12): a quantized weight matrix times 1 to 16 columns.
//
// ggml-cuda reads the weights of a decode at about a third of an H200's bandwidth, and leaves its
// vector kernels for its tiled ones above 8 columns, so that a 16-token DFlash verify costs 2.4
// decodes. Here every column count from 1 to 16 reads each weight byte once:
//   - rows stream through shared memory in chunks, with cp.async, three chunks in flight, in the
//     widest copies the row alignment allows;
//   - 1-4 columns: a CTA owns 8 rows (4 output rows and their gate rows when ggml fuses the
//     FFN's gate, up and GLU for one column); each thread takes one 32-value piece for all 8
//     rows, so that the activations it loads serve 8 rows, and multiplies with dp4a;
//   - 5-16 columns: a CTA owns 16 rows and multiplies them with tensor cores (mma.sync on int8);
//   - the activations are quantized to int8 once per graph and source tensor (Q, K and V share
//     theirs; so do gate and up), not once per product.
// See lucepy-quants.cuh for the piece format, and hooks.patch for where ggml calls in.
//
// Measured on an H200 (docs/BENCHMARKS.md): still slower than ggml's kernels (decode 0.92x), so
// off unless LUCEPY_CUDA_KERNELS=1. A decode's products are small enough to be latency-bound,
// which staging through shared memory does not help.

#include "lucepy-mm.cuh"
#include "lucepy-quants.cuh"

#include <array>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#if !defined(GGML_USE_HIP) && !defined(GGML_USE_MUSA)

namespace lucepy {

constexpr int THREADS = 128;
constexpr int ROWS = 8;     // rows staged per CTA
constexpr int STAGES = 3;   // chunks in flight per CTA
constexpr int MAX_COLS = 16;
constexpr int SLOTS = 4;    // quantized activations kept per context and graph

// A thread multiplies its piece with up to 4 columns: 1-4 columns are one group of 128 threads,
// 5-8 two groups of 64, 9-16 four groups of 32. A chunk holds one piece per thread of a group.
template <int NC> struct Cols {
    static constexpr int groups = NC <= 4 ? 1 : NC <= 8 ? 2 : 4;
    static constexpr int per_group = (NC + groups - 1) / groups;
    static constexpr int slots = THREADS / groups;
};

template <int K, int NC> struct Chunk {
    static constexpr int blocks = Cols<NC>::slots / Layout<K>::pieces;
    static constexpr int bytes = blocks * Layout<K>::bytes;   // of one row
    static constexpr int pitch = (bytes + 15) / 16 * 16;      // its room in shared memory
    static constexpr int smem = STAGES * ROWS * pitch;
};

// --- copies into shared memory ----------------------------------------------------------------

__device__ __forceinline__ void copy_async(uint8_t * dst, const uint8_t * src, int unit) {
#if __CUDA_ARCH__ >= GGML_CUDA_CC_AMPERE
    const unsigned s = unsigned(__cvta_generic_to_shared(dst));
    if (unit == 16) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(src));
    } else if (unit == 8) {
        asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(s), "l"(src));
    } else {
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(src));
    }
#else
    if (unit == 16) {
        *reinterpret_cast<int4 *>(dst) = *reinterpret_cast<const int4 *>(src);
    } else if (unit == 8) {
        *reinterpret_cast<int2 *>(dst) = *reinterpret_cast<const int2 *>(src);
    } else {
        *reinterpret_cast<int *>(dst) = *reinterpret_cast<const int *>(src);
    }
#endif
}

__device__ __forceinline__ void copy_commit() {
#if __CUDA_ARCH__ >= GGML_CUDA_CC_AMPERE
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}

template <int PENDING> __device__ __forceinline__ void copy_wait() {
#if __CUDA_ARCH__ >= GGML_CUDA_CC_AMPERE
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING));
#endif
}

__device__ __forceinline__ float glu(int op, float x, float gate) {
    if (op == GGML_GLU_OP_GEGLU) {
        const float c = 0.79788456080286535588f;  // sqrt(2 / pi)
        return x * 0.5f * gate * (1.0f + tanhf(c * gate * (1.0f + 0.044715f * gate * gate)));
    }
    return x * gate / (1.0f + expf(-gate));  // SWIGLU
}

// --- the product --------------------------------------------------------------------------------

struct Args {
    const uint8_t * w;        // weights, rows of row_stride bytes
    const uint8_t * gate;     // the fused gate's weights, or null
    int64_t row_stride;
    const int * xq;           // [piece][column][8 ints]: 32 int8 activations
    const float2 * xds;       // [piece][column]: (scale, scale * sum of the int8 values)
    float * dst;              // [column][row], columns dst_stride floats apart
    int64_t dst_stride;
    const float * x_bias;     // fused bias of the product, or null
    const float * gate_bias;  // fused bias of the gate, or null
    int glu_op;
    int nrows;
    int npieces;              // row length / 32
    int unit;                 // bytes per copy: 16, 8 or 4
};

template <int K, int NC, bool GATE>
__global__ void __launch_bounds__(THREADS) mul_mat(const Args a) {
    using C = Cols<NC>;
    using Ch = Chunk<K, NC>;
    using L = Layout<K>;
    constexpr int OUT = GATE ? ROWS / 2 : ROWS;  // output rows per CTA
    extern __shared__ __align__(16) uint8_t smem[];

    const int tid = threadIdx.x;
    const int slot = tid % C::slots;
    const int group = tid / C::slots;
    const int row0 = blockIdx.x * OUT;
    const int nblocks = a.npieces / L::pieces;
    const int nchunks = (nblocks + Ch::blocks - 1) / Ch::blocks;

    // staged row r: output row row0 + r, or with a gate, rows 0..3 the product's, 4..7 the gate's
    auto issue = [&](int ch) {
        if (ch < nchunks) {
            const int b0 = ch * Ch::blocks;
            const int bytes = min(Ch::blocks, nblocks - b0) * L::bytes;
            uint8_t * stage = smem + (ch % STAGES) * ROWS * Ch::pitch;
#pragma unroll
            for (int r = 0; r < ROWS; r++) {
                const int row = row0 + r % OUT;
                if (row >= a.nrows) {
                    continue;
                }
                const uint8_t * src = (GATE && r >= OUT ? a.gate : a.w) + row * a.row_stride +
                                      int64_t(b0) * L::bytes;
                for (int o = tid * a.unit; o < bytes; o += THREADS * a.unit) {
                    copy_async(stage + r * Ch::pitch + o, src + o, a.unit);
                }
            }
        }
        copy_commit();  // an empty group past the end keeps the count of groups in flight
    };

    float acc[ROWS][C::per_group];
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
#pragma unroll
        for (int i = 0; i < C::per_group; i++) {
            acc[r][i] = 0.0f;
        }
    }

#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        issue(s);  // weights: no kernel before this one writes them
    }
    ggml_cuda_pdl_sync();  // the activations: the kernel before has finished
    for (int ch = 0; ch < nchunks; ch++) {
        issue(ch + STAGES - 1);
        copy_wait<STAGES - 1>();
        __syncthreads();
        const int piece = ch * C::slots + slot;
        if (piece < a.npieces) {
            int xq[C::per_group][8];
            float dx[C::per_group], sx[C::per_group];
#pragma unroll
            for (int i = 0; i < C::per_group; i++) {
                const int c = group * C::per_group + i;
                if (c < NC) {
                    const int64_t at = int64_t(piece) * NC + c;
                    const int4 lo = reinterpret_cast<const int4 *>(a.xq)[2 * at];
                    const int4 hi = reinterpret_cast<const int4 *>(a.xq)[2 * at + 1];
                    xq[i][0] = lo.x, xq[i][1] = lo.y, xq[i][2] = lo.z, xq[i][3] = lo.w;
                    xq[i][4] = hi.x, xq[i][5] = hi.y, xq[i][6] = hi.z, xq[i][7] = hi.w;
                    const float2 ds = a.xds[at];
                    dx[i] = ds.x, sx[i] = ds.y;
                }
            }
            const uint8_t * stage = smem + (ch % STAGES) * ROWS * Ch::pitch +
                                    (slot / L::pieces) * L::bytes;
#pragma unroll
            for (int r = 0; r < ROWS; r++) {
                if (row0 + r % OUT >= a.nrows) {
                    continue;
                }
                Piece p;
                unpack<K>(stage + r * Ch::pitch, slot % L::pieces, p);
#pragma unroll
                for (int i = 0; i < C::per_group; i++) {
                    if (group * C::per_group + i < NC) {
                        acc[r][i] += dot(p, xq[i], dx[i], sx[i]);
                    }
                }
            }
        }
        __syncthreads();
    }

    ggml_cuda_pdl_lc();  // the next kernel may start (and fetch its own weights)

    // sum over the slots of each group: across a warp's lanes, then across the group's warps
    constexpr int WARPS = THREADS / 32;
    constexpr int WARPS_PER_GROUP = C::slots / 32;
    float * red = reinterpret_cast<float *>(smem);  // the stages are free now
    const int warp = tid / 32;
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
#pragma unroll
        for (int i = 0; i < C::per_group; i++) {
            float v = acc[r][i];
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) {
                v += __shfl_xor_sync(0xFFFFFFFFu, v, off);
            }
            if (tid % 32 == 0) {
                red[(warp * ROWS + r) * C::per_group + i] = v;
            }
        }
    }
    static_assert(WARPS * ROWS * C::per_group * sizeof(float) <= Ch::smem, "room to reduce");
    __syncthreads();
    for (int o = tid; o < OUT * NC; o += THREADS) {
        const int r = o % OUT;
        const int c = o / OUT;
        const int row = row0 + r;
        if (row >= a.nrows) {
            continue;
        }
        const int g = c / C::per_group;
        const int i = c % C::per_group;
        float v = 0.0f, gv = 0.0f;
#pragma unroll
        for (int k = 0; k < WARPS_PER_GROUP; k++) {
            const int w = g * WARPS_PER_GROUP + k;
            v += red[(w * ROWS + r) * C::per_group + i];
            if (GATE) {
                gv += red[(w * ROWS + OUT + r) * C::per_group + i];
            }
        }
        const int64_t at = c * a.dst_stride + row;
        if (a.x_bias) {
            v += a.x_bias[at];
        }
        if (GATE) {
            if (a.gate_bias) {
                gv += a.gate_bias[at];
            }
            v = glu(a.glu_op, v, gv);
        }
        a.dst[at] = v;
    }
}

// --- 5 to 16 columns: tensor cores -------------------------------------------------------------
//
// A CTA owns 16 rows and its 4 warps take every 4th piece of a chunk. Per piece a warp multiplies
// the 16 rows' int8 values by up to 16 columns' (one or two m16n8 tiles) with mma.sync, k = 32
// (Q6_K: two k = 16, for its two scales a piece), and scales the exact int32 sums into float
// accumulators. Fragments (PTX ISA, integer m16n8k32 / m16n8k16, g = lane / 4, t = lane % 4):
//   A: reg 0 row g, values 4t..4t+3; reg 1 row g + 8, the same; regs 2, 3 as 0, 1 for values
//      16+4t..16+4t+3 (k = 16: regs 0, 1 only, values 4t..4t+3 of the 16)
//   B: reg 0 column g, values 4t..4t+3; reg 1 values 16+4t.. (k = 16: reg 0 only)
//   C: regs 0, 1 row g, columns 2t, 2t + 1; regs 2, 3 row g + 8, the same columns

constexpr int MMA_ROWS = 16;
constexpr int MMA_WARPS = THREADS / 32;
constexpr int MMA_PIECES = 32;  // pieces per chunk and row

template <int K> struct MmaChunk {
    static constexpr int blocks = MMA_PIECES / Layout<K>::pieces;
    static constexpr int bytes = blocks * Layout<K>::bytes;
    static constexpr int pitch = (bytes + 15) / 16 * 16 + 16;  // + 16: rows g and g + 1 apart in banks
    static constexpr int smem = STAGES * MMA_ROWS * pitch;
};

__device__ __forceinline__ void mma_k32(int (&c)[4], int a0, int a1, int a2, int a3, int b0,
                                        int b1) {
#if __CUDA_ARCH__ >= GGML_CUDA_CC_AMPERE
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
    NO_DEVICE_CODE;  // the host takes this path from Ampere up only
#endif
}

__device__ __forceinline__ void mma_k16(int (&c)[4], int a0, int a1, int b0) {
#if __CUDA_ARCH__ >= GGML_CUDA_CC_AMPERE
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
        "{%0, %1, %2, %3};\n"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(b0));
#else
    NO_DEVICE_CODE;
#endif
}

template <int K, int NC>
__global__ void __launch_bounds__(THREADS) mul_mat_mma(const Args a) {
    using Ch = MmaChunk<K>;
    using L = Layout<K>;
    constexpr int TILES = (NC + 7) / 8;
    extern __shared__ __align__(16) uint8_t smem[];

    const int tid = threadIdx.x;
    const int lane = tid % 32;
    const int warp = tid / 32;
    const int g = lane / 4;
    const int t = lane % 4;
    const int row0 = blockIdx.x * MMA_ROWS;
    const int nblocks = a.npieces / L::pieces;
    const int nchunks = (nblocks + Ch::blocks - 1) / Ch::blocks;

    auto issue = [&](int ch) {
        if (ch < nchunks) {
            const int b0 = ch * Ch::blocks;
            const int bytes = min(Ch::blocks, nblocks - b0) * L::bytes;
            uint8_t * stage = smem + (ch % STAGES) * MMA_ROWS * Ch::pitch;
            for (int r = 0; r < MMA_ROWS; r++) {
                const int row = row0 + r;
                if (row >= a.nrows) {
                    break;
                }
                const uint8_t * src = a.w + row * a.row_stride + int64_t(b0) * L::bytes;
                for (int o = tid * a.unit; o < bytes; o += THREADS * a.unit) {
                    copy_async(stage + r * Ch::pitch + o, src + o, a.unit);
                }
            }
        }
        copy_commit();
    };

    float acc[TILES][4];
#pragma unroll
    for (int j = 0; j < TILES; j++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            acc[j][e] = 0.0f;
        }
    }

#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        issue(s);
    }
    ggml_cuda_pdl_sync();
    for (int ch = 0; ch < nchunks; ch++) {
        issue(ch + STAGES - 1);
        copy_wait<STAGES - 1>();
        __syncthreads();
        const uint8_t * stage = smem + (ch % STAGES) * MMA_ROWS * Ch::pitch;
        for (int p = warp; p < MMA_PIECES; p += MMA_WARPS) {
            const int piece = ch * MMA_PIECES + p;
            if (piece >= a.npieces) {
                break;
            }
            // rows past the end hold stale bytes: only their own outputs see them, and are dropped
            const uint8_t * top = stage + g * Ch::pitch + (p / L::pieces) * L::bytes;
            const uint8_t * low = top + 8 * Ch::pitch;
            const int at = p % L::pieces;
            int a0, a1, a2, a3;
            ints<K>(top, at, t, a0, a2);
            ints<K>(low, at, t, a1, a3);
            const Scales st = scales<K>(top, at);
            const Scales sl = scales<K>(low, at);
#pragma unroll
            for (int j = 0; j < TILES; j++) {
                const int cb = 8 * j + g;  // this thread's column of B
                int b0 = 0, b1 = 0;
                if (cb < NC) {
                    const int * x = a.xq + (int64_t(piece) * NC + cb) * 8;
                    b0 = x[t];
                    b1 = x[4 + t];
                }
                const int c0 = 8 * j + 2 * t;  // this thread's columns of C
                const float2 d0 = c0 < NC ? a.xds[int64_t(piece) * NC + c0] : make_float2(0, 0);
                const float2 d1 =
                    c0 + 1 < NC ? a.xds[int64_t(piece) * NC + c0 + 1] : make_float2(0, 0);
                if constexpr (K == Q6_K) {
                    int lo[4] = {0, 0, 0, 0}, hi[4] = {0, 0, 0, 0};
                    mma_k16(lo, a0, a1, b0);
                    mma_k16(hi, a2, a3, b1);
                    acc[j][0] += (float(lo[0]) * st.s0 + float(hi[0]) * st.s1) * d0.x;
                    acc[j][1] += (float(lo[1]) * st.s0 + float(hi[1]) * st.s1) * d1.x;
                    acc[j][2] += (float(lo[2]) * sl.s0 + float(hi[2]) * sl.s1) * d0.x;
                    acc[j][3] += (float(lo[3]) * sl.s0 + float(hi[3]) * sl.s1) * d1.x;
                } else {
                    int c[4] = {0, 0, 0, 0};
                    mma_k32(c, a0, a1, a2, a3, b0, b1);
                    acc[j][0] += float(c[0]) * (st.s0 * d0.x) - st.bias * d0.y;
                    acc[j][1] += float(c[1]) * (st.s0 * d1.x) - st.bias * d1.y;
                    acc[j][2] += float(c[2]) * (sl.s0 * d0.x) - sl.bias * d0.y;
                    acc[j][3] += float(c[3]) * (sl.s0 * d1.x) - sl.bias * d1.y;
                }
            }
        }
        __syncthreads();
    }

    ggml_cuda_pdl_lc();

    // the warps' sums: element e of tile j of lane l is row (e / 2) * 8 + l / 4, column
    // 8j + 2 (l % 4) + e % 2
    float * red = reinterpret_cast<float *>(smem);
    static_assert(MMA_WARPS * TILES * 4 * 32 * sizeof(float) <= Ch::smem, "room to reduce");
#pragma unroll
    for (int j = 0; j < TILES; j++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            red[((warp * TILES + j) * 4 + e) * 32 + lane] = acc[j][e];
        }
    }
    __syncthreads();
    for (int o = tid; o < MMA_ROWS * NC; o += THREADS) {
        const int r = o % MMA_ROWS;
        const int c = o / MMA_ROWS;
        const int row = row0 + r;
        if (row >= a.nrows) {
            continue;
        }
        const int j = c / 8;
        const int e = (r / 8) * 2 + c % 2;
        const int l = (r % 8) * 4 + (c % 8) / 2;
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < MMA_WARPS; w++) {
            v += red[((w * TILES + j) * 4 + e) * 32 + l];
        }
        a.dst[c * a.dst_stride + row] = v;
    }
}

// One warp per 32-value piece and column: 32 int8 values, their scale, and the sum of the
// values they stand for (scale times their sum).
// (No __restrict__ here or in Args: ggml-cuda finds it unsafe beside programmatic dependent launch.)
__global__ void quantize(const float * x, int64_t col_stride, int npieces, int ncols, int8_t * xq,
                         float2 * xds) {
    ggml_cuda_pdl_lc();    // the product after this may start fetching its weights
    ggml_cuda_pdl_sync();  // x: the kernel before has finished
    const int piece = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int c = blockIdx.y;
    const int lane = threadIdx.x % 32;
    if (piece >= npieces) {
        return;
    }
    const float v = x[c * col_stride + int64_t(piece) * 32 + lane];
    float amax = fabsf(v);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, off));
    }
    const float d = amax / 127.0f;
    const int q = amax == 0.0f ? 0 : __float2int_rn(v / d);
    int sum = q;  // of the quantized values: a min's error then cancels the values' (Q4_K)
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        sum += __shfl_xor_sync(0xFFFFFFFFu, sum, off);
    }
    const int64_t at = int64_t(piece) * ncols + c;
    xq[at * 32 + lane] = int8_t(q);
    if (lane == 0) {
        xds[at] = make_float2(d, d * float(sum));
    }
}

// --- host side ----------------------------------------------------------------------------------

std::atomic<int> g_on{-1};
std::atomic<int64_t> g_calls{0};
std::atomic<int64_t> g_quantized{0};

bool enabled() {
    int on = g_on.load(std::memory_order_relaxed);
    if (on < 0) {
        const char * env = std::getenv("LUCEPY_CUDA_KERNELS");  // off unless asked: measured
        on = (env && env[0] == '1') ? 1 : 0;                    // slower than ggml's so far
        g_on.store(on, std::memory_order_relaxed);
    }
    return on == 1;
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
    uint64_t graph = 0;
    uint64_t used = 0;
    uint8_t * buf = nullptr;
    size_t cap = 0;
};

struct ContextState {
    uint64_t graph = 1;
    uint64_t clock = 0;
    Kept slot[SLOTS];
    std::vector<uint8_t *> retired;
    const ggml_cgraph * cgraph = nullptr;  // the graph being computed
    std::unordered_set<const ggml_tensor *> members;  // its nodes and leafs, once asked
    bool listed = false;

    bool in_graph(const ggml_tensor * t) {
        if (cgraph == nullptr) {
            return false;
        }
        if (!listed) {
            for (int i = 0; i < cgraph->n_nodes; i++) {
                members.insert(cgraph->nodes[i]);
            }
            for (int i = 0; i < cgraph->n_leafs; i++) {
                members.insert(cgraph->leafs[i]);
            }
            listed = true;
        }
        return members.count(t) != 0;
    }
};

std::mutex g_mutex;
std::unordered_map<const ggml_backend_cuda_context *, ContextState> g_states;

ContextState & state_of(const ggml_backend_cuda_context & ctx) {
    std::lock_guard<std::mutex> lock(g_mutex);
    return g_states[&ctx];
}

size_t quantized_bytes(int64_t npieces, int64_t ncols) {
    return size_t(npieces * ncols) * (32 + sizeof(float2));
}

void run_quantize(const ggml_tensor * src1, int64_t npieces, uint8_t * buf, cudaStream_t stream) {
    const int64_t ncols = src1->ne[1];
    int8_t * xq = reinterpret_cast<int8_t *>(buf);
    float2 * xds = reinterpret_cast<float2 *>(buf + npieces * ncols * 32);
    constexpr int WARPS = 8;
    const dim3 grid(unsigned((npieces + WARPS - 1) / WARPS), unsigned(ncols));
    ggml_cuda_kernel_launch(quantize, ggml_cuda_kernel_launch_params(grid, WARPS * 32, 0, stream),
                            static_cast<const float *>(src1->data),
                            src1->nb[1] / int64_t(sizeof(float)), int(npieces), int(ncols), xq,
                            xds);
    g_quantized.fetch_add(1, std::memory_order_relaxed);
}

// the quantized activations of src1 on ctx's stream: kept ones, or quantized now into a slot
uint8_t * kept_quantized(ContextState & st, ggml_backend_cuda_context & ctx,
                         const ggml_tensor * src1, int64_t npieces) {
    const size_t need = quantized_bytes(npieces, src1->ne[1]);
    Kept * oldest = &st.slot[0];
    auto age = [&](const Kept & k) { return k.graph == st.graph ? k.used : 0; };  // stale first
    for (Kept & k : st.slot) {
        if (k.graph == st.graph && k.node == src1 && k.data == src1->data &&
            k.ne0 == src1->ne[0] && k.ne1 == src1->ne[1] && k.nb1 == src1->nb[1]) {
            k.used = ++st.clock;
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
    k.graph = st.graph;
    k.used = ++st.clock;
    run_quantize(src1, npieces, k.buf, ctx.stream());
    return k.buf;
}

using Launch = void (*)(const Args &, cudaStream_t, int device);

template <int K, int NC, bool GATE> void launch(const Args & a, cudaStream_t stream, int device) {
    constexpr int smem = Chunk<K, NC>::smem;
    static bool raised[GGML_CUDA_MAX_DEVICES] = {};
    if (smem > 48 * 1024 && !raised[device]) {
        CUDA_CHECK(cudaFuncSetAttribute(mul_mat<K, NC, GATE>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        raised[device] = true;
    }
    constexpr int out = GATE ? ROWS / 2 : ROWS;
    const dim3 grid(unsigned((a.nrows + out - 1) / out));
    ggml_cuda_kernel_launch(mul_mat<K, NC, GATE>,
                            ggml_cuda_kernel_launch_params(grid, THREADS, smem, stream), a);
}

template <int K, int NC> void launch_mma(const Args & a, cudaStream_t stream, int device) {
    constexpr int smem = MmaChunk<K>::smem;
    static bool raised[GGML_CUDA_MAX_DEVICES] = {};
    if (smem > 48 * 1024 && !raised[device]) {
        CUDA_CHECK(cudaFuncSetAttribute(mul_mat_mma<K, NC>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        raised[device] = true;
    }
    const dim3 grid(unsigned((a.nrows + MMA_ROWS - 1) / MMA_ROWS));
    ggml_cuda_kernel_launch(mul_mat_mma<K, NC>,
                            ggml_cuda_kernel_launch_params(grid, THREADS, smem, stream), a);
}

constexpr int MMA_FROM = 5;  // columns from which tensor cores take over (from Ampere)

template <int K, size_t... I> constexpr auto table(std::index_sequence<I...>) {
    return std::array<Launch, sizeof...(I)>{&launch<K, int(I) + 1, false>...};
}

template <int K, size_t... I> constexpr auto mma_table(std::index_sequence<I...>) {
    return std::array<Launch, sizeof...(I)>{&launch_mma<K, int(I) + MMA_FROM>...};
}

template <int K> Launch pick(int ncols, bool gate, bool mma) {
    static constexpr auto plain = table<K>(std::make_index_sequence<MAX_COLS>{});
    static constexpr auto cores = mma_table<K>(std::make_index_sequence<MAX_COLS - MMA_FROM + 1>{});
    if (gate) {
        return &launch<K, 1, true>;
    }
    return mma ? cores[ncols - MMA_FROM] : plain[ncols - 1];
}

template <int K> int chunk_bytes(int ncols, bool mma) {
    if (mma) {
        return MmaChunk<K>::bytes;
    }
    return ncols <= 4 ? Chunk<K, 1>::bytes : ncols <= 8 ? Chunk<K, 5>::bytes : Chunk<K, 9>::bytes;
}

bool kind_of(ggml_type type, int & kind) {
    switch (type) {
        case GGML_TYPE_Q4_0: kind = Q4_0; return true;
        case GGML_TYPE_Q8_0: kind = Q8_0; return true;
        case GGML_TYPE_Q4_K: kind = Q4_K; return true;
        case GGML_TYPE_Q6_K: kind = Q6_K; return true;
        default: return false;
    }
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

}  // namespace lucepy

bool lucepy_cuda_mul_mat(ggml_backend_cuda_context & ctx, const ggml_tensor * src0,
                         const ggml_tensor * src1, ggml_tensor * dst,
                         const ggml_cuda_mm_fusion_args_host * fusion) {
    using namespace lucepy;
    int kind;
    if (!enabled() || !kind_of(src0->type, kind)) {
        return false;
    }
    const int64_t ncols = src1->ne[1];
    const int64_t pieces_per_block = (kind == Q4_K || kind == Q6_K) ? 8 : 1;
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
    const ggml_tensor * gate = fusion ? fusion->gate : nullptr;
    if (fusion) {
        const bool plain_glu = !gate || fusion->glu_op == GGML_GLU_OP_SWIGLU ||
                               fusion->glu_op == GGML_GLU_OP_GEGLU;
        const bool same = !gate || (gate->type == src0->type && ggml_are_same_stride(gate, src0) &&
                                    ggml_are_same_shape(gate, src0));
        const bool biases = (!fusion->x_bias || ggml_is_contiguous(fusion->x_bias)) &&
                            (!fusion->gate_bias || (gate && ggml_is_contiguous(fusion->gate_bias)));
        if (fusion->x_scale || fusion->gate_scale || !plain_glu || !same || !biases ||
            (gate && ncols != 1)) {
            return false;
        }
    }
    const bool mma = ncols >= MMA_FROM && !gate && cc >= GGML_CUDA_CC_AMPERE;
    int chunk = 0;
    switch (kind) {
        case Q4_0: chunk = chunk_bytes<Q4_0>(int(ncols), mma); break;
        case Q8_0: chunk = chunk_bytes<Q8_0>(int(ncols), mma); break;
        case Q4_K: chunk = chunk_bytes<Q4_K>(int(ncols), mma); break;
        default: chunk = chunk_bytes<Q6_K>(int(ncols), mma); break;
    }
    const int unit = copy_unit(src0, gate, chunk);
    if (unit == 0) {
        return false;
    }

    const int64_t npieces = src0->ne[0] / 32;
    cudaStream_t stream = ctx.stream();
    uint8_t * quantized = nullptr;
    ggml_cuda_pool_alloc<uint8_t> scratch(ctx.pool());
    ContextState & st = state_of(ctx);
    if (ctx.curr_stream_no == 0 && st.in_graph(src1)) {
        quantized = kept_quantized(st, ctx, src1, npieces);
    } else {  // not a tensor of the graph, or ggml's concurrent streams: nothing shared
        quantized = scratch.alloc(quantized_bytes(npieces, ncols));
        run_quantize(src1, npieces, quantized, stream);
    }

    Args a;
    a.w = static_cast<const uint8_t *>(src0->data);
    a.gate = gate ? static_cast<const uint8_t *>(gate->data) : nullptr;
    a.row_stride = src0->nb[1];
    a.xq = reinterpret_cast<const int *>(quantized);
    a.xds = reinterpret_cast<const float2 *>(quantized + npieces * ncols * 32);
    a.dst = static_cast<float *>(dst->data);
    a.dst_stride = dst->nb[1] / int64_t(sizeof(float));
    a.x_bias =
        fusion && fusion->x_bias ? static_cast<const float *>(fusion->x_bias->data) : nullptr;
    a.gate_bias = fusion && fusion->gate_bias ? static_cast<const float *>(fusion->gate_bias->data)
                                              : nullptr;
    a.glu_op = fusion ? int(fusion->glu_op) : 0;
    a.nrows = int(src0->ne[1]);
    a.npieces = int(npieces);
    a.unit = unit;

    Launch run = nullptr;
    switch (kind) {
        case Q4_0: run = pick<Q4_0>(int(ncols), gate != nullptr, mma); break;
        case Q8_0: run = pick<Q8_0>(int(ncols), gate != nullptr, mma); break;
        case Q4_K: run = pick<Q4_K>(int(ncols), gate != nullptr, mma); break;
        default: run = pick<Q6_K>(int(ncols), gate != nullptr, mma); break;
    }
    run(a, stream, ctx.device);
    g_calls.fetch_add(1, std::memory_order_relaxed);
    return true;
}

void lucepy_cuda_graph_begin(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph) {
    if (!lucepy::enabled()) {  // ggml's kernels: nothing kept (the next begin with ours bumps)
        return;
    }
    lucepy::ContextState & st = lucepy::state_of(ctx);
    st.graph++;
    st.cgraph = cgraph;
    st.members.clear();
    st.listed = false;
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

void lucepy_cuda_graph_begin(ggml_backend_cuda_context &, const ggml_cgraph *) {}

void lucepy_cuda_context_free(ggml_backend_cuda_context &) {}

namespace lucepy {
std::atomic<int> g_on{0};
std::atomic<int64_t> g_calls{0};
std::atomic<int64_t> g_quantized{0};
}  // namespace lucepy

#endif

extern "C" {

void lucepy_cuda_kernels_set(int on) {
    lucepy::g_on.store(on ? 1 : 0, std::memory_order_relaxed);
}

int lucepy_cuda_kernels_get(void) {
#if !defined(GGML_USE_HIP) && !defined(GGML_USE_MUSA)
    return lucepy::enabled() ? 1 : 0;
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
}
