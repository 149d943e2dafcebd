// Kernels for every column count on lucepy-layouts.cuh's repacked layouts: one (gemv_r), 2-16
// (gemm_r here, gemm_rb), a prefill's (to_halves_col, gemm_rq), each written once for every layout
// (RpQ4_0, RpQ4_K, RpQ5_K, RpQ6_K: what a layout makes different). lucepy-repacked.cu takes the
// products of matrices that lucepy_cuda_repack rewrote (LUCEPY_CUDA_REPACK=1: docs/architecture.md,
// decision 12); bench-kernels.cu times and checks them alone. The kernels whose weights the TMA
// unit fetches (gemm_rb, gemv_r) are lucepy-bulk.cuh's, a prefill's lucepy-prefill.cuh's; each
// includes the one before it.
#pragma once

#include "lucepy-walks.cuh"  // (and the layouts it includes)

#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>  // integral_constant
#include <utility>      // integer_sequence

namespace lucepy {

// --- what the kernels below share: their activations' stages, mmas, timelines -------------------

// f(integral_constant<int, i>) for i = 0 .. N - 1, in turn
template <typename F, int... I>
__device__ __forceinline__ void each_index_of(F & f, std::integer_sequence<int, I...>) {
    (f(std::integral_constant<int, I>()), ...);
}

template <int N, typename F> __device__ __forceinline__ void each_index(F && f) {
    each_index_of(f, std::make_integer_sequence<int, N>());
}

// gemm_r's chunks of activations a stage and a barrier: 2 at 9-16 columns (alone on the H200
// 2-5 % faster at 16 on five of six of the 27B-shaped model's products, the same on the FFN's
// stacked up and gate), 1 at 2-8 (there two made the stacked up and gate 8 % slower) and in
// the passes of more columns (not measured).
__host__ __device__ constexpr int gemm_r_xch(int nt) {
    return nt == 2 ? 2 : 1;
}

// A CTA's timeline (RP_STAMPS), RP_STAMP_WORDS words at a.stamps + RP_STAMP_WORDS x its linear
// index: the SM, the global timer (ns) at its start and end, and its SM's clock at its start,
// after its first barrier, at the start of each of its first RP_STAMP_CHUNKS chunks, after its
// last chunk and at its end.
enum RpStamp : int {
    RP_AT_SM = 0,
    RP_AT_START_NS = 1,
    RP_AT_START = 2,
    RP_AT_FIRST_BARRIER = 3,
    RP_AT_CHUNK = 4,  // + chunk
    RP_STAMP_CHUNKS = 8,
    RP_AT_LOOP_END = RP_AT_CHUNK + RP_STAMP_CHUNKS,
    RP_AT_END = RP_AT_LOOP_END + 1,
    RP_AT_END_NS = RP_AT_END + 1,
    RP_STAMP_WORDS = 16
};

__device__ __forceinline__ uint64_t global_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// with RP_STAMPS, thread 0 of the CTA writes `value` as its word `what`
template <int SKIP>
__device__ __forceinline__ void stamp(const GemmArgs & a, int what, uint64_t value) {
    if constexpr (SKIP & RP_STAMPS) {
        if (threadIdx.x == 0) {
            const uint64_t at = uint64_t(blockIdx.y) * gridDim.x + blockIdx.x;
            a.stamps[at * RP_STAMP_WORDS + what] = value;
        }
    }
}

// the same with the SM's clock (read only where stamps are on)
template <int SKIP> __device__ __forceinline__ void stamp_clock(const GemmArgs & a, int what) {
    if constexpr (SKIP & RP_STAMPS) {
        stamp<SKIP>(a, what, uint64_t(clock64()));
    }
}

// with RP_STAMPS, a CTA's first stamps: its SM, the global timer and its SM's clock
template <int SKIP> __device__ __forceinline__ void stamp_start(const GemmArgs & a) {
    if constexpr (SKIP & RP_STAMPS) {
        uint32_t sm;
        asm("mov.u32 %0, %%smid;" : "=r"(sm));
        stamp<SKIP>(a, RP_AT_SM, sm);
        stamp<SKIP>(a, RP_AT_START_NS, global_ns());
        stamp_clock<SKIP>(a, RP_AT_START);
    }
}

// with RP_STAMPS, a CTA's last stamps, once every warp has stored its tile (the whole CTA calls it)
template <int SKIP> __device__ __forceinline__ void stamp_end(const GemmArgs & a) {
    if constexpr (SKIP & RP_STAMPS) {
        __syncthreads();
        stamp_clock<SKIP>(a, RP_AT_END);
        stamp<SKIP>(a, RP_AT_END_NS, global_ns());
    }
}

// a word's two mmas into a column tile's two chains (or, left out, its registers kept alive)
template <int SKIP>
__device__ __forceinline__ void word_mmas(float (&acc)[4], float (&acc2)[4],
                                          const uint32_t (&lo)[4], const uint32_t (&hi)[4],
                                          const uint4 & x) {
    if constexpr (SKIP & RP_MMA) {
        asm volatile("" ::"r"(x.x), "r"(x.y), "r"(x.z), "r"(x.w), "r"(lo[0]), "r"(lo[1]),
                     "r"(lo[2]), "r"(lo[3]), "r"(hi[0]), "r"(hi[1]), "r"(hi[2]), "r"(hi[3]));
    } else {
        mma_16816(acc, lo, x.x, x.y);
        mma_16816(acc2, hi, x.z, x.w);
    }
}

// a column's chunk of activations in gemm_r's and gemm_rb's shared memory: 8 pieces of 64 bytes
// and 32 bytes more (so that the 8 lanes of each quarter of a warp's loads read 8 bank groups)
constexpr int RP_X_PITCH = 8 * 64 + 32;

// A thread's share of copying a chunk of NT tiles of columns' activations (to_halves' halves)
// into a stage of shared memory, as gemm_r and gemm_rb read them: group w of piece i of a column
// at 16 (w ^ (i / 2 % 2)), columns RP_X_PITCH bytes apart. Thread i copies the 16-byte group u =
// i % XN of columns i / XN, i / XN + CSTEP, ... from one source and one destination (k column
// steps apart), which keeps gemm_r at 5 CTAs an SM unspilled (session 37).
template <int NT, int THREADS> struct ActCopy {
    static constexpr int XN = 8 * 4;  // 16-byte groups of a column's chunk
    static constexpr int XC = NT * GM_COL_TILE * XN / THREADS;
    static constexpr int CSTEP = THREADS / XN;
    static_assert(THREADS % XN == 0 && XC * CSTEP == NT * GM_COL_TILE, "whole columns a pass");
    const uint4 * src;  // this thread's first group of the part's first chunk
    int dst;

    __device__ __forceinline__ ActCopy(const GemmArgs & a, int chunk0) {
        const int u = threadIdx.x % XN;
        const int col = threadIdx.x / XN;
        const int piece = u / 4;
        src = a.x.xh + (int64_t(col) * a.npieces + int64_t(chunk0) * 8) * 4 + u;
        dst = col * RP_X_PITCH + 64 * piece + 16 * ((u % 4) ^ (piece / 2 % 2));
    }

    // chunk ch of the part into `stage`
    __device__ __forceinline__ void issue(uint8_t * stage, int npieces, int ch) const {
#pragma unroll
        for (int k = 0; k < XC; k++) {
            copy_async<16, true>(stage + dst + k * CSTEP * RP_X_PITCH,
                                 reinterpret_cast<const uint8_t *>(
                                     src + int64_t(k) * CSTEP * npieces * 4 + int64_t(ch) * XN));
        }
    }
};

// the shared addresses of word w of lane (g, t)'s piece of column g in stage 0 of ActCopy's
// layout (kept in registers of their own: opaque)
__device__ __forceinline__ void activation_lanes(const uint8_t * smem, int g, int t,
                                                 uint32_t (&x_lane)[4]) {
    const int swz = t / 2 % 2;
#pragma unroll
    for (int w = 0; w < 4; w++) {
        x_lane[w] = opaque(shared_at(smem) + g * RP_X_PITCH + t * 64 + 16 * (w ^ swz));
    }
}

// the 1 / scale of this lane's columns in the segment at xi (column 2t's; each column's nsegs
// apart), xi then moved on to the next segment (kept, not worked out each segment)
template <int NT>
__device__ __forceinline__ void next_inv(const float *& xi, int nsegs, float (&inv)[NT][2]) {
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        inv[nt][0] = __ldg(xi + nt * GM_COL_TILE * nsegs);
        inv[nt][1] = __ldg(xi + (nt * GM_COL_TILE + 1) * nsegs);
    }
    xi++;
}

