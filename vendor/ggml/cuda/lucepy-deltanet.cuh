// lucepy's own kernels (issue 19, decision 12) for qwen35's Gated DeltaNet layers, beside the
// products: the gates of a step (`delta_gates`), the short convolution and its state
// (`conv_step`: three of ggml's kernels in one) and, in lucepy-recurrence.cuh (which includes
// this), the recurrence (`delta_net`, a rollback's layers as one launch: `delta_net_layers`).
// The device code only: lucepy-deltanet.cu hooks them into ggml-cuda, bench-kernels.cu times
// them alone.

#pragma once

#include "lucepy-kernels.cuh"

#include <type_traits>

namespace lucepy {

// qwen35's DeltaNet gates of a step, tiny tensors ([heads, tokens]): ggml's ADD of the dt bias,
// SOFTPLUS and MUL by A (the decay), and the SIGMOID of beta where it comes next (alpha and
// beta columns of a wider product: a stacked product's parts); one kernel where ggml-cuda runs
// three or more, a thread an element. Each writes every node's result as ggml's kernels do
// (their formulas), but for beta's copy out of the product, which only the sigmoid read.
struct DeltaGates {
    const float * alpha;  // [n / period] columns of period, alpha_stride apart
    int64_t alpha_stride;
    const float * bias;   // [period], repeated
    const float * a;      // [period], repeated
    float * sum, * soft, * decay;
    int n, period;
    const float * beta;  // [nbeta / beta_period] columns of beta_period, beta_stride apart
    int64_t beta_stride;
    float * sig;         // [nbeta] dense, or nbeta 0
    int nbeta, beta_period;
};

// element e of the gates (a thread's), where there is one
__device__ __forceinline__ void gate_element(const DeltaGates & g, int e) {
    if (e < g.n) {
        const float s = g.alpha[int64_t(e / g.period) * g.alpha_stride + e % g.period] +
                        g.bias[e % g.period];
        const float p = s > 20.0f ? s : logf(1.0f + expf(s));
        g.sum[e] = s;
        g.soft[e] = p;
        g.decay[e] = p * g.a[e % g.period];
    }
    if (e < g.nbeta) {
        const float b = g.beta[int64_t(e / g.beta_period) * g.beta_stride + e % g.beta_period];
        g.sig[e] = 1.0f / (1.0f + expf(-b));
    }
}

// A causal depthwise convolution of K taps over a recurrent state's K - 1 saved columns and t new
// ones (qwen35's DeltaNet conv: ggml's CONCAT, the copy of the new tail into the state, SSM_CONV
// and its SiLU), one kernel where ggml-cuda runs three: grid (channels / CONV_THREADS rounded up,
// sequences, groups of per_group tokens), a thread a channel's tokens of its group. Each writes
// the joined columns `x` ([K - 1 + t, C, N], as the concat does, where anything reads them), the
// conv and its SiLU ([C, t, N]) and the new tail ([K - 1, C, N], dense) over the saved columns.
// Only the first group reads the saved columns (a group is at least K - 1 tokens), and its
// thread writes its channel's tail after them; the host checks that what is written aliases
// nothing read, or only what the same thread has read already (with one group: the new columns
// as the conv or its SiLU, the tail's new columns then taken from the CTA's copy of them in
// shared memory, session 40; the conv as its SiLU) or, for the tail, the saved columns. (A
// 16-token verify in groups of 4 tokens: 320 CTAs where a group of 16 made 80, each token's
// head norm a barrier; docs/BENCHMARKS.md, session 27.) With `heads`, the first heads
// x CONV_THREADS channels of the SiLU are also RMS-normed a head of CONV_THREADS channels at a
// time (qwen35's l2 norm of q and k: ggml's RMS_NORM then SCALE), a CTA a head. With gates
// (`g`, where the DeltaNet gates come next in the graph and share no bytes with the step), the
// CTAs past the channels' of the first sequence and group compute them as `delta_gates` would:
// one kernel less before the recurrence, which then launches only when this kernel ends (as it
// did after `delta_gates`).
constexpr int CONV_THREADS = 128;
constexpr int CONV_MAX_T = 16;
constexpr int CONV_GROUP = 4;  // tokens a CTA where groups may be (at least K - 1)

struct ConvArgs {
    const float * saved;  // [K - 1, C, N]: column j of channel c, sequence n at j + c s_c + n s_n
    int64_t s_c, s_n;
    const float * steps;  // [t, C, N]: token i of channel c, sequence n at i x_t + c x_c + n x_n
    int64_t x_t, x_c, x_n;
    const float * w;  // [K, C]: tap k of channel c at k + K c
    float * x, * tail, * conv;  // dense (x null: the joined columns unwritten, read by nobody)
    float * act;                // the conv's SiLU (dense), or null
    int heads;                  // heads normed (0: none), into normed and scaled
    float * normed, * scaled;   // [CONV_THREADS, heads, t, N], dense
    float eps, scale;           // the norm's epsilon, the scale after it
    int C, t;
    int per_group;              // tokens a CTA (grid z: groups of them; at least K - 1 a group)
};

template <int K>
__global__ void __launch_bounds__(CONV_THREADS) conv_step(const ConvArgs a, const DeltaGates g) {
    constexpr int K1 = K - 1;
    constexpr int JW = K1 + CONV_MAX_T;  // a channel's joined columns in shared memory, at most
    __shared__ float joined[CONV_THREADS * JW];  // [channel of the CTA][column - lo]
    __shared__ float head_sums[2][CONV_THREADS / 32];  // a token's squares, a warp's sum each
    const int tiles = (a.C + CONV_THREADS - 1) / CONV_THREADS;
    if (g.n == 0 && g.nbeta == 0) {
        LUCEPY_PDL_LAUNCH();
    }
    LUCEPY_PDL_SYNC();  // the new columns (and alpha, beta): the kernel before has finished
    if (int(blockIdx.x) >= tiles) {  // the gates' CTAs
        if (blockIdx.y == 0 && blockIdx.z == 0) {
            gate_element(g, (int(blockIdx.x) - tiles) * CONV_THREADS + int(threadIdx.x));
        }
        return;
    }
    const int W = K1 + a.t;
    const int i0 = blockIdx.z * a.per_group;  // this CTA's tokens i0 .. i1
    const int i1 = min(a.t, i0 + a.per_group);
    const int lo = i0 == 0 ? 0 : K1 + i0;  // and joined columns lo .. K1 + i1 (the first: saved)
    const int width = K1 + i1 - lo;
    const int c0 = blockIdx.x * CONV_THREADS;
    const int n = blockIdx.y;
    const int mine = threadIdx.x;
    const int c = c0 + mine;
    const int nc = min(CONV_THREADS, a.C - c0);
    if (c < a.C) {
        float tap[K], win[K];
#pragma unroll
        for (int k = 0; k < K; k++) {
            tap[k] = a.w[k + int64_t(K) * c];
        }
        const float * saved = a.saved + c * a.s_c + n * a.s_n;
        const float * steps = a.steps + c * a.x_c + n * a.x_n;
        auto column = [&](int j) {  // joined column j of the channel (only the first CTA: saved)
            return j < K1 ? saved[j] : steps[int64_t(j - K1) * a.x_t];
        };
#pragma unroll
        for (int j = 0; j < K1; j++) {
            win[j + 1] = column(i0 + j);
            if (i0 == 0) {
                joined[mine * JW + j] = win[j + 1];
            }
        }
        // the group's new columns, all loads in flight at once (in the loop below each would
        // wait behind the stores before it, which may lie over them)
        for (int i = i0; i < i1; i++) {
            joined[mine * JW + K1 + i - lo] = steps[i * a.x_t];
        }
        const int64_t out = c + int64_t(a.C) * a.t * n;
        for (int i = i0; i < i1; i++) {
#pragma unroll
            for (int k = 0; k < K1; k++) {
                win[k] = win[k + 1];
            }
            win[K1] = joined[mine * JW + K1 + i - lo];
            float sum = 0.0f;
#pragma unroll
            for (int k = 0; k < K; k++) {
                sum += win[k] * tap[k];
            }
            a.conv[out + int64_t(a.C) * i] = sum;
            const float y = sum / (1.0f + expf(-sum));
            if (a.act) {
                a.act[out + int64_t(a.C) * i] = y;
            }
            if (int(blockIdx.x) < a.heads) {  // (the whole CTA: c < C)
                float sq = y * y;
#pragma unroll
                for (int off = 16; off > 0; off >>= 1) {
                    sq += __shfl_xor_sync(0xFFFFFFFFu, sq, off);
                }
                if (mine % 32 == 0) {
                    head_sums[i % 2][mine / 32] = sq;
                }
                __syncthreads();
                float total = 0.0f;
#pragma unroll
                for (int wp = 0; wp < CONV_THREADS / 32; wp++) {
                    total += head_sums[i % 2][wp];
                }
                const float r = rsqrtf(total / float(CONV_THREADS) + a.eps);
                const int64_t o = c + int64_t(a.heads) * CONV_THREADS * (i + int64_t(a.t) * n);
                a.normed[o] = r * y;
                a.scaled[o] = (r * y) * a.scale;
            }
        }
        if (i0 == 0) {  // the tail, after this thread's reads of its channel's saved columns
            // In one group the CTA holds every joined column (lo 0), and the conv or its SiLU may
            // have been written over the new columns (the host allows it then): the tail comes
            // from the copy in shared memory. In groups nothing lies over the new columns.
            float * tail = a.tail + (int64_t(n) * a.C + c) * K1;
#pragma unroll
            for (int j = 0; j < K1; j++) {
                tail[j] = i1 == a.t ? joined[mine * JW + a.t + j] : column(a.t + j);
            }
        }
    }
    __syncthreads();  // the CTA's joined columns are in shared memory
    const int64_t first = int64_t(n) * a.C + c0;
    for (int e = threadIdx.x; a.x && e < nc * width; e += CONV_THREADS) {
        a.x[(first + e / width) * W + lo + e % width] = joined[(e / width) * JW + e % width];
    }
}

// The kernel after it (the recurrence, one wave of CTAs) is not let launch before it ends:
// launched while the conv step still held SMs, the recurrence's CTAs went unevenly to the SMs and
// it took 22 us a 16-token verify where it took 14.4 (docs/BENCHMARKS.md, session 28).
static __global__ void delta_gates(const DeltaGates g) {
    LUCEPY_PDL_SYNC();  // alpha and beta: the product before has finished
    gate_element(g, blockIdx.x * blockDim.x + threadIdx.x);
}

}  // namespace lucepy
