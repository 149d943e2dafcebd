// lucepy's own kernels (issue 19, decision 12): a quantized weight matrix times one column.
// The device code only: lucepy-mm.cu and lucepy-fuse.cu hook it into ggml-cuda, and
// bench-kernels.cu times it alone (no ggml), on the same source. Both host files include it, so
// a kernel that is no template is `static` (each file its own copy), as in lucepy-gemm.cuh.
//
// ggml-cuda reads the weights of a decode at about a third of an H200's bandwidth. Here:
//   - one column (`gemv`, a decode): each warp streams whole rows (and their gate rows when ggml
//     fuses the FFN's gate, up and GLU) through its own shared memory with cp.async, and
//     multiplies each 32-value piece with dp4a for all its rows, the activations read from the
//     CTA's shared memory;
//   - the activations are quantized to int8 planes once per graph and source tensor, by the
//     kernel that writes them where it can (lucepy-ops.cuh: `quantize`, the norms, the gates,
//     with norm_rope and the argmax).
// qwen35's DeltaNet conv step, gates and recurrence: lucepy-deltanet.cuh, lucepy-recurrence.cuh.
// 2 to 16 columns: lucepy-gemm.cuh (tensor cores). See lucepy-quants.cuh for the piece format.
//
// The includer may define LUCEPY_PDL_SYNC() (wait for the kernel before: programmatic dependent
// launch) and LUCEPY_PDL_LAUNCH() (let the next kernel start); by default they are Hopper's
// griddepcontrol instructions, which do nothing for a kernel launched without the attribute.
#pragma once

#include "lucepy-quants.cuh"

#include <cuda_fp16.h>

#include <cfloat>
#include <cstdint>

#ifndef LUCEPY_PDL_SYNC
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define LUCEPY_PDL_SYNC() asm volatile("griddepcontrol.wait;" ::: "memory")
#define LUCEPY_PDL_LAUNCH() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
#else
#define LUCEPY_PDL_SYNC()
#define LUCEPY_PDL_LAUNCH()
#endif
#endif

namespace lucepy {

// --- copies into shared memory ----------------------------------------------------------------

// a shared-memory address, as the instructions that take one want it
__device__ __forceinline__ uint32_t shared_at(const void * p) {
    return uint32_t(__cvta_generic_to_shared(p));
}

// Through the L2 cache only (weights, read once), or with L1 too (CACHED: what every CTA of an
// SM reads, the activations).
template <int U, bool CACHED = false>
__device__ __forceinline__ void copy_async(uint8_t * dst, const uint8_t * src) {
    static_assert(U == 16 || U == 8 || U == 4, "cp.async copies 4, 8 or 16 bytes");
#if __CUDA_ARCH__ >= 800
    const uint32_t s = shared_at(dst);
    if constexpr (U == 16 && !CACHED) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(src));
    } else {
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(s), "l"(src), "n"(U));
    }
#else
    if constexpr (U == 16) {
        *reinterpret_cast<int4 *>(dst) = *reinterpret_cast<const int4 *>(src);
    } else if constexpr (U == 8) {
        *reinterpret_cast<int2 *>(dst) = *reinterpret_cast<const int2 *>(src);
    } else {
        *reinterpret_cast<int *>(dst) = *reinterpret_cast<const int *>(src);
    }
#endif
}

__device__ __forceinline__ void copy_commit() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}

template <int PENDING> __device__ __forceinline__ void copy_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING));
#endif
}

// --- mbarriers ----------------------------------------------------------------------------------

// the mbarrier at shared address `bar` expects `count` arrivals a phase
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
#endif
}

// this thread's arrival on the mbarrier `bar`, its phase then also waiting for `bytes` to land
__device__ __forceinline__ void mbar_expect(uint32_t bar, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
                 : "memory");
#endif
}