template <int SPLIT> __host__ __device__ constexpr int gemv_r_warps() {
    return SPLIT > 4 ? SPLIT : 4;
}

// --- gemm_r: 2-16 columns, each lane's weights by its own loads --------------------------------
//
// gemm on a repacked Q4_0 or Q4_K matrix (a.w; a.row_stride unused; layout L). Each warp loads its tile's groups
// straight into registers, a chunk (8 pieces) ahead; the CTA shares the activations' chunks in
// shared memory as gemm does. The mma's k order: in each of a group's 8 k-steps (word w, low
// or high nibbles), lane t of a quad holds 4 values of its own piece t, as piece_halves gives
// lane w of a quad; the activations' halves (to_halves' order) are read to match: group w of
// piece t. Stored in a column's chunk with group w of piece i at 16 (w ^ (i / 2 % 2)) and a
// column pitch of 34 16-byte units, so that the 8 lanes of each quarter of a warp's 16-byte
// loads read 8 different bank groups.
//
// XCH chunks of activations a stage, and a barrier: gemm_r_xch's (docs/BENCHMARKS.md, session 34).
// SKIP: RpSkip's parts left out.
template <int NT, int W = GM_WARPS, int MINB = 16 / W, int XCH = gemm_r_xch(NT), int SKIP = 0,
          class L = RpQ4_0>
