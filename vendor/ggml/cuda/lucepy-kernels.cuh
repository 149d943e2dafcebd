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
//   - the activations are quantized to int8 planes once per graph and source tensor
//     (`quantize`), or by the kernel that writes them where that is an RMS norm times its
//     weight (`norm_quantize`) or a SiLU or sigmoid gate (`gate_quantize`).
// A gated norm of short rows does both at once (`norm_gate_quantize`). Also an attention head's
// norm and multi-section rope with its cache write (`norm_rope`), and the argmax of long rows
// (`argmax_part`, `argmax_rows`). qwen35's DeltaNet conv step, gates and recurrence:
// lucepy-deltanet.cuh. 2 to 16 columns: lucepy-gemm.cuh (tensor cores). See lucepy-quants.cuh
// for the piece format.
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

// One piece of one column, its 32 values one a lane of the calling warp: `planes` planes of 32
// int8 values at (at + plane) * 32 of `xq`, each plane the rounding left by the ones before, with
// its scale and the sum of the values it stands for (scale times the sum of its int8 values) at
// at + plane of `xds`.
__device__ __forceinline__ void quantize_piece(float v, int planes, int64_t at, int8_t * xq,
                                               float2 * xds) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int k = 0; k < MAX_PLANES; k++) {
        if (k == planes) {
            break;
        }
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
        xq[(at + k) * 32 + lane] = int8_t(q);
        if (lane == 0) {
            xds[at + k] = make_float2(d, d * float(sum));
        }
        v -= d * float(q);  // what this plane leaves for the next
    }
}

// One warp per 32-value piece and column: the planes of quantize_piece, piece-major
// ([piece][column][plane]).
// (No __restrict__ here or in Args: ggml-cuda finds it unsafe beside programmatic dependent
// launch.)
static __global__ void quantize(const float * x, int64_t col_stride, int npieces, int ncols,
                                int planes, int8_t * xq, float2 * xds) {
    LUCEPY_PDL_LAUNCH();  // the product after this may start fetching its weights
    LUCEPY_PDL_SYNC();    // x: the kernel before has finished
    const int piece = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int c = blockIdx.y;
    const int lane = threadIdx.x % 32;
    if (piece >= npieces) {
        return;
    }
    const float v = x[c * col_stride + int64_t(piece) * 32 + lane];
    quantize_piece(v, planes, (int64_t(piece) * ncols + c) * planes, xq, xds);
}

// An RMS norm times a weight vector (ggml's RMS_NORM then MUL, as ggml-cuda fuses them) whose
// result goes to products: the result as ggml writes it, and the products' activations, in one
// kernel where there were two. CTAs of NORM_THREADS; `norm_scale` is the norm's
// factor: each thread sums the squares of values tid, tid + NORM_THREADS, ... (ggml's order),
// the warps' sums meet in shared memory.
constexpr int NORM_THREADS = 1024;

// the line at p into the SM's L1, nothing waiting for it
__device__ __forceinline__ void prefetch_l1(const void * p) {
    asm volatile("prefetch.global.L1 [%0];" ::"l"(p));
}

// the sum of v over a CTA of THREADS, every thread's, in ggml's block_reduce order: each warp's
// sum (xor shuffles 16, 8, ..., 1), then the warps' sums, those of lanes past THREADS / 32 zeros
template <int THREADS> __device__ __forceinline__ float block_sum(float v) {
    static_assert(THREADS % 32 == 0 && THREADS <= 1024, "whole warps, at most 32");
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        v += __shfl_xor_sync(0xFFFFFFFFu, v, off);
    }
    __shared__ float sums[THREADS / 32];
    if (lane == 0) {
        sums[threadIdx.x / 32] = v;
    }
    __syncthreads();
    v = lane < THREADS / 32 ? sums[lane] : 0.0f;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        v += __shfl_xor_sync(0xFFFFFFFFu, v, off);
    }
    return v;
}

__device__ __forceinline__ float norm_scale(const float * x, int n, float eps) {
    float sum = 0.0f;
    for (int i = threadIdx.x; i < n; i += NORM_THREADS) {
        sum += x[i] * x[i];
    }
    return rsqrtf(block_sum<NORM_THREADS>(sum) / float(n) + eps);
}