// until the mbarrier `bar` completes its phase of parity `phase`; CLUSTER: what the cluster's
// other CTAs stored (st.async) to complete it is seen after it
#define LUCEPY_MBAR_WAIT(SEM)                                                   \
    asm volatile("{\n"                                                          \
                 ".reg .pred p;\n"                                              \
                 "WAIT_%=:\n"                                                   \
                 "mbarrier.try_wait.parity" SEM ".shared::cta.b64 p, [%0], %1;\n" \
                 "@!p bra WAIT_%=;\n"                                           \
                 "}\n" ::"r"(bar),                                              \
                 "r"(phase)                                                     \
                 : "memory")

template <bool CLUSTER = false>
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t phase) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if constexpr (CLUSTER) {
        LUCEPY_MBAR_WAIT(".acquire.cluster");
    } else {
        LUCEPY_MBAR_WAIT("");
    }
#endif
}

#undef LUCEPY_MBAR_WAIT

// this thread's mbarrier inits seen by the TMA unit (and the rest of the cluster) after it
__device__ __forceinline__ void mbar_init_fence() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}

enum Glu : int { GLU_SWIGLU = 0, GLU_GEGLU = 1 };

__device__ __forceinline__ float glu(int op, float x, float gate) {
    if (op == GLU_GEGLU) {
        const float c = 0.79788456080286535588f;  // sqrt(2 / pi)
        return x * 0.5f * gate * (1.0f + tanhf(c * gate * (1.0f + 0.044715f * gate * gate)));
    }
    return x * gate / (1.0f + expf(-gate));  // SWIGLU
}

// ggml's SWIGLU op of a verify's separate gate and up results, silu(x) times y in ggml's order
// (not glu()'s, the fused product's): glu_halves and gemm_f8's GLU build
__device__ __forceinline__ float swiglu(float x, float y) {
    return x / (1.0f + expf(-x)) * y;
}

// --- the product --------------------------------------------------------------------------------

struct Args {
    const uint8_t * w;        // weights, rows of row_stride bytes
    const uint8_t * gate;     // the fused gate's weights, or null
    int64_t row_stride;
    const int * xq;           // [piece][plane][8 ints]: 32 int8 activations a plane
    const float2 * xds;       // [piece][plane]: (scale, scale * sum of the int8 values)
    float * dst;              // one value a row
    const float * x_bias;     // fused bias of the product, or null
    const float * gate_bias;  // fused bias of the gate, or null
    int glu_op;
    int nrows;
    int npieces;              // row length / 32
};

// Activations in int8 planes a piece: x = d1 * q1 (+ d2 * q2, the second plane the first's
// rounding). One plane rounds an activation by up to 2^-8 of its piece's largest: small against
// a 4- or 6-bit weight's rounding, as large as an 8-bit one's. So Q8_0 takes two planes (within
// about 2^-15): with one, a GPU parity test failed (tests/test_gpu.py, the tiny random q8_0
// model, one decode step at 2.6x llama.cpp's error where the bound is 2x); with two everywhere
// all GPU tests passed, but the 27B-shaped Q4_0 decoded at 85.5 tok/s against 130.6 with one
// (docs/BENCHMARKS.md).
constexpr int MAX_PLANES = 2;

__host__ __device__ constexpr int planes_of(int kind) {
    return kind == Q8_0 ? 2 : 1;
}

// --- one column: a warp streams whole rows -----------------------------------------------
//
// Each warp owns R output rows (and, fused, their R gate rows: S staged rows in all) and walks
// along them in chunks of 64 pieces, each chunk of each row copied into the warp's own shared
// memory with cp.async, ST chunks in flight. A lane takes pieces lane, 32 + lane, ... of a chunk
// and multiplies each with all S rows with dp4a. A warp's sums meet by shuffles. A chunk of 64
// pieces is 1,152 bytes of Q4_0 or Q4_K, 2,176 of Q8_0, 1,680 of Q6_K, all multiples of 16, so a
// chunk starts where its row's alignment allows.
//
// The activations (40 bytes a piece and plane, against 18 of Q4_0 weights) are copied once into
// the CTA's shared memory, through the L1 cache, which its warps then read: the products of 5-30
// MB went from 0.6x of a streaming read to 0.7x (docs/BENCHMARKS.md). (Copied past the L1, every
// CTA's copy of the same bytes queued at the L2: 3-4x slower.)
//
// Measured against alternatives on the H200 (bench-kernels.cu, docs/BENCHMARKS.md): one tile of
// R rows a warp (or SPLIT warps, below) beat warps that stream several tiles in turn (fewer
// warps in flight); more stages than three, longer chunks and more rows a warp did not help.

