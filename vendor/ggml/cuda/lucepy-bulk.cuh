// Kernels on lucepy-layouts.cuh's repacked layouts whose weights the TMA unit fetches (bulk copies
// on mbarriers): 2-16 columns (`gemm_rb`) and one (`gemv_r`); what they share with gemm_r is
// lucepy-repack.cuh's.

#pragma once

#include "lucepy-repack.cuh"

#include <cstdint>

namespace lucepy {

// --- gemm_rb: gemm_r with each warp's weights fetched by the TMA unit -----------------------
//
// The same products as gemm_r (2-16 columns on a repacked layout, its k order, activations and
// sums), but each warp's weights of a chunk, its tile's two groups (2,304 contiguous bytes on
// Q4_0's layout), come by one bulk copy (cp.async.bulk, Hopper's TMA unit) into shared memory,
// completing on the warp's mbarrier of the stage, where gemm_r loads them into registers a
// chunk ahead (36 registers); the activations' chunks are copied as gemm_r copies them, one a
// stage; both low and high nibbles' mmas go into one chain. 89 registers at two column tiles: 5 CTAs an SM (73 at one: 6). On an
// H200 at 16 columns (docs/BENCHMARKS.md, session 38) 2.5-8.5 % faster than gemm_r where each of
// the 5 x 132 CTA slots gets about 5 or more chunks (the FFN's stacked up and gate 39.5 us where
// 43.1, and 41.2 for gemm_r at 5 CTAs an SM; ffn down 22.7 where 23.4; qkv 15.2 where 15.6), 5-9
// % slower where it gets 3 or fewer (attn out 11.7 where 11.1); at 2-8 columns ffn down 18.1-18.4
// where 19.3-19.6 (session 39). sm_90 and newer. SKIP: RP_STAMPS alone (bench-kernels'
// --timeline), as gemm_r's.

// `bytes` from global `src` to shared `dst` by the TMA unit, completing the phase of the mbarrier
// `bar` that this thread's arrival opens (one arrival a phase)
__device__ __forceinline__ void mbar_copy(uint32_t bar, uint32_t dst, const void * src,
                                          uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    mbar_expect(bar, bytes);
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
            "r"(dst),
        "l"(src), "r"(bytes), "r"(bar)
        : "memory");
#endif
}

// this thread's reads of shared memory ordered before its next bulk copy writes there
__device__ __forceinline__ void async_proxy_fence() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

constexpr int RB_STAGES = 2;  // chunks of activations and of weights in flight

// a warp's weights of a chunk (two groups) on layout L
template <class L> __host__ __device__ constexpr int rb_warp_bytes() {
    return 2 * L::bytes;
}

template <int NT, class L = RpQ4_0> __host__ __device__ constexpr int gemm_rb_smem() {
    return RB_STAGES * (NT * GM_COL_TILE * RP_X_PITCH + GM_WARPS * rb_warp_bytes<L>()) +
           GM_WARPS * RB_STAGES * 8;
}

