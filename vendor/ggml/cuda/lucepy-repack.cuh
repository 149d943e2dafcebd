// Kernels for every column count on lucepy-layouts.cuh's repacked layouts: one (gemv_r), 2-16
// (gemm_r, gemm_rb), a prefill's (to_halves_col, gemm_rq), each written once for every layout
// (RpQ4_0, RpQ4_K, RpQ5_K, RpQ6_K: what a layout makes different). lucepy-mm.cu takes the
// products of matrices that lucepy_cuda_repack rewrote (LUCEPY_CUDA_REPACK=1: docs/architecture.md,
// decision 12); bench-kernels.cu times and checks them alone.
#pragma once

#include "lucepy-layouts.cuh"

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
// together, so that a plan and a launch of it cannot take another build's (lucepy-mm.cu,
// bench-kernels.cu)
template <int NT, int W = GM_WARPS, int MINB = 16 / W, int XCH = gemm_r_xch(NT), class L = RpQ4_0>
struct GemmR {
    static constexpr int warps = W;
    static constexpr double start = 0.35;  // a CTA's start, in chunks (gemm_parts_by_cost)
    static constexpr int smem = gemm_r_smem<NT, XCH>();
    static auto kernel() { return gemm_r<NT, W, MINB, XCH, 0, L>; }
};

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

// --- a prefill's columns: one activation scale a column ---------------------------------------
//
// to_halves' layout with one power-of-two scale for the whole column (its largest to [2^14,
// 2^15)), so that a product's sums need no rescaling along the row: 1 / scale at xinv[column].
__global__ void __launch_bounds__(256) to_halves_col(const float * x, int64_t col_stride,
                                                     int npieces, Halves out) {
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
