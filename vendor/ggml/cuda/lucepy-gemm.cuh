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
#pragma once

#include "lucepy-kernels.cuh"  // copy_async, the PDL hooks
#include "lucepy-plan.h"     // gemm_parts, row_tiles

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>

namespace lucepy {

// --- activations as halves --------------------------------------------------------------------
//
// Per column and piece, four 16-byte groups, group t (the lane of a quad that reads it) holding
// the halves of values (4t, 4t+2), (4t+1, 4t+3), (16+4t, 16+4t+2), (17+4t, 17+4t+2): the two B
// registers of the piece's low 16 values and of its high 16 (see `gemm` for the order).

constexpr int GM_COL_TILE = 8;  // columns an mma takes (n8)

__host__ __device__ constexpr int padded_cols(int ncols) {
    return (ncols + GM_COL_TILE - 1) / GM_COL_TILE * GM_COL_TILE;
}

constexpr int GM_SEG = 16;  // pieces that share a scale (a segment)

__host__ __device__ constexpr int segments(int npieces) {
    return (npieces + GM_SEG - 1) / GM_SEG;
}

// bytes of the halves and scales of `ncols` columns of `npieces` pieces
__host__ __device__ constexpr int64_t halves_bytes(int64_t npieces, int ncols) {
    return int64_t(padded_cols(ncols)) *
           (npieces * 64 + segments(int(npieces)) * int64_t(sizeof(float)));
}

// Where to_halves writes in a buffer of halves_bytes: the halves [column][piece][4 groups], then
// 1 / scale [column][segment].
struct Halves {
    uint4 * xh;
    float * xinv;
};

// where 1 / scale of column c and segment seg is among the halves' scales ([column][segment])
__host__ __device__ constexpr int64_t halves_scale_at(int c, int seg, int nsegs) {
    return int64_t(c) * nsegs + seg;
}

inline Halves halves_at(uint8_t * buf, int64_t npieces, int ncols) {
    return {reinterpret_cast<uint4 *>(buf),
            reinterpret_cast<float *>(buf + int64_t(padded_cols(ncols)) * npieces * 64)};
}

// The power of two a segment of largest magnitude `amax` is multiplied by.
__host__ __device__ inline float segment_scale(float amax) {
    if (!(amax > 0.0f) || !isfinite(amax)) {
        return 1.0f;  // zeros; and an inf or NaN reaches the result as it would unscaled
    }
    int e;
    frexpf(amax, &e);  // amax < 2^e
    return ldexpf(1.0f, min(15 - e, 100));
}

constexpr int TH_THREADS = GM_SEG * 4;  // to_halves: a thread a group (8 values) of a segment

// a group's 8 values times the segment's scale as halves, in gemm's order (values 0, 2 | 1, 3 |
// 4, 6 | 5, 7 paired)
__device__ __forceinline__ uint4 group_halves(const float * v, float s) {
    const __half2 h[4] = {
        __floats2half2_rn(v[0] * s, v[2] * s), __floats2half2_rn(v[1] * s, v[3] * s),
        __floats2half2_rn(v[4] * s, v[6] * s), __floats2half2_rn(v[5] * s, v[7] * s)};
    uint4 o;
    o.x = *reinterpret_cast<const uint32_t *>(&h[0]);
    o.y = *reinterpret_cast<const uint32_t *>(&h[1]);
    o.z = *reinterpret_cast<const uint32_t *>(&h[2]);
    o.w = *reinterpret_cast<const uint32_t *>(&h[3]);
    return o;
}

// The largest magnitude of each segment of a CTA of SEGS segments, WPS warps each (warp w in
// segment w / WPS), from each thread's own largest `amax`: every thread gets its segment's.
// (fmaxf drops a NaN: the product carries it.)
template <int SEGS, int WPS> __device__ __forceinline__ float segment_amax(float amax) {
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, off));
    }
    __shared__ float red[SEGS * WPS];
    if (lane == 0) {
        red[warp] = amax;
    }
    __syncthreads();
#pragma unroll
    for (int w = 0; w < WPS; w++) {
        amax = fmaxf(amax, red[warp / WPS * WPS + w]);
    }
    return amax;
}

constexpr int TH_WARPS = TH_THREADS / 32;

