// lucepy's own kernels (issue 19, decision 12): a quantized weight matrix times up to 16 columns
// (a DFlash verify's rows) on tensor cores; lucepy-mm.cu takes it from 3 columns. The device code
// and its launch arithmetic only: lucepy-mm.cu (and lucepy-fuse.cu, its norms and gates) hooks
// it into ggml-cuda, bench-kernels.cu times it alone.
//
// A decode reads each weight once and spends a few dp4a on it; k columns spend k times as many,
// and from about 4 columns dp4a is what limits (docs/BENCHMARKS.md: lucepy's dp4a kernel for 2-4
// columns lost to ggml's). Here each weight is turned into a half once and enters an mma with
// all the columns at once:
//   - `to_halves` writes the activations as halves, each segment of 16 pieces of a column
//     multiplied by a power of two that brings its largest to [2^14, 2^15) (no half overflows; the
//     segment's sums are divided by it again), in the order the mma's B fragments take them,
//     padded with zero columns to a multiple of 8;
//   - `gemm`: a CTA owns M rows and a range of the row's pieces; its warps copy chunks of P pieces
//     of every row, and of the activations, into shared memory (cp.async, ST chunks in flight),
//     and each warp multiplies its 16 rows with m16n8k16 mmas in f32, the weights unpacked with
//     their scales (lucepy-quants.cuh) to halves;
//   - a product of few rows splits its pieces over several CTAs (parts), whose sums `gemm_sum`
//     adds in part order (the same result every run). (The last CTA of a row tile to finish
//     adding them instead measured slower: that CTA's loads of every part's sums are the end of
//     the product.)
//
// The kernels before and after the product, which write its activations and read its sums, are
// in the headers this one includes first: lucepy-halves.cuh, lucepy-records.cuh (e4m3 records,
// the gated norm, the GLU) and lucepy-sumnorm.cuh.

#pragma once

#include "lucepy-kernels.cuh"  // copy_async, the PDL hooks
#include "lucepy-plan.h"     // gemm_parts, row_tiles
#include "lucepy-halves.cuh"
#include "lucepy-records.cuh"
#include "lucepy-sumnorm.cuh"

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>

