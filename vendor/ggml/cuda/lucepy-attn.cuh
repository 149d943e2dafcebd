// lucepy's attention for a few queries (a decode's one, a verify's 2-16) over an f16 cache:
// ggml's FLASH_ATTN_EXT (no ALiBi, soft cap or sinks) of heads of 128 or 256 values, taken by
// lucepy_cuda_fuse. ggml-cuda's kernel for such shapes spreads the keys over the SMs and adds the
// pieces in a second kernel: at 256 keys it took 17 us a 16-query layer of the 27B-shaped model
// and 11 a decode's, plus 2-3 us of that fixup (docs/BENCHMARKS.md session 59), for 0.25 MB of
// K and V a KV head.
//
// Here a CTA takes 16 rows of one KV head's group of query heads (row r: query r / ratio, head
// r % ratio of the group, so a decode's 6 heads are one tile and a verify's 16 queries six) and
// every `splits`-th chunk of 32 keys, the next chunk's K and V in flight during one; its D / 128
// warps each take 128 of the values. Each warp computes its rows' scores on the tensor cores (q,
// pre-scaled, and K as f16, f32 sums; every warp of the CTA computes the same scores, which costs
// less than sharing them), keeps each row's running maximum and sum (the online softmax, in base
// 2) and adds P V with P rounded to f16, as ggml-cuda's kernel does. The splits spread the keys
// over about two CTAs an SM (a CTA reading all of a head's 0.25 MB alone took 11 us), and a
// second kernel joins their results by their maxima and sums.
//
// The device code only: lucepy-attn.cu hooks it into ggml-cuda, bench-attn.cu times it alone.

#pragma once

#include "lucepy-gemm.cuh"  // mma_16816, as_u32 (and lucepy-kernels.cuh: the copies, PDL)

#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>

