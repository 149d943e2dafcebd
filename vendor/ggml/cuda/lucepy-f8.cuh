// lucepy's own kernels (issue 19, decision 12): a repacked Q4_0 or Q4_K matrix times 9-16 columns
// on Hopper's FP8 warpgroup mma (`gemm_f8`), where `gemm_rb` spends most of its compute turning
// each weight into a half (docs/BENCHMARKS.md, sessions 49-50). A Q4_0 nibble byte read as e4m3 is
// n / 512 exactly, so a lane's A registers are its words masked (a lop3 a register); each piece
// (one block: one scale a row) is one k32 step, whose sums are scaled by its rows' scales in f32
// as they land. The activations are two e4m3 terms each (the value, then what the first term
// missed), written by `to_e4m3` or by the kernel before the product; the nibbles' offset (8) comes
// off once a segment by an mma of the rows' scales against the segment's pieces' activation sums.
// The wgmmas need sm_90a code: hooks.patch's lines in ggml-cuda's CMakeLists compile lucepy-mm.cu
// and lucepy-repacked.cu (which launches these) for sm_90a too where the build makes sm_90 code
// (the driver runs it on a GPU of compute capability 9.0) and define LUCEPY_F8 for their host
// side; `f8_compiled` asks the device.
#pragma once

#include "lucepy-bulk.cuh"  // the layouts, the bulk copies' mbarriers, store_tile; (through
                            // lucepy-gemm.cuh, lucepy-records.cuh) the e4m3 records

#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace lucepy {

// x [ncols][col_stride] f32 (ncols <= 16: the rest zeros) as the records at `out` (f8_at): a CTA
// a segment of a column, grid (segments, 16), TH_THREADS threads (a thread a group of a piece)
static __global__ void __launch_bounds__(TH_THREADS)
    to_e4m3(const float * x, int64_t col_stride, int npieces, int ncols, Halves out) {
    LUCEPY_PDL_LAUNCH();
    LUCEPY_PDL_SYNC();  // x: the kernel before has finished
    const int seg = blockIdx.x;
    const int c = blockIdx.y;
    const int piece = seg * GM_SEG + threadIdx.x / 4;
    const int t = threadIdx.x % 4;
    float v[8];
    const float scale = f8_scale(
        segment_amax<1, TH_WARPS>(segment_group(x, col_stride, npieces, ncols, piece, v)));
    if (threadIdx.x == 0) {
        out.xinv[f8_scale_at(c, seg)] = 512.0f / scale;
    }
    if (piece >= npieces) {
        return;
    }
    uint8_t * xe = reinterpret_cast<uint8_t *>(out.xh);
    float sum = f8_group(v, scale, xe, piece, c, t);
    sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 1);
    sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 2);
    if (t == 0) {
        f8_offset(sum, const_cast<__half *>(f8_offsets(out.xinv, npieces)), piece, c, seg);
    }
}

// --- Hopper's warpgroup mma ------------------------------------------------------------------

// 1 where this build runs sm_90a code (the wgmmas below), else 0
static __global__ void f8_compiled(int * out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    out[0] = 1;
#else
    out[0] = 0;
#endif
}

// d (+)= A (registers: a lane's e4m3 of 64 rows x 32) times B (16 columns at descriptor `desc`)
template <bool ACC>
__device__ __forceinline__ void wgmma_e4m3(float (&d)[8], const uint32_t (&a)[4], uint64_t desc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {%0,%1,%2,%3,%4,%5,%6,%7}, "
        "{%8,%9,%10,%11}, %12, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(int(ACC)));
#endif
}

__device__ __forceinline__ void wgmma_fence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void wgmma_commit() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

template <int N> __device__ __forceinline__ void wgmma_wait() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}

// registers an async wgmma writes, held where they are up to here
template <int N> __device__ __forceinline__ void pin_floats(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; i++) {
        asm volatile("" : "+f"(r[i])::"memory");
    }
}

// mbar_copy where `on`, without a branch (a branch between wgmmas makes ptxas serialize them all)
__device__ __forceinline__ void mbar_copy_if(bool on, uint32_t bar, uint32_t dst, const void * src,
                                             uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %4, 0;\n"
        "@p mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %3;\n"
        "@p cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%1], [%2], %3, "
        "[%0];\n}\n" ::"r"(bar),
        "r"(dst), "l"(src), "r"(bytes), "r"(int(on))
        : "memory");
#endif
}