__global__ void __launch_bounds__(W * 32, MINB) gemm_r(const GemmArgs a) {
    static_assert(L::gemm_r, "gemm_r reads Q4_0's and Q4_K's layouts");
    constexpr bool RK = std::is_same_v<L, RpQ4_K>;
    static_assert(!RK || SKIP == 0, "Q4_K repacked: nothing left out");
    constexpr int P = 8;   // pieces a chunk: two groups
    static_assert(GM_SEG == 2 * P, "a segment is two chunks");
    constexpr int ST = 2;  // the activations' stages: chunk ch's is ch / XCH % 2
    constexpr int X_STAGE = NT * GM_COL_TILE * RP_X_PITCH;
    extern __shared__ __align__(16) uint8_t smem[];
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int g = lane / 4;
    const int t = lane % 4;
    const int row0 = blockIdx.x * W * 16;
    const int rows = min(W * 16, a.nrows - row0);
    const int nchunks_all = a.npieces / P;
    const int chunk0 = blockIdx.y * a.per_part;
    const int nchunks = max(0, min(a.per_part, nchunks_all - chunk0));
    const bool mine = warp * 16 < rows;
    stamp_start<SKIP>(a);

    const ActCopy<NT, W * 32> x_copy(a, chunk0);
    auto issue_x = [&](int q) {  // stage q's chunks: q XCH on
#pragma unroll
        for (int h = 0; h < XCH; h++) {
            const int ch = q * XCH + h;
            if (ch < nchunks) {
                x_copy.issue(smem + ((q % ST) * XCH + h) * X_STAGE, a.npieces, ch);
            }
        }
        copy_commit();
    };

    const int ngroups = a.npieces / RP_GROUP;
    const uint8_t * wp = warp_tile_at(a, row0, warp, chunk0, ngroups);
    // where this lane's words of the next chunk to load start (kept, not worked out each load)
    const uint4 * wq = reinterpret_cast<const uint4 *>(wp) + rp_slot(lane);
    const uint32_t * wd = reinterpret_cast<const uint32_t *>(wp + 1024) + lane;
    auto load = [&](RpGroup (&buf)[2], int ch) {
        if (mine && ch < nchunks && (!(SKIP & RP_LOADS) || ch < 2)) {
#pragma unroll
            for (int j = 0; j < 2; j++) {
                buf[j] = load_lane(wq + j * RP_U4, wd + j * RP_BYTES / 4);
            }
            wq += 2 * RP_U4;
            wd += 2 * RP_BYTES / 4;
        }
    };

    // this segment's sums of the low nibbles' products, and of the high nibbles' apart: two
    // chains of mmas, each waiting on its own sums, not one (1 % faster alone, session 33)
    float acc[NT][4] = {};
    float acc2[NT][4] = {};
    float total[NT][4] = {};  // and the sums of those before, scaled back
    const int nsegs = segments(a.npieces);
    // the 1 / scale of this lane's first column (2t) in the next segment to flush
    const float * xi = a.x.xinv + halves_scale_at(2 * t, chunk0 / 2, nsegs);
    uint32_t x_lane[4];  // word w of this lane's piece of column g in stage 0
    activation_lanes(smem, g, t, x_lane);

    // chunk ch, the I-th of a round of ST XCH (its activations in stage I / XCH, part I % XCH)
    auto step = [&](const RpGroup (&cur)[2], RpGroup (&nxt)[2], int ch, auto index) {
        constexpr int I = decltype(index)::value;  // its activations at smem + I X_STAGE
        if (ch < RP_STAMP_CHUNKS) {
            stamp_clock<SKIP>(a, RP_AT_CHUNK + ch);
        }
        load(nxt, ch + 1);
        if constexpr (I % XCH == 0) {
            copy_wait<ST - 2>();
            __syncthreads();  // the stage's chunks have landed; the stage before is read by all
            issue_x(ch / XCH + ST - 1);
            if (ch == 0) {
                stamp_clock<SKIP>(a, RP_AT_FIRST_BARRIER);
            }
        }
        if (!mine) {
            return;
        }
        // a segment is two chunks: the sums are scaled back after its odd one, or the last
        const bool flush = ch + 1 == nchunks || ((chunk0 + ch) & 1);
        float inv[NT][2];
        if (flush) {
            next_inv<NT>(xi, nsegs, inv);
        }
        [[maybe_unused]] uint32_t dd = 0, mm = 0;  // Q4_K: the chunk's super-block record
        if constexpr (RK) {
            rk_record(cur[0].d, cur[1].d, t, dd, mm);
        }
#pragma unroll
        for (int j = 0; j < 2; j++) {
            uint32_t da, db;
            [[maybe_unused]] uint32_t ma = 0, mb = 0;
            if constexpr (RK) {
                rk_group(cur[j].d, dd, mm, da, db, ma, mb);
            } else {
                da = __byte_perm(cur[j].d, 0, 0x1010);
                db = __byte_perm(cur[j].d, 0, 0x3232);
            }
#pragma unroll
            for (int w = 0; w < 4; w++) {
                uint32_t a_lo[4], a_hi[4];
                if constexpr (RK) {
                    lane_words_k(word(cur[j].a, w), word(cur[j].b, w), da, db, ma, mb, a_lo, a_hi);
                } else {
                    lane_words<SKIP>(word(cur[j].a, w), word(cur[j].b, w), da, db, a_lo, a_hi);
                }
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    const uint32_t at =
                        x_lane[w] + I * X_STAGE + nt * GM_COL_TILE * RP_X_PITCH + 4 * j * 64;
                    const uint4 x = SKIP & RP_SHARED ? make_uint4(at, j, w, nt) : load_shared(at);
                    word_mmas<SKIP>(acc[nt], acc2[nt], a_lo, a_hi, x);
                }
            }
        }
        if (flush) {  // the segment's sums, unscaled (its two chains added first)
#pragma unroll
            for (int nt = 0; nt < NT; nt++) {
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    acc[nt][j] += acc2[nt][j];
                    acc2[nt][j] = 0.0f;
                }
            }
            flush_segment<NT>(acc, total, inv);
        }
    };

    RpGroup w[2][2];  // chunk ch's weights in w[ch % 2]
    load(w[0], 0);    // weights: no kernel before this one writes them
    LUCEPY_PDL_SYNC();
