// Kernels on lucepy-layouts.cuh's repacked layouts for a prefill's columns (more than 16): the
// activations with one scale a column (`to_halves_col`) and their product (`gemm_rq`).

#pragma once

#include "lucepy-bulk.cuh"

#include <cstdint>

namespace lucepy {

// --- a prefill's columns: one activation scale a column ---------------------------------------
//
// to_halves' layout with one power-of-two scale for the whole column (its largest to [2^14,
// 2^15)), so that a product's sums need no rescaling along the row: 1 / scale at xinv[column].
static __global__ void __launch_bounds__(256)
    to_halves_col(const float * x, int64_t col_stride, int npieces, Halves out) {
    LUCEPY_PDL_LAUNCH();  // the product after this may start fetching its weights
    LUCEPY_PDL_SYNC();    // x: the kernel before has finished
    const int c = blockIdx.x;
    x += c * col_stride;
    const int n = npieces * 32;
    float amax = 0.0f;
    for (int i = threadIdx.x; i < n; i += 256) {
        amax = fmaxf(amax, fabsf(x[i]));
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, off));
    }
    __shared__ float red[8];
    if (threadIdx.x % 32 == 0) {
        red[threadIdx.x / 32] = amax;
    }
    __syncthreads();
#pragma unroll
    for (int w = 0; w < 8; w++) {
        amax = fmaxf(amax, red[w]);
    }
    const float scale = segment_scale(amax);
    if (threadIdx.x == 0) {
        out.xinv[c] = 1.0f / scale;
    }
    for (int i = threadIdx.x; i < npieces * 4; i += 256) {
        const float * at = x + (i / 4) * 32 + 4 * (i % 4);
        const float v[8] = {at[0], at[1], at[2], at[3], at[16], at[17], at[18], at[19]};
        out.xh[int64_t(c) * npieces * 4 + i] = group_halves(v, scale);
    }
}

// A prefill's columns (multiples of 64) on a repacked matrix (layout L), activations from
// to_halves_col: a CTA of 4 warps owns 64 MT rows by 64 columns and walks the row a group (4
// pieces) at a time, its weights and activations copied into two shared stages (cp.async);
// each warp unpacks its own MT tiles of 16 rows (as gemm_r's lanes do) and multiplies them with
// the 64 columns' halves, so each weight is unpacked once for 64 columns and each 16-byte load
// of activations serves MT tiles. MT = 2 takes rows a multiple of 128; MT = 1 any multiple of
// 16 (the last CTA's warps past them only share the copies and barriers). No tail of columns
// yet (the grid covers whole tiles of 64, and to_halves_col writes only real columns).
constexpr int RQ_COLS = 64;
constexpr int RQ_XP = 4 * 64 + 32;  // a column's group of halves, padded (bank groups)

template <int MT, class L = RpQ4_0> __host__ __device__ constexpr int rq_stage() {
    return 4 * MT * L::bytes + RQ_COLS * RQ_XP;
}

template <int MT, class L = RpQ4_0> __host__ __device__ constexpr int gemm_rq_smem() {
    return 2 * rq_stage<MT, L>();
}