// --- the product ------------------------------------------------------------------------------
//
// A CTA is one warpgroup of 64 rows (its warps' tiles of 16 rows, as gemm_rb's) and a part's
// chunks. Each warp's weights of a chunk and the CTA's activation record of it come by the TMA
// unit into ST stages. Lane (g, t) takes word t of each of a chunk's 8 pieces of rows g and g + 8
// by `ldmatrix` (matrix m the piece, from the turned layout: no bank conflicts), masks its low
// and high nibbles into the A registers of a piece's k32 step, and two wgmmas a piece (the
// activations' two terms) sum into S accumulator sets in turn; each piece's sums, once landed,
// are scaled by its rows' scales into the segment's f32 sums. At the segment's end the offsets
// come off (an m16n8k16 mma a tile and term of the rows' scales, A, against the pieces' sums, B)
// and the segment's sums are scaled back by 512 / scale into the total. 16 columns.
constexpr int F8_STAGES = 2;
constexpr int F8_INFLIGHT = 2;  // pieces' wgmmas in flight (4: spilled, 15-25 % slower)

template <int ST = F8_STAGES> __host__ __device__ constexpr int gemm_f8_smem() {
    return ST * (F8_CHUNK + 4 * 2 * RP_BYTES) + 5 * ST * 8;
}

// Its parts in a cluster (launch_in_parts with `paired`: the CTAs of a row tile's parts one
// cluster along y, at most F8_PAIR_MOST): each CTA past the first sends its sums (4 KB: 8 floats
// a thread) into the first's shared memory, after its stages, by st.async completing on the
// first's mbarrier there; the first adds them in part order to its own (gemm_sum's sums, bit for
// bit) and stores the tile with its residual: no parts written, no gemm_sum launched.
constexpr int F8_PAIR_MOST = 2;
constexpr int F8_PAIR_SUMS = GM_WARPS * 32 * 8 * 4;  // a CTA's sums, bytes

template <int ST = F8_STAGES> __host__ __device__ constexpr int gemm_f8_pair_bar() {
    return (gemm_f8_smem<ST>() + 15) / 16 * 16;  // the mbarrier (16 bytes kept), then the sums
}

template <int ST = F8_STAGES> __host__ __device__ constexpr int gemm_f8_pair_smem(int parts) {
    return gemm_f8_pair_bar<ST>() + 16 + (parts - 1) * F8_PAIR_SUMS;
}

static_assert(gemm_f8_pair_smem(F8_PAIR_MOST) <= 48 * 1024, "no limit to raise for the pairs");

// A tail part's sums (this thread's 8, `total`) to its tile's: true in the tile's last part to
// finish, `total` then all parts' sums added in part order (as gemm_sum adds parts), the tile's
// count back to 0 for the next launch; false in the others (their sums written, nothing more to
// do). No CTA waits for another: the parts need not be resident at once. `last` is a word of
// shared memory nothing else uses meanwhile (gemm_f8's is in its stages, free by then; with a
// static __shared__ word, which the dynamic shared memory then starts after, every gemm_f8 took
// a third longer: the Q4_0 FFN stack 50.4 us where 33.6, docs/BENCHMARKS.md session 57).
__device__ __forceinline__ bool tail_sum(const F8Tail & tail, int u, int part, float (&total)[8],
                                         volatile int & last) {
    const int64_t stride = int64_t(blockDim.x) * 8;  // a part's sums
    float * sums = tail.sums + int64_t(u) * tail.parts * stride + threadIdx.x * 8;
    float4 * mine = reinterpret_cast<float4 *>(sums + part * stride);
    mine[0] = make_float4(total[0], total[1], total[2], total[3]);
    mine[1] = make_float4(total[4], total[5], total[6], total[7]);
    __threadfence();
    __syncthreads();  // every thread's sums are visible on the device before the count moves
    if (threadIdx.x == 0) {
        last = int(atomicAdd(tail.count + u, 1u) == unsigned(tail.parts - 1));
    }
    __syncthreads();
    if (!last) {
        return false;
    }
    __threadfence();
    float sum[8] = {};
    for (int p = 0; p < tail.parts; p++) {
        float v[8];
        if (p == part) {
#pragma unroll
            for (int i = 0; i < 8; i++) {
                v[i] = total[i];
            }
        } else {  // (from L2: another SM wrote them)
            const float4 * at = reinterpret_cast<const float4 *>(sums + p * stride);
            const float4 lo = __ldcg(at), hi = __ldcg(at + 1);
            const float w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
            for (int i = 0; i < 8; i++) {
                v[i] = w[i];
            }
        }
#pragma unroll
        for (int i = 0; i < 8; i++) {
            sum[i] += v[i];
        }
    }
#pragma unroll
    for (int i = 0; i < 8; i++) {
        total[i] = sum[i];
    }
    if (threadIdx.x == 0) {
        tail.count[u] = 0;
    }
    return true;
}