#pragma unroll
    for (int s = 0; s < ST - 1; s++) {
        issue_x(s);
    }
    for (int ch = 0; ch < nchunks; ch += ST * XCH) {
        each_index<ST * XCH>([&](auto i) {
            constexpr int I = decltype(i)::value;
            if (ch + I < nchunks) {
                step(w[I % 2], w[(I + 1) % 2], ch + I, i);
            }
        });
    }
    copy_wait<0>();
    stamp_clock<SKIP>(a, RP_AT_LOOP_END);

    LUCEPY_PDL_LAUNCH();

    if (mine) {
        store_tile<NT>(a, total, row0 + warp * 16, g, t);
    }
    stamp_end<SKIP>(a);
}

template <int NT, int XCH = gemm_r_xch(NT)> __host__ __device__ constexpr int gemm_r_smem() {
    return 2 * XCH * NT * GM_COL_TILE * RP_X_PITCH;
}

// One build of gemm_r (its template's arguments but SKIP): its kernel and its shared memory named
// together, so that a plan and a launch of it cannot take another build's (lucepy-repacked.cu,
// bench-kernels.cu)
template <int NT, int W = GM_WARPS, int MINB = 16 / W, int XCH = gemm_r_xch(NT), class L = RpQ4_0>
struct GemmR {
    static constexpr int warps = W;
    static constexpr double start = 0.35;  // a CTA's start, in chunks (gemm_parts_by_cost)
    static constexpr int smem = gemm_r_smem<NT, XCH>();
    static auto kernel() { return gemm_r<NT, W, MINB, XCH, 0, L>; }
};

}  // namespace lucepy