template <int MT, class L = RpQ4_0>
__global__ void __launch_bounds__(128, MT == 1 ? L::rq_ctas : 2) gemm_rq(const GemmArgs a) {
    constexpr int STAGE = rq_stage<MT, L>();
    constexpr int BYTES = L::bytes;
    constexpr int U4 = BYTES / 16;  // a tile's 16-byte copies a group
    extern __shared__ __align__(16) uint8_t smem[];
    const int tid = threadIdx.x;
    const int lane = tid % 32;
    const int warp = tid / 32;
    const int g = lane / 4;
    const int t = lane % 4;
    const int row0 = blockIdx.x * 64 * MT;
    const int col0 = blockIdx.y * RQ_COLS;
    const int ngroups = a.npieces / RP_GROUP;
    const uint8_t * wsrc = a.w + repacked_at(row0 / RP_ROWS + warp * MT, 0, ngroups, BYTES);
    const int64_t tile_bytes = int64_t(ngroups) * BYTES;
    const bool mine = row0 + warp * MT * 16 < a.nrows;  // this warp's tiles are rows

    auto issue = [&](int grp) {
        if (grp < ngroups) {
            uint8_t * st = smem + (grp % 2) * STAGE;
            uint8_t * ws = st + warp * MT * BYTES;
#pragma unroll
            for (int m = 0; m < MT && mine; m++) {
                const uint8_t * src = wsrc + m * tile_bytes + int64_t(grp) * BYTES;
#pragma unroll
                for (int k = 0; k < (U4 + 31) / 32; k++) {
                    const int i = lane + 32 * k;
                    if (i < U4) {
                        copy_async<16>(ws + m * BYTES + 16 * i, src + 16 * i);
                    }
                }
            }
            uint8_t * xs = st + 4 * MT * BYTES;
#pragma unroll
            for (int k = 0; k < 8; k++) {
                const int i = tid + 128 * k;
                const int c = i / 16;
                const int p = i / 4 % 4;
                const int u = i % 4;
                const uint4 * src = a.x.xh + (int64_t(col0 + c) * a.npieces + 4 * grp + p) * 4 + u;
                copy_async<16, true>(xs + c * RQ_XP + 64 * p + 16 * (u ^ (p / 2 % 2)),
                                     reinterpret_cast<const uint8_t *>(src));
            }
        }
        copy_commit();
    };

    float acc[MT][8][4] = {};
    const int swz = t / 2 % 2;
    LUCEPY_PDL_SYNC();  // the activations: the kernel before has finished
    issue(0);
    for (int grp = 0; grp < ngroups; grp++) {
        issue(grp + 1);
        copy_wait<1>();
        __syncthreads();  // group grp has landed for every warp
        if (!mine) {
            __syncthreads();  // (the stage's refill waits for every warp)
            continue;
        }
        const uint8_t * st = smem + (grp % 2) * STAGE;
        const uint8_t * ws = st + warp * MT * BYTES;
        const uint8_t * xs = st + 4 * MT * BYTES;
        typename L::Part part[MT];
#pragma unroll
        for (int m = 0; m < MT; m++) {
            const PtrLane group{ws + m * BYTES, lane};
            typename L::Sb sb{};
            if constexpr (L::pair) {  // the super-block's other group's word from memory
                const int at = 16 * lane + L::super_at(lane, g);
                const uint32_t own = *reinterpret_cast<const uint32_t *>(ws + m * BYTES + at);
                const uint32_t other = __ldg(reinterpret_cast<const uint32_t *>(
                    wsrc + m * tile_bytes + int64_t(grp ^ 1) * BYTES + at));
                sb = L::super(grp % 2 ? other : own, grp % 2 ? own : other, g, t);
            }
            part[m] = L::part(group, sb);
        }
#pragma unroll
        for (int w = 0; w < 4; w++) {
            uint32_t lo[MT][4], hi[MT][4];
#pragma unroll
            for (int m = 0; m < MT; m++) {
                L::words(part[m], w, lo[m], hi[m]);
            }
#pragma unroll
            for (int n = 0; n < 8; n++) {
                const uint4 x = *reinterpret_cast<const uint4 *>(
                    xs + (8 * n + g) * RQ_XP + 64 * t + 16 * (w ^ swz));
#pragma unroll
                for (int m = 0; m < MT; m++) {
                    mma_16816(acc[m][n], lo[m], x.x, x.y);
                    mma_16816(acc[m][n], hi[m], x.z, x.w);
                }
            }
        }
        // Every warp is done with this stage before it is refilled. (Left out after the last
        // groups, where no refill follows, the 27B-shaped model's pp512 measured 3,816 and 3,819
        // tok/s against 4,018-4,041 with it: session 30, docs/BENCHMARKS.md.)
        __syncthreads();
    }
    copy_wait<0>();
    LUCEPY_PDL_LAUNCH();
    if (!mine) {
        return;
    }
#pragma unroll
    for (int n = 0; n < 8; n++) {
        const int c = col0 + 8 * n + 2 * t;
        const float inv[2] = {a.x.xinv[c], a.x.xinv[c + 1]};
#pragma unroll
        for (int m = 0; m < MT; m++) {
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const int row = row0 + (warp * MT + m) * 16 + g + 8 * (j / 2);
                if (c + j % 2 < a.ncols) {
                    a.dst[(c + j % 2) * a.dst_stride + row] = acc[m][n][j] * inv[j % 2];
                }
            }
        }
    }
}

}  // namespace lucepy
