// lucepy's own kernels (issue 19, decision 12): the one-column ops around the products, each
// writing its product's int8 activations as it computes: the activations quantized (`quantize`),
// an RMS norm times its weight (`norm_quantize`), a SiLU or sigmoid gate (`gate_quantize`), a
// gated norm of short rows (`norm_gate_quantize`); also an attention head's norm and multi-section
// rope with its cache write (`norm_rope`) and the argmax of long rows (`argmax_part`,
// `argmax_rows`). The device code only, as lucepy-kernels.cuh's (whose PDL hooks it uses); a
// kernel that is no template is `static`.

#pragma once

#include "lucepy-kernels.cuh"

#include <cuda_fp16.h>

#include <cfloat>
#include <cstdint>

namespace lucepy {

// One piece of one column, its 32 values one a lane of the calling warp: `planes` planes of 32
// int8 values at (at + plane) * 32 of `xq`, each plane the rounding left by the ones before, with
// its scale and the sum of the values it stands for (scale times the sum of its int8 values) at
// at + plane of `xds`.
__device__ __forceinline__ void quantize_piece(float v, int planes, int64_t at, int8_t * xq,
                                               float2 * xds) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int k = 0; k < MAX_PLANES; k++) {
        if (k == planes) {
            break;
        }
        float amax = fabsf(v);
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, off));
        }
        const float d = amax / 127.0f;
        const int q = amax == 0.0f ? 0 : __float2int_rn(v / d);
        int sum = q;  // of the quantized values: a min's error then cancels the values' (Q4_K)
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            sum += __shfl_xor_sync(0xFFFFFFFFu, sum, off);
        }
        xq[(at + k) * 32 + lane] = int8_t(q);
        if (lane == 0) {
            xds[at + k] = make_float2(d, d * float(sum));
        }
        v -= d * float(q);  // what this plane leaves for the next
    }
}

// One warp per 32-value piece and column: the planes of quantize_piece, piece-major
// ([piece][column][plane]).
// (No __restrict__ here or in Args: ggml-cuda finds it unsafe beside programmatic dependent
// launch.)
static __global__ void quantize(const float * x, int64_t col_stride, int npieces, int ncols,
                                int planes, int8_t * xq, float2 * xds) {
    LUCEPY_PDL_LAUNCH();  // the product after this may start fetching its weights
    LUCEPY_PDL_SYNC();    // x: the kernel before has finished
    const int piece = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int c = blockIdx.y;
    const int lane = threadIdx.x % 32;
    if (piece >= npieces) {
        return;
    }
    const float v = x[c * col_stride + int64_t(piece) * 32 + lane];
    quantize_piece(v, planes, (int64_t(piece) * ncols + c) * planes, xq, xds);
}

// An RMS norm times a weight vector (ggml's RMS_NORM then MUL, as ggml-cuda fuses them) whose
// result goes to products: the result as ggml writes it, and the products' activations, in one
// kernel where there were two. CTAs of NORM_THREADS; `norm_scale` is the norm's
// factor: each thread sums the squares of values tid, tid + NORM_THREADS, ... (ggml's order),
// the warps' sums meet in shared memory.
constexpr int NORM_THREADS = 1024;

// the line at p into the SM's L1, nothing waiting for it
__device__ __forceinline__ void prefetch_l1(const void * p) {
    asm volatile("prefetch.global.L1 [%0];" ::"l"(p));
}

// the sum of v over a CTA of THREADS, every thread's, in ggml's block_reduce order: each warp's
// sum (xor shuffles 16, 8, ..., 1), then the warps' sums, those of lanes past THREADS / 32 zeros
template <int THREADS> __device__ __forceinline__ float block_sum(float v) {
    static_assert(THREADS % 32 == 0 && THREADS <= 1024, "whole warps, at most 32");
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        v += __shfl_xor_sync(0xFFFFFFFFu, v, off);
    }
    __shared__ float sums[THREADS / 32];
    if (lane == 0) {
        sums[threadIdx.x / 32] = v;
    }
    __syncthreads();
    v = lane < THREADS / 32 ? sums[lane] : 0.0f;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        v += __shfl_xor_sync(0xFFFFFFFFu, v, off);
    }
    return v;
}

__device__ __forceinline__ float norm_scale(const float * x, int n, float eps) {
    float sum = 0.0f;
    for (int i = threadIdx.x; i < n; i += NORM_THREADS) {
        sum += x[i] * x[i];
    }
    return rsqrtf(block_sum<NORM_THREADS>(sum) / float(n) + eps);
}