// GLU (an FFN's gate and up as one product, `a.w` the gate's rows and `a.w2` the up's, a.rows2
// each, in one part): CTA b's warps 0 and 1 take the gate's rows 32 b .. 32 b + 31 and warps 2
// and 3 the up's same rows, and the CTA writes SWIGLU of them (silu(gate) times up, ggml's
// formula, as glu_halves computes it from the same sums) into a.dst, [column][a.dst_stride],
// where a.rows2 / 32 CTAs of 64 rows of the stack would write both products for glu_halves
// to read (lucepy-repacked.cu's glu_pair_nodes, `f8_glu`).
template <int ST = F8_STAGES, int MINB = 5, int S = F8_INFLIGHT, class L = RpQ4_0,
          bool GLU = false>
__global__ void __launch_bounds__(128, MINB) gemm_f8(const GemmArgs a) {
    // Q4_K: the nibbles unsigned (q / 512), each piece's scale s = round(d sc) from the lane's
    // words and the super-block's record (rk_group), and its min's term off by the offsets' mma
    // with m = round(dmin m) / 8 in the place of Q4_0's d (the records' offsets are the pieces'
    // sums times -8 / 512)
    constexpr bool K = std::is_same_v<L, RpQ4_K>;
    static_assert(K || std::is_same_v<L, RpQ4_0>, "gemm_f8 reads Q4_0's and Q4_K's layouts");
    constexpr int WB = 2 * RP_BYTES;  // a warp's weights of a chunk
    constexpr int W_STAGE = 4 * WB;
    extern __shared__ __align__(16) uint8_t smem[];
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int g = lane / 4;
    const int t = lane % 4;
    // this CTA's row tile and part (a.tail's: the CTAs from a.tail.from on, a.tail.parts a tile)
    const bool tailed = a.tail.parts > 0 && int(blockIdx.x) >= a.tail.from;
    const int tail_at = int(blockIdx.x) - a.tail.from;  // (tailed: its part of the tail)
    const int tile = tailed ? a.tail.from + tail_at / a.tail.parts : int(blockIdx.x);
    const int part = tailed ? tail_at % a.tail.parts : int(blockIdx.y);
    const int per_part = tailed ? a.tail.chunks : a.per_part;
    const int row0 = tile * 64;
    // GLU: this warp's first row of the stack (the gate's, or the up's after a.rows2)
    const int glu_row = (warp >= 2 ? a.rows2 : 0) + 32 * tile + 16 * (warp % 2);
    const int chunk0 = part * per_part;
    const int nchunks = max(0, min(per_part, a.npieces / 8 - chunk0));
    const bool mine = GLU || row0 + warp * 16 < a.nrows;
    const uint32_t x_at = shared_at(smem);
    const uint32_t w_dst = x_at + ST * F8_CHUNK + warp * WB;
    const uint32_t bars = x_at + ST * (F8_CHUNK + W_STAGE);
    const uint32_t wbar = bars + warp * ST * 8, xbar = bars + 4 * ST * 8;
    const int ngroups = a.npieces / RP_GROUP;
    const uint8_t * w_src =
        GLU ? warp_tile_at(a, glu_row, 0, chunk0, ngroups)
            : warp_tile_at(a, mine ? row0 : 0, mine ? warp : 0, chunk0, ngroups);
    const uint8_t * x_src = reinterpret_cast<const uint8_t *>(a.x.xh) + int64_t(chunk0) * F8_CHUNK;
    // the chunk after the stages' first: its weights and records, advanced a chunk each fetch
    const uint8_t * w_next = w_src + int64_t(ST) * WB;
    const uint8_t * x_next = x_src + int64_t(ST) * F8_CHUNK;
    auto fetch = [&](int ch) {
        const bool here = ch < nchunks;
        mbar_copy_if(here && lane == 0, wbar + 8 * (ch % ST), w_dst + (ch % ST) * W_STAGE, w_next,
                     WB);
        mbar_copy_if(here && threadIdx.x == 0, xbar + 8 * (ch % ST), x_at + (ch % ST) * F8_CHUNK,
                     x_next, F8_CHUNK);
        w_next += WB;
        x_next += F8_CHUNK;
    };
    const int ranks = int(cluster_ctas());  // the row tile's parts in a cluster, or 1
    const uint32_t pair_bar = x_at + gemm_f8_pair_bar<ST>();
    if (lane == 0) {
#pragma unroll
        for (int s = 0; s < ST; s++) {
            mbar_init(wbar + 8 * s, 1);
            if (warp == 0) {
                mbar_init(xbar + 8 * s, 1);
            }
        }
        if (ranks > 1 && threadIdx.x == 0 && cluster_rank() == 0) {
            mbar_init(pair_bar, 1);
            mbar_expect(pair_bar, uint32_t(ranks - 1) * F8_PAIR_SUMS);
        }
        mbar_init_fence();
    }
    __syncthreads();
    if (ranks > 1) {
        cluster_arrive_relaxed();  // (waited for at the end: the first's mbarrier is ready)
    }
    // the weights first (no kernel before this one writes them), the activations after the wait
#pragma unroll
    for (int c = 0; c < ST; c++) {
        mbar_copy_if(c < nchunks && lane == 0, wbar + 8 * c, w_dst + c * W_STAGE,
                     w_src + int64_t(c) * WB, WB);
    }
    LUCEPY_PDL_SYNC();  // the activations: the kernel before has finished
#pragma unroll
    for (int c = 0; c < ST; c++) {
        mbar_copy_if(c < nchunks && threadIdx.x == 0, xbar + 8 * c, x_at + c * F8_CHUNK,
                     x_src + int64_t(c) * F8_CHUNK, F8_CHUNK);
    }
    // B's descriptor: no swizzle, core matrices 128 bytes apart along k, 256 along n
    const uint64_t desc0 = (uint64_t(128 >> 4) << 16) | (uint64_t(256 >> 4) << 32);
    const __half * xo = f8_offsets(a.x.xinv, a.npieces);
    // this lane's ldmatrix row: matrix m = lane / 8 (piece m of a group), row lane % 8 (turned)
    const int lr = lane % 8;
    const uint32_t w_ldm = w_dst + 64 * lr + 16 * rp_turn(lr, lane / 8);
    float D[S][8];
    uint32_t A[S][4];
    float acc[8] = {};
    float total[8] = {};
    // piece q's sums (landed) times its rows' scales into the segment's (Q4_K: lane (g, q % 4)
    // holds them)
    auto finish = [&](int q, const uint4 (&dq)[2], const uint32_t (&ds)[2]) {
        pin_floats(D[q % S]);
        const uint32_t dw = K ? __shfl_sync(0xFFFFFFFFu, ds[q / 4], (lane & ~3) | (q % 4))
                              : word(dq[q / 4], q % 4);
        const float2 d = __half22float2(as_h2(dw));
#pragma unroll
        for (int i = 0; i < 8; i++) {
            acc[i] = fmaf(D[q % S][i], i % 4 < 2 ? d.x : d.y, acc[i]);
        }
    };
    uint32_t sa[4] = {0, 0, 0, 0};  // the segment's scales as the offsets' mma A registers
    uint2 xb[4];                     // and its offsets as their B registers (tile, term)
    for (int ch = 0; ch < nchunks; ch++) {
        const int s = ch % ST;
        mbar_wait(wbar + 8 * s, uint32_t(ch / ST) & 1u);
        mbar_wait(xbar + 8 * s, uint32_t(ch / ST) & 1u);
        const uint32_t xs = x_at + s * F8_CHUNK;
        // this stage's first piece's B; piece q's two terms are 1024 q and 1024 q + 512 bytes on,
        // an add to the start address field (shared address / 16, 14 bits: under 228 KB it
        // never carries), worked out once here where each descriptor cost 4-5 uniform
        // instructions (the Q4_0 stack 1.2 us faster, Q4_K's 2.6: docs/BENCHMARKS.md, session 53).
        // The address's low 18 bits only: launched in clusters (paired parts) a CTA's shared
        // addresses hold its rank from bit 24, which would land in the next field (session 56's
        // first paired products were wrong in the second CTA of each pair).
        const uint64_t desc_s = desc0 | ((xs & 0x3FFFFu) >> 4);
        uint32_t qa[2][4], qb[2][4];
        uint4 dq[2];
        uint32_t ds[2] = {0, 0};  // Q4_K: (s of row g, of row g + 8) of this lane's pieces t, 4 + t
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const uint32_t ra = w_ldm + s * W_STAGE + j * RP_BYTES;
            ldmatrix4<false>(qa[j], ra);
            ldmatrix4<false>(qb[j], ra + 512);
            if constexpr (!K) {
                dq[j] = load_shared(w_dst + s * W_STAGE + j * RP_BYTES + 1024 + 16 * g);
            }
        }
        {  // pieces t and 4 + t of this chunk's scales, rows g and g + 8: the offsets' A
            uint32_t d0 = load_shared_word(w_dst + s * W_STAGE + 1024 + 4 * lane);
            uint32_t d1 = load_shared_word(w_dst + s * W_STAGE + RP_BYTES + 1024 + 4 * lane);
            if constexpr (K) {  // (a chunk is a super-block: its two groups' words its record)
                uint32_t dd, mm;
                rk_record(d0, d1, t, dd, mm);
                uint32_t w[2] = {d0, d1};
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    uint32_t sg, sg8, mg, mg8;  // (s, s) and (-m, -m) of rows g and g + 8
                    rk_group(w[j], dd, mm, sg, sg8, mg, mg8);
                    ds[j] = __byte_perm(sg, sg8, 0x5410);
                    w[j] = as_u32(__hmul2(as_h2(__byte_perm(mg, mg8, 0x5410)),
                                          as_h2(0xB000B000u)));  // times -1/8: m / 8
                }
                d0 = w[0];
                d1 = w[1];
            }
            const int hs = (chunk0 + ch) & 1;  // the segment's second chunk: k 8 + 2t
            // (selected, not indexed by hs: an index known only at run time put sa in local
            // memory, a store a chunk and a load a segment)
            const uint32_t s_lo = __byte_perm(d0, d1, 0x5410), s_hi = __byte_perm(d0, d1, 0x7632);
            sa[0] = hs ? sa[0] : s_lo;
            sa[1] = hs ? sa[1] : s_hi;
            sa[2] = hs ? s_lo : sa[2];
            sa[3] = hs ? s_hi : sa[3];
            if (hs == 0 || ch == 0) {  // the segment's offsets, loaded well ahead
                const int seg = (chunk0 + ch) / 2;
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    const int64_t at = (int64_t(seg) * 4 + q) * 32 + lane;
                    xb[q] = __ldg(reinterpret_cast<const uint2 *>(xo) + at);
                }
            }
        }
