// lucepy's own kernels (issue 19, decision 12): the activations of a product of 2-16 columns as
// halves (`to_halves`, the norms that write them as they compute: `norm_halves`,
// `segment_halves`), for `gemm` (lucepy-gemm.cuh, which includes this).

#pragma once

#include "lucepy-ops.cuh"  // block_sum, norm_scale (and lucepy-kernels.cuh: the PDL hooks)

#include <cuda_fp16.h>

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

}  // namespace lucepy
