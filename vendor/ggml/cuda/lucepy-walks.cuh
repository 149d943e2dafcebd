// The repacked layouts (lucepy-layouts.cuh, lucepy-layouts6.cuh) as lucepy-repack.cuh's kernels
// walk them: a struct a layout (RpQ4_0, RpQ4_K, RpQ5_K, RpQ6_K).

#pragma once

#include "lucepy-layouts6.cuh"

#include <cuda_fp16.h>

#include <cstdint>

namespace lucepy {

// --- the layouts, as lucepy-repack.cuh's kernels walk them -------------------------------------
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
    // Q4_0's and Q4_K's piece of the lane at off (0: row g's, 512: g + 8's), turned (rp_slot)
    __device__ __forceinline__ uint4 piece(int off) const {
        return load_shared(at + off + 16 * (rp_slot(lane) - lane));
    }
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
    __device__ __forceinline__ uint4 piece(int off) const {  // (SharedLane's)
        return reinterpret_cast<const uint4 *>(at + off)[rp_slot(lane)];
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
        p.qa = v.piece(0);
        p.qb = v.piece(512);
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
        p.qa = v.piece(0);
        p.qb = v.piece(512);
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

}  // namespace lucepy