#pragma unroll
        for (int q = 0; q < 8; q++) {
            if (q >= S) {
                wgmma_wait<S - 1>();
                finish(q - S, dq, ds);
            }
            const uint32_t wa = qa[q / 4][q % 4], wr = qb[q / 4][q % 4];
            A[q % S][0] = wa & 0x0F0F0F0Fu;
            A[q % S][1] = wr & 0x0F0F0F0Fu;
            A[q % S][2] = (wa >> 4) & 0x0F0F0F0Fu;
            A[q % S][3] = (wr >> 4) & 0x0F0F0F0Fu;
            const uint64_t d_hi = desc_s + q * 64;
            const uint64_t d_lo = desc_s + q * 64 + 32;
            wgmma_fence();
            wgmma_e4m3<false>(D[q % S], A[q % S], d_hi);
            wgmma_e4m3<true>(D[q % S], A[q % S], d_lo);
            wgmma_commit();
        }
        wgmma_wait<0>();
#pragma unroll
        for (int q = 8 - S; q < 8; q++) {
            finish(q, dq, ds);
        }
        async_proxy_fence();
        __syncthreads();  // every warp has read this stage: the next chunk may land there
        fetch(ch + ST);
        if (ch + 1 == nchunks || ((chunk0 + ch) & 1)) {  // the segment's end
            const int seg = (chunk0 + ch) / 2;
#pragma unroll
            for (int nt = 0; nt < 2; nt++) {
                float c4[4] = {acc[4 * nt], acc[4 * nt + 1], acc[4 * nt + 2], acc[4 * nt + 3]};
#pragma unroll
                for (int term = 0; term < 2; term++) {
                    mma_16816(c4, sa, xb[nt * 2 + term].x, xb[nt * 2 + term].y);
                }
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    acc[4 * nt + j] = c4[j];
                }
            }