// One column (a decode), grid (pieces / 32 rounded up, columns): each CTA finds the norm's
// factor over the whole column (the same sum in each), then its warp w takes piece 32 x + w (a
// lane a value) into the planes of quantize_piece. (One CTA for all of a column's pieces, its 32
// warps quantizing several in turn, was no faster than ggml's norm and our quantize.)
static __global__ void __launch_bounds__(NORM_THREADS) norm_quantize(
    const float * x, int64_t x_stride, const float * w, float * dst, int64_t dst_stride, int n,
    float eps, int ncols, int planes, int8_t * xq, float2 * xds) {
    LUCEPY_PDL_LAUNCH();
    const int c = blockIdx.y;
    x += c * x_stride;
    dst += c * dst_stride;
    LUCEPY_PDL_SYNC();  // x: the kernel before has finished
    const int piece = blockIdx.x * (NORM_THREADS / 32) + threadIdx.x / 32;
    const int i = piece * 32 + threadIdx.x % 32;
    const bool mine = piece < n / 32;
    const float xi = mine ? x[i] : 0.0f;  // loaded beside the norm's sum, not after it
    const float wi = mine ? w[i] : 0.0f;
    const float scale = norm_scale(x, n, eps);
    if (mine) {
        const float v = scale * xi * wi;
        dst[i] = v;
        quantize_piece(v, planes, (int64_t(piece) * ncols + c) * planes, xq, xds);
    }
}

// An attention head's RMS norm times its weight, then its multi-section rope (ggml's RMS_NORM,
// MUL and ROPE of an MROPE or IMROPE mode: qwen35's q and k), and where a SET_ROWS of the
// rope's result comes next (k's: the f16 KV cache), that too: one kernel where ggml-cuda runs
// two or three (it fuses a rope with its norm and cache write for the NORMAL and NEOX modes
// only). The same arithmetic as ggml-cuda's kernels: a thread a value of the row (ggml's
// norm of rows under 1,024 takes 256 threads a row, each its value's square summed the same
// way: the warp, then the warps' sums), the rope's angle and rotation as its rope_multi
// writes them; the norm's and the weight's results are not written (only the rope reads them).
struct NormRope {
    const float * x;  // rows of n: head h of token t at x[t x_tok + h x_row]
    int64_t x_row, x_tok;
    const float * w;  // [n]
    float * dst;      // the rope's result, dense [n, heads, tokens]
    half * cache;     // or null: token t's heads, as one row, into row rows[t] of cache
    int64_t cache_row;  // (halves)
    const int64_t * rows;
    const int32_t * pos;       // [4 tokens]: the sections' positions
    const float * freq_factors;  // [n_dims / 2], or null
    int n, heads, tokens, n_dims, n_offs;
    float eps, theta_scale, freq_scale, ext_factor, attn_factor, corr0, corr1;
    int sections[4];
    bool imrope;
};

constexpr int NR_THREADS = 256;  // a row of up to 256 values, a thread each

// grid (heads, tokens), NR_THREADS threads
static __global__ void __launch_bounds__(NR_THREADS) norm_rope(const __grid_constant__ NormRope a) {
    LUCEPY_PDL_LAUNCH();
    const int h = blockIdx.x;
    const int t = blockIdx.y;
    const int i = threadIdx.x;
    const float * x = a.x + t * a.x_tok + h * a.x_row;
    const float wi = i < a.n ? a.w[i] : 0.0f;
    LUCEPY_PDL_SYNC();  // x and pos: the kernels before have finished
    const float xi = i < a.n ? x[i] : 0.0f;
    const float scale = rsqrtf(block_sum<NR_THREADS>(xi * xi) / a.n + a.eps);
    __shared__ float y[NR_THREADS];
    y[i] = scale * xi * wi;
    __syncthreads();
    if (i >= a.n) {
        return;
    }
    // channel i: rotated (the pair n_offs + k, n_offs + k + n_dims / 2) or passed through
    float v = y[i];
    const int half_dims = a.n_dims / 2;
    const int r = i - a.n_offs;
    if (r >= 0 && r < a.n_dims) {
        const int k = r < half_dims ? r : r - half_dims;
        const int iw = 2 * k;
        const int sect_dims = a.sections[0] + a.sections[1] + a.sections[2] + a.sections[3];
        const int sec_w = a.sections[1] + a.sections[0];
        const int sector = (iw / 2) % sect_dims;
        int p;  // which section's position
        if (a.imrope) {
            p = sector % 3 == 1 && sector < 3 * a.sections[1]   ? 1
                : sector % 3 == 2 && sector < 3 * a.sections[2] ? 2
                : sector % 3 == 0 && sector < 3 * a.sections[0] ? 0
                                                                 : 3;
        } else {
            p = sector < a.sections[0]                                       ? 0
                : sector < sec_w                                             ? 1
                : sector < sec_w + a.sections[2]                             ? 2
                                                                             : 3;
        }
        const float theta_base = a.pos[t + a.tokens * p] * powf(a.theta_scale, iw / 2.0f);
        const float ff = a.freq_factors ? a.freq_factors[iw / 2] : 1.0f;
        const float theta_extrap = theta_base / ff;
        const float theta_interp = a.freq_scale * theta_extrap;
        float theta = theta_interp;
        float mscale = a.attn_factor;
        if (a.ext_factor != 0.0f) {
            const float ramp_y = (iw / 2 - a.corr0) / fmaxf(0.001f, a.corr1 - a.corr0);
            const float ramp_mix = (1.0f - fminf(1.0f, fmaxf(0.0f, ramp_y))) * a.ext_factor;
            theta = theta_interp * (1 - ramp_mix) + theta_extrap * ramp_mix;
            mscale *= 1.0f + 0.1f * logf(1.0f / a.freq_scale);
        }
        const float cos_theta = cosf(theta) * mscale;
        const float sin_theta = sinf(theta) * mscale;
        const float x0 = y[a.n_offs + k];
        const float x1 = y[a.n_offs + k + half_dims];
        v = r < half_dims ? x0 * cos_theta - x1 * sin_theta : x0 * sin_theta + x1 * cos_theta;
    }
    a.dst[(int64_t(t) * a.heads + h) * a.n + i] = v;
    if (a.cache) {
        a.cache[a.rows[t] * a.cache_row + int64_t(h) * a.n + i] = __float2half(v);
    }
}