namespace lucepy {

// --- the product ------------------------------------------------------------------------------

// gemm_f8's tail (lucepy-f8.cuh: one part, its row tiles past the last whole wave of a CTA an SM
// each cut along k into parts, added by the last of them to finish): CTAs from `from` on, `parts`
// a row tile of `chunks` chunks each; no tail where `parts` is 0
struct F8Tail {
    float * sums;      // the parts' sums [tile - from][part][thread][8]
    unsigned * count;  // a tail tile's parts finished: 0 between launches (the last one resets it)
    int from;
    int parts;
    int chunks;
};

struct GemmArgs {
    const uint8_t * w;   // weights, rows of row_stride bytes
    int64_t row_stride;
    const uint8_t * w2;  // or null (gemm_r only): rows from `rows2` on are this matrix's, from 0
    int rows2;           // (a multiple of a CTA's rows: two products of one input, one launch)
    Halves x;            // to_halves' halves and scales
    float * dst;         // [col][dst_stride] f32
    int64_t dst_stride;
    float * parts;       // split: the parts' sums [part][col][nrows], for gemm_sum
    const float * residual;  // or null: dst = the product + residual ([col][res_stride])
    int64_t res_stride;
    int nrows;
    int npieces;
    int ncols;           // columns to write (the halves hold padded_cols of them)
    int per_part;        // chunks a part of the pieces takes (gridDim.y parts)
    uint64_t * stamps;   // or null: gemm_r's timelines (RP_STAMPS: bench-kernels --timeline)
    F8Tail tail;         // gemm_f8's only
};

constexpr int GM_WARPS = 4;  // a CTA's warps, each an mma tile of 16 rows

// Chunks of P pieces (P % pieces-a-block == 0), ST in flight, NT tiles of 8 columns, W warps.
template <int K, int NT, int P, int ST = 2, int W = GM_WARPS> struct Gm {
    using L = Layout<K>;
    static_assert(P % L::pieces == 0, "a chunk is whole blocks");
    static_assert(GM_SEG % P == 0, "a chunk is in one segment");
    static constexpr int rows = 16 * W;  // a CTA's (M)
    static constexpr int bytes = P / L::pieces * L::bytes;  // of a row's chunk
    // its 16-byte granules from the one its first byte is in, for any start
    static constexpr int granules = (bytes + 15) / 16 + 1;
    // A row's pitch: room for the granules, and 4 words more so that the 8 rows a load reads
    // start in different banks.
    static constexpr int pitch = 16 * granules + 16 * ((granules + 1) % 2);
    static constexpr int x_pitch = P * 64 + 64;  // a column's halves (two columns fill the banks)
    static constexpr int w_stage = rows * pitch;
    static constexpr int x_stage = NT * GM_COL_TILE * x_pitch;
    static constexpr int smem = ST * (w_stage + x_stage);
};

// Pieces a chunk: 8 for every kind (a row's chunk of Q4_0 and Q4_K is 144 bytes, Q8_0 272, Q6_K
// 210). Measured on the H200 (bench-kernels.cu, docs/BENCHMARKS.md) against 16 pieces, three
// stages and 8 warps a CTA: two stages of 8 pieces and 4 warps were faster, or within 2 %, for
// every kind and shape of the 27B-shaped model.
template <int K> __host__ __device__ constexpr int gemm_chunk() {
    return 8;
}

// four signed bytes to two half2: (b0, b2) and (b1, b3), exactly (1024 + 128 + b, less 1152)
__device__ __forceinline__ void bytes_to_halves(int q, __half2 & even, __half2 & odd) {
    const uint32_t u = uint32_t(q) ^ 0x80808080u;  // b + 128
    const uint32_t e = __byte_perm(u, 0x64646464u, 0x4240);
    const uint32_t o = __byte_perm(u, 0x64646464u, 0x4341);
    const __half2 bias = __float2half2_rn(1152.0f);
    even = __hsub2(*reinterpret_cast<const __half2 *>(&e), bias);
    odd = __hsub2(*reinterpret_cast<const __half2 *>(&o), bias);
}

__device__ __forceinline__ uint32_t as_u32(__half2 h) {
    return *reinterpret_cast<const uint32_t *>(&h);
}

__device__ __forceinline__ __half2 as_h2(uint32_t u) {
    return *reinterpret_cast<const __half2 *>(&u);
}

// d (16x8, f32) += a (16x16, halves) b (16x8, halves)
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// four 8 x 8 matrices of halves from shared memory at `at` (each lane's row address), TRANS:
// transposed; the "memory" clobber keeps it after the waits for those bytes (gemm_f8's mbarriers)
template <bool TRANS> __device__ __forceinline__ void ldmatrix4(uint32_t (&r)[4], uint32_t at) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    if constexpr (TRANS) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(at)
                     : "memory");
    } else {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(at)
                     : "memory");
    }
#endif
}

// the nibbles at bits 0..3 and 16..19 of `bits` as the halves 1024 + n (one lop3: (a & b) | c)
__device__ __forceinline__ __half2 nibble_halves(uint32_t bits) {
    uint32_t h;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;"
        : "=r"(h)
        : "r"(bits), "r"(0x000F000Fu), "r"(0x64006400u));
    return *reinterpret_cast<const __half2 *>(&h);
}