// to_halves' and to_e4m3's thread (a CTA of TH_THREADS a segment of column blockIdx.y, grid
// (segments, padded columns)): its group t = threadIdx.x % 4 of piece `piece` of x [ncols]
// [col_stride] f32 into v (values 4t..4t+3, then 16 + 4t..; zeros past the column or its pieces),
// their largest magnitude returned
__device__ __forceinline__ float segment_group(const float * x, int64_t col_stride, int npieces,
                                               int ncols, int piece, float (&v)[8]) {
    const int c = blockIdx.y;
    const bool here = c < ncols && piece < npieces;
    const float * at = x + c * col_stride + piece * 32 + 4 * (threadIdx.x % 4);
    float amax = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        v[j] = here ? at[j] : 0.0f;
        v[4 + j] = here ? at[16 + j] : 0.0f;
    }
#pragma unroll
    for (int j = 0; j < 8; j++) {
        amax = fmaxf(amax, fabsf(v[j]));
    }
    return amax;
}

// A CTA of TH_THREADS a segment of a column, grid (segments, padded columns): x [ncols]
// [col_stride] f32 to `out` (halves_at).
static __global__ void __launch_bounds__(TH_THREADS)
    to_halves(const float * x, int64_t col_stride, int npieces, int ncols, Halves out) {
    LUCEPY_PDL_LAUNCH();  // the product after this may start fetching its weights
    LUCEPY_PDL_SYNC();    // x: the kernel before has finished
    const int seg = blockIdx.x;
    const int c = blockIdx.y;
    const int piece = seg * GM_SEG + threadIdx.x / 4;
    const int t = threadIdx.x % 4;
    float v[8];
    const float amax =
        segment_amax<1, TH_WARPS>(segment_group(x, col_stride, npieces, ncols, piece, v));
    const float scale = segment_scale(amax);
    if (threadIdx.x == 0) {
        out.xinv[halves_scale_at(c, seg, segments(npieces))] = 1.0f / scale;
    }
    if (piece >= npieces) {
        return;
    }
    out.xh[(int64_t(c) * npieces + piece) * 4 + t] = group_halves(v, scale);
}

// norm_quantize's twin for 3-16 columns (a verify): a CTA a padded column, warp w taking
// segments w, w + 32, ..., each lane two of a segment's 64 groups (16-byte loads and stores:
// x, w and dst 16-byte aligned), what to_halves writes (the padding columns zeros, as there).
static __global__ void __launch_bounds__(NORM_THREADS)
    norm_halves(const float * x, int64_t x_stride, const float * w, float * dst,
                int64_t dst_stride, int n, float eps, int ncols, Halves out) {
    LUCEPY_PDL_LAUNCH();
    const int c = blockIdx.x;
    const bool real = c < ncols;
    x += real ? c * x_stride : 0;
    dst += c * dst_stride;
    LUCEPY_PDL_SYNC();  // x: the kernel before has finished
    const int npieces = n / 32;
    const int lane = threadIdx.x % 32;
    // the weights of the warp's first segment into L1 beside the norm's sum, not after it (its
    // values of x: the sum loads them)
    if (real && threadIdx.x / 32 < segments(npieces)) {
#pragma unroll
        for (int g = 0; g < 2; g++) {
            const int piece = threadIdx.x / 32 * GM_SEG + (32 * g + lane) / 4;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                if (piece < npieces) {
                    prefetch_l1(w + piece * 32 + 4 * (lane % 4) + 16 * h);
                }
            }
        }
    }
    const float scale = real ? norm_scale(x, n, eps) : 0.0f;
    for (int seg = threadIdx.x / 32; seg < segments(npieces); seg += NORM_THREADS / 32) {
        float v[2][8];
        int piece[2];
        float amax = 0.0f;
#pragma unroll
        for (int g = 0; g < 2; g++) {
            const int group = 32 * g + lane;  // of the segment's 64
            piece[g] = seg * GM_SEG + group / 4;
            const int t = group % 4;
            const bool here = real && piece[g] < npieces;
#pragma unroll
            for (int h = 0; h < 2; h++) {  // values 4t..4t+3, then 16+4t..16+4t+3: 16 bytes each
                const int i = piece[g] * 32 + 4 * t + 16 * h;
                float4 u = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                if (here) {
                    const float4 xi = *reinterpret_cast<const float4 *>(x + i);
                    const float4 wi = *reinterpret_cast<const float4 *>(w + i);
                    u = make_float4(scale * xi.x * wi.x, scale * xi.y * wi.y, scale * xi.z * wi.z,
                                    scale * xi.w * wi.w);
                    *reinterpret_cast<float4 *>(dst + i) = u;
                }
                v[g][4 * h] = u.x, v[g][4 * h + 1] = u.y, v[g][4 * h + 2] = u.z;
                v[g][4 * h + 3] = u.w;
            }
#pragma unroll
            for (int j = 0; j < 8; j++) {
                amax = fmaxf(amax, fabsf(v[g][j]));  // (fmaxf drops a NaN: the product has it)
            }
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, off));
        }
        const float s = segment_scale(amax);
        if (lane == 0) {
            out.xinv[halves_scale_at(c, seg, segments(npieces))] = 1.0f / s;
        }
