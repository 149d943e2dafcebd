// Q4_0, Q4_K, Q5_K and Q6_K repacked for lucepy's CUDA kernels (repack_q4_0, repack_q4_k,
// repack_q5_k, repack_q6_k), and kernels for every column count on them: one (gemv_r), 2-16
// (gemm_r, gemm_rb), a prefill's (to_halves_col, gemm_rq), each written once for every layout
// (RpQ4_0, RpQ4_K, RpQ5_K, RpQ6_K: what a layout makes different). lucepy-mm.cu takes the
// products of matrices that lucepy_cuda_repack rewrote (LUCEPY_CUDA_REPACK=1: docs/architecture.md,
// decision 12); bench-kernels.cu times and checks them alone.
#pragma once

#include "lucepy-gemm.cuh"  // gemm's activations (to_halves), mma, GemmArgs; Args

#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>  // integral_constant
#include <utility>      // integer_sequence

namespace lucepy {

// --- Q4_0 repacked -----------------------------------------------------------------------------
//
// `gemm` copies each row's 18-byte blocks into shared memory and reads a piece's nibbles and
// scale back as 2-byte halves: about 70 instructions a warp's piece of 16 rows, of which the
// unpacking and the mmas are about 40 (docs/BENCHMARKS.md, session 20). Rearranged once, a
// matrix's bytes load in whole 16-byte pieces: tiles of 16 rows, each a run of groups of 4
// pieces, a group 1,152 bytes (its 64 blocks' bytes):
//   - bytes 0..1023: row r's 4 pieces' nibbles (16 bytes each) at 64 r;
//   - bytes 1024..1151: at 4 (4 g + t), the scales of piece t of rows g and g + 8 (g < 8).
// Lane (g, t) of a warp (g = lane / 4, t = lane % 4) loads piece t of rows g and g + 8 as two
// 16-byte loads at 16 lane and 512 + 16 lane, and their scales as one word at 1024 + 4 lane.
// A matrix of a multiple of 16 rows and of 8 pieces a row.
constexpr int RP_ROWS = 16;
constexpr int RP_GROUP = 4;                                // pieces
constexpr int RP_BYTES = RP_ROWS * RP_GROUP * 18;          // a group's
constexpr int RP_U4 = RP_BYTES / 16;                       // its 16-byte loads

__host__ __device__ constexpr bool repackable(int64_t nrows, int64_t npieces) {
    return nrows % RP_ROWS == 0 && npieces % 8 == 0;
}

// where group `group` of tile `tile` starts, groups of `bytes` (a layout's), ngroups a tile
__host__ __device__ inline int64_t repacked_at(int64_t tile, int64_t group, int64_t ngroups,
                                               int bytes = RP_BYTES) {
    return (tile * ngroups + group) * bytes;
}

// Q4_0 rows (row_stride bytes apart) into the layout above at `out` (another buffer): a CTA a
// tile's group, a thread a row's piece (its 16 nibble bytes read as halves: the blocks are
// 2-byte aligned) and its scale. Grid (groups, tiles), 64 threads.
__global__ void __launch_bounds__(64) repack_q4_0(const uint8_t * w, int64_t row_stride,
                                                  int ngroups, uint8_t * out) {
    const int grp = blockIdx.x;
    const int tile = blockIdx.y;
    const int r = threadIdx.x / 4;
    const int j = threadIdx.x % 4;
    const uint16_t * b = reinterpret_cast<const uint16_t *>(
        w + int64_t(RP_ROWS * tile + r) * row_stride + int64_t(RP_GROUP * grp + j) * 18);
    uint32_t q[4];
#pragma unroll
    for (int k = 0; k < 4; k++) {
        q[k] = uint32_t(b[1 + 2 * k]) | (uint32_t(b[2 + 2 * k]) << 16);
    }
    uint8_t * o = out + repacked_at(tile, grp, ngroups);
    *reinterpret_cast<uint4 *>(o + 64 * r + 16 * j) = make_uint4(q[0], q[1], q[2], q[3]);
    *reinterpret_cast<uint16_t *>(o + 1024 + 4 * (4 * (r % 8) + j) + 2 * (r / 8)) = b[0];
}

// the bytes of warp `warp`'s tile of 16 rows in the CTA's rows from row0 (of a.w, or of a.w2 from
// a.rows2 on), from chunk chunk0 (two groups of `bytes`); ngroups is a.npieces / RP_GROUP
// (gemm_r works it out where it did before this helper, which keeps its code as it was)
__device__ __forceinline__ const uint8_t * warp_tile_at(const GemmArgs & a, int row0, int warp,
                                                        int chunk0, int ngroups,
                                                        int bytes = RP_BYTES) {
    const bool second = a.w2 != nullptr && row0 >= a.rows2;  // the second matrix's rows
    return (second ? a.w2 : a.w) +
           repacked_at((row0 - (second ? a.rows2 : 0) + warp * 16) / RP_ROWS,
                       int64_t(chunk0) * 2, ngroups, bytes);
}

// word k of a 16-byte load
__device__ __forceinline__ uint32_t word(const uint4 & v, int k) {
    return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w;
}

// lop3 (a & b) | c
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t b, uint32_t c) {
    uint32_t h;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(h) : "r"(a), "r"(b), "r"(c));
    return h;
}

// A lane's piece of a row and its scale (d, d): word w (values 4w..4w+3 low, 16+4w.. high) as
// piece_halves<Q4_0> would give lane w of a quad (lo = (v[4w], v[4w+2]), (v[4w+1], v[4w+3]); hi
// 16 on), the high nibbles taken in place (1024 + 16 n, times 1/16 less 72: n - 8, exact).
__device__ __forceinline__ void word_halves(uint32_t q, __half2 d, __half2 (&lo)[2],
                                            __half2 (&hi)[2]) {
    const __half2 off = as_h2(0x64086408u);        // 1032
    const __half2 sixteenth = as_h2(0x2C002C00u);  // 1/16
    const __half2 less = as_h2(0xD480D480u);       // -72
    const uint32_t q8 = q >> 8;
    lo[0] = __hmul2(__hsub2(as_h2(and_or(q, 0x000F000Fu, 0x64006400u)), off), d);
    lo[1] = __hmul2(__hsub2(as_h2(and_or(q8, 0x000F000Fu, 0x64006400u)), off), d);
    hi[0] = __hmul2(__hfma2(as_h2(and_or(q, 0x00F000F0u, 0x64006400u)), sixteenth, less), d);
    hi[1] = __hmul2(__hfma2(as_h2(and_or(q8, 0x00F000F0u, 0x64006400u)), sixteenth, less), d);
}