// One column (a decode), grid (pieces / 32 rounded up, columns): each CTA finds the norm's
// factor over the whole column (the same sum in each), then its warp w takes piece 32 x + w (a
// lane a value) into the planes of quantize_piece. (One CTA for all of a column's pieces, its 32
// warps quantizing several in turn, was no faster than ggml's norm and our quantize.)
static __global__ void __launch_bounds__(NORM_THREADS) norm_quantize(
    const float * x, int64_t x_stride, const float * w, float * dst, int64_t dst_stride, int n,
    float eps, int ncols, int planes, int8_t * xq, float2 * xds) {
    LUCEPY_PDL_LAUNCH();
    const int c = blockIdx.y;
    x += c * x_stride;
    dst += c * dst_stride;
    LUCEPY_PDL_SYNC();  // x: the kernel before has finished
    const int piece = blockIdx.x * (NORM_THREADS / 32) + threadIdx.x / 32;
    const int i = piece * 32 + threadIdx.x % 32;
    const bool mine = piece < n / 32;
    const float xi = mine ? x[i] : 0.0f;  // loaded beside the norm's sum, not after it
    const float wi = mine ? w[i] : 0.0f;
    const float scale = norm_scale(x, n, eps);
    if (mine) {
        const float v = scale * xi * wi;
        dst[i] = v;
        quantize_piece(v, planes, (int64_t(piece) * ncols + c) * planes, xq, xds);
    }
}

// An attention head's RMS norm times its weight, then its multi-section rope (ggml's RMS_NORM,
// MUL and ROPE of an MROPE or IMROPE mode: qwen35's q and k), and where a SET_ROWS of the
// rope's result comes next (k's: the f16 KV cache), that too: one kernel where ggml-cuda runs
// two or three (it fuses a rope with its norm and cache write for the NORMAL and NEOX modes
// only). The same arithmetic as ggml-cuda's kernels: a thread a value of the row (ggml's
// norm of rows under 1,024 takes 256 threads a row, each its value's square summed the same
// way: the warp, then the warps' sums), the rope's angle and rotation as its rope_multi
// writes them; the norm's and the weight's results are not written (only the rope reads them).
struct NormRope {
    const float * x;  // rows of n: head h of token t at x[t x_tok + h x_row]
    int64_t x_row, x_tok;
    const float * w;  // [n]
    float * dst;      // the rope's result, dense [n, heads, tokens]
    half * cache;     // or null: token t's heads, as one row, into row rows[t] of cache
    int64_t cache_row;  // (halves)
    const int64_t * rows;
    const int32_t * pos;       // [4 tokens]: the sections' positions
    const float * freq_factors;  // [n_dims / 2], or null
    int n, heads, tokens, n_dims, n_offs;
    float eps, theta_scale, freq_scale, ext_factor, attn_factor, corr0, corr1;
    int sections[4];
    bool imrope;
};

constexpr int NR_THREADS = 256;  // a row of up to 256 values, a thread each

// grid (heads, tokens), NR_THREADS threads
static __global__ void __launch_bounds__(NR_THREADS) norm_rope(const __grid_constant__ NormRope a) {
    LUCEPY_PDL_LAUNCH();
    const int h = blockIdx.x;
    const int t = blockIdx.y;
    const int i = threadIdx.x;
    const float * x = a.x + t * a.x_tok + h * a.x_row;
    const float wi = i < a.n ? a.w[i] : 0.0f;
    LUCEPY_PDL_SYNC();  // x and pos: the kernels before have finished
    const float xi = i < a.n ? x[i] : 0.0f;
    const float scale = rsqrtf(block_sum<NR_THREADS>(xi * xi) / a.n + a.eps);
    __shared__ float y[NR_THREADS];
    y[i] = scale * xi * wi;
    __syncthreads();
    if (i >= a.n) {
        return;
    }
    // channel i: rotated (the pair n_offs + k, n_offs + k + n_dims / 2) or passed through
    float v = y[i];
    const int half_dims = a.n_dims / 2;
    const int r = i - a.n_offs;
    if (r >= 0 && r < a.n_dims) {
        const int k = r < half_dims ? r : r - half_dims;
        const int iw = 2 * k;
        const int sect_dims = a.sections[0] + a.sections[1] + a.sections[2] + a.sections[3];
        const int sec_w = a.sections[1] + a.sections[0];
        const int sector = (iw / 2) % sect_dims;
        int p;  // which section's position
        if (a.imrope) {
            p = sector % 3 == 1 && sector < 3 * a.sections[1]   ? 1
                : sector % 3 == 2 && sector < 3 * a.sections[2] ? 2
                : sector % 3 == 0 && sector < 3 * a.sections[0] ? 0
                                                                 : 3;
        } else {
            p = sector < a.sections[0]                                       ? 0
                : sector < sec_w                                             ? 1
                : sector < sec_w + a.sections[2]                             ? 2
                                                                             : 3;
        }
        const float theta_base = a.pos[t + a.tokens * p] * powf(a.theta_scale, iw / 2.0f);
        const float ff = a.freq_factors ? a.freq_factors[iw / 2] : 1.0f;
        const float theta_extrap = theta_base / ff;
        const float theta_interp = a.freq_scale * theta_extrap;
        float theta = theta_interp;
        float mscale = a.attn_factor;
        if (a.ext_factor != 0.0f) {
            const float ramp_y = (iw / 2 - a.corr0) / fmaxf(0.001f, a.corr1 - a.corr0);
            const float ramp_mix = (1.0f - fminf(1.0f, fmaxf(0.0f, ramp_y))) * a.ext_factor;
            theta = theta_interp * (1 - ramp_mix) + theta_extrap * ramp_mix;
            mscale *= 1.0f + 0.1f * logf(1.0f / a.freq_scale);
        }
        const float cos_theta = cosf(theta) * mscale;
        const float sin_theta = sinf(theta) * mscale;
        const float x0 = y[a.n_offs + k];
        const float x1 = y[a.n_offs + k + half_dims];
        v = r < half_dims ? x0 * cos_theta - x1 * sin_theta : x0 * sin_theta + x1 * cos_theta;
    }
    a.dst[(int64_t(t) * a.heads + h) * a.n + i] = v;
    if (a.cache) {
        a.cache[a.rows[t] * a.cache_row + int64_t(h) * a.n + i] = __float2half(v);
    }
}