// A SiLU or sigmoid gate, act(z) * x (ggml's UNARY then MUL, as ggml-cuda fuses them), whose
// result a product reads as one column: the result as ggml writes it and its planes as
// `quantize` writes them, one warp a piece.
enum Gate : int { GATE_SILU = 0, GATE_SIGMOID = 1 };

// Where a gate's z lies: element e of column c at z[c col + (e / len) row + e % len] (dense:
// len a column's values; read in place, the view a CONT copied: qwen35's attention gate, each
// head's `len` values beside its query in the stacked product)
struct GateAt {
    const float * z;
    int len;
    int64_t row, col;
};

__device__ __forceinline__ float gate_z(const GateAt & z, int c, int64_t e) {
    return z.z[c * z.col + e / z.len * z.row + e % z.len];
}

__device__ __forceinline__ float gate_act(float g, int op) {
    return op == GATE_SILU ? g / (1.0f + expf(-g)) : 1.0f / (1.0f + expf(-g));
}

static __global__ void gate_quantize(const GateAt z, const float * x, float * dst, int npieces,
                                     int op, int planes, int8_t * xq, float2 * xds) {
    LUCEPY_PDL_LAUNCH();
    LUCEPY_PDL_SYNC();  // z and x: the kernel before has finished
    const int piece = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (piece >= npieces) {
        return;
    }
    const int64_t i = int64_t(piece) * 32 + threadIdx.x % 32;
    const float v = gate_act(gate_z(z, 0, i), op) * x[i];
    dst[i] = v;
    quantize_piece(v, planes, int64_t(piece) * planes, xq, xds);
}

// Short rows each RMS-normed times a weight vector, then gated (qwen35's gated norm: ggml's
// RMS_NORM, MUL, SiLU or sigmoid of z, MUL), the result read by a product as one column: one warp
// a 32-value piece of a row of n = 32 PIECES values, a CTA of 8 warps whole rows (each warp sums
// the squares of its whole row, each lane PIECES of them); writes the three nodes' results as
// ggml does and the last one's planes as `quantize` writes them (row r's pieces r PIECES ...).
// The CTA reads its rows before any result is written (a result may be written over x). ggml-cuda
// runs two kernels for it (the norm and its weight, the gate), and ours quantized. (A warp a row,
// quantizing its pieces in turn, was no faster than the two.)
constexpr int NORM_GATE_WARPS = 8;

// A gated norm's reads (norm_gate_quantize, norm_gate_halves): this lane's value of piece `mine`
// of row `row` (rows of n = 32 PIECES values) and the row's sum of squares, summed over the warp
// (each lane PIECES of them). The whole warp calls it.
template <int PIECES>
__device__ __forceinline__ float2 gated_norm_read(const float * x, int64_t x_stride, int64_t row,
                                                  int mine, bool here) {
    const int lane = threadIdx.x % 32;
    float y = 0.0f;
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < PIECES; j++) {
        const float v = here ? x[row * x_stride + 32 * j + lane] : 0.0f;
        sum += v * v;
        y = j == mine ? v : y;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        sum += __shfl_xor_sync(0xFFFFFFFFu, sum, off);
    }
    return make_float2(y, sum);
}

// ... then its writes, at i of the three dense results as ggml writes them (the norm times its
// weight `wv`, the gate of `g`, their product), after every read of the CTA's rows (a result may
// be written over x); the gated value
__device__ __forceinline__ float gated_norm_write(float2 ys, int n, float eps, float wv, float g,
                                                  int op, float * normed, float * gate,
                                                  float * dst, int64_t i) {
    const float scale = rsqrtf(ys.y / float(n) + eps);
    const float y = scale * ys.x * wv;
    const float act = gate_act(g, op);
    normed[i] = y;
    gate[i] = act;
    dst[i] = y * act;
    return y * act;
}