constexpr int GV_WARPS = 4;

// Chunks of P pieces (a multiple of 32: one piece a lane), ST of them in flight per warp, copied U
// bytes at a time (16, or 8 or 4 where the row starts allow no more).
template <int K, bool GATE, int R, int U, int P = 64, int ST = 3> struct Gv {
    static_assert(P % 32 == 0, "a chunk is whole pieces for every lane");
    static constexpr int blocks = P / Layout<K>::pieces;
    static constexpr int bytes = blocks * Layout<K>::bytes;  // of one row
    static_assert(bytes % 16 == 0, "chunks start 16-byte aligned in an aligned row");
    static constexpr int pitch = bytes + 16;  // a block's reads run up to 6 bytes past its end
    static constexpr int copies = (bytes + 32 * U - 1) / (32 * U);  // per lane and row
    static constexpr int staged = GATE ? 2 * R : R;
    static constexpr int warp_bytes = ST * staged * pitch;
    // the weights' stages (staged activations follow them: activation_bytes)
    static constexpr int smem = GV_WARPS * warp_bytes;
};

// shared memory that a row of `npieces` pieces' activations take, `planes` planes a piece
__host__ __device__ constexpr int activation_bytes(int npieces, int planes) {
    return npieces * planes * (32 + int(sizeof(float2)));
}

// The activations into shared memory at `xs`, one cp.async group: the int8 halves of each piece
// and plane as [half][plane][piece] (16 bytes each: a warp's lanes read consecutive ones), then
// the scales as [plane][piece].
template <int PLANES> __device__ __forceinline__ void stage_activations(const Args & a,
                                                                        uint8_t * xs) {
    const int n = a.npieces * PLANES;
    const uint8_t * q = reinterpret_cast<const uint8_t *>(a.xq);
    for (int u = threadIdx.x; u < 2 * n; u += blockDim.x) {
        const int i = u / 2;  // piece * PLANES + plane
        const int at = ((u % 2) * PLANES + i % PLANES) * a.npieces + i / PLANES;
        copy_async<16, true>(xs + 16 * at, q + 16 * int64_t(u));
    }
    float2 * ds = reinterpret_cast<float2 *>(xs + 32 * n);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        uint8_t * to = reinterpret_cast<uint8_t *>(ds + (i % PLANES) * a.npieces + i / PLANES);
        copy_async<8, true>(to, reinterpret_cast<const uint8_t *>(a.xds + i));
    }
    copy_commit();
}

// A Q4_0 block in shared memory at byte `at` of a 16-byte aligned `base` (blocks of 18 bytes sit
// at 2-byte alignment), times int8 activations, added to `acc`: six 4-byte loads and funnel
// shifts, where a byte-wise read takes nine; the nibbles enter dp4a as they are (0 to 15) and the
// 8 that each stands above its value comes off through the activations' sums:
// d * sum((q - 8) * x) = d * sum over planes (dx * sum(q * xq) - 8 * sx), sx = dx * sum(xq).
template <int PLANES>
__device__ __forceinline__ void dot_q4_0_shared(const uint8_t * base, int at,
                                                const int (&xq)[PLANES][8],
                                                const float (&dx)[PLANES],
                                                const float (&sx)[PLANES], float & acc) {
    const uint32_t * w = reinterpret_cast<const uint32_t *>(base + (at & ~3));
    const float d = __half2float(__ushort_as_half(uint16_t(w[0] >> (8 * (at & 2)))));
    const int q = at + 2;  // the nibbles
    const uint32_t * wq = reinterpret_cast<const uint32_t *>(base + (q & ~3));
    const int shift = 8 * (q & 3);  // 0 or 16
    uint32_t v[5];
#pragma unroll
    for (int i = 0; i < 5; i++) {
        v[i] = wq[i];
    }
    int sum[PLANES];
#pragma unroll
    for (int k = 0; k < PLANES; k++) {
        sum[k] = 0;
    }
#pragma unroll
    for (int t = 0; t < 4; t++) {
        const int x = int(__funnelshift_r(v[t], v[t + 1], shift));
        const int lo = x & 0x0F0F0F0F;         // values 4t..4t+3
        const int hi = (x >> 4) & 0x0F0F0F0F;  // values 16+4t..16+4t+3
#pragma unroll
        for (int k = 0; k < PLANES; k++) {
            sum[k] = dp4a(lo, xq[k][t], sum[k]);
            sum[k] = dp4a(hi, xq[k][4 + t], sum[k]);
        }
    }
    float total = 0.0f;
#pragma unroll
    for (int k = 0; k < PLANES; k++) {
        total += dx[k] * float(sum[k]) - 8.0f * sx[k];
    }
    acc += d * total;
}

