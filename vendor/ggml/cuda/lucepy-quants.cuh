// lucepy's own kernels (issue 19, decision 12): one 32-value piece of a quantized weight row,
// unpacked to signed bytes with its scales, and its dot product with one column of int8
// activations. Shared by the kernels (lucepy-kernels.cuh) and by tests/test_cuda_kernels.py, which
// compiles it with the host's C++ compiler and compares it with ggml's own dequantization.
//
// A piece is 32 consecutive weights of a row. Its value i (0..31) is
//     scale[i / 16] * q[i] - bias
// with q[i] a signed byte packed four to an int (q[0] holds values 0..3, q[7] values 28..31).
// Q4_0, Q8_0, Q4_1 and Q5_1 have one piece per block; Q4_K, Q5_K, Q6_K and IQ4_XS have eight per
// 256-value super-block.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#define LUCEPY_HD __host__ __device__ __forceinline__
#else
#define LUCEPY_HD inline
#endif

namespace lucepy {

enum Kind : int {
    Q4_0 = 0, Q8_0 = 1, Q4_K = 2, Q6_K = 3, Q4_1 = 4, Q5_1 = 5, Q5_K = 6, IQ4_XS = 7
};

// bytes of one quant block, pieces (32 values) per block, and the alignment its `ints` loads
// need (4 where they read whole ints, 2 for load_a2)
template <int K> struct Layout;
template <> struct Layout<Q4_0> { static constexpr int bytes = 18, pieces = 1, align = 2; };
template <> struct Layout<Q8_0> { static constexpr int bytes = 34, pieces = 1, align = 2; };
template <> struct Layout<Q4_K> { static constexpr int bytes = 144, pieces = 8, align = 4; };
template <> struct Layout<Q6_K> { static constexpr int bytes = 210, pieces = 8, align = 2; };
template <> struct Layout<Q4_1> { static constexpr int bytes = 20, pieces = 1, align = 4; };
template <> struct Layout<Q5_1> { static constexpr int bytes = 24, pieces = 1, align = 4; };
template <> struct Layout<Q5_K> { static constexpr int bytes = 176, pieces = 8, align = 4; };
template <> struct Layout<IQ4_XS> { static constexpr int bytes = 136, pieces = 8, align = 2; };

// f(std::integral_constant<int, K>) for the kind K that the number `kind` names, and what f
// returns: the one switch from a kind number to the templates of its kind (host code).
template <typename F> auto with_kind(int kind, F && f) {
    switch (kind) {
        case Q4_0: return f(std::integral_constant<int, Q4_0>{});
        case Q8_0: return f(std::integral_constant<int, Q8_0>{});
        case Q4_K: return f(std::integral_constant<int, Q4_K>{});
        case Q6_K: return f(std::integral_constant<int, Q6_K>{});
        case Q4_1: return f(std::integral_constant<int, Q4_1>{});
        case Q5_1: return f(std::integral_constant<int, Q5_1>{});
        case Q5_K: return f(std::integral_constant<int, Q5_K>{});
        default: return f(std::integral_constant<int, IQ4_XS>{});
    }
}

// whether a kind's values carry a bias (a min: Q4_K's, Q5_K's, Q4_1's and Q5_1's)
template <int K> LUCEPY_HD constexpr bool biased() {
    return K == Q4_K || K == Q5_K || K == Q4_1 || K == Q5_1;
}

struct Piece {
    int q[8];
    float scale[2];  // values 0..15, values 16..31
    float bias;      // subtracted from every value (Q4_K's min; minus Q4_1's, Q5_1's m)
};

LUCEPY_HD int dp4a(int a, int b, int acc) {
#if defined(__CUDA_ARCH__)
    return __dp4a(a, b, acc);
#else
    for (int i = 0; i < 4; i++) {
        acc += int(int8_t(a >> (8 * i))) * int(int8_t(b >> (8 * i)));
    }
    return acc;
#endif
}

// a - b in each byte, wrapping: a nibble minus 8 becomes its signed byte
LUCEPY_HD int sub_bytes(int a, int b) {
#if defined(__CUDA_ARCH__)
    return int(__vsub4(unsigned(a), unsigned(b)));
#else
    unsigned out = 0;
    for (int i = 0; i < 4; i++) {
        out |= unsigned(uint8_t((a >> (8 * i)) - (b >> (8 * i)))) << (8 * i);
    }
    return int(out);
#endif
}

// four bytes at an address aligned to 2 (the blocks of 18, 34 and 210 bytes are)
LUCEPY_HD int load_a2(const uint8_t * p) {
#if defined(__CUDA_ARCH__)
    const uint16_t * h = reinterpret_cast<const uint16_t *>(p);
    return int(uint32_t(h[0]) | (uint32_t(h[1]) << 16));
#else
    int v;
    memcpy(&v, p, 4);
    return v;
#endif
}

LUCEPY_HD int load_a4(const uint8_t * p) {
#if defined(__CUDA_ARCH__)
    return *reinterpret_cast<const int *>(p);
#else
    return load_a2(p);
#endif
}

LUCEPY_HD float load_half(const uint8_t * p) {
#if defined(__CUDACC__)
    return __half2float(*reinterpret_cast<const __half *>(p));
#else  // IEEE binary16, for the host check
    uint16_t h;
    memcpy(&h, p, 2);
    const int sign = h >> 15, exponent = (h >> 10) & 31, mantissa = h & 1023;
    float v;
    if (exponent == 0) {
        v = float(mantissa) * (1.0f / 16777216.0f);  // 2^-24: subnormal
    } else if (exponent == 31) {
        v = mantissa ? __builtin_nanf("") : __builtin_inff();
    } else {
        v = float(1024 + mantissa) * __builtin_ldexpf(1.0f, exponent - 25);
    }
    return sign ? -v : v;
#endif
}

// A piece's scales: values 0..15 and 16..31 are scale0 * q and scale1 * q, minus bias.
struct Scales {
    float s0, s1, bias;
};

// of piece `at` (0..pieces-1) of the block at `b`: the scales, and ints t and 4 + t (values 4t..4t+3
// and 16+4t..16+4t+3)
template <int K> LUCEPY_HD Scales scales(const uint8_t * b, int at);
template <int K> LUCEPY_HD void ints(const uint8_t * b, int at, int t, int & lo, int & hi);

// Q4_0: half d, 16 bytes of nibbles; value i < 16 is the low nibble of byte i, value 16 + i its
// high nibble; both minus 8
template <> LUCEPY_HD Scales scales<Q4_0>(const uint8_t * b, int) {
    const float d = load_half(b);
    return {d, d, 0.0f};
}

template <> LUCEPY_HD void ints<Q4_0>(const uint8_t * b, int, int t, int & lo, int & hi) {
    const int v = load_a2(b + 2 + 4 * t);
    lo = sub_bytes(v & 0x0F0F0F0F, 0x08080808);
    hi = sub_bytes((v >> 4) & 0x0F0F0F0F, 0x08080808);
}

// Q8_0: half d, 32 signed bytes
template <> LUCEPY_HD Scales scales<Q8_0>(const uint8_t * b, int) {
    const float d = load_half(b);
    return {d, d, 0.0f};
}

template <> LUCEPY_HD void ints<Q8_0>(const uint8_t * b, int, int t, int & lo, int & hi) {
    lo = load_a2(b + 2 + 4 * t);
    hi = load_a2(b + 18 + 4 * t);
}

// Q4_K: half d, half dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles. Pieces 2g and
// 2g + 1 share bytes 32g..32g+31 (low nibbles, then high ones); piece j is d*sc[j]*q - dmin*m[j].
// (Q5_K's first 16 bytes are the same.)
// piece `at`'s 6-bit scale and min from a super-block's 12 bytes of them (`sm`, Q4_K's bytes 4-15;
// repack_q4_k copies them into its layout as these integers)
LUCEPY_HD void scale_min_k4(const uint8_t * sm, int at, int & sc, int & m) {
    if (at < 4) {
        sc = sm[at] & 63;
        m = sm[at + 4] & 63;
    } else {
        sc = (sm[at + 4] & 0x0F) | ((sm[at - 4] >> 6) << 4);
        m = (sm[at + 4] >> 4) | ((sm[at] >> 6) << 4);
    }
}

template <> LUCEPY_HD Scales scales<Q4_K>(const uint8_t * b, int at) {
    int sc, m;
    scale_min_k4(b + 4, at, sc, m);
    const float s = load_half(b) * float(sc);
    return {s, s, load_half(b + 2) * float(m)};
}

template <> LUCEPY_HD void ints<Q4_K>(const uint8_t * b, int at, int t, int & lo, int & hi) {
    const uint8_t * qs = b + 16 + 32 * (at / 2);
    const int shift = 4 * (at % 2);
    lo = (load_a4(qs + 4 * t) >> shift) & 0x0F0F0F0F;
    hi = (load_a4(qs + 16 + 4 * t) >> shift) & 0x0F0F0F0F;
}

// Q4_1: half d, half m, 16 bytes of nibbles as Q4_0's, unsigned: value i is d * q + m. Its
// blocks of 20 bytes sit at 4-byte alignment where rows do.
template <> LUCEPY_HD Scales scales<Q4_1>(const uint8_t * b, int) {
    const float d = load_half(b);
    return {d, d, -load_half(b + 2)};
}

template <> LUCEPY_HD void ints<Q4_1>(const uint8_t * b, int, int t, int & lo, int & hi) {
    const int v = load_a4(b + 4 + 4 * t);
    lo = v & 0x0F0F0F0F;
    hi = (v >> 4) & 0x0F0F0F0F;
}

// bits 0..3 of `b` to bit 4 of bytes 0..3 (b's four bits land in distinct places: no carries)
LUCEPY_HD int spread_to_bit4(uint32_t b) {
    return int(((b & 15u) * 0x00204081u & 0x01010101u) << 4);
}

// Q5_1: half d, half m, 4 bytes qh (bit i: value i's fifth bit), 16 bytes of nibbles as Q4_1's;
// value i is d * q + m, q of 0..31. Blocks of 24 bytes: 4-byte alignment where rows have it.
template <> LUCEPY_HD Scales scales<Q5_1>(const uint8_t * b, int) {
    const float d = load_half(b);
    return {d, d, -load_half(b + 2)};
}

template <> LUCEPY_HD void ints<Q5_1>(const uint8_t * b, int, int t, int & lo, int & hi) {
    const uint32_t qh = uint32_t(load_a4(b + 4));
    const int v = load_a4(b + 8 + 4 * t);
    lo = (v & 0x0F0F0F0F) | spread_to_bit4(qh >> (4 * t));
    hi = ((v >> 4) & 0x0F0F0F0F) | spread_to_bit4(qh >> (16 + 4 * t));
}

// Q5_K: Q4_K's d, dmin and scales, then 32 bytes qh (bit j of byte l: value l's fifth bit in
// piece j), then Q4_K's 128 bytes of nibbles; piece j is d*sc[j]*q - dmin*m[j], q of 0..31. 176
// bytes: blocks keep a row's 16-byte alignment.
template <> LUCEPY_HD Scales scales<Q5_K>(const uint8_t * b, int at) {
    return scales<Q4_K>(b, at);
}

template <> LUCEPY_HD void ints<Q5_K>(const uint8_t * b, int at, int t, int & lo, int & hi) {
    const uint8_t * qs = b + 48 + 32 * (at / 2);
    const int shift = 4 * (at % 2);
    const int high_lo = ((load_a4(b + 16 + 4 * t) >> at) & 0x01010101) << 4;
    const int high_hi = ((load_a4(b + 32 + 4 * t) >> at) & 0x01010101) << 4;
    lo = ((load_a4(qs + 4 * t) >> shift) & 0x0F0F0F0F) | high_lo;
    hi = ((load_a4(qs + 16 + 4 * t) >> shift) & 0x0F0F0F0F) | high_hi;
}

// IQ4_XS: half d, 16 bits of scales' high pairs, 4 bytes of scales' low nibbles, 128 bytes of
// nibbles that index a table of 16 signed values (ggml's kvalues_iq4nl); piece j holds bytes
// 16j..16j+15 as Q4_0 holds its 16 (low nibbles values 0..15, high ones 16..31) and its scale is
// d * (6-bit s_j - 32). Blocks of 136 bytes sit at 8-byte alignment where rows do.
LUCEPY_HD int iq4nl_values(uint32_t nibbles) {  // four bytes of 0..15 to their table values
#if defined(__CUDA_ARCH__)
    const uint32_t x = nibbles & 0x07070707u;  // each byte's place among 8 table bytes
    const uint32_t packed = x | (x >> 4);
    const uint32_t sel = (packed & 0xFFu) | ((packed >> 8) & 0xFF00u);
    const uint32_t low = __byte_perm(0xBFAD9881u, 0xF6EADDCFu, sel);   // -127 .. -10
    const uint32_t high = __byte_perm(0x26190D01u, 0x71594535u, sel);  // 1 .. 113
    const uint32_t upper = ((nibbles & 0x08080808u) >> 3) * 0xFFu;     // bytes of 8..15
    return int((low & ~upper) | (high & upper));
#else
    static const int8_t table[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                     1,    13,   25,  38,  53,  69,  89,  113};
    uint32_t out = 0;
    for (int i = 0; i < 4; i++) {
        out |= uint32_t(uint8_t(table[(nibbles >> (8 * i)) & 15])) << (8 * i);
    }
    return int(out);
#endif
}

template <> LUCEPY_HD Scales scales<IQ4_XS>(const uint8_t * b, int at) {
    const int high = (int(b[2] | (b[3] << 8)) >> (2 * at)) & 3;
    const int low = (b[4 + at / 2] >> (4 * (at % 2))) & 15;
    const float s = load_half(b) * float((low | (high << 4)) - 32);
    return {s, s, 0.0f};
}

template <> LUCEPY_HD void ints<IQ4_XS>(const uint8_t * b, int at, int t, int & lo, int & hi) {
    const uint32_t v = uint32_t(load_a2(b + 8 + 16 * at + 4 * t));
    lo = iq4nl_values(v & 0x0F0F0F0Fu);
    hi = iq4nl_values((v >> 4) & 0x0F0F0F0Fu);
}

// Q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 signed scales (one per 16 values),
// half d. Each half of the block (128 values) holds four pieces: piece k of half h takes the
// low (k < 2) or high nibble of ql[64h + 32(k % 2) + i] and bits 2k, 2k+1 of qh[32h + i]; minus 32.
template <> LUCEPY_HD Scales scales<Q6_K>(const uint8_t * b, int at) {
    const int8_t * sc = reinterpret_cast<const int8_t *>(b + 192) + 8 * (at / 4) + 2 * (at % 4);
    const float d = load_half(b + 208);
    return {d * float(sc[0]), d * float(sc[1]), 0.0f};
}

template <> LUCEPY_HD void ints<Q6_K>(const uint8_t * b, int at, int t, int & lo, int & hi) {
    const int h = at / 4;
    const int k = at % 4;
    const uint8_t * ql = b + 64 * h + 32 * (k % 2);
    const uint8_t * qh = b + 128 + 32 * h;
    const int lo_shift = 4 * (k / 2);
    const int hi_shift = 2 * k;
    int q[2];
    for (int i = 0; i < 2; i++) {
        const int at4 = 4 * (t + 4 * i);
        const int low = (load_a2(ql + at4) >> lo_shift) & 0x0F0F0F0F;
        const int high = ((load_a2(qh + at4) >> hi_shift) & 0x03030303) << 4;
        q[i] = sub_bytes(low | high, 0x20202020);
    }
    lo = q[0];
    hi = q[1];
}

// the whole piece, for the kernels that give a thread all of it
template <int K> LUCEPY_HD void unpack(const uint8_t * b, int at, Piece & p) {
    const Scales s = scales<K>(b, at);
    for (int t = 0; t < 4; t++) {
        ints<K>(b, at, t, p.q[t], p.q[4 + t]);
    }
    p.scale[0] = s.s0;
    p.scale[1] = s.s1;
    p.bias = s.bias;
}

// the piece times one column's 32 activations, quantized as x = dx * xq, with sx = dx * sum(xq)
LUCEPY_HD float dot(const Piece & p, const int (&xq)[8], float dx, float sx) {
    int lo = 0, hi = 0;
    for (int i = 0; i < 4; i++) {
        lo = dp4a(p.q[i], xq[i], lo);
        hi = dp4a(p.q[4 + i], xq[4 + i], hi);
    }
    return dx * (p.scale[0] * float(lo) + p.scale[1] * float(hi)) - p.bias * sx;
}

}  // namespace lucepy