// --- Q4_K repacked -----------------------------------------------------------------------------
//
// Q4_K in the same layout and bytes (a super-block, 144 bytes, is 8 pieces: two groups of a
// tile): each piece's nibbles in Q4_0's order (byte b: values b and b + 16), so that the kernels
// read and unpack them alike, and a group's 128 bytes of scales a word a lane: lane (g, t)'s word
// of group grp holds piece 4 grp + t's 6-bit scale and min of row g (bits 0-5, 6-11) and of row
// g + 8 (12-17, 18-23), and in bits 24-31 byte 4 (grp % 2) + t of its quad's record, the halves d
// and dmin of row g, then of row g + 8, so that a super-block's two groups hold the whole record.
// A piece's value is d sc q - dmin m (q of 0-15): the products on halves take round(d sc) and
// round(dmin m) as gemm does on the blocks, gemv_r's f32 sums d sc and dmin m exactly.

// A K type's piece p (of a super-block's 8) as 4 words in Q4_0's order (byte i of word k: values
// 4k + i and 4k + i + 16), from its low (p even) or high nibbles in `qs`, the 32 bytes that
// pieces p and p ^ 1 share (Q4_K's and Q5_K's low 4 bits)
__device__ __forceinline__ void k_piece_words(const uint8_t * qs, int p, uint32_t (&words)[4]) {
    const int shift = 4 * (p % 2);
#pragma unroll
    for (int k = 0; k < 4; k++) {
        uint32_t v = 0;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int at = 4 * k + i;  // byte at of the piece: values at and at + 16
            const uint32_t lo = (qs[at] >> shift) & 0x0F;
            const uint32_t hi = (qs[at + 16] >> shift) & 0x0F;
            v |= (lo | (hi << 4)) << (8 * i);
        }
        words[k] = v;
    }
}

// lane (r, p % 4)'s word of scales of piece p (r < 8), from the super-blocks of rows r (b) and
// r + 8 (b8), whose first 16 bytes are Q4_K's: both rows' 6-bit scale and min, and byte p of
// the two rows' records (d, dmin of row r, then of row r + 8)
__device__ __forceinline__ uint32_t k_scale_word(const uint8_t * b, const uint8_t * b8, int p) {
    int sc, m, sc8, m8;
    scale_min_k4(b + 4, p, sc, m);
    scale_min_k4(b8 + 4, p, sc8, m8);
    const uint8_t rec = p < 4 ? b[p] : b8[p - 4];
    return uint32_t(sc) | uint32_t(m) << 6 | uint32_t(sc8) << 12 | uint32_t(m8) << 18 |
           uint32_t(rec) << 24;
}

// Q4_K rows (row_stride bytes apart) into that layout at `out` (another buffer): a CTA a tile's
// super-block, thread (r, p) piece p of row r, and for r < 8 the word of lane (r, p % 4) of group
// p / 4. Grid (super-blocks, tiles), 128 threads.
__global__ void __launch_bounds__(128) repack_q4_k(const uint8_t * w, int64_t row_stride,
                                                   int ngroups, uint8_t * out) {
    const int sb = blockIdx.x;
    const int tile = blockIdx.y;
    const int r = threadIdx.x / 8;
    const int p = threadIdx.x % 8;
    auto block = [&](int row) {
        return w + int64_t(RP_ROWS * tile + row) * row_stride + int64_t(sb) * 144;
    };
    const uint8_t * b = block(r);
    uint32_t words[4];
    k_piece_words(b + 16 + 32 * (p / 2), p, words);
    const int grp = 2 * sb + p / 4;
    uint8_t * o = out + repacked_at(tile, grp, ngroups);
    *reinterpret_cast<uint4 *>(o + 64 * r + 16 * (p % 4)) =
        make_uint4(words[0], words[1], words[2], words[3]);
    if (r < 8) {
        *reinterpret_cast<uint32_t *>(o + 1024 + 4 * (4 * r + p % 4)) =
            k_scale_word(b, block(r + 8), p);
    }
}

// byte t of the result: the top byte of w in lane t of this lane's quad
__device__ __forceinline__ uint32_t quad_top_bytes(uint32_t w, int t) {
    const uint32_t x = w >> 24;
    const uint32_t o1 = __shfl_xor_sync(0xFFFFFFFFu, x, 1);
    const uint32_t y = (t & 1) ? (o1 | (x << 8)) : (x | (o1 << 8));
    const uint32_t o2 = __shfl_xor_sync(0xFFFFFFFFu, y, 2);
    return (t & 2) ? (o2 | (y << 16)) : (y | (o2 << 16));
}

// a super-block's record for this lane's rows from its words of the two groups: (d of row g, of
// row g + 8) and (dmin of row g, of row g + 8), as halves
__device__ __forceinline__ void rk_record(uint32_t w_even, uint32_t w_odd, int t, uint32_t & dd,
                                          uint32_t & mm) {
    const uint32_t rg = quad_top_bytes(w_even, t);
    const uint32_t rg8 = quad_top_bytes(w_odd, t);
    dd = __byte_perm(rg, rg8, 0x5410);
    mm = __byte_perm(rg, rg8, 0x7632);
}