namespace lucepy {

constexpr int AT_ROWS = 16;  // a CTA's rows: an mma tile
constexpr int AT_KC = 32;    // keys a chunk
constexpr int AT_DW = 128;   // values a warp
constexpr int AT_SPLITS = 16;  // CTAs a row tile at most (attn_join's loads)
// caches of more rows: ggml's kernel by default (lucepy-attn.cu; not measured yet, bench-attn.cu
// and LUCEPY_CUDA_ATTN_KEYS measure them); where taken, up to AT_LONG_SPLITS CTAs a row tile,
// joined AT_SPLITS at a time (attn_join's LONG)
constexpr int AT_MAX_KEYS = 1024;
constexpr int AT_LONG_SPLITS = 64;

struct AttnArgs {
    const char * q;  // [D, T, nh, ns] f32, strides in bytes
    int64_t q1, q2, q3;
    const char * k;  // [D, n_kv, nkv, ns] f16
    int64_t k1, k2, k3;
    const char * v;
    int64_t v1, v2, v3;
    const char * mask;  // [n_kv, >= T, mh, ms] f16, or null
    int64_t m1, m2, m3;
    int mh, ms;
    float * dst;  // [D, nh, T, ns] f32, dense
    int T, nh, ratio, n_kv;
    float scale;  // times log2(e): scores in base 2
    int splits;   // CTAs a row tile, each every splits-th chunk; more than one: their results in
    float * part; // [splits][rows][D] (P V, not divided), rows (s nkv + g) R + r
    float2 * part_ms;  // [splits][rows]: each row's maximum (base 2) and sum
};

// row r of KV head g's query heads: its query t and head h (the rows' order, above)
struct AttnRow {
    int t, h;
};

__device__ __forceinline__ AttnRow attn_row(const AttnArgs & a, int g, int r) {
    return {r / a.ratio, g * a.ratio + r % a.ratio};
}

template <int D> __host__ __device__ constexpr int attn_pitch() {
    return D + 8;  // halves a row in shared memory: ldmatrix's 8 rows fall on different banks
}

template <int D> __host__ __device__ constexpr int attn_smem() {
    return (AT_ROWS + 2 * 2 * AT_KC) * attn_pitch<D>() * 2;  // q, and K and V twice
}

// grid (row tiles x splits, KV heads, sequences), D / AT_DW warps
template <int D>
__global__ void __launch_bounds__(D / AT_DW * 32) attn_few(const AttnArgs a) {
    constexpr int P = attn_pitch<D>();
    constexpr float NEG = -INFINITY;
    extern __shared__ __align__(16) uint8_t smem[];
    __half * qs = reinterpret_cast<__half *>(smem);

    const int lane = threadIdx.x % 32;
    const int dh = threadIdx.x / 32;  // values dh AT_DW on
    const int split = blockIdx.x % a.splits;
    const int g = blockIdx.y;  // KV head
    const int s = blockIdx.z;  // sequence
    const int R = a.ratio * a.T;
    const int r0 = blockIdx.x / a.splits * AT_ROWS;
    const char * kbase = a.k + g * a.k2 + s * a.k3;
    const char * vbase = a.v + g * a.v2 + s * a.v3;
    const int nchunks = (a.n_kv + AT_KC - 1) / AT_KC;
    auto kv_at = [&](int b) { return qs + AT_ROWS * P + b * 2 * AT_KC * P; };  // K, then V

    LUCEPY_PDL_LAUNCH();
    LUCEPY_PDL_SYNC();  // q, the cache rows and the mask: the kernels before have finished

    // chunk c's K and V rows into buffer b (past the end: zeros), a group of copies
    auto issue = [&](int c, int b) {
        if (c < nchunks) {
            __half * ks = kv_at(b);
            __half * vs = ks + AT_KC * P;
            const int key0 = c * AT_KC;
            for (int e = threadIdx.x; e < AT_KC * D / 8; e += blockDim.x) {
                const int r = e / (D / 8), u = 8 * (e % (D / 8));
                if (key0 + r < a.n_kv) {
                    const char * kr = kbase + (key0 + r) * a.k1 + 2 * u;
                    const char * vr = vbase + (key0 + r) * a.v1 + 2 * u;
                    copy_async<16>(reinterpret_cast<uint8_t *>(ks + r * P + u),
                                   reinterpret_cast<const uint8_t *>(kr));
                    copy_async<16>(reinterpret_cast<uint8_t *>(vs + r * P + u),
                                   reinterpret_cast<const uint8_t *>(vr));
                } else {
                    *reinterpret_cast<int4 *>(ks + r * P + u) = make_int4(0, 0, 0, 0);
                    *reinterpret_cast<int4 *>(vs + r * P + u) = make_int4(0, 0, 0, 0);
                }
            }
        }
        copy_commit();
    };
    issue(split, 0);

    // the tile's q rows, scaled, as f16 (rows past the group's: zeros); every load in flight
    // at once (in a loop of loads and stores, each waited for the L2 alone: 8-9 us a call)
    constexpr int NQ = AT_ROWS * D / 4 / (D / AT_DW * 32);  // 16-byte loads a thread
    float4 qv[NQ];
#pragma unroll
    for (int j = 0; j < NQ; j++) {
        const int e = threadIdx.x + j * blockDim.x;
        const int r = e / (D / 4), d = 4 * (e % (D / 4));
        qv[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (r0 + r < R) {
            const auto [t, h] = attn_row(a, g, r0 + r);
            const char * at = a.q + t * a.q1 + h * a.q2 + s * a.q3 + 4 * d;
            qv[j] = *reinterpret_cast<const float4 *>(at);
        }
    }
#pragma unroll
    for (int j = 0; j < NQ; j++) {
        const int e = threadIdx.x + j * blockDim.x;
        const int r = e / (D / 4), d = 4 * (e % (D / 4));
        const float4 x = qv[j];
        __half2 * to = reinterpret_cast<__half2 *>(qs + r * P + d);
        to[0] = __floats2half2_rn(x.x * a.scale, x.y * a.scale);
        to[1] = __floats2half2_rn(x.z * a.scale, x.w * a.scale);
    }

    // this lane's rows of the tile (mma's c rows: gr, gr + 8) and their mask rows
    const int gr = lane / 4, gc = lane % 4;
    const __half * mrow[2] = {nullptr, nullptr};
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int r = min(r0 + gr + 8 * i, R - 1);  // (a row past the group's: any real one)
        const auto [t, h] = attn_row(a, g, r);
        if (a.mask) {
            mrow[i] = reinterpret_cast<const __half *>(a.mask + t * a.m1 + (h % a.mh) * a.m2 +
                                                       (s % a.ms) * a.m3);
        }
    }
    float o[AT_DW / 8][4] = {};  // P V: values dh AT_DW + 8 n + 2 gc (+1), rows gr and gr + 8
    float mx[2] = {NEG, NEG};    // the rows' running maximum (base 2)
    float sum[2] = {0.0f, 0.0f}; // this lane's part of the rows' running sums
    const int lr = lane % 8, lm = lane / 8;  // ldmatrix: the row and matrix this lane points at
    for (int c = split, b = 0; c < nchunks; c += a.splits, b ^= 1) {
        const int key0 = c * AT_KC;
        float2 mk[AT_KC / 8][2];  // the chunk's mask values of this lane's scores (asked first)
#pragma unroll
        for (int n = 0; n < AT_KC / 8; n++) {
            const int key = key0 + 8 * n + 2 * gc;
#pragma unroll
            for (int i = 0; i < 2; i++) {
                mk[n][i] = make_float2(0.0f, 0.0f);
                if (mrow[i] && key < a.n_kv) {  // (n_kv even: key + 1 too)
                    mk[n][i] = __half22float2(*reinterpret_cast<const __half2 *>(mrow[i] + key));
                }
            }
        }
        issue(c + a.splits, b ^ 1);  // the next chunk in flight during this one
        copy_wait<1>();
        __syncthreads();  // the chunk (and, the first time, q) is in place for every warp
        const __half * ks = kv_at(b);
        const __half * vs = ks + AT_KC * P;

        // scores: q (16 x D) times the chunk's keys, 4 n tiles of 8
        float sc[AT_KC / 8][4] = {};
#pragma unroll
        for (int k0 = 0; k0 < D; k0 += 16) {
            uint32_t qa[4];
            ldmatrix4<false>(qa, shared_at(qs + (lr + 8 * (lm & 1)) * P + k0 + 8 * (lm >> 1)));
#pragma unroll
            for (int n = 0; n < AT_KC / 16; n++) {
                uint32_t kb[4];
                const int key = 16 * n + lr + 8 * (lm >> 1);
                ldmatrix4<false>(kb, shared_at(ks + key * P + k0 + 8 * (lm & 1)));
                mma_16816(sc[2 * n], qa, kb[0], kb[1]);
                mma_16816(sc[2 * n + 1], qa, kb[2], kb[3]);
            }
        }
        // the mask, and keys past the end out; each row's new maximum
        float cmax[2] = {NEG, NEG};
#pragma unroll
        for (int n = 0; n < AT_KC / 8; n++) {
            const int key = key0 + 8 * n + 2 * gc;
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const float2 m = mk[n][i];
                const float x0 = key < a.n_kv ? sc[n][2 * i] + m.x * 1.4426950408889634f : NEG;
                const float x1 = key < a.n_kv ? sc[n][2 * i + 1] + m.y * 1.4426950408889634f : NEG;
                sc[n][2 * i] = x0, sc[n][2 * i + 1] = x1;
                cmax[i] = fmaxf(cmax[i], fmaxf(x0, x1));
            }
        }
#pragma unroll
        for (int i = 0; i < 2; i++) {
            cmax[i] = fmaxf(cmax[i], __shfl_xor_sync(0xFFFFFFFFu, cmax[i], 1));
            cmax[i] = fmaxf(cmax[i], __shfl_xor_sync(0xFFFFFFFFu, cmax[i], 2));
            const float m_new = fmaxf(mx[i], cmax[i]);
            const float base = m_new == NEG ? 0.0f : m_new;  // (every key so far masked)
            const float keep = exp2f(mx[i] - base);
            mx[i] = m_new;
            sum[i] *= keep;
#pragma unroll
            for (int n = 0; n < AT_DW / 8; n++) {
                o[n][2 * i] *= keep;
                o[n][2 * i + 1] *= keep;
            }
#pragma unroll
            for (int n = 0; n < AT_KC / 8; n++) {
                sc[n][2 * i] = exp2f(sc[n][2 * i] - base);
                sc[n][2 * i + 1] = exp2f(sc[n][2 * i + 1] - base);
                sum[i] += sc[n][2 * i] + sc[n][2 * i + 1];
            }
        }
        // P (f16, the scores' tiles as mma's a tiles) times the chunk's V, this warp's values
#pragma unroll
        for (int kk = 0; kk < AT_KC / 16; kk++) {
            const float(&lo)[4] = sc[2 * kk];  // keys 16 kk + 2 gc (+1), then those + 8
            const float(&hi)[4] = sc[2 * kk + 1];
            const uint32_t pa[4] = {as_u32(__floats2half2_rn(lo[0], lo[1])),
                                    as_u32(__floats2half2_rn(lo[2], lo[3])),
                                    as_u32(__floats2half2_rn(hi[0], hi[1])),
                                    as_u32(__floats2half2_rn(hi[2], hi[3]))};
#pragma unroll
            for (int n = 0; n < AT_DW / 16; n++) {
                uint32_t vb[4];
                const int key = 16 * kk + lr + 8 * (lm & 1);
                ldmatrix4<true>(vb, shared_at(vs + key * P + dh * AT_DW + 16 * n + 8 * (lm >> 1)));
                mma_16816(o[2 * n], pa, vb[0], vb[1]);
                mma_16816(o[2 * n + 1], pa, vb[2], vb[3]);
            }
        }
        __syncthreads();  // every warp is done with the buffer the next issue fills
    }
    copy_wait<0>();  // (the last, empty groups)

#pragma unroll
    for (int i = 0; i < 2; i++) {
        sum[i] += __shfl_xor_sync(0xFFFFFFFFu, sum[i], 1);
        sum[i] += __shfl_xor_sync(0xFFFFFFFFu, sum[i], 2);
    }
    const int64_t rows = int64_t(gridDim.z) * gridDim.y * R;  // every tile's rows, all heads
#pragma unroll
    for (int i = 0; i < 2; i++) {
        const int r = r0 + gr + 8 * i;
        if (r >= R) {
            continue;
        }
        const auto [t, h] = attn_row(a, g, r);
        float * out;
        float inv = 1.0f;
        if (a.splits == 1) {
            out = a.dst + ((int64_t(s) * a.T + t) * a.nh + h) * D + dh * AT_DW;
            inv = sum[i] > 0.0f ? 1.0f / sum[i] : 0.0f;
        } else {
            const int64_t row = (int64_t(s) * gridDim.y + g) * R + r;
            out = a.part + (split * rows + row) * D + dh * AT_DW;
            if (dh == 0 && gc == 0) {
                a.part_ms[split * rows + row] = make_float2(mx[i], sum[i]);
            }
        }
#pragma unroll
        for (int n = 0; n < AT_DW / 8; n++) {
            *reinterpret_cast<float2 *>(out + 8 * n + 2 * gc) =
                make_float2(o[n][2 * i] * inv, o[n][2 * i + 1] * inv);
        }
    }
}