#pragma unroll
        for (int g = 0; g < 2; g++) {
            if (piece[g] < npieces) {
                out.xh[(int64_t(c) * npieces + piece[g]) * 4 + (32 * g + lane) % 4] =
                    group_halves(v[g], s);
            }
        }
    }
}

// SEGS segments of a column as to_halves writes them, from a CTA of SEGS x GM_SEG / V warps that
// holds them, V pieces a warp: warp w's piece i is piece (seg0 + w / (GM_SEG / V)) GM_SEG +
// w % (GM_SEG / V) + i GM_SEG / V of column c (c perhaps a padding one, its v 0; pieces past
// the column's npieces not written), its lane j that piece's value j (v[i])
template <int SEGS = 1, int V = 1>
__device__ __forceinline__ void segment_halves(const float (&v)[V], const Halves & out, int c,
                                               int npieces, int seg0) {
    constexpr int WPS = GM_SEG / V;  // warps a segment
    static_assert(GM_SEG % V == 0, "a segment's pieces shared out evenly");
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int mine = warp / WPS;  // the CTA's segment
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < V; i++) {
        amax = fmaxf(amax, fabsf(v[i]));
    }
    const float s = segment_scale(segment_amax<SEGS, WPS>(amax));
    if (warp % WPS == 0 && lane == 0) {
        out.xinv[halves_scale_at(c, seg0 + mine, segments(npieces))] = 1.0f / s;
    }
    const int t = lane % 4;  // group t: values 4t..4t+3 and 16+4t..16+4t+3
#pragma unroll
    for (int i = 0; i < V; i++) {
        float g[8];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            g[j] = __shfl_sync(0xFFFFFFFFu, v[i], 4 * t + j);
            g[4 + j] = __shfl_sync(0xFFFFFFFFu, v[i], 16 + 4 * t + j);
        }
        const int piece = (seg0 + mine) * GM_SEG + warp % WPS + i * WPS;
        if (piece < npieces && lane < 4) {
            out.xh[(int64_t(c) * npieces + piece) * 4 + t] = group_halves(g, s);
        }
    }
}

// --- the activations: e4m3 records --------------------------------------------------------------
//
// A chunk of 8 pieces of 16 columns is F8_CHUNK bytes: piece q's first terms at 1024 q and its
// second terms 512 after, each 16 columns x 32 values in wgmma's core matrices (8 columns x 16
// bytes, column c's values 4t..4t+3 as the word at 256 (c / 8) + 16 (c % 8) + 4 t, its values
// 16 + 4t.. 128 bytes after). After the chunks: 512 / scale a column and segment ([segments][16]
// (f8_scale_at): a lane's four columns of a segment two 8-byte loads; each segment's largest
// scaled into [128, 256)), then each segment's pieces' sums times -8 / 512
// (two halves: the sum, then what it missed) as an m16n8k16 mma's B registers of the segment's 16
// pieces, [segment][tile of 8 columns][term][lane][4 halves].
constexpr int F8_CHUNK = 8 * 1024;
constexpr int F8_COLS = 16;

__host__ __device__ constexpr int64_t f8_records_bytes(int64_t npieces) {
    return npieces / 8 * F8_CHUNK;
}

__host__ __device__ constexpr int64_t f8_bytes(int64_t npieces) {
    return f8_records_bytes(npieces) + int64_t(F8_COLS) * segments(int(npieces)) * 4 +
           int64_t(segments(int(npieces))) * 2 * 2 * 32 * 4 * 2;
}

// the records, scales and offsets in a buffer of f8_bytes, as Halves (xh the records)
inline Halves f8_at(uint8_t * buf, int64_t npieces) {
    return {reinterpret_cast<uint4 *>(buf),
            reinterpret_cast<float *>(buf + f8_records_bytes(npieces))};
}