// A group's factors for this lane's piece, from its word and the record: (s, s) of rows g and
// g + 8 (da, db) and (-m, -m) (ma, mb), s = round(d sc), m = round(dmin m)
__device__ __forceinline__ void rk_group(uint32_t w, uint32_t dd, uint32_t mm, uint32_t & da,
                                         uint32_t & db, uint32_t & ma, uint32_t & mb) {
    const __half2 magic = as_h2(0x64006400u);  // 1024
    const uint32_t sc = (w & 0x3Fu) | ((w << 4) & 0x3F0000u) | 0x64006400u;
    const uint32_t mn = ((w >> 6) & 0x3Fu) | ((w >> 2) & 0x3F0000u) | 0x64006400u;
    const __half2 s = __hmul2(as_h2(dd), __hsub2(as_h2(sc), magic));
    const __half2 m = __hmul2(as_h2(mm), __hsub2(magic, as_h2(mn)));  // dmin times -m: exact negation
    da = __byte_perm(as_u32(s), 0, 0x1010);
    db = __byte_perm(as_u32(s), 0, 0x3232);
    ma = __byte_perm(as_u32(m), 0, 0x1010);
    mb = __byte_perm(as_u32(m), 0, 0x3232);
}

// word_halves for Q4_K repacked: q s - m (q of 0-15 exact: 1024 + q less 1024, and 1024 + 16 q
// times 1/16 less 64), one rounding as gemm's hfma2 on the blocks
__device__ __forceinline__ void word_halves_k(uint32_t q, __half2 s, __half2 m, __half2 (&lo)[2],
                                              __half2 (&hi)[2]) {
    const __half2 magic = as_h2(0x64006400u);      // 1024
    const __half2 sixteenth = as_h2(0x2C002C00u);  // 1/16
    const __half2 less = as_h2(0xD400D400u);       // -64
    const uint32_t q8 = q >> 8;
    lo[0] = __hfma2(__hsub2(as_h2(and_or(q, 0x000F000Fu, 0x64006400u)), magic), s, m);
    lo[1] = __hfma2(__hsub2(as_h2(and_or(q8, 0x000F000Fu, 0x64006400u)), magic), s, m);
    hi[0] = __hfma2(__hfma2(as_h2(and_or(q, 0x00F000F0u, 0x64006400u)), sixteenth, less), s, m);
    hi[1] = __hfma2(__hfma2(as_h2(and_or(q8, 0x00F000F0u, 0x64006400u)), sixteenth, less), s, m);
}

__device__ __forceinline__ uint4 load_stream(const uint4 * p) {
    uint4 v;
    asm volatile("ld.global.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// the 16 bytes at a shared-memory address (shared_at)
__device__ __forceinline__ uint4 load_shared(uint32_t at) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(at)
                 : "memory");
    return v;
}

__device__ __forceinline__ uint32_t load_shared_word(uint32_t at) {
    uint32_t v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(at) : "memory");
    return v;
}

__device__ __forceinline__ uint2 load_shared_pair(uint32_t at) {
    uint2 v;
    asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(at) : "memory");
    return v;
}

// v, kept in a register of its own: the compiler cannot take it apart and work it out again
// where it is used (as it did with gemm_r's activation addresses: three instructions a load)
__device__ __forceinline__ uint32_t opaque(uint32_t v) {
    uint32_t r;
    asm("mov.b32 %0, %1;" : "=r"(r) : "r"(v));
    return r;
}

// A lane's part of a group: piece t of rows g and g + 8, and their scales.
struct RpGroup {
    uint4 a, b;
    uint32_t d;
};

// a lane's part of the group whose nibbles (q) and scales (d) its lane's words start at
__device__ __forceinline__ RpGroup load_lane(const uint4 * q, const uint32_t * d) {
    return {load_stream(q), load_stream(q + 32), __ldg(d)};
}

__device__ __forceinline__ RpGroup load_group(const uint8_t * group, int lane) {
    return load_lane(reinterpret_cast<const uint4 *>(group) + lane,
                     reinterpret_cast<const uint32_t *>(group + 1024) + lane);
}

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

// What gemm_r leaves out for bench-kernels' --anatomy (0 in the model; wrong results): its
// weights after the first two chunks, the unpacking, the activations' shared loads, the mmas.
// RP_STAMPS leaves nothing out: each CTA writes its timeline to a.stamps (--timeline).
enum RpSkip : int { RP_LOADS = 1, RP_UNPACK = 2, RP_SHARED = 4, RP_MMA = 8, RP_STAMPS = 16 };

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

// rows g's (a) and g + 8's (b) halves of a word as a lane's A registers, in the mma's k order:
// row g's pair, row g + 8's, then their next pair
__device__ __forceinline__ void k_order(const __half2 (&alo)[2], const __half2 (&ahi)[2],
                                        const __half2 (&blo)[2], const __half2 (&bhi)[2],
                                        uint32_t (&lo)[4], uint32_t (&hi)[4]) {
#pragma unroll
    for (int i = 0; i < 2; i++) {
        lo[2 * i] = as_u32(alo[i]);
        lo[2 * i + 1] = as_u32(blo[i]);
        hi[2 * i] = as_u32(ahi[i]);
        hi[2 * i + 1] = as_u32(bhi[i]);
    }
}

// a lane's A registers of a word's low and high nibbles, rows g (qa) and g + 8 (qb)
template <int SKIP>
__device__ __forceinline__ void lane_words(uint32_t qa, uint32_t qb, uint32_t da, uint32_t db,
                                           uint32_t (&lo)[4], uint32_t (&hi)[4]) {
    if constexpr (SKIP & RP_UNPACK) {
        lo[0] = lo[2] = hi[0] = hi[2] = qa ^ da;
        lo[1] = lo[3] = hi[1] = hi[3] = qb ^ db;
        return;
    }
    __half2 alo[2], ahi[2], blo[2], bhi[2];
    word_halves(qa, as_h2(da), alo, ahi);
    word_halves(qb, as_h2(db), blo, bhi);
    k_order(alo, ahi, blo, bhi, lo, hi);
}