// Piece `at` of the block at `b`, the 8 values of a quad's lane t (4t..4t+3 and 16+4t..16+4t+3),
// as halves with their scales: lo = (v[4t], v[4t+2]), (v[4t+1], v[4t+3]); hi alike, 16 on.
template <int K>
__device__ __forceinline__ void piece_halves(const uint8_t * b, int at, int t, __half2 (&lo)[2],
                                             __half2 (&hi)[2]) {
    if constexpr (K == Q4_0) {  // the nibbles straight into halves 1024 + n, less 1032, times d
        const __half2 d = __half2half2(*reinterpret_cast<const __half *>(b));
        const uint32_t v = uint32_t(load_a2(b + 2 + 4 * t));
        const __half2 off = __float2half2_rn(1032.0f);
        lo[0] = __hmul2(__hsub2(nibble_halves(v), off), d);
        lo[1] = __hmul2(__hsub2(nibble_halves(v >> 8), off), d);
        hi[0] = __hmul2(__hsub2(nibble_halves(v >> 4), off), d);
        hi[1] = __hmul2(__hsub2(nibble_halves(v >> 12), off), d);
        return;
    }
    if constexpr (K == Q4_1) {  // as Q4_0's, less 1024: then times d plus m in one fma
        const __half2 d = __half2half2(*reinterpret_cast<const __half *>(b));
        const __half2 m = __half2half2(*reinterpret_cast<const __half *>(b + 2));
        const uint32_t v = uint32_t(load_a4(b + 4 + 4 * t));
        const __half2 off = __float2half2_rn(1024.0f);
        lo[0] = __hfma2(__hsub2(nibble_halves(v), off), d, m);
        lo[1] = __hfma2(__hsub2(nibble_halves(v >> 8), off), d, m);
        hi[0] = __hfma2(__hsub2(nibble_halves(v >> 4), off), d, m);
        hi[1] = __hfma2(__hsub2(nibble_halves(v >> 12), off), d, m);
        return;
    }
    const Scales s = scales<K>(b, at);
    int qlo, qhi;
    ints<K>(b, at, t, qlo, qhi);
    bytes_to_halves(qlo, lo[0], lo[1]);
    bytes_to_halves(qhi, hi[0], hi[1]);
    const __half2 s0 = __float2half2_rn(s.s0);
    const __half2 s1 = __float2half2_rn(s.s1);
    if constexpr (biased<K>()) {  // a min (Q4_K's; Q5_1's m)
        const __half2 bias = __float2half2_rn(-s.bias);
        lo[0] = __hfma2(lo[0], s0, bias), lo[1] = __hfma2(lo[1], s0, bias);
        hi[0] = __hfma2(hi[0], s1, bias), hi[1] = __hfma2(hi[1], s1, bias);
    } else {
        lo[0] = __hmul2(lo[0], s0), lo[1] = __hmul2(lo[1], s0);
        hi[0] = __hmul2(hi[0], s1), hi[1] = __hmul2(hi[1], s1);
    }
}

// The 1 / scale of segment `seg` of this lane's columns (lane t of a quad: columns 2t, 2t + 1 of
// each tile of 8), fetched ahead of the segment's last chunk
template <int NT>
__device__ __forceinline__ void segment_inv(const GemmArgs & a, int t, int seg, int nsegs,
                                            float (&inv)[NT][2]) {
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        inv[nt][0] = __ldg(a.x.xinv + halves_scale_at(nt * GM_COL_TILE + 2 * t, seg, nsegs));
        inv[nt][1] = __ldg(a.x.xinv + halves_scale_at(nt * GM_COL_TILE + 2 * t + 1, seg, nsegs));
    }
}

// A segment's sums, scaled back, into the total; the segment's accumulators cleared
template <int NT>
__device__ __forceinline__ void flush_segment(float (&acc)[NT][4], float (&total)[NT][4],
                                              const float (&inv)[NT][2]) {
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
#pragma unroll
        for (int j = 0; j < 4; j++) {
            total[nt][j] += acc[nt][j] * inv[nt][j % 2];
            acc[nt][j] = 0.0f;
        }
    }
}