// where 512 / scale of column c and segment seg is among the records' scales
__host__ __device__ constexpr int64_t f8_scale_at(int c, int seg) {
    return int64_t(seg) * F8_COLS + c;
}

// the offsets after the scales
__host__ __device__ inline const __half * f8_offsets(const float * xinv, int npieces) {
    return reinterpret_cast<const __half *>(xinv + F8_COLS * segments(npieces));
}

// The multiplier that brings a segment's largest magnitude `amax` into [128, 256) (a power of two)
__device__ __forceinline__ float f8_scale(float amax) {
    if (!(amax > 0.0f) || !isfinite(amax)) {
        return 1.0f;
    }
    int e;
    frexpf(amax, &e);  // amax < 2^e
    return ldexpf(1.0f, min(8 - e, 100));
}

// a as e4m3, rounded to nearest: the hardware's conversion (sm_89 and newer: one instruction;
// it saturates), and e4m3's NaN for a value past 448, an inf or a NaN (as the conversion that
// does not saturate gives; on sm_90 that one runs through doubles in software: writing records
// took the FFN's GLU kernel 6.9 us a call where halves took 3.0, docs/BENCHMARKS.md session 54).
// Byte for byte the non-saturating conversion's at every |a| <= 448 (bench-kernels --e4m3).
__device__ __forceinline__ __nv_fp8_storage_t f8_of(float a) {
    const __nv_fp8_storage_t b = __nv_cvt_float_to_fp8(a, __NV_SATFINITE, __NV_E4M3);
    return fabsf(a) <= 448.0f ? b : __nv_fp8_storage_t(0x7F);
}

// value a (scaled: below 256, where e4m3 reaches 448) as two e4m3 terms, and their sum as the
// product will see it (an inf or NaN becomes e4m3's NaN, which the product carries)
__device__ __forceinline__ float f8_terms(float a, uint32_t & hi, uint32_t & lo) {
    const __nv_fp8_storage_t h = f8_of(a);
    const float hf = __half2float(__half(__nv_cvt_fp8_to_halfraw(h, __NV_E4M3)));
    const __nv_fp8_storage_t l = f8_of(a - hf);
    const float lf = __half2float(__half(__nv_cvt_fp8_to_halfraw(l, __NV_E4M3)));
    hi = uint32_t(h);
    lo = uint32_t(l);
    return hf + lf;
}

// the two terms' words (hi, lo) of values 4t..4t+3 (`high`: 16 + 4t..) of piece `piece` of column
// c into the records at xe
__device__ __forceinline__ void f8_put(uint8_t * xe, int piece, int c, int t, int high, uint32_t hi,
                                       uint32_t lo) {
    uint8_t * rec = xe + int64_t(piece / 8) * F8_CHUNK + (piece % 8) * 1024 +
                    (c / 8) * 256 + (c % 8) * 16 + 4 * t + 128 * high;
    *reinterpret_cast<uint32_t *>(rec) = hi;
    *reinterpret_cast<uint32_t *>(rec + 512) = lo;
}

// A thread's 8 values of piece `piece` of column c (group t: values 4t..4t+3 and 16 + 4t..), all
// times `scale`, into the records at xe, their terms' sum returned (the caller adds a piece's)
__device__ __forceinline__ float f8_group(const float (&v)[8], float scale, uint8_t * xe,
                                          int piece, int c, int t) {
    uint32_t hi[2] = {0, 0}, lo[2] = {0, 0};
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        uint32_t h, l;
        sum += f8_terms(v[j] * scale, h, l);
        hi[j / 4] |= h << (8 * (j % 4));
        lo[j / 4] |= l << (8 * (j % 4));
    }
    f8_put(xe, piece, c, t, 0, hi[0], lo[0]);
    f8_put(xe, piece, c, t, 1, hi[1], lo[1]);
    return sum;
}

// piece `piece`'s terms' sum (of column c, segment seg) times -8 / 512 as the offsets' B halves
__device__ __forceinline__ void f8_offset(float sum, __half * xo, int piece, int c, int seg) {
    const float o = sum * (-8.0f / 512.0f);
    const int pp = piece % GM_SEG, nt = c / 8, ln = (c % 8) * 4 + pp % 4;
    const int h = (pp / 8) * 2 + (pp / 4) % 2;
    const __half oh = __float2half_rn(o);
    const __half ol = __float2half_rn(o - __half2float(oh));
    xo[(((int64_t(seg) * 2 + nt) * 2 + 0) * 32 + ln) * 4 + h] = oh;
    xo[(((int64_t(seg) * 2 + nt) * 2 + 1) * 32 + ln) * 4 + h] = ol;
}