// lane_words for Q4_K repacked: (s, s), (-m, -m) of rows g (da, ma) and g + 8 (db, mb)
__device__ __forceinline__ void lane_words_k(uint32_t qa, uint32_t qb, uint32_t da, uint32_t db,
                                             uint32_t ma, uint32_t mb, uint32_t (&lo)[4],
                                             uint32_t (&hi)[4]) {
    __half2 alo[2], ahi[2], blo[2], bhi[2];
    word_halves_k(qa, as_h2(da), as_h2(ma), alo, ahi);
    word_halves_k(qb, as_h2(db), as_h2(mb), blo, bhi);
    k_order(alo, ahi, blo, bhi, lo, hi);
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

// --- gemv_r's sums, for the layouts below -----------------------------------------------------

template <int SPLIT> __host__ __device__ constexpr int gemv_r_warps() {
    return SPLIT > 4 ? SPLIT : 4;
}

// the integer sums of a lane's piece t of rows g (sa) and g + 8 (sb), its nibbles 0-15, with the
// activations of its low (xl) and high (xh) values
__device__ __forceinline__ void group_sums(const RpGroup & q, const int (&xl)[4],
                                           const int (&xh)[4], int & sa, int & sb) {
    sa = 0;
    sb = 0;
#pragma unroll
    for (int w = 0; w < 4; w++) {
        const uint32_t qa = word(q.a, w);
        const uint32_t qb = word(q.b, w);
        sa = dp4a(int(qa & 0x0F0F0F0Fu), xl[w], sa);
        sa = dp4a(int((qa >> 4) & 0x0F0F0F0Fu), xh[w], sa);
        sb = dp4a(int(qb & 0x0F0F0F0Fu), xl[w], sb);
        sb = dp4a(int((qb >> 4) & 0x0F0F0F0Fu), xh[w], sb);
    }
}

// a lane's sums of piece t of rows g and g + 8 (the nibbles 0-15; the 8 comes off in ds.y)
__device__ __forceinline__ void dot_group(const RpGroup & q, const int (&xl)[4],
                                          const int (&xh)[4], float2 ds, float & acc_a,
                                          float & acc_b) {
    int sa, sb;
    group_sums(q, xl, xh, sa, sb);
    const float2 d = __half22float2(as_h2(q.d));
    acc_a += d.x * (ds.x * float(sa) - 8.0f * ds.y);
    acc_b += d.y * (ds.x * float(sb) - 8.0f * ds.y);
}

// dot_group on Q4_K repacked: f = (d sc of rows g, g + 8; dmin m of rows g, g + 8), exact in f32
__device__ __forceinline__ void dot_group_k(const RpGroup & q, const int (&xl)[4],
                                            const int (&xh)[4], float2 ds, float4 f,
                                            float & acc_a, float & acc_b) {
    int sa, sb;
    group_sums(q, xl, xh, sa, sb);
    acc_a += f.x * (ds.x * float(sa)) - f.z * ds.y;
    acc_b += f.y * (ds.x * float(sb)) - f.w * ds.y;
}

// a Q4_K group's factors for dot_group_k, from its word and the super-block's record
__device__ __forceinline__ float4 rk_factors(uint32_t w, uint32_t dd, uint32_t mm) {
    const float2 d = __half22float2(as_h2(dd));
    const float2 m = __half22float2(as_h2(mm));
    return make_float4(d.x * float(w & 63u), d.y * float((w >> 12) & 63u),
                       m.x * float((w >> 6) & 63u), m.y * float((w >> 18) & 63u));
}

// --- Q6_K repacked -----------------------------------------------------------------------------
//
// The Q4_0 layout's tiles of 16 rows and groups of 4 pieces, at Q6_K's 26.25 bytes a piece (1,680
// a group, a super-block two groups, the blocks' bytes):
//   - bytes 0..1023: the low nibbles of row r's piece p at 64 r + 16 p, in Q4_0's order (byte b:
//     values b and b + 16);
//   - 1024..1535: lane (g, t)'s high bit pairs at 16 lane: words A and B of row g, then of row
//     g + 8; byte i of A holds in bits 2w, 2w + 1 the pair of value 4w + i, B of value 16 + 4w + i;
//   - 1536..1663: lane (g, t)'s 4 signed scales at 4 lane (row g's values 0-15, 16-31, then
//     row g + 8's);
//   - 1664..1679: the halves d of rows 0-7 (a super-block's first group) or 8-15 (its second).
// Values are q - 32 (q of 0-63) times d and the value's scale. One column (RpQ6_K below): a
// super-block a step, dp4a on the 6-bit values, each half piece's sum of activations taken apart
// for the 32 (on an H200 alone 0.59-0.73x the blocks' gemv's time: docs/BENCHMARKS.md, session
// 43); more columns: the 6-bit values to halves as word_halves does Q4_0's, d sc rounded to a
// half as gemm does on the blocks. Its kernels need sm_90 and newer (gemm_rb at 2-16 columns).

constexpr int R6_BYTES = RP_ROWS * RP_GROUP * 105 / 4;  // 1,680

// Q6_K rows into that layout: a CTA a tile's super-block, thread (r, p) piece p of row r.
// Grid (super-blocks, tiles), 128 threads.
__global__ void __launch_bounds__(128) repack_q6_k(const uint8_t * w, int64_t row_stride,
                                                   int ngroups, uint8_t * out) {
    const int sb = blockIdx.x;
    const int tile = blockIdx.y;
    const int r = threadIdx.x / 8;
    const int p = threadIdx.x % 8;
    const uint8_t * b = w + int64_t(RP_ROWS * tile + r) * row_stride + int64_t(sb) * 210;
    const int h = p / 4;
    const int k = p % 4;
    const uint8_t * ql = b + 64 * h + 32 * (k % 2);
    const uint8_t * qh = b + 128 + 32 * h;
    uint8_t q[32];  // the piece's values, 0-63
    for (int i = 0; i < 32; i++) {
        q[i] = uint8_t(((ql[i] >> (4 * (k / 2))) & 0x0F) | (((qh[i] >> (2 * k)) & 3) << 4));
    }
    uint8_t * o = out + repacked_at(tile, 2 * sb + p / 4, ngroups, R6_BYTES);
    const int j = p % 4;
    uint32_t nib[4];
    for (int c = 0; c < 4; c++) {
        uint32_t v = 0;
        for (int i = 0; i < 4; i++) {
            const int at = 4 * c + i;
            v |= uint32_t((q[at] & 0x0F) | ((q[at + 16] & 0x0F) << 4)) << (8 * i);
        }
        nib[c] = v;
    }
    *reinterpret_cast<uint4 *>(o + 64 * r + 16 * j) = make_uint4(nib[0], nib[1], nib[2], nib[3]);
    uint32_t hw[2] = {};
    for (int half = 0; half < 2; half++) {
        for (int wd = 0; wd < 4; wd++) {
            for (int i = 0; i < 4; i++) {
                hw[half] |= uint32_t(q[16 * half + 4 * wd + i] >> 4) << (8 * i + 2 * wd);
            }
        }
    }
    const int lane = 4 * (r % 8) + j;
    *reinterpret_cast<uint2 *>(o + 1024 + 16 * lane + 8 * (r / 8)) = make_uint2(hw[0], hw[1]);
    const uint8_t * sc = b + 192 + 2 * p;
    o[1536 + 4 * lane + 2 * (r / 8)] = sc[0];
    o[1536 + 4 * lane + 2 * (r / 8) + 1] = sc[1];
    if (p == 0) {  // the row's d, in the super-block's group of its half of the rows
        uint8_t * od = out + repacked_at(tile, 2 * sb + r / 8, ngroups, R6_BYTES);
        od[1664 + 2 * (r % 8)] = b[208];
        od[1664 + 2 * (r % 8) + 1] = b[209];
    }
}

struct R6Group {
    uint4 a, b, h;  // nibbles of rows g and g + 8; high pairs
    uint32_t sc;    // the 4 scales
    uint32_t d;     // the d of this group's half of the rows (row g, or g + 8)
};

__device__ __forceinline__ R6Group load_r6(const uint8_t * group, int lane) {
    const uint4 * q = reinterpret_cast<const uint4 *>(group) + lane;
    return {load_stream(q), load_stream(q + 32), load_stream(q + 64),
            __ldg(reinterpret_cast<const uint32_t *>(group + 1536) + lane),
            uint32_t(__ldg(reinterpret_cast<const unsigned short *>(group + 1664) + lane / 4))};
}

// the values (0-63) of word w of a row's piece: its low nibbles and pairs (lo), its high ones (hi)
// (w a constant where it is called: unrolled)
__device__ __forceinline__ void r6_word(uint32_t q, uint32_t ha, uint32_t hb, int w, int & lo,
                                        int & hi) {
    uint32_t sa = ha >> 2, sb = hb >> 2;  // each pair to bits 4-5 of its byte
    if (w < 3) {
        sa = ha << (4 - 2 * w);
        sb = hb << (4 - 2 * w);
    }
    lo = int((q & 0x0F0F0F0Fu) | (sa & 0x30303030u));
    hi = int(((q >> 4) & 0x0F0F0F0Fu) | (sb & 0x30303030u));
}

// a row's piece times the activations: sum over its halves of scale (sum q x - 32 sum x)
__device__ __forceinline__ int r6_row(uint4 q, uint32_t ha, uint32_t hb, int sc0, int sc1,
                                      const int (&xl)[4], const int (&xh)[4], int sxl, int sxh) {
    int sl = 0, sh = 0, lo, hi;
    r6_word(q.x, ha, hb, 0, lo, hi);
    sl = dp4a(lo, xl[0], sl);
    sh = dp4a(hi, xh[0], sh);
    r6_word(q.y, ha, hb, 1, lo, hi);
    sl = dp4a(lo, xl[1], sl);
    sh = dp4a(hi, xh[1], sh);
    r6_word(q.z, ha, hb, 2, lo, hi);
    sl = dp4a(lo, xl[2], sl);
    sh = dp4a(hi, xh[2], sh);
    r6_word(q.w, ha, hb, 3, lo, hi);
    sl = dp4a(lo, xl[3], sl);
    sh = dp4a(hi, xh[3], sh);
    return sc0 * (sl - 32 * sxl) + sc1 * (sh - 32 * sxh);
}

// A lane's halves of word w of a row's piece, as word_halves gives Q4_0's: (v - 32) s, v the
// 6-bit values (r6_word's bytes), s the scale of values 0-15 (lo) or 16-31 (hi)
__device__ __forceinline__ void r6_halves(uint32_t bytes, __half2 s, __half2 (&out)[2]) {
    const __half2 off = as_h2(0x64206420u);  // 1056: 1024 + v less 1056 is v - 32, exact
    out[0] = __hmul2(__hsub2(as_h2(and_or(bytes, 0x003F003Fu, 0x64006400u)), off), s);
    out[1] = __hmul2(__hsub2(as_h2(and_or(bytes >> 8, 0x003F003Fu, 0x64006400u)), off), s);
}

// --- Q5_K repacked -----------------------------------------------------------------------------
//
// Q4_K's layout (repack_q4_k) with each value's fifth bit beside it, 1,408 bytes a group (22 a
// piece, the blocks' bytes): bytes 0..1023 the nibbles as Q4_K's; 1024..1279 lane (g, t)'s fifth
// bits of piece t of rows g and g + 8, a word each at 8 lane: byte i holds in bit w the fifth
// bit of value 4w + i and in bit 4 + w that of value 16 + 4w + i; 1280..1407 the lanes' words
// of 6-bit scales and mins and record bytes as Q4_K's at 1024. Values d sc q - dmin m, q of
// 0-31. On an H200 one column alone took 0.82-0.86x the blocks' gemv's time (session 44); its
// kernels need sm_90 and newer, as Q6_K's.
constexpr int R5_BYTES = RP_ROWS * RP_GROUP * 22;  // 1,408

// Q5_K rows into that layout: a CTA a tile's super-block, thread (r, p) piece p of row r.
__global__ void __launch_bounds__(128) repack_q5_k(const uint8_t * w, int64_t row_stride,
                                                   int ngroups, uint8_t * out) {
    const int sb = blockIdx.x;
    const int tile = blockIdx.y;
    const int r = threadIdx.x / 8;
    const int p = threadIdx.x % 8;
    auto block = [&](int row) {
        return w + int64_t(RP_ROWS * tile + row) * row_stride + int64_t(sb) * 176;
    };
    const uint8_t * b = block(r);
    const uint8_t * qh = b + 16;
    uint32_t words[4];
    k_piece_words(b + 48 + 32 * (p / 2), p, words);
    uint32_t fifth = 0;
    for (int k = 0; k < 4; k++) {
        for (int i = 0; i < 4; i++) {
            const int at = 4 * k + i;  // byte at of the piece: values at and at + 16
            fifth |= uint32_t((qh[at] >> p) & 1) << (8 * i + k);
            fifth |= uint32_t((qh[at + 16] >> p) & 1) << (8 * i + 4 + k);
        }
    }
    uint8_t * o = out + repacked_at(tile, 2 * sb + p / 4, ngroups, R5_BYTES);
    const int j = p % 4;
    *reinterpret_cast<uint4 *>(o + 64 * r + 16 * j) =
        make_uint4(words[0], words[1], words[2], words[3]);
    const int lane = 4 * (r % 8) + j;
    *reinterpret_cast<uint32_t *>(o + 1024 + 8 * lane + 4 * (r / 8)) = fifth;
    if (r < 8) {
        *reinterpret_cast<uint32_t *>(o + 1280 + 4 * (4 * r + j)) = k_scale_word(b, block(r + 8), p);
    }
}

struct R5Group {
    uint4 a, b;  // nibbles of rows g and g + 8
    uint2 h;     // their fifth bits
    uint32_t d;  // the lane's word of scales, mins and record
};

__device__ __forceinline__ R5Group load_r5(const uint8_t * group, int lane) {
    const uint4 * q = reinterpret_cast<const uint4 *>(group) + lane;
    return {load_stream(q), load_stream(q + 32),
            __ldg(reinterpret_cast<const uint2 *>(group + 1024) + lane),
            __ldg(reinterpret_cast<const uint32_t *>(group + 1280) + lane)};
}

// the values (0-31) of word w of a row's piece: its low nibbles with their fifth bits (lo), its
// high ones (hi); h, the lane's fifth bits of that row
// (w a constant where it is called: unrolled)
__device__ __forceinline__ void r5_word(uint32_t q, uint32_t h, int w, uint32_t & lo,
                                        uint32_t & hi) {
    lo = (q & 0x0F0F0F0Fu) | ((h << (4 - w)) & 0x10101010u);
    hi = ((q >> 4) & 0x0F0F0F0Fu) | ((h >> w) & 0x10101010u);
}

// dot_group_k with the fifth bits: values 0-31
__device__ __forceinline__ void dot_group_k5(const R5Group & q, const int (&xl)[4],
                                             const int (&xh)[4], float2 ds, float4 f,
                                             float & acc_a, float & acc_b) {
    int sa = 0, sb = 0;
#pragma unroll
    for (int w = 0; w < 4; w++) {
        uint32_t alo, ahi, blo, bhi;
        r5_word(word(q.a, w), q.h.x, w, alo, ahi);
        r5_word(word(q.b, w), q.h.y, w, blo, bhi);
        sa = dp4a(int(alo), xl[w], sa);
        sa = dp4a(int(ahi), xh[w], sa);
        sb = dp4a(int(blo), xl[w], sb);
        sb = dp4a(int(bhi), xh[w], sb);
    }
    acc_a += f.x * (ds.x * float(sa)) - f.z * ds.y;
    acc_b += f.y * (ds.x * float(sb)) - f.w * ds.y;
}

// A lane's halves of word w of a row's piece, as word_halves_k gives Q4_K's: q s - m, q the
// 5-bit values (r5_word's bytes; 1024 + q less 1024, exact), one rounding
__device__ __forceinline__ void r5_halves(uint32_t bytes, __half2 s, __half2 m, __half2 (&out)[2]) {
    const __half2 magic = as_h2(0x64006400u);  // 1024
    out[0] = __hfma2(__hsub2(as_h2(and_or(bytes, 0x001F001Fu, 0x64006400u)), magic), s, m);
    out[1] = __hfma2(__hsub2(as_h2(and_or(bytes >> 8, 0x001F001Fu, 0x64006400u)), magic), s, m);
}

// --- the layouts, as the kernels below walk them ----------------------------------------------
//
// gemv_r (one column), gemm_rb (2-16) and gemm_rq (a prefill's) walk every repacked layout alike:
// tiles of 16 rows, groups of 4 pieces, lane (g, t) of a warp piece t of rows g and g + 8. What a
// layout makes different, its struct below names (RpQ4_0, RpQ4_K, RpQ5_K, RpQ6_K):
//   - bytes, a group's; pair: its super-block is two groups that share factors (the K types;
//     a Q4_0 group stands alone); gemm_r: gemm_r (the weights by the lanes' loads, any
//     compute capability) takes it too; rq_ctas, gemm_rq's CTAs an SM at one tile a warp;
//     repack, the kernel that rewrites the blocks into it;
//   - for the halves' kernels (gemm_rb, gemm_rq): super_at, where the word lies (from the
//     group's address plus 16 lane) that both groups of a super-block hold for this lane;
//     super, what the two words give (Sb); part, a lane's part of a group read through a view
//     of it (SharedLane, PtrLane) with its super-block's Sb; words, the lane's A registers of
//     word w of that part (w a constant where it is called: a template's lambda in its place
//     changed gemm_rb's code);
//   - for gemv_r's dp4a: Group and load, a lane's part of a group from memory; factors, those of
//     a super-block's groups; dot, a group's sums into the lane's two rows.

// A lane's view of a group: u4, its 16 bytes at off + 16 lane of the group; u2 and u32, its 8
// and 4 at off + stride x lane. In shared memory (gemm_rb), from `at`, the group's address plus
// 16 lane (worked out once: opaque)
struct SharedLane {
    uint32_t at;
    int lane;
    __device__ __forceinline__ uint32_t addr(int off, int stride) const {
        return at + off + (stride - 16) * lane;
    }
    __device__ __forceinline__ uint4 u4(int off) const { return load_shared(at + off); }
    __device__ __forceinline__ uint2 u2(int off, int stride) const {
        return load_shared_pair(addr(off, stride));
    }
    __device__ __forceinline__ uint32_t u32(int off, int stride) const {
        return load_shared_word(addr(off, stride));
    }
};

// the same through a generic pointer to the group (gemm_rq's stages)
struct PtrLane {
    const uint8_t * at;
    int lane;
    __device__ __forceinline__ uint4 u4(int off) const {
        return reinterpret_cast<const uint4 *>(at + off)[lane];
    }
    __device__ __forceinline__ uint2 u2(int off, int stride) const {
        return *reinterpret_cast<const uint2 *>(at + off + stride * lane);
    }
    __device__ __forceinline__ uint32_t u32(int off, int stride) const {
        return *reinterpret_cast<const uint32_t *>(at + off + stride * lane);
    }
};

struct RpQ4_0 {
    static constexpr int bytes = RP_BYTES;
    static constexpr bool pair = false;
    static constexpr bool gemm_r = true;
    static constexpr int rq_ctas = 4;
    static constexpr auto repack = repack_q4_0;
    struct Sb {};
    __device__ static int super_at(int, int) { return 0; }
    __device__ static Sb super(uint32_t, uint32_t, int, int) { return {}; }
    struct Part {
        uint4 qa, qb;
        uint32_t da, db;  // (d, d) of rows g and g + 8
    };
    template <class V> __device__ static Part part(const V & v, const Sb &) {
        Part p;
        p.qa = v.u4(0);
        p.qb = v.u4(512);
        const uint32_t d = v.u32(1024, 4);
        p.da = __byte_perm(d, 0, 0x1010);
        p.db = __byte_perm(d, 0, 0x3232);
        return p;
    }
    __device__ static void words(const Part & p, int w, uint32_t (&lo)[4], uint32_t (&hi)[4]) {
        lane_words<0>(word(p.qa, w), word(p.qb, w), p.da, p.db, lo, hi);
    }
    using Group = RpGroup;
    __device__ static Group load(const uint8_t * group, int lane) {
        return load_group(group, lane);
    }
    struct Factors {};
    template <int U> __device__ static void factors(const Group (&)[U], int, Factors (&)[U]) {}
    __device__ static void dot(const Group & q, const Factors &, const int (&xl)[4],
                               const int (&xh)[4], float2 ds, float & acc_a, float & acc_b) {
        dot_group(q, xl, xh, ds, acc_a, acc_b);
    }
};

// Q4_K's and Q5_K's super-blocks: a record (d, dmin of the lane's two rows) from the two groups'
// words of scales at `scales`
template <int SCALES> struct RpRecord {
    static constexpr bool pair = true;
    struct Sb {
        uint32_t dd, mm;
    };
    __device__ static int super_at(int lane, int) { return SCALES - 12 * lane; }  // + 4 lane
    __device__ static Sb super(uint32_t even, uint32_t odd, int, int t) {
        Sb s;
        rk_record(even, odd, t, s.dd, s.mm);
        return s;
    }
    template <class Group, int U>
    __device__ static void factors(const Group (&cur)[U], int t, float4 (&f)[U]) {
        uint32_t dd, mm;
        rk_record(cur[0].d, cur[1].d, t, dd, mm);
#pragma unroll
        for (int u = 0; u < U; u++) {
            f[u] = rk_factors(cur[u].d, dd, mm);
        }
    }
};

struct RpQ4_K : RpRecord<1024> {
    static constexpr int bytes = RP_BYTES;
    static constexpr bool gemm_r = true;
    static constexpr int rq_ctas = 4;
    static constexpr auto repack = repack_q4_k;
    struct Part {
        uint4 qa, qb;
        uint32_t da, db, ma, mb;  // (s, s) and (-m, -m) of rows g and g + 8
    };
    template <class V> __device__ static Part part(const V & v, const Sb & sb) {
        Part p;
        p.qa = v.u4(0);
        p.qb = v.u4(512);
        rk_group(v.u32(1024, 4), sb.dd, sb.mm, p.da, p.db, p.ma, p.mb);
        return p;
    }
    __device__ static void words(const Part & p, int w, uint32_t (&lo)[4], uint32_t (&hi)[4]) {
        lane_words_k(word(p.qa, w), word(p.qb, w), p.da, p.db, p.ma, p.mb, lo, hi);
    }
    using Group = RpGroup;
    __device__ static Group load(const uint8_t * group, int lane) {
        return load_group(group, lane);
    }
    using Factors = float4;
    __device__ static void dot(const Group & q, const Factors & f, const int (&xl)[4],
                               const int (&xh)[4], float2 ds, float & acc_a, float & acc_b) {
        dot_group_k(q, xl, xh, ds, f, acc_a, acc_b);
    }
};

struct RpQ5_K : RpRecord<1280> {
    static constexpr int bytes = R5_BYTES;
    static constexpr bool gemm_r = false;
    static constexpr int rq_ctas = 3;
    static constexpr auto repack = repack_q5_k;
    struct Part {
        uint4 qa, qb;
        uint2 h;  // the fifth bits of rows g and g + 8
        uint32_t da, db, ma, mb;
    };
    template <class V> __device__ static Part part(const V & v, const Sb & sb) {
        Part p;
        p.qa = v.u4(0);
        p.qb = v.u4(512);
        p.h = v.u2(1024, 8);
        rk_group(v.u32(1280, 4), sb.dd, sb.mm, p.da, p.db, p.ma, p.mb);
        return p;
    }
    __device__ static void words(const Part & p, int w, uint32_t (&lo)[4], uint32_t (&hi)[4]) {
        uint32_t alo, ahi, blo, bhi;
        r5_word(word(p.qa, w), p.h.x, w, alo, ahi);
        r5_word(word(p.qb, w), p.h.y, w, blo, bhi);
        __half2 a_lo[2], a_hi[2], b_lo[2], b_hi[2];
        r5_halves(alo, as_h2(p.da), as_h2(p.ma), a_lo);
        r5_halves(ahi, as_h2(p.da), as_h2(p.ma), a_hi);
        r5_halves(blo, as_h2(p.db), as_h2(p.mb), b_lo);
        r5_halves(bhi, as_h2(p.db), as_h2(p.mb), b_hi);
        k_order(a_lo, a_hi, b_lo, b_hi, lo, hi);
    }
    using Group = R5Group;
    __device__ static Group load(const uint8_t * group, int lane) { return load_r5(group, lane); }
    using Factors = float4;
    __device__ static void dot(const Group & q, const Factors & f, const int (&xl)[4],
                               const int (&xh)[4], float2 ds, float & acc_a, float & acc_b) {
        dot_group_k5(q, xl, xh, ds, f, acc_a, acc_b);
    }
};

struct RpQ6_K {
    static constexpr int bytes = R6_BYTES;
    static constexpr bool pair = true;
    static constexpr bool gemm_r = false;
    static constexpr int rq_ctas = 3;
    static constexpr auto repack = repack_q6_k;
    struct Sb {
        float da, db;  // the d of rows g (the super-block's first group holds it) and g + 8
    };
    // the word of the halves d that holds row g's in the first group, g + 8's in the second
    __device__ static int super_at(int lane, int g) { return 1664 + 4 * (g / 2) - 16 * lane; }
    __device__ static Sb super(uint32_t even, uint32_t odd, int g, int) {
        const int shift = 16 * (g & 1);
        return {__half2float(__ushort_as_half((unsigned short) ((even >> shift) & 0xFFFFu))),
                __half2float(__ushort_as_half((unsigned short) ((odd >> shift) & 0xFFFFu)))};
    }
    struct Part {
        uint4 qa, qb, h;                    // nibbles of rows g and g + 8; high pairs
        __half2 sa_lo, sa_hi, sb_lo, sb_hi;  // d sc of rows g and g + 8, values 0-15 and 16-31
    };
    template <class V> __device__ static Part part(const V & v, const Sb & sb) {
        Part p;
        p.qa = v.u4(0);
        p.qb = v.u4(512);
        p.h = v.u4(1024);
        const int sc = int(v.u32(1536, 4));
        p.sa_lo = __float2half2_rn(sb.da * float(int8_t(sc)));
        p.sa_hi = __float2half2_rn(sb.da * float(int8_t(sc >> 8)));
        p.sb_lo = __float2half2_rn(sb.db * float(int8_t(sc >> 16)));
        p.sb_hi = __float2half2_rn(sb.db * float(sc >> 24));
        return p;
    }
    __device__ static void words(const Part & p, int w, uint32_t (&lo)[4], uint32_t (&hi)[4]) {
        int alo, ahi, blo, bhi;
        r6_word(word(p.qa, w), p.h.x, p.h.y, w, alo, ahi);
        r6_word(word(p.qb, w), p.h.z, p.h.w, w, blo, bhi);
        __half2 a_lo[2], a_hi[2], b_lo[2], b_hi[2];
        r6_halves(uint32_t(alo), p.sa_lo, a_lo);
        r6_halves(uint32_t(ahi), p.sa_hi, a_hi);
        r6_halves(uint32_t(blo), p.sb_lo, b_lo);
        r6_halves(uint32_t(bhi), p.sb_hi, b_hi);
        k_order(a_lo, a_hi, b_lo, b_hi, lo, hi);
    }
    using Group = R6Group;
    __device__ static Group load(const uint8_t * group, int lane) { return load_r6(group, lane); }
    using Factors = float2;  // (d of row g, of row g + 8), a super-block's
    template <int U>
    __device__ static void factors(const Group (&cur)[U], int, Factors (&f)[U]) {
        const float2 d = make_float2(__half2float(__ushort_as_half((unsigned short) cur[0].d)),
                                     __half2float(__ushort_as_half((unsigned short) cur[1].d)));
#pragma unroll
        for (int u = 0; u < U; u++) {
            f[u] = d;
        }
    }
    // a row's piece: the sums of its halves' activations taken apart for the 32
    __device__ static void dot(const Group & q, const Factors & f, const int (&xl)[4],
                               const int (&xh)[4], float2 ds, float & acc_a, float & acc_b) {
        int sxl = 0, sxh = 0;
#pragma unroll
        for (int w = 0; w < 4; w++) {
            sxl = dp4a(0x01010101, xl[w], sxl);
            sxh = dp4a(0x01010101, xh[w], sxh);
        }
        const int sc = int(q.sc);
        const int va =
            r6_row(q.a, q.h.x, q.h.y, int(int8_t(sc)), int(int8_t(sc >> 8)), xl, xh, sxl, sxh);
        const int vb =
            r6_row(q.b, q.h.z, q.h.w, int(int8_t(sc >> 16)), sc >> 24, xl, xh, sxl, sxh);
        acc_a += f.x * (ds.x * float(va));
        acc_b += f.y * (ds.x * float(vb));
    }
};

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
    const uint4 * wq = reinterpret_cast<const uint4 *>(wp) + lane;
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
    const float * xi = a.x.xinv + 2 * t * nsegs + chunk0 / 2;
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

// the mbarrier at shared address `bar` expects `count` arrivals a phase
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
#endif
}

// `bytes` from global `src` to shared `dst` by the TMA unit, completing the phase of the mbarrier
// `bar` that this thread's arrival opens (one arrival a phase)
__device__ __forceinline__ void mbar_copy(uint32_t bar, uint32_t dst, const void * src,
                                          uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
                 : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
            "r"(dst),
        "l"(src), "r"(bytes), "r"(bar)
        : "memory");
#endif
}

// until the mbarrier `bar` completes its phase of parity `phase`
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t phase) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        "@!p bra WAIT_%=;\n"
        "}\n" ::"r"(bar),
        "r"(phase)
        : "memory");
#endif
}

// this thread's mbarrier inits seen by the TMA unit (and the rest of the cluster) after it
__device__ __forceinline__ void mbar_init_fence() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
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
    const float * xi = a.x.xinv + 2 * t * nsegs + chunk0 / 2;
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