// A SiLU or sigmoid gate, act(z) * x (ggml's UNARY then MUL, as ggml-cuda fuses them), whose
// result a product reads as one column: the result as ggml writes it and its planes as
// `quantize` writes them, one warp a piece.
enum Gate : int { GATE_SILU = 0, GATE_SIGMOID = 1 };

// Where a gate's z lies: element e of column c at z[c col + (e / len) row + e % len] (dense:
// len a column's values; read in place, the view a CONT copied: qwen35's attention gate, each
// head's `len` values beside its query in the stacked product)
struct GateAt {
    const float * z;
    int len;
    int64_t row, col;
};

__device__ __forceinline__ float gate_z(const GateAt & z, int c, int64_t e) {
    return z.z[c * z.col + e / z.len * z.row + e % z.len];
}

__device__ __forceinline__ float gate_act(float g, int op) {
    return op == GATE_SILU ? g / (1.0f + expf(-g)) : 1.0f / (1.0f + expf(-g));
}

static __global__ void gate_quantize(const GateAt z, const float * x, float * dst, int npieces,
                                     int op, int planes, int8_t * xq, float2 * xds) {
    LUCEPY_PDL_LAUNCH();
    LUCEPY_PDL_SYNC();  // z and x: the kernel before has finished
    const int piece = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (piece >= npieces) {
        return;
    }
    const int64_t i = int64_t(piece) * 32 + threadIdx.x % 32;
    const float v = gate_act(gate_z(z, 0, i), op) * x[i];
    dst[i] = v;
    quantize_piece(v, planes, int64_t(piece) * planes, xq, xds);
}

// Short rows each RMS-normed times a weight vector, then gated (qwen35's gated norm: ggml's
// RMS_NORM, MUL, SiLU or sigmoid of z, MUL), the result read by a product as one column: one warp
// a 32-value piece of a row of n = 32 PIECES values, a CTA of 8 warps whole rows (each warp sums
// the squares of its whole row, each lane PIECES of them); writes the three nodes' results as
// ggml does and the last one's planes as `quantize` writes them (row r's pieces r PIECES ...).
// The CTA reads its rows before any result is written (a result may be written over x). ggml-cuda
// runs two kernels for it (the norm and its weight, the gate), and ours quantized. (A warp a row,
// quantizing its pieces in turn, was no faster than the two.)
constexpr int NORM_GATE_WARPS = 8;

// A gated norm's reads (norm_gate_quantize, norm_gate_halves): this lane's value of piece `mine`
// of row `row` (rows of n = 32 PIECES values) and the row's sum of squares, summed over the warp
// (each lane PIECES of them). The whole warp calls it.
template <int PIECES>
__device__ __forceinline__ float2 gated_norm_read(const float * x, int64_t x_stride, int64_t row,
                                                  int mine, bool here) {
    const int lane = threadIdx.x % 32;
    float y = 0.0f;
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < PIECES; j++) {
        const float v = here ? x[row * x_stride + 32 * j + lane] : 0.0f;
        sum += v * v;
        y = j == mine ? v : y;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        sum += __shfl_xor_sync(0xFFFFFFFFu, sum, off);
    }
    return make_float2(y, sum);
}

// ... then its writes, at i of the three dense results as ggml writes them (the norm times its
// weight `wv`, the gate of `g`, their product), after every read of the CTA's rows (a result may
// be written over x); the gated value
__device__ __forceinline__ float gated_norm_write(float2 ys, int n, float eps, float wv, float g,
                                                  int op, float * normed, float * gate,
                                                  float * dst, int64_t i) {
    const float scale = rsqrtf(ys.y / float(n) + eps);
    const float y = scale * ys.x * wv;
    const float act = gate_act(g, op);
    normed[i] = y;
    gate[i] = act;
    dst[i] = y * act;
    return y * act;
}