// The splits' results joined: a CTA a row of a query head (grid (R, KV heads, sequences)), each
// thread 4 values; every split's maximum, sum and values asked for at once, AT_SPLITS at a time
// (LONG: more splits than that, the running sums scaled to each batch's new maximum)
template <int D, bool LONG = false>
__global__ void __launch_bounds__(D / 4) attn_join(const AttnArgs a) {
    LUCEPY_PDL_SYNC();  // the splits' results: attn_few has finished
    constexpr float NEG = -INFINITY;
    const int r = blockIdx.x, g = blockIdx.y, s = blockIdx.z;
    const int R = a.ratio * a.T;
    const int64_t rows = int64_t(gridDim.z) * gridDim.y * R;
    const int64_t row = (int64_t(s) * gridDim.y + g) * R + r;
    const int d = 4 * threadIdx.x;
    float m = NEG, l = 0.0f;
    float4 y = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int k0 = 0; k0 < (LONG ? a.splits : 1); k0 += AT_SPLITS) {
        float2 ms[AT_SPLITS];
        float4 x[AT_SPLITS];
#pragma unroll
        for (int k = 0; k < AT_SPLITS; k++) {
            if (k0 + k < a.splits) {
                ms[k] = a.part_ms[(k0 + k) * rows + row];
                x[k] = *reinterpret_cast<const float4 *>(a.part + ((k0 + k) * rows + row) * D + d);
            }
        }
        float mb = m;
#pragma unroll
        for (int k = 0; k < AT_SPLITS; k++) {
            mb = k0 + k < a.splits ? fmaxf(mb, ms[k].x) : mb;
        }
        const float base = mb == NEG ? 0.0f : mb;
        if constexpr (LONG) {
            const float keep = exp2f(m - base);  // (m -inf: nothing added yet)
            l *= keep;
            y.x *= keep, y.y *= keep, y.z *= keep, y.w *= keep;
        }
#pragma unroll
        for (int k = 0; k < AT_SPLITS; k++) {
            if (k0 + k < a.splits) {
                const float w = exp2f(ms[k].x - base);
                l += w * ms[k].y;
                y.x += w * x[k].x, y.y += w * x[k].y, y.z += w * x[k].z, y.w += w * x[k].w;
            }
        }
        m = mb;
    }
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    const auto [t, h] = attn_row(a, g, r);
    float * out = a.dst + ((int64_t(s) * a.T + t) * a.nh + h) * D + d;
    *reinterpret_cast<float4 *>(out) = make_float4(y.x * inv, y.y * inv, y.z * inv, y.w * inv);
}

// The splits of a row tile: about two CTAs an SM (`ctas` CTAs without splits), at most one a
// chunk and AT_SPLITS (AT_LONG_SPLITS past AT_MAX_KEYS rows)
inline int attn_splits(int n_kv, int ctas, int sms) {
    const int nchunks = (n_kv + AT_KC - 1) / AT_KC;
    const int most = n_kv > AT_MAX_KEYS ? AT_LONG_SPLITS : AT_SPLITS;
    return std::max(1, std::min({nchunks, most, 2 * sms / ctas}));
}

}  // namespace lucepy
