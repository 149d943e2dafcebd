// lucepy's own kernels (issue 19, decision 12): the activations of gemm_f8 (lucepy-f8.cuh) as e4m3
// records, and the kernels that write activations as their ops compute: the gated norm
// (`norm_gate_halves`), a split product's parts added (`parts_sum`), the FFN's GLU (`glu_halves`);
// included by lucepy-gemm.cuh.

#pragma once

#include "lucepy-halves.cuh"

#include <cuda_fp8.h>

namespace lucepy {

// --- the activations: e4m3 records --------------------------------------------------------------
//
// A chunk of 8 pieces of 16 columns is F8_CHUNK bytes: piece q's first terms at 1024 q and its
// second terms 512 after, each 16 columns x 32 values in wgmma's core matrices (8 columns x 16
// bytes, column c's values 4t..4t+3 as the word at 256 (c / 8) + 16 (c % 8) + 4 t, its values
// 16 + 4t.. 128 bytes after). After the chunks: 512 / scale a column and segment ([segments][16]
// (f8_scale_at): a lane's four columns of a segment two 8-byte loads; each segment's largest
// scaled into [128, 256)), then each segment's pieces' sums times -8 / 512
// (two halves: the sum, then what it missed) as an m16n8k16 mma's B registers of the segment's 16
// pieces, [segment][tile of 8 columns][term][lane][4 halves].
constexpr int F8_CHUNK = 8 * 1024;
constexpr int F8_COLS = 16;

__host__ __device__ constexpr int64_t f8_records_bytes(int64_t npieces) {
    return npieces / 8 * F8_CHUNK;
}

__host__ __device__ constexpr int64_t f8_bytes(int64_t npieces) {
    return f8_records_bytes(npieces) + int64_t(F8_COLS) * segments(int(npieces)) * 4 +
           int64_t(segments(int(npieces))) * 2 * 2 * 32 * 4 * 2;
}

// the records, scales and offsets in a buffer of f8_bytes, as Halves (xh the records)
inline Halves f8_at(uint8_t * buf, int64_t npieces) {
    return {reinterpret_cast<uint4 *>(buf),
            reinterpret_cast<float *>(buf + f8_records_bytes(npieces))};
}

// where 512 / scale of column c and segment seg is among the records' scales
__host__ __device__ constexpr int64_t f8_scale_at(int c, int seg) {
    return int64_t(seg) * F8_COLS + c;
}

// the offsets after the scales
__host__ __device__ inline const __half * f8_offsets(const float * xinv, int npieces) {
    return reinterpret_cast<const __half *>(xinv + F8_COLS * segments(npieces));
}

// The multiplier that brings a segment's largest magnitude `amax` into [128, 256) (a power of two)
__device__ __forceinline__ float f8_scale(float amax) {
    if (!(amax > 0.0f) || !isfinite(amax)) {
        return 1.0f;
    }
    int e;
    frexpf(amax, &e);  // amax < 2^e
    return ldexpf(1.0f, min(8 - e, 100));
}

// a as e4m3, rounded to nearest: the hardware's conversion (sm_89 and newer: one instruction;
// it saturates), and e4m3's NaN for a value past 448, an inf or a NaN (as the conversion that
// does not saturate gives; on sm_90 that one runs through doubles in software: writing records
// took the FFN's GLU kernel 6.9 us a call where halves took 3.0, docs/BENCHMARKS.md session 54).
// Byte for byte the non-saturating conversion's at every |a| <= 448 (bench-kernels --e4m3).
__device__ __forceinline__ __nv_fp8_storage_t f8_of(float a) {
    const __nv_fp8_storage_t b = __nv_cvt_float_to_fp8(a, __NV_SATFINITE, __NV_E4M3);
    return fabsf(a) <= 448.0f ? b : __nv_fp8_storage_t(0x7F);
}

// value a (scaled: below 256, where e4m3 reaches 448) as two e4m3 terms, and their sum as the
// product will see it (an inf or NaN becomes e4m3's NaN, which the product carries)
__device__ __forceinline__ float f8_terms(float a, uint32_t & hi, uint32_t & lo) {
    const __nv_fp8_storage_t h = f8_of(a);
    const float hf = __half2float(__half(__nv_cvt_fp8_to_halfraw(h, __NV_E4M3)));
    const __nv_fp8_storage_t l = f8_of(a - hf);
    const float lf = __half2float(__half(__nv_cvt_fp8_to_halfraw(l, __NV_E4M3)));
    hi = uint32_t(h);
    lo = uint32_t(l);
    return hf + lf;
}

// the two terms' words (hi, lo) of values 4t..4t+3 (`high`: 16 + 4t..) of piece `piece` of column
// c into the records at xe
__device__ __forceinline__ void f8_put(uint8_t * xe, int piece, int c, int t, int high, uint32_t hi,
                                       uint32_t lo) {
    uint8_t * rec = xe + int64_t(piece / 8) * F8_CHUNK + (piece % 8) * 1024 +
                    (c / 8) * 256 + (c % 8) * 16 + 4 * t + 128 * high;
    *reinterpret_cast<uint32_t *>(rec) = hi;
    *reinterpret_cast<uint32_t *>(rec + 512) = lo;
}

// A thread's 8 values of piece `piece` of column c (group t: values 4t..4t+3 and 16 + 4t..), all
// times `scale`, into the records at xe, their terms' sum returned (the caller adds a piece's)
__device__ __forceinline__ float f8_group(const float (&v)[8], float scale, uint8_t * xe,
                                          int piece, int c, int t) {
    uint32_t hi[2] = {0, 0}, lo[2] = {0, 0};
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        uint32_t h, l;
        sum += f8_terms(v[j] * scale, h, l);
        hi[j / 4] |= h << (8 * (j % 4));
        lo[j / 4] |= l << (8 * (j % 4));
    }
    f8_put(xe, piece, c, t, 0, hi[0], lo[0]);
    f8_put(xe, piece, c, t, 1, hi[1], lo[1]);
    return sum;
}