// SEGS segments of a column as e4m3 records (as to_e4m3 writes them), from a CTA of SEGS x
// GM_SEG / V warps that holds them, V pieces a warp (as segment_halves takes them: warp w's piece
// i is piece (seg0 + w / (GM_SEG / V)) GM_SEG + w % (GM_SEG / V) + i GM_SEG / V of column c), its
// lane j that piece's value j (v[i]); pieces past npieces not written
template <int SEGS, int V = 1>
__device__ __forceinline__ void segment_e4m3(const float (&v)[V], const Halves & out, int c,
                                             int npieces, int seg0) {
    constexpr int WPS = GM_SEG / V;  // warps a segment
    static_assert(GM_SEG % V == 0, "a segment's pieces shared out evenly");
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int mine = warp / WPS;  // the CTA's segment
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < V; i++) {
        amax = fmaxf(amax, fabsf(v[i]));
    }
    const float scale = f8_scale(segment_amax<SEGS, WPS>(amax));
    const int seg = seg0 + mine;
    if (warp % WPS == 0 && lane == 0) {
        out.xinv[f8_scale_at(c, seg)] = 512.0f / scale;
    }
#pragma unroll
    for (int i = 0; i < V; i++) {
        uint32_t h, l;
        float sum = f8_terms(v[i] * scale, h, l);
        uint32_t hw = h, lw = l;  // lane 4k: the bytes of values 4k..4k+3
#pragma unroll
        for (int b = 1; b < 4; b++) {
            hw |= __shfl_down_sync(0xFFFFFFFFu, h, b) << (8 * b);
            lw |= __shfl_down_sync(0xFFFFFFFFu, l, b) << (8 * b);
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            sum += __shfl_xor_sync(0xFFFFFFFFu, sum, off);
        }
        const int piece = seg * GM_SEG + warp % WPS + i * WPS;
        if (piece < npieces) {
            if (lane % 4 == 0) {  // values 4t.. (lanes 0-15) or 16 + 4t.. (16-31) of group t
                f8_put(reinterpret_cast<uint8_t *>(out.xh), piece, c, (lane / 4) % 4, lane / 16,
                       hw, lw);
            }
            if (lane == 0) {
                f8_offset(sum, const_cast<__half *>(f8_offsets(out.xinv, npieces)), piece, c,
                          seg);
            }
        }
    }
}

// norm_gate_quantize's twin for 2-16 columns (a verify's gated norm): grid (segments of a column,
// padded columns), a CTA of GM_SEG warps a segment, a warp a piece; a column `npieces` pieces of
// whole rows (of n = 32 PIECES values: GM_SEG % PIECES == 0, so a CTA holds whole rows). Writes
// the three results as ggml does and the gated one's halves as to_halves writes them (padding
// columns zeros). z's columns are z_stride floats apart (a verify's z read in place from the
// stacked product, where ggml-cuda would copy it out with a 2D memcpy outside the PDL chain).
template <int PIECES>
__global__ void __launch_bounds__(GM_SEG * 32) norm_gate_halves(
    const float * x, int64_t x_stride, const float * w, const float * z, int64_t z_stride,
    float * normed, float * gate, float * dst, int npieces, int ncols, float eps, int op,
    Halves out) {
    static_assert(GM_SEG % PIECES == 0, "a CTA holds whole rows");
    LUCEPY_PDL_LAUNCH();
    LUCEPY_PDL_SYNC();  // x and z: the kernels before have finished
    const int seg = blockIdx.x;
    const int c = blockIdx.y;
    const int lane = threadIdx.x % 32;
    const int p = seg * GM_SEG + threadIdx.x / 32;  // the column's piece
    const bool piece_here = p < npieces;
    const bool here = c < ncols && piece_here;
    const int64_t piece = int64_t(c) * npieces + p;  // of the results
    const int mine = int(piece % PIECES);
    const float wi = w[32 * mine + lane];  // loaded beside the row's, not after them
    const float zi = here ? z[c * z_stride + p * 32 + lane] : 0.0f;
    const float2 ys = gated_norm_read<PIECES>(x, x_stride, piece / PIECES, mine, here);
    __syncthreads();  // the CTA's rows read: results may overwrite them
    float v = 0.0f;
    if (here) {
        v = gated_norm_write(ys, 32 * PIECES, eps, wi, zi, op, normed, gate, dst, piece * 32 + lane);
    }
    segment_halves<1, 1>({v}, out, c, npieces, seg);
}