// SPLIT warps share each tile of R rows, each taking a contiguous range of its pieces (whole
// steps of 32 pieces; of 64 for Q6_K, whose 32 pieces are 840 bytes), so that a product of few
// rows still fills the GPU with warps; their sums meet in shared memory.
template <int K> __host__ __device__ constexpr int split_step() {
    return K == Q6_K ? 64 : 32;
}

// Whether a CTA copies the activations into its shared memory (where its warps own whole rows of
// one matrix) or its warps read them from the L1 and L2 caches: where they share rows (a CTA then
// reads only a few rows' worth of weights) or stream a gate row beside each row (two rows to one
// activation) the copy did not pay on the H200 (FFN up+gate: 30.5 against 28.9 us, the best
// split of each; docs/BENCHMARKS.md).
__host__ __device__ constexpr bool staged_activations(int split, bool gate) {
    return split == 1 && !gate;
}

// Launched with Gv::smem bytes of shared memory, and activation_bytes(npieces, planes_of(K))
// more where staged_activations(SPLIT, GATE).
template <int K, bool GATE, int R, int U, int SPLIT = 1, int P = 64, int ST = 3>
__global__ void __launch_bounds__(GV_WARPS * 32) gemv(const Args a) {
    using L = Layout<K>;
    using Ch = Gv<K, GATE, R, U, P, ST>;
    constexpr int S = Ch::staged;
    constexpr int PLANES = planes_of(K);
    constexpr bool STAGED = staged_activations(SPLIT, GATE);
    static_assert(GV_WARPS % SPLIT == 0, "a CTA holds whole tiles");
    extern __shared__ __align__(16) uint8_t smem[];

    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int part = warp % SPLIT;
    const int row0 = (blockIdx.x * (GV_WARPS / SPLIT) + warp / SPLIT) * R;
    // this warp's pieces: [first, end)
    constexpr int G = split_step<K>();
    const int steps = (a.npieces + G - 1) / G;
    const int per = (steps + SPLIT - 1) / SPLIT;
    const int first = min(a.npieces, part * per * G);
    const int end = min(a.npieces, (part + 1) * per * G);
    const int nchunks = row0 < a.nrows ? (end - first + P - 1) / P : 0;
    const int64_t base = int64_t(first / L::pieces) * L::bytes;  // bytes into the row
    const int64_t last = int64_t((end + L::pieces - 1) / L::pieces) * L::bytes;
    uint8_t * mine = smem + warp * Ch::warp_bytes;
    uint8_t * xs = smem + Ch::smem;  // the activations
    const int4 * xs_q = reinterpret_cast<const int4 *>(xs);
    const float2 * xs_ds = reinterpret_cast<const float2 *>(xs + 32 * PLANES * a.npieces);

    auto issue = [&](int ch) {
        if (ch < nchunks) {
            const int64_t off = base + int64_t(ch) * Ch::bytes;
            const int bytes = int(last - off < Ch::bytes ? last - off : Ch::bytes);
            uint8_t * stage = mine + (ch % ST) * S * Ch::pitch;
#pragma unroll
            for (int r = 0; r < S; r++) {
                const int row = row0 + r % R;
                if (row < a.nrows) {
                    const uint8_t * src =
                        (GATE && r >= R ? a.gate : a.w) + row * a.row_stride + off;
#pragma unroll
                    for (int i = 0; i < Ch::copies; i++) {
                        const int o = (32 * i + lane) * U;
                        if (o < bytes) {
                            copy_async<U>(stage + r * Ch::pitch + o, src + o);
                        }
                    }
                }
            }
        }
        copy_commit();  // an empty group past the end keeps the count of groups in flight
    };

    float acc[S];
#pragma unroll
    for (int r = 0; r < S; r++) {
        acc[r] = 0.0f;
    }

#pragma unroll
    for (int s = 0; s < ST - 1; s++) {
        issue(s);  // weights: no kernel before this one writes them
    }
    LUCEPY_PDL_SYNC();  // the activations: the kernel before has finished
    if constexpr (STAGED) {
        stage_activations<PLANES>(a, xs);
        copy_wait<0>();
        __syncthreads();  // every warp's share of the activations has landed
    }
    if (SPLIT == 1 && row0 >= a.nrows) {
        return;  // no barrier below waits for this warp
    }
    for (int ch = 0; ch < nchunks; ch++) {
        issue(ch + ST - 1);
        copy_wait<ST - 1>();
        __syncwarp();
        const uint8_t * stage = mine + (ch % ST) * S * Ch::pitch;
#pragma unroll
        for (int k = 0; k < P / 32; k++) {
            const int at = 32 * k + lane;  // the piece in the chunk
            const int piece = first + ch * P + at;
            if (piece < end) {
                int xq[PLANES][8];
                float dx[PLANES], sx[PLANES];
#pragma unroll
                for (int pl = 0; pl < PLANES; pl++) {
                    int4 lo, hi;
                    float2 ds;
                    if constexpr (STAGED) {
                        lo = xs_q[pl * a.npieces + piece];
                        hi = xs_q[(PLANES + pl) * a.npieces + piece];
                        ds = xs_ds[pl * a.npieces + piece];
                    } else {
                        const int64_t i = int64_t(piece) * PLANES + pl;
                        lo = __ldg(reinterpret_cast<const int4 *>(a.xq) + 2 * i);
                        hi = __ldg(reinterpret_cast<const int4 *>(a.xq) + 2 * i + 1);
                        ds = __ldg(a.xds + i);
                    }
                    int * q = xq[pl];
                    q[0] = lo.x, q[1] = lo.y, q[2] = lo.z, q[3] = lo.w;
                    q[4] = hi.x, q[5] = hi.y, q[6] = hi.z, q[7] = hi.w;
                    dx[pl] = ds.x, sx[pl] = ds.y;
                }
#pragma unroll
                for (int r = 0; r < S; r++) {
                    // a row past the end holds stale bytes: its sum is never written
                    const uint8_t * row = stage + r * Ch::pitch;
                    if constexpr (K == Q4_0) {
                        dot_q4_0_shared<PLANES>(row, at * L::bytes, xq, dx, sx, acc[r]);
                    } else {
                        Piece p;
                        unpack<K>(row + (at / L::pieces) * L::bytes, at % L::pieces, p);
#pragma unroll
                        for (int pl = 0; pl < PLANES; pl++) {
                            acc[r] += dot(p, xq[pl], dx[pl], sx[pl]);
                        }
                    }
                }
            }
        }
        __syncwarp();  // every lane has read the stage before the next issue refills it
    }

    LUCEPY_PDL_LAUNCH();  // the next kernel may start (and fetch its own weights)

#pragma unroll
    for (int r = 0; r < S; r++) {
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            acc[r] += __shfl_xor_sync(0xFFFFFFFFu, acc[r], off);
        }
    }
    if constexpr (SPLIT > 1) {  // the parts' sums, in part order: the same result every run
        __syncthreads();        // every warp is past its stages
        float * red = reinterpret_cast<float *>(smem);
        static_assert(GV_WARPS * S * sizeof(float) <= Ch::smem, "room to reduce");
        if (lane == 0) {
#pragma unroll
            for (int r = 0; r < S; r++) {
                red[warp * S + r] = acc[r];
            }
        }
        __syncthreads();
        if (part != 0) {
            return;
        }
#pragma unroll
        for (int r = 0; r < S; r++) {
            float v = 0.0f;
#pragma unroll
            for (int q = 0; q < SPLIT; q++) {
                v += red[(warp + q) * S + r];
            }
            acc[r] = v;
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
        const int row = row0 + r;
        if (lane == r % 32 && row < a.nrows) {
            float v = acc[r];
            if (a.x_bias) {
                v += a.x_bias[row];
            }
            if constexpr (GATE) {
                float g = acc[R + r];
                if (a.gate_bias) {
                    g += a.gate_bias[row];
                }
                v = glu(a.glu_op, v, g);
            }
            a.dst[row] = v;
        }
    }
}