template <int NT, int MINB, int SKIP = 0, class L = RpQ4_0>
__global__ void __launch_bounds__(GM_WARPS * 32, MINB) gemm_rb(const GemmArgs a) {
    static_assert((SKIP & ~RP_STAMPS) == 0, "gemm_rb leaves nothing out");
    constexpr int W = GM_WARPS, P = 8, ST = RB_STAGES;
    constexpr int X_STAGE = NT * GM_COL_TILE * RP_X_PITCH;
    constexpr int WB = rb_warp_bytes<L>();
    constexpr int W_STAGE = W * WB;
    extern __shared__ __align__(16) uint8_t smem[];
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int g = lane / 4;
    const int t = lane % 4;
    const int row0 = blockIdx.x * W * 16;
    const int nchunks_all = a.npieces / P;
    const int chunk0 = blockIdx.y * a.per_part;
    const int nchunks = max(0, min(a.per_part, nchunks_all - chunk0));
    const bool mine = row0 + warp * 16 < a.nrows;
    stamp_start<SKIP>(a);
    // this warp's mbarriers, one a stage, after the stages
    const uint32_t bars = shared_at(smem) + ST * (X_STAGE + W_STAGE) + warp * ST * 8;
    const uint32_t w_dst = shared_at(smem) + ST * X_STAGE + warp * WB;
    const uint8_t * w_src = warp_tile_at(a, row0, warp, chunk0, a.npieces / RP_GROUP, L::bytes);
    auto fetch = [&](int ch) {  // the weights of chunk ch: lane 0 of the warp
        if (mine && lane == 0 && ch < nchunks) {
            // this warp read the stage's last chunk before (it waited on its loads' results)
            async_proxy_fence();
            mbar_copy(bars + 8 * (ch % ST), w_dst + (ch % ST) * W_STAGE,
                      w_src + int64_t(ch) * WB, WB);
        }
    };
    if (lane == 0) {
#pragma unroll
        for (int s = 0; s < ST; s++) {
            mbar_init(bars + 8 * s, 1);
        }
        mbar_init_fence();
    }
    __syncwarp();
#pragma unroll
    for (int c = 0; c < ST - 1; c++) {
        fetch(c);  // weights: no kernel before this one writes them
    }

    const ActCopy<NT, W * 32> x_copy(a, chunk0);
    auto copy_x = [&](int ch) {
        if (ch < nchunks) {
            x_copy.issue(smem + (ch % ST) * X_STAGE, a.npieces, ch);
        }
        copy_commit();
    };

    float acc[NT][4] = {};
    float total[NT][4] = {};
    const int nsegs = segments(a.npieces);
    const float * xi = a.x.xinv + halves_scale_at(2 * t, chunk0 / 2, nsegs);
    uint32_t x_lane[4];
    activation_lanes(smem, g, t, x_lane);
    const uint32_t w_lane = opaque(w_dst + 16 * lane);

    LUCEPY_PDL_SYNC();  // the activations: the kernel before has finished
#pragma unroll
    for (int c = 0; c < ST - 1; c++) {
        copy_x(c);
    }
    for (int ch = 0; ch < nchunks; ch++) {
        if (ch < RP_STAMP_CHUNKS) {
            stamp_clock<SKIP>(a, RP_AT_CHUNK + ch);
        }
        copy_wait<ST - 2>();
        __syncthreads();  // chunk ch's activations landed for all; chunk ch - 1 read by all
        if (ch == 0) {
            stamp_clock<SKIP>(a, RP_AT_FIRST_BARRIER);
        }
        copy_x(ch + ST - 1);
        fetch(ch + ST - 1);
        if (!mine) {
            continue;
        }
        const int s = ch % ST;
        mbar_wait(bars + 8 * s, uint32_t(ch / ST) & 1u);
        const bool flush = ch + 1 == nchunks || ((chunk0 + ch) & 1);
        float inv[NT][2];
        if (flush) {
            next_inv<NT>(xi, nsegs, inv);
        }
        typename L::Sb sb{};  // what the chunk's super-block's two groups share
        if constexpr (L::pair) {
            // (Q4_K's: the same words as part's, which ptxas loads once)
            const uint32_t at = w_lane + s * W_STAGE + L::super_at(lane, g);
            sb = L::super(load_shared_word(at), load_shared_word(at + L::bytes), g, t);
        }
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const SharedLane group{w_lane + s * W_STAGE + j * L::bytes, lane};
            const typename L::Part part = L::part(group, sb);
#pragma unroll
            for (int w = 0; w < 4; w++) {
                uint32_t lo[4], hi[4];
                L::words(part, w, lo, hi);
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    const uint4 x = load_shared(x_lane[w] + s * X_STAGE +
                                                nt * GM_COL_TILE * RP_X_PITCH + 4 * j * 64);
                    word_mmas<0>(acc[nt], acc[nt], lo, hi, x);
                }
            }
        }
        if (flush) {
            flush_segment<NT>(acc, total, inv);
        }
    }
    copy_wait<0>();
    stamp_clock<SKIP>(a, RP_AT_LOOP_END);

    LUCEPY_PDL_LAUNCH();

    if (mine) {
        store_tile<NT>(a, total, row0 + warp * 16, g, t);
    }
    stamp_end<SKIP>(a);
}

// gemm_rb's build at MINB CTAs an SM on layout L, as GemmR names gemm_r's
template <int NT, int MINB = 5, class L = RpQ4_0> struct GemmRB {
    static constexpr int warps = GM_WARPS;
    static constexpr double start = 0.35;
    static constexpr int minb = MINB;
    static constexpr int smem = gemm_rb_smem<NT, L>();
    static auto kernel() { return gemm_rb<NT, MINB, 0, L>; }
};