// The sum of `nparts` floats `stride` apart, in order (the first plus the second, ...), their
// loads issued four at a time ahead of the adds (against one at a time, a split product with
// its gemm_sum measured 0.1-0.2 us faster on the H200: docs/BENCHMARKS.md, session 29)
__device__ __forceinline__ float parts_sum(const float * p, int nparts, int64_t stride) {
    float v = p[0];
    int q = 1;
    for (; q + 4 <= nparts; q += 4) {
        const float a = p[q * stride], b = p[(q + 1) * stride];
        const float c = p[(q + 2) * stride], d = p[(q + 3) * stride];
        v += a;
        v += b;
        v += c;
        v += d;
    }
    for (; q < nparts; q++) {
        v += p[q * stride];
    }
    return v;
}

// SWIGLU (silu(a) times b, ggml's formula) for 2-16 columns (a verify's FFN) into dense `dst`,
// a and b each `nparts` parts `part_stride` floats apart whose sums (in part order, as gemm_sum
// adds them) are the values, a column's `col_stride` apart: grid (segments of a column, padded
// columns), a CTA of GLU_WARPS warps a segment, a warp two pieces (the FFN of the 27B-shaped
// model, 34 segments of 16 columns, then fits the H200 at once: a warp a piece took a second
// wave of CTAs); writes the result, and its halves as to_halves writes them (padding columns
// zeros), or (F8: 16 columns) its e4m3 records as to_e4m3 writes them. Each element read and
// written by one lane (with one part, the result may be written over a or b).
constexpr int GLU_WARPS = GM_SEG / 2;

template <bool F8 = false>
static __global__ void __launch_bounds__(GLU_WARPS * 32)
    glu_halves(const float * a, const float * b, int64_t col_stride, int nparts,
               int64_t part_stride, float * dst, int npieces, int ncols, Halves out) {
    LUCEPY_PDL_LAUNCH();
    LUCEPY_PDL_SYNC();  // a and b: the kernels before have finished
    const int seg = blockIdx.x;
    const int c = blockIdx.y;
    float v[2] = {0.0f, 0.0f};
    float x[2], y[2];
    int p[2];  // the column's pieces
    bool here[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {  // both pieces' loads in flight before the arithmetic
        p[i] = seg * GM_SEG + threadIdx.x / 32 + i * GLU_WARPS;
        here[i] = c < ncols && p[i] < npieces;
        const int64_t at = c * col_stride + int64_t(p[i]) * 32 + threadIdx.x % 32;
        x[i] = here[i] ? parts_sum(a + at, nparts, part_stride) : 0.0f;
        y[i] = here[i] ? parts_sum(b + at, nparts, part_stride) : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < 2; i++) {
        if (here[i]) {
            v[i] = swiglu(x[i], y[i]);
            dst[(int64_t(c) * npieces + p[i]) * 32 + threadIdx.x % 32] = v[i];
        }
    }
    if constexpr (F8) {
        segment_e4m3<1, 2>(v, out, c, npieces, seg);
    } else {
        segment_halves<1, 2>(v, out, c, npieces, seg);
    }
}

// gate_quantize's twin for 2-16 columns (a verify's attention gate): act(z) * x into dense
// `dst` and its halves as to_halves writes them (padding columns zeros); x dense, a column's
// `x_col` apart. Grid (segments of a column, padded columns), a CTA of GM_SEG warps a segment, a
// warp a piece, each element read and written by one lane (dst may be written over x).
static __global__ void __launch_bounds__(GM_SEG * 32)
    gate_halves(const GateAt z, const float * x, int64_t x_col, float * dst, int npieces,
                int ncols, int op, Halves out) {
    LUCEPY_PDL_LAUNCH();
    LUCEPY_PDL_SYNC();  // z and x: the kernels before have finished
    const int seg = blockIdx.x;
    const int c = blockIdx.y;
    const int p = seg * GM_SEG + threadIdx.x / 32;  // the column's piece
    const bool piece_here = p < npieces;
    float v = 0.0f;
    if (c < ncols && piece_here) {
        const int64_t e = int64_t(p) * 32 + threadIdx.x % 32;  // of the column
        v = gate_act(gate_z(z, c, e), op) * x[c * x_col + e];
        dst[int64_t(c) * npieces * 32 + e] = v;
    }
    segment_halves<1, 1>({v}, out, c, npieces, seg);
}

// --- a split product's sums, its residual and the RMS norm after it, in one kernel ---------------
//
// A verify layer's output product and its skip connection (ggml's MUL_MAT and ADD), then the
// next block's RMS norm times its weight (RMS_NORM and MUL), whose result goes to products:
// where gemm_sum added the product's parts and the residual and norm_halves then normed the sum
// in a CTA of its own a column (16 SMs for 16 columns), a cluster of CL CTAs holds a column of
// CL x NORM_THREADS values, a thread a value: each adds its value's parts and residual as
// gemm_sum does (bit for bit) and writes the sum; the cluster's CTAs then read each other's
// values through distributed shared memory, so that each thread sums the squares of values tid,
// tid + NORM_THREADS, ... in norm_scale's (ggml's) order, and every CTA finds norm_halves' factor
// bit for bit; a CTA's two segments' halves as to_halves writes them. lucepy-mm.cu launches it
// after a product in parts: of one part, whose store wrote the sums, norm_halves alone took
// 0.78x its time (bench-kernels --sum-norm, which times both ways).
//
// PUSH (the default): each thread sends its value to its place in every CTA of the cluster
// (st.async, completing bytes on the receiver's mbarrier), each CTA waits on its own mbarrier
// and sums the squares from its shared memory, and no CTA waits for another at its end. Without
// it (PULL, for comparison) each CTA reads the others' values after a cluster barrier, and a
// second keeps every CTA until all have read: each barrier's release is a MEMBAR.ALL.GPU in
// sm_90's code, waiting on every global store before it (Nsight Compute: membar the largest
// stall after the loads').

// the cluster's barrier, in two halves: arrive (what this thread wrote before is seen by those
// that wait after) and wait
__device__ __forceinline__ void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// the cluster's barrier's arrival that orders nothing (only that every CTA has reached it)
__device__ __forceinline__ void cluster_arrive_relaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
}