// The split for a product of `tiles` tiles and `steps` steps of split_step pieces, on a GPU with
// room for `alone` warps of the kernel at once where a warp owns its rows and `shared` where
// warps share them (their shared memory differs: staged_activations). A warp a row where the
// rows fill at least half of `alone` and `staged` (the CTA copies the activations: sharing rows
// gives that up); else the split whose last wave of warps is fullest, a larger one only where it
// fills 5 % more of it, and never under two steps a warp. (On the H200 the FFN's fused up/gate
// takes two warps a row: 28.9 against 30.5 us, a product of 1,024 rows two or four, and the
// staged products of 5,120-10,240 rows one: bench-kernels.cu. In the model the last rule alone
// had given the staged products 2 or 4 warps a row, 3.50 ms a token against 3.24 now.)
inline int gemv_split(int64_t tiles, int steps, int64_t alone, int64_t shared, bool staged) {
    if (staged && 2 * tiles >= alone) {
        return 1;
    }
    int best = 1;
    double fill = 0.0;
    for (int split : {1, 2, 4}) {
        if (split > 1 && steps < 2 * split) {
            break;
        }
        const int64_t slots = split == 1 ? alone : shared;
        const int64_t units = tiles * split;
        const int64_t waves = (units + slots - 1) / slots;
        const double f = double(units) / double(waves * slots);
        if (f > fill + 0.05) {
            best = split;
            fill = f;
        }
    }
    return best;
}