template <int PIECES>
__global__ void __launch_bounds__(NORM_GATE_WARPS * 32) norm_gate_quantize(
    const float * x, int64_t x_stride, const float * w, const float * z, float * normed,
    float * gate, float * dst, int nrows, float eps, int op, int planes, int8_t * xq,
    float2 * xds) {
    static_assert(NORM_GATE_WARPS % PIECES == 0, "a CTA holds whole rows");
    LUCEPY_PDL_LAUNCH();
    LUCEPY_PDL_SYNC();  // x and z: the kernels before have finished
    const int piece = blockIdx.x * NORM_GATE_WARPS + threadIdx.x / 32;
    const int row = piece / PIECES;
    const int mine = piece % PIECES;
    const int lane = threadIdx.x % 32;
    const bool here = row < nrows;
    const int64_t i = int64_t(piece) * 32 + lane;
    const float wi = w[32 * mine + lane];  // loaded beside the row's, not after them
    const float zi = here ? z[i] : 0.0f;
    const float2 ys = gated_norm_read<PIECES>(x, x_stride, row, mine, here);
    __syncthreads();  // the CTA's rows read: results may overwrite them
    if (!here) {
        return;
    }
    const float v = gated_norm_write(ys, 32 * PIECES, eps, wi, zi, op, normed, gate, dst, i);
    quantize_piece(v, planes, int64_t(piece) * planes, xq, xds);
}

// The argmax of long rows (a greedy step's logits over the vocabulary), where ggml-cuda runs one
// CTA a row (about 90 us over 248,320 logits on an H200): `argmax_part` gives each CTA of grid
// (slices, rows) ARGMAX_SLICE values of a row and writes their largest and its column;
// `argmax_rows` takes a row's slices. Ties go to the lowest column; NaN is never the largest,
// and a row of NaN or -inf only gives -1 (as ggml's).
constexpr int ARGMAX_THREADS = 256;
constexpr int ARGMAX_SLICE = 2048;

struct Best {
    float v;
    int i;
};

__device__ __forceinline__ Best better(Best a, Best b) {
    return (b.v > a.v || (b.v == a.v && b.i >= 0 && (a.i < 0 || b.i < a.i))) ? b : a;
}

// the largest of the CTA's `mine`, in every thread
__device__ __forceinline__ Best cta_best(Best mine) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const Best other = {__shfl_xor_sync(0xFFFFFFFFu, mine.v, off),
                            __shfl_xor_sync(0xFFFFFFFFu, mine.i, off)};
        mine = better(mine, other);
    }
    __shared__ Best warps[ARGMAX_THREADS / 32];
    if (threadIdx.x % 32 == 0) {
        warps[threadIdx.x / 32] = mine;
    }
    __syncthreads();
    Best best = warps[0];
#pragma unroll
    for (int w = 1; w < ARGMAX_THREADS / 32; w++) {
        best = better(best, warps[w]);
    }
    return best;
}

static __global__ void __launch_bounds__(ARGMAX_THREADS)
    argmax_part(const float * x, int64_t row_stride, int ncols, Best * parts) {
    LUCEPY_PDL_LAUNCH();
    LUCEPY_PDL_SYNC();  // x: the kernel before has finished
    const float * row = x + blockIdx.y * row_stride;
    const int first = blockIdx.x * ARGMAX_SLICE;
    const int end = min(ncols, first + ARGMAX_SLICE);
    Best mine = {-FLT_MAX, -1};
    for (int c = first + threadIdx.x; c < end; c += ARGMAX_THREADS) {
        const float v = row[c];
        if (v > mine.v) {  // (in column order: the first of equals stays)
            mine = {v, c};
        }
    }
    const Best best = cta_best(mine);
    if (threadIdx.x == 0) {
        parts[int64_t(blockIdx.y) * gridDim.x + blockIdx.x] = best;
    }
}

static __global__ void __launch_bounds__(ARGMAX_THREADS)
    argmax_rows(const Best * parts, int nslices, int32_t * dst) {
    LUCEPY_PDL_LAUNCH();
    LUCEPY_PDL_SYNC();  // the parts
    Best mine = {-FLT_MAX, -1};
    for (int s = threadIdx.x; s < nslices; s += ARGMAX_THREADS) {
        mine = better(mine, parts[int64_t(blockIdx.x) * nslices + s]);
    }
    const Best best = cta_best(mine);
    if (threadIdx.x == 0) {
        dst[blockIdx.x] = best.i;
    }
}

}  // namespace lucepy
