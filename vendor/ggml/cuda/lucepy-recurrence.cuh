// lucepy's own kernels (issue 19, decision 12) for qwen35's Gated DeltaNet layers: the recurrence
// (`delta_net`, a rollback's layers as one launch: `delta_net_layers`), after the gates and the
// conv step of lucepy-deltanet.cuh. The device code only: lucepy-deltanet.cu hooks it into
// ggml-cuda, bench-kernels.cu times it alone.

#pragma once

#include "lucepy-deltanet.cuh"

#include <type_traits>

namespace lucepy {

// --- qwen35's gated delta net -----------------------------------------------------------------
//
// ggml's GATED_DELTA_NET with a scalar gate, state rows of 128 and no per-token snapshots, for
// any number of tokens: the same arithmetic token by token as ggml-cuda's kernel (a column of
// the state summed by a warp, each lane four of its rows, the same sums in the same order), but
// the CTA copies the q, k, v, gate and beta of DN_TILE tokens at a time into shared memory ahead
// of the recurrence (cp.async, the next tile in flight during this one), where ggml's loads them
// token by token inside it and waits on each load: 18 us a layer for a 16-token verify on the
// H200. ggml's warp sums a column's 32 lanes' parts by xor shuffles (16, 8, 4, 2, 1); here 8
// lanes hold a column (DnShape's lanes), lane j the rows of ggml's lanes j, j + 8, j + 16 and
// j + 24, so that its first two levels (16: j with j + 16, j + 8 with j + 24; 8: those two) are
// adds inside the lane and three shuffles are left on the chain from token to token, where five
// were (the same sums, in the same order: bit for bit ggml's). Each lane holds its rows of two
// columns (DnModel), so the k and q it loads from shared memory serve both: a warp keeps eight
// columns, a CTA of 4 warps 32, the 27B-shaped model's 48 heads are 192 CTAs (on the H200,
// docs/BENCHMARKS.md session 46: 9.49 us a 16-token call where a column a lane, 384 CTAs, took
// 10.04; 199.4 where 209.4 at 512 tokens; 4.47 where 4.53 at one; four columns a lane or CTAs of
// 1 or 2 warps slower at 16 tokens and more; in the model's verify no sooner, as session 40 had
// found on the kernel of then. Two columns a warp of 32 lanes, 768 CTAs: 11 us a 16-token call,
// 4.5 a decode's; a column a warp, 1,536 CTAs, took more: sessions 27 and 33.) Only S^T k's sums
// are on the chain: the outputs' (S^T q of the updated state) wait for the tile's end, all its
// tokens' shuffles side by side, and lane j of a column writes token j's. The state after the
// last token goes where the copy after the op puts it (the sequence's own state, read
// first by the same warp) and, where anything else reads it, into the op's result too; a
// verify's copy of the state before it (a DUP node that the op reads) is written as it loads,
// and a rollback's copy of the conv's tail (the CPY after the state's) by its threads. Where the
// host finds that no kernel that may still run writes the state (`early`), the state is loaded
// before the wait for the kernels before (a decode's span 5.60 -> 5.46 ms, session 28); where
// no kernel of the graph needs another's results (`alone`: a rollback's), it does not wait, and
// up to DN_LAYERS such recurrences are one launch (delta_net_layers): a rollback's 48 layers
// took 48 launches of 768 CTAs, of which PDL let about two run at once.
constexpr int DN_S = 128;
constexpr int DN_R = DN_S / 32;  // rows of each of ggml's lanes a lane holds: j + LN v + 32 r
constexpr int DN_TILE = 8;       // tokens a tile

// where row `row` of q or k sits in a tile's shared copy, for LN lanes a column: ggml lane
// j + LN v's row r (row j + LN v + 32 r) at 4 LN v + 4 j + r, so that one v's 16-byte loads by
// lanes j = 0..LN-1 read 16 LN bytes side by side (no bank conflicts; the columns of a warp read
// the same bytes). The model's 8 lanes: 32 v + 4 j + r.
template <int LN> __device__ __forceinline__ int dn_slot(int row) {
    constexpr int LG = LN == 8 ? 3 : 2;  // log2 LN (4 or 8)
    return (row >> LG & (32 / LN - 1)) * 4 * LN + (row & (LN - 1)) * 4 + (row >> 5);
}

struct DeltaNetArgs {
    const float * q, * k;  // [S, hk, T, N / rq3], rows contiguous; strides in floats
    int64_t sq1, sq2, sq3;
    const float * v;  // [S, H, T, N]
    int64_t sv1, sv2, sv3;
    const float * g, * beta;  // [1, H, T, N]
    int64_t sb1, sb2, sb3;
    const float * s0;  // [S, S, H, N] dense: column c of head h, sequence n at (n H + h) S S + c S
    float * s0_copy;   // s0 again, as loaded (a verify's copy of the state before it), or null
    float * attn;      // [S, H, T, N] dense, or null: not written
    float * state;     // [S, S, H, N] dense, as s0: the state after the last token
    float * state2;    // the same again, or null
    int H, N, T, hk, rq3;
    float scale;
    // a copy made beside the recurrence (a rollback's of the conv's tail), or tail_n 0: rows of
    // tail_row values tail_stride floats apart into `tail`, dense
    const float * tail_from;
    int64_t tail_stride;
    float * tail;
    int tail_row, tail_n;
    bool early;  // s0 loaded before the wait for the kernels before (none of them writes it)
    bool alone;  // and no wait at all (none of them writes what it reads or touches what it writes)
};

// ggml's warp sum (xor 16, 8, 4, 2, 1) of one column's 32 parts, of which lane j holds the V =
// 32 / LN parts x[v] = ggml lane j + LN v's: the levels 16 .. LN here, in its pairs (v with
// v + V / 2, then v + V / 4, ...: for 8 lanes (x[0] + x[2]) + (x[1] + x[3]))
template <int V> __device__ __forceinline__ float dn_lane_sum(const float (&x)[V]) {
    float y[V];
#pragma unroll
    for (int v = 0; v < V; v++) {
        y[v] = x[v];
    }
#pragma unroll
    for (int d = V / 2; d > 0; d /= 2) {
#pragma unroll
        for (int v = 0; v < d; v++) {
            y[v] += y[v + d];
        }
    }
    return y[0];
}

// the last levels (xor LN / 2, ..., 1) across a column's LN lanes, each of x side by side
template <int LN, int N> __device__ __forceinline__ void dn_column_sums(float (&x)[N]) {
#pragma unroll
    for (int off = LN / 2; off > 0; off >>= 1) {
        float other[N];
#pragma unroll
        for (int i = 0; i < N; i++) {
            other[i] = __shfl_xor_sync(0xFFFFFFFFu, x[i], off, 32);
        }
#pragma unroll
        for (int i = 0; i < N; i++) {
            x[i] += other[i];
        }
    }
}

// A recurrence's CTAs: W warps, LN lanes a column (each ggml's lanes j + LN v, v < 32 / LN: the
// column's sum LN lanes across, log2 LN shuffles on the chain from token to token), each lane
// holding its rows of CL columns (the k and q it loads serve them all), so a warp holds 32 / LN
// x CL columns, a CTA `cols`, a head `z` CTAs
template <int W, int CL, int LN = 8> struct DnShape {
    static constexpr int warps = W, per_lane = CL, threads = 32 * W;
    static constexpr int lanes = LN;
    static constexpr int groups = 32 / LN;  // a warp's groups of LN lanes
    static constexpr int parts = 32 / LN;   // ggml's lanes a lane holds (their parts of a sum)
    static constexpr int cols = W * groups * CL;
    static constexpr int z = DN_S / cols;
    static_assert(DN_S % cols == 0, "whole columns a CTA");
    static_assert((LN == 4 || LN == 8) && DN_TILE % LN == 0, "a lane writes tokens j + LN u");
};

using DnModel = DnShape<4, 2>;  // the model's (above)

// The CTA (h, n, z) of a's recurrence on shape D: head h, sequence n, columns D::cols z on
template <class D>
__device__ __forceinline__ void delta_net_cta(const DeltaNetArgs & a, const int h, const int n,
                                              const int z) {
    constexpr int CL = D::per_lane;
    constexpr int LN = D::lanes, V = D::parts;
    __shared__ __align__(16) float qs[2][DN_TILE][DN_S];  // rows at dn_slot<LN>
    __shared__ __align__(16) float ks[2][DN_TILE][DN_S];
    __shared__ __align__(16) float vs[2][DN_TILE][D::cols];
    __shared__ float gs[2][DN_TILE];
    __shared__ float bs[2][DN_TILE];
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int j = lane % LN;  // ggml's lanes j + LN v
    int col[CL];              // the CTA's columns of this lane
#pragma unroll
    for (int c = 0; c < CL; c++) {
        col[c] = (warp * CL + c) * D::groups + lane / LN;
    }
    const int col0 = z * D::cols;
    const int64_t qk_at = (n / a.rq3) * a.sq3 + (h % a.hk) * a.sq1;
    const float * q = a.q + qk_at;
    const float * k = a.k + qk_at;
    const float * v = a.v + n * a.sv3 + h * a.sv1 + col0;
    const int64_t gb_at = n * a.sb3 + h * a.sb1;
    const int ntiles = (a.T + DN_TILE - 1) / DN_TILE;
    constexpr int VU = D::cols / 4;  // 16-byte copies of a token's v
    // this thread's rows of q and k in a tile's copies (the same each tile): rows
    // threadIdx.x % RS + RS i of tokens t00, t00 + TS, ... (the model's 128 threads: row
    // threadIdx.x of every token), their slots worked out once (each copy's row, slot and
    // address had been a dozen instructions, a token's share of them 31 of the warp's 268:
    // Nsight Compute, docs/BENCHMARKS.md session 56)
    constexpr int RS = D::threads < DN_S ? D::threads : DN_S;
    constexpr int TS = D::threads / RS;
    constexpr int NR = DN_S / RS;
    static_assert(D::threads % RS == 0 && DN_S % RS == 0, "whole rows a thread");
    const int t00 = threadIdx.x / RS;
    int slot[NR];
#pragma unroll
    for (int i = 0; i < NR; i++) {
        slot[i] = dn_slot<LN>(int(threadIdx.x % RS) + RS * i);
    }
    const float * q_row = q + threadIdx.x % RS;
    const float * k_row = k + threadIdx.x % RS;
    auto issue = [&](int tile) {  // tile's inputs into buffer tile % 2 (past the end: empty)
        if (tile < ntiles) {
            const int t0 = tile * DN_TILE;
            const int nt = min(DN_TILE, a.T - t0);
            const int b = tile % 2;
            for (int t = t00; t < nt; t += TS) {
                const int64_t at = (t0 + t) * a.sq2;
#pragma unroll
                for (int i = 0; i < NR; i++) {
                    copy_async<4, true>(reinterpret_cast<uint8_t *>(&qs[b][t][slot[i]]),
                                        reinterpret_cast<const uint8_t *>(q_row + at + RS * i));
                    copy_async<4, true>(reinterpret_cast<uint8_t *>(&ks[b][t][slot[i]]),
                                        reinterpret_cast<const uint8_t *>(k_row + at + RS * i));
                }
            }
            if (threadIdx.x < nt * VU) {
                const int t = threadIdx.x / VU;
                const int u = 4 * (threadIdx.x % VU);
                copy_async<16, true>(reinterpret_cast<uint8_t *>(&vs[b][t][u]),
                                     reinterpret_cast<const uint8_t *>(v + (t0 + t) * a.sv2 + u));
            }
            if (threadIdx.x < nt) {
                const int t = threadIdx.x;
                const int64_t at = gb_at + (t0 + t) * a.sb2;
                copy_async<4, true>(reinterpret_cast<uint8_t *>(&gs[b][t]),
                                    reinterpret_cast<const uint8_t *>(a.g + at));
                copy_async<4, true>(reinterpret_cast<uint8_t *>(&bs[b][t]),
                                    reinterpret_cast<const uint8_t *>(a.beta + at));
            }
        }
        copy_commit();
    };
    // this lane's rows of column col0 + col[c] of this head and sequence: j + LN v + 32 r
    int64_t head[CL];
#pragma unroll
    for (int c = 0; c < CL; c++) {
        head[c] = (int64_t(n) * a.H + h) * DN_S * DN_S + int64_t(col0 + col[c]) * DN_S + j;
    }
    float s[CL][V][DN_R];
    auto each_value = [&](auto && f) {  // f(c, i, r, at) for each state value of this lane
#pragma unroll
        for (int c = 0; c < CL; c++) {
#pragma unroll
            for (int i = 0; i < V; i++) {
#pragma unroll
                for (int r = 0; r < DN_R; r++) {
                    f(c, i, r, head[c] + LN * i + 32 * r);
                }
            }
        }
    };
    auto load_state = [&]() {
        each_value([&](int c, int i, int r, int64_t at) { s[c][i][r] = a.s0[at]; });
    };
    if (a.early) {
        load_state();
    }
    if (!a.alone) {
        LUCEPY_PDL_SYNC();  // every input: the kernels before have finished
    }
    issue(0);
    if (!a.early) {
        load_state();
    }
    if (a.s0_copy) {  // (after the wait: a kernel before may still read those bytes till then)
        each_value([&](int c, int i, int r, int64_t at) { a.s0_copy[at] = s[c][i][r]; });
    }
    const int64_t threads = int64_t(a.H) * a.N * D::z * blockDim.x;  // the recurrence's
    for (int64_t e = ((int64_t(z) * a.N + n) * a.H + h) * blockDim.x + threadIdx.x; e < a.tail_n;
         e += threads) {
        a.tail[e] = a.tail_from[e / a.tail_row * a.tail_stride + e % a.tail_row];
    }
    float * attn = a.attn ? a.attn + (int64_t(n) * a.T * a.H + h) * DN_S + col0 : nullptr;
    const int64_t token_stride = int64_t(DN_S) * a.H;
    for (int tile = 0; tile < ntiles; tile++) {
        issue(tile + 1);
        copy_wait<1>();
        __syncthreads();  // tile's inputs have landed for every warp
        const int b = tile % 2;
        const int t0 = tile * DN_TILE;
        const int nt = min(DN_TILE, a.T - t0);
        // (S^T q)[col[c]] of each token's updated state, this lane's part, at out[c DN_TILE + t]
        float out[CL * DN_TILE];
#pragma unroll
        for (int t = 0; t < CL * DN_TILE; t++) {
            out[t] = 0.0f;  // (tokens past the end: never written)
        }
        // the tile's tokens; FULL (every tile of a verify's 8 or 16 tokens): all DN_TILE, no
        // branch between them, so that one token's work may fill the waits of another's (with
        // a branch a token, each waited alone on its column sums' shuffles)
        auto tokens = [&](auto full) {
#pragma unroll
            for (int t = 0; t < DN_TILE; t++) {
                if (!decltype(full)::value && t >= nt) {
                    break;
                }
                float kr[V][DN_R], qr[V][DN_R];
#pragma unroll
                for (int i = 0; i < V; i++) {
                    const int at = 4 * LN * i + 4 * j;
                    const float4 kk = *reinterpret_cast<const float4 *>(&ks[b][t][at]);
                    const float4 qq = *reinterpret_cast<const float4 *>(&qs[b][t][at]);
                    kr[i][0] = kk.x, kr[i][1] = kk.y, kr[i][2] = kk.z, kr[i][3] = kk.w;
                    qr[i][0] = qq.x, qr[i][1] = qq.y, qr[i][2] = qq.z, qr[i][3] = qq.w;
                }
                const float beta = bs[b][t];
                const float g = expf(gs[b][t]);
                float kv[CL];  // (S^T k)[col[c]], each column's sums side by side
#pragma unroll
                for (int c = 0; c < CL; c++) {
                    float x[V];  // ggml lane j + LN i's part
#pragma unroll
                    for (int i = 0; i < V; i++) {
                        x[i] = 0.0f;
#pragma unroll
                        for (int r = 0; r < DN_R; r++) {
                            x[i] += s[c][i][r] * kr[i][r];
                        }
                    }
                    kv[c] = dn_lane_sum(x);
                }
                dn_column_sums<LN>(kv);
#pragma unroll
                for (int c = 0; c < CL; c++) {
                    const float delta = (vs[b][t][col[c]] - g * kv[c]) * beta;
                    float o[V];
#pragma unroll
                    for (int i = 0; i < V; i++) {
                        o[i] = 0.0f;
#pragma unroll
                        for (int r = 0; r < DN_R; r++) {
                            s[c][i][r] = g * s[c][i][r] + kr[i][r] * delta;
                            o[i] += s[c][i][r] * qr[i][r];
                        }
                    }
                    out[c * DN_TILE + t] = dn_lane_sum(o);
                }
            }
        };
        if (nt == DN_TILE) {
            tokens(std::true_type{});
        } else {
            tokens(std::false_type{});
        }
        if (attn) {  // the tile's outputs summed across the column's lanes side by side
            dn_column_sums<LN>(out);
#pragma unroll
            for (int c = 0; c < CL; c++) {
#pragma unroll
                for (int u = 0; u < DN_TILE / LN; u++) {  // lane j writes tokens j + LN u
                    const float * its = out + c * DN_TILE + LN * u;
                    float mine = its[0];
#pragma unroll
                    for (int t = 1; t < LN; t++) {
                        mine = j == t ? its[t] : mine;
                    }
                    if (j + LN * u < nt) {
                        attn[(t0 + j + LN * u) * token_stride + col[c]] = mine * a.scale;
                    }
                }
            }
        }
        __syncthreads();  // every warp is done with buffer b: tile + 2 may land there
    }
    each_value([&](int c, int i, int r, int64_t at) {
        a.state[at] = s[c][i][r];
        if (a.state2) {
            a.state2[at] = s[c][i][r];
        }
    });
}

// grid (H, N, D::z), D::threads threads
template <class D = DnModel>
__global__ void __launch_bounds__(D::threads) delta_net(const __grid_constant__ DeltaNetArgs a) {
    LUCEPY_PDL_LAUNCH();
    delta_net_cta<D>(a, blockIdx.x, blockIdx.y, blockIdx.z);
}

// Recurrences that are `alone` (none reads or writes what another does), of the same H and N:
// as many as a launch's 4 KB of arguments hold
constexpr int DN_LAYERS = 16;

struct DeltaNetLayers {
    DeltaNetArgs a[DN_LAYERS];
    int n;
};

static_assert(sizeof(DeltaNetLayers) <= 4096, "a launch's arguments");

// grid (H, N, D::z n), D::threads threads: recurrence z / D::z's CTA (x, y, z % D::z)
template <class D = DnModel>
__global__ void __launch_bounds__(D::threads)
    delta_net_layers(const __grid_constant__ DeltaNetLayers b) {
    LUCEPY_PDL_LAUNCH();
    delta_net_cta<D>(b.a[blockIdx.z / D::z], blockIdx.x, blockIdx.y, blockIdx.z % D::z);
}

}  // namespace lucepy