// piece `piece`'s terms' sum (of column c, segment seg) times -8 / 512 as the offsets' B halves
__device__ __forceinline__ void f8_offset(float sum, __half * xo, int piece, int c, int seg) {
    const float o = sum * (-8.0f / 512.0f);
    const int pp = piece % GM_SEG, nt = c / 8, ln = (c % 8) * 4 + pp % 4;
    const int h = (pp / 8) * 2 + (pp / 4) % 2;
    const __half oh = __float2half_rn(o);
    const __half ol = __float2half_rn(o - __half2float(oh));
    xo[(((int64_t(seg) * 2 + nt) * 2 + 0) * 32 + ln) * 4 + h] = oh;
    xo[(((int64_t(seg) * 2 + nt) * 2 + 1) * 32 + ln) * 4 + h] = ol;
}

// SEGS segments of a column as e4m3 records (as to_e4m3 writes them), from a CTA of SEGS x
// GM_SEG / V warps that holds them, V pieces a warp (as segment_halves takes them: warp w's piece
// i is piece (seg0 + w / (GM_SEG / V)) GM_SEG + w % (GM_SEG / V) + i GM_SEG / V of column c), its
// lane j that piece's value j (v[i]); pieces past npieces not written
template <int SEGS, int V = 1>
__device__ __forceinline__ void segment_e4m3(const float (&v)[V], const Halves & out, int c,
                                             int npieces, int seg0) {
    constexpr int WPS = GM_SEG / V;  // warps a segment
    static_assert(GM_SEG % V == 0, "a segment's pieces shared out evenly");
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int mine = warp / WPS;  // the CTA's segment
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < V; i++) {
        amax = fmaxf(amax, fabsf(v[i]));
    }
    const float scale = f8_scale(segment_amax<SEGS, WPS>(amax));
    const int seg = seg0 + mine;
    if (warp % WPS == 0 && lane == 0) {
        out.xinv[f8_scale_at(c, seg)] = 512.0f / scale;
    }