#pragma unroll
            for (int j = 0; j < 4; j++) {
                sa[j] = 0;
            }
            // columns 2t, 2t + 1 (tile 0) and 8 + 2t, 9 + 2t (tile 1)
            const float * xi = a.x.xinv + f8_scale_at(2 * t, seg);
            const float2 inv[2] = {__ldg(reinterpret_cast<const float2 *>(xi)),
                                   __ldg(reinterpret_cast<const float2 *>(xi + GM_COL_TILE))};
#pragma unroll
            for (int i = 0; i < 8; i++) {
                total[i] += acc[i] * (i % 2 ? inv[i / 4].y : inv[i / 4].x);
                acc[i] = 0.0f;
            }
        }
    }
    LUCEPY_PDL_LAUNCH();
    // (the tail's flag in the stages, past the GLU's sums of the up below)
    if (tailed && !tail_sum(a.tail, tail_at / a.tail.parts, part, total,
                            *reinterpret_cast<int *>(smem + F8_CHUNK))) {
        return;  // (another part of the tile adds them)
    }
    if constexpr (GLU) {  // the up's sums to the gate's warps, through the (free) stages
        // (the last chunk's barrier passed: every warp's wgmmas have read their stages)
        float * ups = reinterpret_cast<float *>(smem);  // [warp % 2][lane][8]
        if (warp >= 2) {
#pragma unroll
            for (int i = 0; i < 8; i++) {
                ups[((warp - 2) * 32 + lane) * 8 + i] = total[i];
            }
        }
        __syncthreads();
        if (warp >= 2) {
            return;
        }
        float v[2][4];
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const float x = total[i];
            const float y = ups[(warp * 32 + lane) * 8 + i];
            v[i / 4][i % 4] = swiglu(x, y);
        }
        store_tile<2>(a, v, 32 * tile + 16 * warp, g, t, false);
        return;
    }
    if (ranks > 1) {
        cluster_wait();
        const int rank = int(cluster_rank());
        const uint32_t sums = pair_bar + 16 + threadIdx.x * 32;  // this thread's, of a part
        if (rank > 0) {
            const uint32_t at = sums + (rank - 1) * F8_PAIR_SUMS;
            cluster_send4(at, pair_bar, 0, total);
            cluster_send4(at + 16, pair_bar, 0, total + 4);
            return;
        }
        mbar_wait<true>(pair_bar, 0);  // every other part's sums have landed here
        for (int r = 1; r < ranks; r++) {
            const uint4 lo = load_shared(sums + (r - 1) * F8_PAIR_SUMS);
            const uint4 hi = load_shared(sums + (r - 1) * F8_PAIR_SUMS + 16);
            const uint32_t u[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
            for (int i = 0; i < 8; i++) {
                total[i] += __uint_as_float(u[i]);
            }
        }
    }
    if (mine) {
        float tot[2][4];
#pragma unroll
        for (int i = 0; i < 8; i++) {
            tot[i / 4][i % 4] = total[i];
        }
        store_tile<2>(a, tot, row0 + warp * 16, g, t, ranks == 1 && gridDim.y > 1);
    }
}

// gemm_f8's build at MINB CTAs an SM on layout L, as GemmRB names gemm_rb's
template <int MINB = 5, class L = RpQ4_0> struct GemmF8 {
    static constexpr int warps = GM_WARPS;
    // a CTA's start, in chunks (gemm_parts_by_cost), as fitted on the H200 (docs/BENCHMARKS.md,
    // session 54): the 27B-shaped DeltaNet inputs at 16 columns took 19.8 us in 2 parts, 22.1 in
    // the 5 that gemm_r's 0.35 picks (two waves of CTAs: each CTA's barriers and descriptors,
    // and its first stages' wait, twice on a slot)
    static constexpr double start = 2.0;
    static constexpr int minb = MINB;
    static constexpr int smem = gemm_f8_smem<F8_STAGES>();
    static auto kernel() { return gemm_f8<F8_STAGES, MINB, F8_INFLIGHT, L>; }
    static auto glu_kernel() { return gemm_f8<F8_STAGES, MINB, F8_INFLIGHT, L, true>; }
};

// whether build R is one of gemm_f8's (GemmF8)
template <class R> struct is_f8_build : std::false_type {};
template <int MINB, class L> struct is_f8_build<GemmF8<MINB, L>> : std::true_type {};

}  // namespace lucepy