template <int PIECES>
__global__ void __launch_bounds__(NORM_GATE_WARPS * 32) norm_gate_quantize(
    const float * x, int64_t x_stride, const float * w, const float * z, float * normed,
    float * gate, float * dst, int nrows, float eps, int op, int planes, int8_t * xq,
    float2 * xds) {
    static_assert(NORM_GATE_WARPS % PIECES == 0, "a CTA holds whole rows");
    LUCEPY_PDL_LAUNCH();
    LUCEPY_PDL_SYNC();  // x and z: the kernels before have finished
    const int piece = blockIdx.x * NORM_GATE_WARPS + threadIdx.x / 32;
    const int row = piece / PIECES;
    const int mine = piece % PIECES;
    const int lane = threadIdx.x % 32;
    const bool here = row < nrows;
    const int64_t i = int64_t(piece) * 32 + lane;
    const float wi = w[32 * mine + lane];  // loaded beside the row's, not after them
    const float zi = here ? z[i] : 0.0f;
    const float2 ys = gated_norm_read<PIECES>(x, x_stride, row, mine, here);
    __syncthreads();  // the CTA's rows read: results may overwrite them
    if (!here) {
        return;
    }
    const float v = gated_norm_write(ys, 32 * PIECES, eps, wi, zi, op, normed, gate, dst, i);
    quantize_piece(v, planes, int64_t(piece) * planes, xq, xds);
}

// The argmax of long rows (a greedy step's logits over the vocabulary), where ggml-cuda runs one
// CTA a row (about 90 us over 248,320 logits on an H200): `argmax_part` gives each CTA of grid
// (slices, rows) ARGMAX_SLICE values of a row and writes their largest and its column;
// `argmax_rows` takes a row's slices. Ties go to the lowest column; NaN is never the largest,
// and a row of NaN or -inf only gives -1 (as ggml's).
constexpr int ARGMAX_THREADS = 256;
constexpr int ARGMAX_SLICE = 2048;

struct Best {
    float v;
    int i;
};

__device__ __forceinline__ Best better(Best a, Best b) {
    return (b.v > a.v || (b.v == a.v && b.i >= 0 && (a.i < 0 || b.i < a.i))) ? b : a;
}

// the largest of the CTA's `mine`, in every thread
__device__ __forceinline__ Best cta_best(Best mine) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const Best other = {__shfl_xor_sync(0xFFFFFFFFu, mine.v, off),
                            __shfl_xor_sync(0xFFFFFFFFu, mine.i, off)};
        mine = better(mine, other);
    }
    __shared__ Best warps[ARGMAX_THREADS / 32];
    if (threadIdx.x % 32 == 0) {
        warps[threadIdx.x / 32] = mine;
    }
    __syncthreads();
    Best best = warps[0];
#pragma unroll
    for (int w = 1; w < ARGMAX_THREADS / 32; w++) {
        best = better(best, warps[w]);
    }
    return best;
}

static __global__ void __launch_bounds__(ARGMAX_THREADS)
    argmax_part(const float * x, int64_t row_stride, int ncols, Best * parts) {
    LUCEPY_PDL_LAUNCH();
    LUCEPY_PDL_SYNC();  // x: the kernel before has finished
    const float * row = x + blockIdx.y * row_stride;
    const int first = blockIdx.x * ARGMAX_SLICE;
    const int end = min(ncols, first + ARGMAX_SLICE);
    Best mine = {-FLT_MAX, -1};
    for (int c = first + threadIdx.x; c < end; c += ARGMAX_THREADS) {
        const float v = row[c];
        if (v > mine.v) {  // (in column order: the first of equals stays)
            mine = {v, c};
        }
    }
    const Best best = cta_best(mine);
    if (threadIdx.x == 0) {
        parts[int64_t(blockIdx.y) * gridDim.x + blockIdx.x] = best;
    }
}

static __global__ void __launch_bounds__(ARGMAX_THREADS)
    argmax_rows(const Best * parts, int nslices, int32_t * dst) {
    LUCEPY_PDL_LAUNCH();
    LUCEPY_PDL_SYNC();  // the parts
    Best mine = {-FLT_MAX, -1};
    for (int s = threadIdx.x; s < nslices; s += ARGMAX_THREADS) {
        mine = better(mine, parts[int64_t(blockIdx.x) * nslices + s]);
    }
    const Best best = cta_best(mine);
    if (threadIdx.x == 0) {
        dst[blockIdx.x] = best.i;
    }
}

}  // namespace lucepy