#pragma unroll
    for (int i = 0; i < V; i++) {
        uint32_t h, l;
        float sum = f8_terms(v[i] * scale, h, l);
        uint32_t hw = h, lw = l;  // lane 4k: the bytes of values 4k..4k+3
#pragma unroll
        for (int b = 1; b < 4; b++) {
            hw |= __shfl_down_sync(0xFFFFFFFFu, h, b) << (8 * b);
            lw |= __shfl_down_sync(0xFFFFFFFFu, l, b) << (8 * b);
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            sum += __shfl_xor_sync(0xFFFFFFFFu, sum, off);
        }
        const int piece = seg * GM_SEG + warp % WPS + i * WPS;
        if (piece < npieces) {
            if (lane % 4 == 0) {  // values 4t.. (lanes 0-15) or 16 + 4t.. (16-31) of group t
                f8_put(reinterpret_cast<uint8_t *>(out.xh), piece, c, (lane / 4) % 4, lane / 16,
                       hw, lw);
            }
            if (lane == 0) {
                f8_offset(sum, const_cast<__half *>(f8_offsets(out.xinv, npieces)), piece, c,
                          seg);
            }
        }
    }
}

// norm_gate_quantize's twin for 2-16 columns (a verify's gated norm): grid (segments of a column,
// padded columns), a CTA of GM_SEG warps a segment, a warp a piece; a column `npieces` pieces of
// whole rows (of n = 32 PIECES values: GM_SEG % PIECES == 0, so a CTA holds whole rows). Writes
// the three results as ggml does and the gated one's halves as to_halves writes them (padding
// columns zeros). z's columns are z_stride floats apart (a verify's z read in place from the
// stacked product, where ggml-cuda would copy it out with a 2D memcpy outside the PDL chain).
template <int PIECES>
__global__ void __launch_bounds__(GM_SEG * 32) norm_gate_halves(
    const float * x, int64_t x_stride, const float * w, const float * z, int64_t z_stride,
    float * normed, float * gate, float * dst, int npieces, int ncols, float eps, int op,
    Halves out) {
    static_assert(GM_SEG % PIECES == 0, "a CTA holds whole rows");
    LUCEPY_PDL_LAUNCH();
    LUCEPY_PDL_SYNC();  // x and z: the kernels before have finished
    const int seg = blockIdx.x;
    const int c = blockIdx.y;
    const int lane = threadIdx.x % 32;
    const int p = seg * GM_SEG + threadIdx.x / 32;  // the column's piece
    const bool piece_here = p < npieces;
    const bool here = c < ncols && piece_here;
    const int64_t piece = int64_t(c) * npieces + p;  // of the results
    const int mine = int(piece % PIECES);
    const float wi = w[32 * mine + lane];  // loaded beside the row's, not after them
    const float zi = here ? z[c * z_stride + p * 32 + lane] : 0.0f;
    const float2 ys = gated_norm_read<PIECES>(x, x_stride, piece / PIECES, mine, here);
    __syncthreads();  // the CTA's rows read: results may overwrite them
    float v = 0.0f;
    if (here) {
        v = gated_norm_write(ys, 32 * PIECES, eps, wi, zi, op, normed, gate, dst, piece * 32 + lane);
    }
    segment_halves<1, 1>({v}, out, c, npieces, seg);
}

// The sum of `nparts` floats `stride` apart, in order (the first plus the second, ...), their
// loads issued four at a time ahead of the adds (against one at a time, a split product with
// its gemm_sum measured 0.1-0.2 us faster on the H200: docs/BENCHMARKS.md, session 29)
__device__ __forceinline__ float parts_sum(const float * p, int nparts, int64_t stride) {
    float v = p[0];
    int q = 1;
    for (; q + 4 <= nparts; q += 4) {
        const float a = p[q * stride], b = p[(q + 1) * stride];
        const float c = p[(q + 2) * stride], d = p[(q + 3) * stride];
        v += a;
        v += b;
        v += c;
        v += d;
    }
    for (; q < nparts; q++) {
        v += p[q * stride];
    }
    return v;
}