// One column on a repacked matrix (a.w, layout L), the activations as `quantize` writes them (one
// plane), and with GATE ggml's fused gate: a.gate repacked alike, dst = glu(W x + bias, G x +
// gate bias). SPLIT warps share a tile of 16 rows, each a range of its groups (whole
// super-blocks of a K type), a CTA of max(4, SPLIT) warps; lane (g, t) takes piece t of rows g
// and g + 8 of each group (8 dp4a a row on Q4_0), U groups loaded ahead of the ones it
// multiplies (a super-block's two for a K type).
template <int SPLIT, int U = 1, bool GATE = false, class L = RpQ4_0>
__global__ void __launch_bounds__(gemv_r_warps<SPLIT>() * 32) gemv_r(const Args a) {
    static_assert(!L::pair || U == 2, "a super-block's two groups at a time");
    using Group = typename L::Group;
    constexpr int WARPS = gemv_r_warps<SPLIT>();
    constexpr int M = GATE ? 2 : 1;  // matrices: the product's, the gate's
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int t = lane % 4;
    const int tile = blockIdx.x * (WARPS / SPLIT) + warp / SPLIT;
    const int part = warp % SPLIT;
    const int ngroups = a.npieces / RP_GROUP;
    // (two groups a super-block: whole super-blocks a part)
    const int per = L::pair ? 2 * ((ngroups + 2 * SPLIT - 1) / (2 * SPLIT))
                            : (ngroups + SPLIT - 1) / SPLIT;
    const int g0 = min(ngroups, part * per);
    const int g1 = tile < a.nrows / RP_ROWS ? min(ngroups, g0 + per) : g0;
    const uint8_t * base[M];
    base[0] = a.w + repacked_at(tile, 0, ngroups, L::bytes);
    if constexpr (GATE) {
        base[1] = a.gate + repacked_at(tile, 0, ngroups, L::bytes);
    }
    Group cur[M][U], nxt[M][U];
    auto load = [&](Group (&buf)[M][U], int first) {
#pragma unroll
        for (int m = 0; m < M; m++) {
#pragma unroll
            for (int u = 0; u < U; u++) {
                if (first + u < g1) {
                    buf[m][u] = L::load(base[m] + int64_t(first + u) * L::bytes, lane);
                }
            }
        }
    };
    load(cur, g0);  // weights: no kernel before this one writes them
    LUCEPY_PDL_SYNC();
    float acc[M][2] = {};
    for (int grp = g0; grp < g1; grp += U) {
        load(nxt, grp + U);
        typename L::Factors f[M][U];  // each group's factors from its super-block
#pragma unroll
        for (int m = 0; m < M; m++) {
            L::factors(cur[m], t, f[m]);
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            if (grp + u < g1) {
                const int piece = 4 * (grp + u) + t;
                const int4 * xp = reinterpret_cast<const int4 *>(a.xq) + 2 * piece;
                const int4 xlo = __ldg(xp);
                const int4 xhi = __ldg(xp + 1);
                const float2 ds = __ldg(a.xds + piece);
                const int xl[4] = {xlo.x, xlo.y, xlo.z, xlo.w};
                const int xh[4] = {xhi.x, xhi.y, xhi.z, xhi.w};
#pragma unroll
                for (int m = 0; m < M; m++) {
                    L::dot(cur[m][u], f[m][u], xl, xh, ds, acc[m][0], acc[m][1]);
                }
            }
        }
#pragma unroll
        for (int m = 0; m < M; m++) {
#pragma unroll
            for (int u = 0; u < U; u++) {
                cur[m][u] = nxt[m][u];
            }
        }
    }
#pragma unroll
    for (int m = 0; m < M; m++) {
#pragma unroll
        for (int off = 1; off < 4; off <<= 1) {  // the quad's 4 pieces
            acc[m][0] += __shfl_xor_sync(0xFFFFFFFFu, acc[m][0], off);
            acc[m][1] += __shfl_xor_sync(0xFFFFFFFFu, acc[m][1], off);
        }
    }
    LUCEPY_PDL_LAUNCH();
    __shared__ float sums[M][WARPS][16];
    if (t == 0) {
#pragma unroll
        for (int m = 0; m < M; m++) {
            sums[m][warp][lane / 4] = acc[m][0];
            sums[m][warp][lane / 4 + 8] = acc[m][1];
        }
    }
    __syncthreads();
    if (part == 0 && lane < 16 && tile < a.nrows / RP_ROWS) {
        const int row = tile * RP_ROWS + lane;
        float v[M] = {};
#pragma unroll
        for (int m = 0; m < M; m++) {
#pragma unroll
            for (int p = 0; p < SPLIT; p++) {
                v[m] += sums[m][warp + p][lane];
            }
        }
        float out = v[0] + (a.x_bias ? a.x_bias[row] : 0.0f);
        if constexpr (GATE) {
            out = glu(a.glu_op, out, v[1] + (a.gate_bias ? a.gate_bias[row] : 0.0f));
        }
        a.dst[row] = out;
    }
}

}  // namespace lucepy