// A warp's tile of 16 rows from `row` (lane (g, t): rows row + g and row + g + 8, columns 2t and
// 2t + 1 of each tile of 8) into dst (plus the residual), or into the CTA's part of the sums when
// `split` (by default: when the grid is in parts)
template <int NT>
__device__ __forceinline__ void store_tile(const GemmArgs & a, const float (&total)[NT][4],
                                           int row, int g, int t, bool split) {
    float * out = split ? a.parts + int64_t(blockIdx.y) * a.ncols * a.nrows : a.dst;
    const int64_t stride = split ? a.nrows : a.dst_stride;
    const float * residual = split ? nullptr : a.residual;
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int r = row + g + 8 * (j / 2);
            const int col = nt * GM_COL_TILE + 2 * t + j % 2;
            if (r < a.nrows && col < a.ncols) {
                const float v = total[nt][j];
                out[col * stride + r] = residual ? v + residual[col * a.res_stride + r] : v;
            }
        }
    }
}

template <int NT>
__device__ __forceinline__ void store_tile(const GemmArgs & a, const float (&total)[NT][4],
                                           int row, int g, int t) {
    store_tile<NT>(a, total, row, g, t, gridDim.y > 1);
}

// The mma's k order: of a piece's low 16 values (one mma; the high 16 the next), lane t of a
// quad holds A's k = 2t, 2t+1 (register 0, row g) and 2t+8, 2t+9 (register 2); they are values
// 4t, 4t+2 and 4t+1, 4t+3 here, and B's registers hold the activations of the same values
// (to_halves' order), so the sum over k is the piece's dot product.
//
// Launched with grid (row tiles, parts), W * 32 threads, Gm::smem bytes of shared memory.
template <int K, int NT, int P, int ST = 2, int W = GM_WARPS, int MINB = 16 / W>
__global__ void __launch_bounds__(W * 32, MINB) gemm(const GemmArgs a) {
    using L = Layout<K>;
    using G = Gm<K, NT, P, ST, W>;
    extern __shared__ __align__(16) uint8_t smem[];
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int g = lane / 4;  // the row (and row + 8) of the tile, the column of B
    const int t = lane % 4;
    const int row0 = blockIdx.x * G::rows;
    const int rows = min(G::rows, a.nrows - row0);
    const int nchunks_all = (a.npieces + P - 1) / P;
    const int chunk0 = blockIdx.y * a.per_part;
    const int nchunks = max(0, min(a.per_part, nchunks_all - chunk0));

    auto w_stage = [&](int s) { return smem + s * (G::w_stage + G::x_stage); };
    auto x_stage = [&](int s) { return w_stage(s) + G::w_stage; };

    // a row's chunk starts this far into its first granule
    auto lead = [&](int r, int ch) {
        const uintptr_t at = uintptr_t(a.w + int64_t(row0 + r) * a.row_stride) +
                             uintptr_t(int64_t(chunk0 + ch) * G::bytes);
        return int(at & 15);
    };
    // Each thread's copies of a chunk, worked out once: a row's chunks start at the same place in
    // a granule where a chunk is whole granules (all but Q6_K), so a copy's source only moves
    // on by a chunk each time; Q6_K's chunks (210 bytes a block) start anywhere.
    constexpr int THREADS = W * 32;
    constexpr bool FIXED = G::bytes % 16 == 0;
    constexpr int WC = (G::rows * G::granules + THREADS - 1) / THREADS;  // a thread's copies
    const uint8_t * w_src[WC];
    int w_dst[WC];
    int w_from[WC];  // where the granule starts against its row's chunk: a copy where < bytes
#pragma unroll
    for (int k = 0; k < WC; k++) {
        const int i = threadIdx.x + k * THREADS;
        const int r = i / G::granules;
        const int q = i % G::granules;
        const uint8_t * src = a.w + int64_t(row0 + min(r, rows - 1)) * a.row_stride +
                              int64_t(chunk0) * G::bytes;
        const int at = int(uintptr_t(src) & 15);
        w_src[k] = src - at + 16 * q;
        w_dst[k] = r * G::pitch + 16 * q;
        w_from[k] = r < rows ? 16 * q - at : INT32_MAX;
    }
    auto issue_w = [&](int ch) {
        if (ch >= nchunks) {
            return;
        }
        const int first = (chunk0 + ch) * P;
        const int bytes = min(P, a.npieces - first) / L::pieces * L::bytes;
        uint8_t * stage = w_stage(ch % ST);
        if constexpr (FIXED) {
#pragma unroll
            for (int k = 0; k < WC; k++) {
                if (w_from[k] < bytes) {
                    copy_async<16>(stage + w_dst[k], w_src[k] + int64_t(ch) * G::bytes);
                }
            }
        } else {
            for (int i = threadIdx.x; i < rows * G::granules; i += THREADS) {
                const int r = i / G::granules;
                const int q = i % G::granules;
                const uint8_t * src = a.w + int64_t(row0 + r) * a.row_stride +
                                      int64_t(first / L::pieces) * L::bytes;
                const uintptr_t start = uintptr_t(src) & ~uintptr_t(15);
                if (start + 16 * q < uintptr_t(src) + bytes) {  // a granule with chunk bytes
                    copy_async<16>(stage + r * G::pitch + 16 * q,
                                   reinterpret_cast<const uint8_t *>(start + 16 * q));
                }
            }
        }
    };
    constexpr int XN = P * 4;  // 16-byte groups of a column's chunk
    constexpr int XC = (NT * GM_COL_TILE * XN + THREADS - 1) / THREADS;
    const uint4 * x_src[XC];
    int x_dst[XC];
    int x_u[XC];
#pragma unroll
    for (int k = 0; k < XC; k++) {
        const int i = threadIdx.x + k * THREADS;
        const int c = min(i / XN, NT * GM_COL_TILE - 1);
        const int u = i % XN;
        x_src[k] = a.x.xh + (int64_t(c) * a.npieces + int64_t(chunk0) * P) * 4 + u;
        x_dst[k] = c * G::x_pitch + 16 * u;
        x_u[k] = i < NT * GM_COL_TILE * XN ? u : INT32_MAX;
    }
    auto issue_x = [&](int ch) {
        if (ch < nchunks) {
            const int n = min(P, a.npieces - (chunk0 + ch) * P) * 4;  // groups a column
            uint8_t * stage = x_stage(ch % ST);
#pragma unroll
            for (int k = 0; k < XC; k++) {
                if (x_u[k] < n) {
                    copy_async<16, true>(stage + x_dst[k], reinterpret_cast<const uint8_t *>(
                                                               x_src[k] + int64_t(ch) * XN));
                }
            }
        }
        copy_commit();
    };

    float acc[NT][4] = {};    // this segment's
    float total[NT][4] = {};  // and the sums of those before, scaled back
    const int nsegs = segments(a.npieces);

#pragma unroll
    for (int s = 0; s < ST - 1; s++) {
        issue_w(s);  // weights: no kernel before this one writes them
    }
    LUCEPY_PDL_SYNC();  // the activations: the kernel before has finished
#pragma unroll
    for (int s = 0; s < ST - 1; s++) {
        issue_x(s);  // group s: its activations (and group 0 the first weights)
    }

    const int r0 = warp * 16 + g;  // this lane's two rows in the CTA: r0 and r0 + 8
    for (int ch = 0; ch < nchunks; ch++) {
        copy_wait<ST - 2>();
        __syncthreads();  // chunk ch has landed for every warp; chunk ch - 1 is read by all
        issue_w(ch + ST - 1);
        issue_x(ch + ST - 1);
        const int first = (chunk0 + ch) * P;
        const int n = min(P, a.npieces - first);
        const uint8_t * ws = w_stage(ch % ST);
        const uint8_t * xs = x_stage(ch % ST);
        const uint8_t * row_a = ws + r0 * G::pitch + lead(r0, ch);
        const uint8_t * row_b = ws + (r0 + 8) * G::pitch + lead(r0 + 8, ch);
        if (warp * 16 >= rows) {
            continue;  // no rows for this warp (it still takes part in the copies and barriers)
        }
        const int seg = first / GM_SEG;
        const bool flush = ch + 1 == nchunks || (first + P) / GM_SEG != seg;
        float inv[NT][2];  // the segment's 1 / scale of this lane's columns, fetched early
        if (flush) {
            segment_inv<NT>(a, t, seg, nsegs, inv);
        }
        auto piece = [&](int i) {
            const int blk = (i / L::pieces) * L::bytes;
            const int at = i % L::pieces;
            __half2 alo[2], ahi[2], blo[2], bhi[2];  // rows r0 and r0 + 8 (stale past the end)
            piece_halves<K>(row_a + blk, at, t, alo, ahi);
            piece_halves<K>(row_b + blk, at, t, blo, bhi);
            const uint32_t a_lo[4] = {as_u32(alo[0]), as_u32(blo[0]), as_u32(alo[1]),
                                      as_u32(blo[1])};
            const uint32_t a_hi[4] = {as_u32(ahi[0]), as_u32(bhi[0]), as_u32(ahi[1]),
                                      as_u32(bhi[1])};
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
                const uint4 x = *reinterpret_cast<const uint4 *>(
                    xs + (nt * GM_COL_TILE + g) * G::x_pitch + i * 64 + 16 * t);
                mma_16816(acc[nt], a_lo, x.x, x.y);
                mma_16816(acc[nt], a_hi, x.z, x.w);
            }
        };
        if (n == P) {  // a whole chunk: unrolled, so that pieces overlap
#pragma unroll
            for (int i = 0; i < P; i++) {
                piece(i);
            }
        } else {
            for (int i = 0; i < n; i++) {
                piece(i);
            }
        }
        if (flush) {  // the segment's sums, unscaled
            flush_segment<NT>(acc, total, inv);
        }
    }
    copy_wait<0>();  // no copy outlives the CTA (the empty groups past the end)

    LUCEPY_PDL_LAUNCH();  // the next kernel may start (and fetch its own weights)

    if (warp * 16 < rows) {
        store_tile<NT>(a, total, row0 + warp * 16, g, t);
    }
}