// --- launching gemv (host side, shared by lucepy-mm.cu and bench-kernels.cu) -------------------

// the shared memory a CTA of gemv<K, GATE, R, U, split, P, ST> takes for rows of `npieces` pieces
template <int K, bool GATE, int R, int U, int P = 64, int ST = 3>
int gemv_smem(int npieces, int split) {
    const int xs = staged_activations(split, GATE) ? activation_bytes(npieces, planes_of(K)) : 0;
    return Gv<K, GATE, R, U, P, ST>::smem + xs;
}

// The split (1, 2 or 4 warps a tile of R rows) that gemv takes for a product: gemv_split on the
// warps that fit on the GPU at once, which `slots(kernel, smem)` tells (the occupancy
// calculator's CTAs a multiprocessor, times the multiprocessors and GV_WARPS).
template <int K, bool GATE, int R, int U, typename Slots>
int gemv_pick(int nrows, int npieces, Slots && slots) {
    const int64_t alone = slots(gemv<K, GATE, R, U, 1>, gemv_smem<K, GATE, R, U>(npieces, 1));
    const int64_t shared = slots(gemv<K, GATE, R, U, 2>, gemv_smem<K, GATE, R, U>(npieces, 2));
    const int steps = (npieces + split_step<K>() - 1) / split_step<K>();
    return gemv_split((nrows + R - 1) / R, steps, alone, shared, staged_activations(1, GATE));
}

}  // namespace lucepy
