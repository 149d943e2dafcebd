// Q6_K and Q5_K repacked for lucepy's CUDA kernels (lucepy-layouts.cuh has Q4_0's and Q4_K's
// and what every layout shares): each layout's bytes, its repack kernel and a lane's reads.

#pragma once

#include "lucepy-layouts.cuh"

#include <cuda_fp16.h>

#include <cstdint>

namespace lucepy {

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
static __global__ void __launch_bounds__(128)
    repack_q6_k(const uint8_t * w, int64_t row_stride, int ngroups, uint8_t * out) {
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
static __global__ void __launch_bounds__(128)
    repack_q5_k(const uint8_t * w, int64_t row_stride, int ngroups, uint8_t * out) {
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

}  // namespace lucepy
