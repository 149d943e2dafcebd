// Q4_0, Q4_K, Q5_K and Q6_K repacked for lucepy's CUDA kernels: each layout's bytes, the kernel
// that rewrites a matrix's blocks into it (repack_q4_0, repack_q4_k, repack_q5_k, repack_q6_k),
// and how a lane reads it: as an mma's A registers (the halves' kernels) and as dp4a sums
// (gemv_r), gathered in one struct a layout (RpQ4_0, RpQ4_K, RpQ5_K, RpQ6_K). The kernels that
// walk every layout alike are lucepy-repack.cuh's; lucepy_cuda_repack (lucepy-repacked.cu) rewrites
// a matrix once at load (docs/architecture.md, decision 12). Here Q4_0's and Q4_K's; Q6_K's and
// Q5_K's are lucepy-layouts6.cuh's, the structs lucepy-walks.cuh's (each includes the one
// before it).
#pragma once

#include "lucepy-gemm.cuh"  // gemm's activations (to_halves), mma, GemmArgs; Args

#include <cuda_fp16.h>

#include <cstdint>

namespace lucepy {

// --- Q4_0 repacked -----------------------------------------------------------------------------
//
// `gemm` copies each row's 18-byte blocks into shared memory and reads a piece's nibbles and
// scale back as 2-byte halves: about 70 instructions a warp's piece of 16 rows, of which the
// unpacking and the mmas are about 40 (docs/BENCHMARKS.md, session 20). Rearranged once, a
// matrix's bytes load in whole 16-byte pieces: tiles of 16 rows, each a run of groups of 4
// pieces, a group 1,152 bytes (its 64 blocks' bytes):
//   - bytes 0..1023: row r's 4 pieces' nibbles (16 bytes each) at 64 r, piece j of them at
//     16 ((j + r / 2) % 4): each pair of rows turned a piece further than the pair before;
//   - bytes 1024..1151: at 4 (4 g + t), the scales of piece t of rows g and g + 8 (g < 8).
// Lane (g, t) of a warp (g = lane / 4, t = lane % 4) loads piece t of rows g and g + 8 as two
// 16-byte loads at 16 rp_slot(lane) and 512 + 16 rp_slot(lane) (a warp's loads the same 512
// bytes as without the turn, so the same transactions), and their scales as one word at 1024 + 4
// lane. (The turn is for a reader that takes word t of every piece of a row to a lane, as an FP8
// product's k-steps would: `ldmatrix` then reads the 8 rows of a step from 8 different banks'
// quads, where unturned they all lie in one: docs/BENCHMARKS.md, session 50.)
// A matrix of a multiple of 16 rows and of 8 pieces a row.
constexpr int RP_ROWS = 16;
constexpr int RP_GROUP = 4;                                // pieces
constexpr int RP_BYTES = RP_ROWS * RP_GROUP * 18;          // a group's
constexpr int RP_U4 = RP_BYTES / 16;                       // its 16-byte loads

// where row r's piece j lies in its 64 bytes, in 16-byte units
__host__ __device__ constexpr int rp_turn(int r, int j) {
    return (j + r / 2) % 4;
}

// the 16-byte slot of lane (g, t)'s piece t of row g in a group's first 512 bytes (of row g + 8
// in its second: (g + 8) / 2 turns as g / 2)
__host__ __device__ constexpr int rp_slot(int lane) {
    return 4 * (lane / 4) + rp_turn(lane / 4, lane % 4);
}

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
static __global__ void __launch_bounds__(64)
    repack_q4_0(const uint8_t * w, int64_t row_stride, int ngroups, uint8_t * out) {
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
    *reinterpret_cast<uint4 *>(o + 64 * r + 16 * rp_turn(r, j)) =
        make_uint4(q[0], q[1], q[2], q[3]);
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
static __global__ void __launch_bounds__(128)
    repack_q4_k(const uint8_t * w, int64_t row_stride, int ngroups, uint8_t * out) {
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
    *reinterpret_cast<uint4 *>(o + 64 * r + 16 * rp_turn(r, p % 4)) =
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
    return load_lane(reinterpret_cast<const uint4 *>(group) + rp_slot(lane),
                     reinterpret_cast<const uint32_t *>(group + 1024) + lane);
}

// What gemm_r leaves out for bench-kernels' --anatomy (0 in the model; wrong results): its
// weights after the first two chunks, the unpacking, the activations' shared loads, the mmas.
// RP_STAMPS leaves nothing out: each CTA writes its timeline to a.stamps (--timeline).
enum RpSkip : int { RP_LOADS = 1, RP_UNPACK = 2, RP_SHARED = 4, RP_MMA = 8, RP_STAMPS = 16 };

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

// --- gemv_r's sums, for the layouts below -----------------------------------------------------

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

}  // namespace lucepy