// dst[col][row] = the parts' sums, in part order (gemm split into parts), plus the residual
static __global__ void gemm_sum(const float * parts, int nparts, int nrows, int ncols, float * dst,
                         int64_t dst_stride, const float * residual, int64_t res_stride) {
    LUCEPY_PDL_SYNC();
    const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (i >= int64_t(nrows) * ncols) {
        return;
    }
    const int col = int(i / nrows);
    const int row = int(i % nrows);
    const float v = parts_sum(parts + int64_t(col) * nrows + row, nparts, int64_t(ncols) * nrows);
    LUCEPY_PDL_LAUNCH();
    dst[col * dst_stride + row] = residual ? v + residual[col * res_stride + row] : v;
}

// --- launching gemm (host side, shared by lucepy-mm.cu and bench-kernels.cu) -------------------

struct GemmPlan {
    dim3 grid;     // (row tiles, parts)
    int per_part;  // chunks a part
};

// for a product of `nrows` rows and `npieces` pieces in (at most) `parts` parts: as many as
// its chunks fill (9 parts of 20 chunks take 3 each: 7 parts, none empty)
inline GemmPlan gemm_plan_in(int nrows, int npieces, int cta_rows, int P, int parts) {
    const int nchunks = (npieces + P - 1) / P;
    const int per_part = (nchunks + parts - 1) / parts;
    return {dim3(unsigned(row_tiles(nrows, cta_rows)),
                 unsigned((nchunks + per_part - 1) / per_part)),
            per_part};
}

// for a product of `nrows` rows and `npieces` pieces, with room for `slots` CTAs of the kernel
inline GemmPlan gemm_plan(int nrows, int npieces, int cta_rows, int P, int64_t slots,
                          int most = 16) {
    return gemm_plan_in(nrows, npieces, cta_rows, P,
                        gemm_parts(nrows, npieces, cta_rows, P, slots, most));
}

}  // namespace lucepy