// SWIGLU (silu(a) times b, ggml's formula) for 2-16 columns (a verify's FFN) into dense `dst`,
// a and b each `nparts` parts `part_stride` floats apart whose sums (in part order, as gemm_sum
// adds them) are the values, a column's `col_stride` apart: grid (segments of a column, padded
// columns), a CTA of GLU_WARPS warps a segment, a warp two pieces (the FFN of the 27B-shaped
// model, 34 segments of 16 columns, then fits the H200 at once: a warp a piece took a second
// wave of CTAs); writes the result, and its halves as to_halves writes them (padding columns
// zeros), or (F8: 16 columns) its e4m3 records as to_e4m3 writes them. Each element read and
// written by one lane (with one part, the result may be written over a or b).
constexpr int GLU_WARPS = GM_SEG / 2;

template <bool F8 = false>
static __global__ void __launch_bounds__(GLU_WARPS * 32)
    glu_halves(const float * a, const float * b, int64_t col_stride, int nparts,
               int64_t part_stride, float * dst, int npieces, int ncols, Halves out) {
    LUCEPY_PDL_LAUNCH();
    LUCEPY_PDL_SYNC();  // a and b: the kernels before have finished
    const int seg = blockIdx.x;
    const int c = blockIdx.y;
    float v[2] = {0.0f, 0.0f};
    float x[2], y[2];
    int p[2];  // the column's pieces
    bool here[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {  // both pieces' loads in flight before the arithmetic
        p[i] = seg * GM_SEG + threadIdx.x / 32 + i * GLU_WARPS;
        here[i] = c < ncols && p[i] < npieces;
        const int64_t at = c * col_stride + int64_t(p[i]) * 32 + threadIdx.x % 32;
        x[i] = here[i] ? parts_sum(a + at, nparts, part_stride) : 0.0f;
        y[i] = here[i] ? parts_sum(b + at, nparts, part_stride) : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < 2; i++) {
        if (here[i]) {
            v[i] = swiglu(x[i], y[i]);
            dst[(int64_t(c) * npieces + p[i]) * 32 + threadIdx.x % 32] = v[i];
        }
    }
    if constexpr (F8) {
        segment_e4m3<1, 2>(v, out, c, npieces, seg);
    } else {
        segment_halves<1, 2>(v, out, c, npieces, seg);
    }
}

// gate_quantize's twin for 2-16 columns (a verify's attention gate): act(z) * x into dense
// `dst` and its halves as to_halves writes them (padding columns zeros); x dense, a column's
// `x_col` apart. Grid (segments of a column, padded columns), a CTA of GM_SEG warps a segment, a
// warp a piece, each element read and written by one lane (dst may be written over x).
static __global__ void __launch_bounds__(GM_SEG * 32)
    gate_halves(const GateAt z, const float * x, int64_t x_col, float * dst, int npieces,
                int ncols, int op, Halves out) {
    LUCEPY_PDL_LAUNCH();
    LUCEPY_PDL_SYNC();  // z and x: the kernels before have finished
    const int seg = blockIdx.x;
    const int c = blockIdx.y;
    const int p = seg * GM_SEG + threadIdx.x / 32;  // the column's piece
    const bool piece_here = p < npieces;
    float v = 0.0f;
    if (c < ncols && piece_here) {
        const int64_t e = int64_t(p) * 32 + threadIdx.x % 32;  // of the column
        v = gate_act(gate_z(z, c, e), op) * x[c * x_col + e];
        dst[int64_t(c) * npieces * 32 + e] = v;
    }
    segment_halves<1, 1>({v}, out, c, npieces, seg);
}

}  // namespace lucepy