// shared address `at` (of this CTA's layout) in the cluster's CTA `rank` (mapa)
__device__ __forceinline__ uint32_t cluster_at(uint32_t at, int rank) {
    uint32_t remote = at;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(at), "r"(rank));
#endif
    return remote;
}

// v into the float at `local`'s place in the shared memory of the cluster's CTA `rank`, its 4
// bytes completing on that CTA's mbarrier at `bar`'s place (st.async)
__device__ __forceinline__ void cluster_send(const float * local, uint32_t bar, int rank, float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];"
                 ::"r"(cluster_at(shared_at(local), rank)), "r"(__float_as_uint(v)),
                 "r"(cluster_at(bar, rank))
                 : "memory");
#endif
}

// v[0..3] into the 16 bytes at shared address `at` (of this CTA's layout) in the cluster's CTA
// `rank`, completing on that CTA's mbarrier at `bar` (st.async, one 16-byte store)
__device__ __forceinline__ void cluster_send4(uint32_t at, uint32_t bar, int rank,
                                              const float * v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile(
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, "
        "[%5];" ::"r"(cluster_at(at, rank)),
        "r"(__float_as_uint(v[0])), "r"(__float_as_uint(v[1])), "r"(__float_as_uint(v[2])),
        "r"(__float_as_uint(v[3])), "r"(cluster_at(bar, rank))
        : "memory");
#endif
}

// the CTAs of this CTA's cluster (1 where it was launched without clusters), and its rank there
__device__ __forceinline__ uint32_t cluster_ctas() {
    uint32_t n = 1;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
#endif
    return n;
}

__device__ __forceinline__ uint32_t cluster_rank() {
    uint32_t r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
    return r;
}

// the float at `local`'s place in the shared memory of the cluster's CTA `rank`
__device__ __forceinline__ float cluster_load(const float * local, int rank) {
    float v = 0.0f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("ld.shared::cluster.f32 %0, [%1];"
                 : "=f"(v)
                 : "r"(cluster_at(shared_at(local), rank))
                 : "memory");
#endif
    return v;
}

// the launch attribute of clusters of `cl` CTAs along x (sum_norm_halves' launches and its
// occupancy query)
inline cudaLaunchAttribute cluster_attr(int cl) {
    cudaLaunchAttribute attr = {};
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = unsigned(cl);
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    return attr;
}

struct SumNorm {
    const float * src;       // the product's parts, part_stride apart, or (one part) its sums
    int64_t src_col;         // a column's stride in src
    int64_t part_stride;
    int nparts;
    const float * residual;  // or null (one part: the product added it)
    int64_t res_stride;
    float * sum;             // where the sums plus the residual go (the ADD's), or null (one part)
    int64_t sum_stride;
    const float * w;         // the norm's weight
    float * normed;          // the MUL's result
    int64_t normed_stride;
    int n;                   // values a column: NORM_THREADS x CL
    int ncols;
    float eps;
    Halves out;              // for the products after it (padding columns zeros)
    bool late;               // the product after it let start at the end (below), not at once
};

// Grid (CL, padded columns), clusters of CL x 1, NORM_THREADS threads (two segments) a CTA, a
// thread a value: CL CTAs a column where norm_halves has one. F8: the products' activations as
// e4m3 records (a.out as f8_at gives them, 16 columns), not halves. `late`: the product after it
// (programmatic dependent launch) may start only once every CTA has written its results, not
// at the kernel's start: a CTA of 1,024 threads holds 40,960 of an SM's 65,536 registers, so
// the product's CTAs launched early crowd onto the other SMs and onto 3 slots of these, and
// come out less even than when launched onto empty SMs (a 16-token verify 0.02-0.025 decode
// steps less, docs/BENCHMARKS.md session 58).
template <int CL, bool F8 = false, bool PUSH = true>
__global__ void __launch_bounds__(NORM_THREADS) sum_norm_halves(const SumNorm a) {
    static_assert(NORM_THREADS == 2 * GM_SEG * 32, "a CTA two segments");
    if (!a.late) {
        LUCEPY_PDL_LAUNCH();
    }
    const int c = blockIdx.y;
    const bool real = c < a.ncols;
    const int e = blockIdx.x * NORM_THREADS + threadIdx.x;  // of the column
    const float wi = a.w[e];
    __shared__ float xs[PUSH ? CL : 1][NORM_THREADS];  // PUSH: [CTA k][t], value k NORM_THREADS + t
    __shared__ uint64_t landed;                        // PUSH: every CTA's values here
    const uint32_t bar = shared_at(&landed);
    if constexpr (PUSH) {
        if (threadIdx.x == 0) {
            mbar_init(bar, 1);
            mbar_expect(bar, CL * NORM_THREADS * sizeof(float));
            mbar_init_fence();
        }
        cluster_arrive_relaxed();
        cluster_wait();  // every CTA's mbarrier is ready before any value is sent to it
    }
    LUCEPY_PDL_SYNC();  // the parts: the product has finished
    float v = 0.0f;
    if (real) {
        v = parts_sum(a.src + c * a.src_col + e, a.nparts, a.part_stride);
        if (a.residual) {
            v += a.residual[c * a.res_stride + e];
        }
        if (a.sum) {
            a.sum[c * a.sum_stride + e] = v;
        }
    }
    float sq = 0.0f;
    if constexpr (PUSH) {
#pragma unroll
        for (int k = 0; k < CL; k++) {
            cluster_send(&xs[blockIdx.x][threadIdx.x], bar, k, v);
        }
        mbar_wait<true>(bar, 0);  // every CTA's values have landed here
#pragma unroll
        for (int k = 0; k < CL; k++) {
            sq += xs[k][threadIdx.x] * xs[k][threadIdx.x];
        }
    } else {
        xs[0][threadIdx.x] = v;
        cluster_arrive();
        cluster_wait();  // every CTA of the column has its values in place
#pragma unroll
        for (int k = 0; k < CL; k++) {
            const float xk = cluster_load(xs[0] + threadIdx.x, k);
            sq += xk * xk;
        }
        cluster_arrive();  // this CTA has read the others' values (they may exit once all have)
    }
    const float scale = rsqrtf(block_sum<NORM_THREADS>(sq) / float(a.n) + a.eps);
    const float u = scale * v * wi;
    if (real) {
        a.normed[c * a.normed_stride + e] = u;
    }
    if constexpr (F8) {
        segment_e4m3<2>({u}, a.out, c, a.n / 32, 2 * blockIdx.x);
    } else {
        segment_halves<2, 1>({u}, a.out, c, a.n / 32, 2 * blockIdx.x);
    }
    if (a.late) {
        LUCEPY_PDL_LAUNCH();
    }
    if constexpr (!PUSH) {
        cluster_wait();  // no CTA's shared memory goes while another reads it
    }
}

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
