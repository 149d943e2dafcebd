// lucepy's product kernels (lucepy-kernels.cuh, lucepy-gemm.cuh; lucepy-repack.cuh's on a
// repacked copy of the same matrix: Q4_0, Q4_K, Q5_K, Q6_K) alone on a GPU, without ggml:
// each way to launch them on the decode shapes of the 27B-shaped model, their time per call and
// the weight bytes read per second, and each result against the same math on the host
// (lucepy-quants.cuh), on the same rounded weights and activations. One column (gemv: rows per
// warp, warps per row) against a plain streaming read of the same bytes; with --cols, gemm for
// those counts of columns (stages, warps, parts) against gemv's one column.
//
//     nvcc -O3 -std=c++17 -arch=sm_90 -o bench-kernels bench-kernels.cu
//     ./bench-kernels [--quick] [--kind KIND] [--shape NAME] [--cols 1,2,4,8,16]
//     (KIND: q4_0, q4_K, q8_0, q6_K by default; also q5_K, iq4_xs, q4_1, q5_1 when named)
//     BENCH_ONCE=1 ncu --kernel-name regex:gemv ./bench-kernels --quick --shape ffn_down
//     (BENCH_FEW=1: of gemm's launches only lucepy-mm.cu's, beside the repacked Q4_0's)
//     ./bench-kernels --sum-norm   (a verify's residual sum and next RMS norm: gemm_sum and
//     norm_halves against sum_norm_halves, their results compared byte for byte; then the FFN's
//     GLU writing halves and writing e4m3 records)
//     ./bench-kernels --e4m3   (f8_of against the non-saturating conversion, every float)
//     ./bench-kernels --overlap   (a product on a second stream beside the DeltaNet recurrence)
//     ./bench-kernels --mma-rate   (mma.sync's rate alone: warps an SM, chains, unpacking beside;
//     m16n8k32 on s8 and e4m3; a Q4_0 piece at 16 columns from shared memory four ways)
//     ./bench-kernels --delta-net   (the recurrence's CTA shapes, warps and columns a lane, at 1
//     to 512 tokens: us a call, each against the host's recurrence in double and the model's)
//     BENCH_FEW=1 ./bench-kernels --kind q4_0 --cols 16 --anatomy   (the repacked Q4_0's gemm_r
//     beside itself with parts of its work left out: its loads alone, its compute alone, ...)
//     ./bench-kernels --kind q4_0 --cols 8,16 --timeline   (gemm_r's and gemm_rb's CTAs, each
//     stamping its start, first barrier, chunks and end: their lives, waits and the tail)
//     BENCH_FEW=1 ./bench-kernels --kind q4_0 --cols 9,16 --f8   (gemm_f8 on Hopper's FP8
//     wgmma beside gemm_rb: time, and error against the exact sums of the unrounded x)
//     BENCH_IN_L2=1 ...   (each matrix one copy, read from the L2 cache where it fits)
//     BENCH_FEW=1 ./bench-kernels --kind q6_K --cols 1,2,16   (Q6_K repacked: gemv_r's splits
//     against the blocks' gemv, gemm_rb against their gemm; --kind q5_K the same for Q5_K)
//
// The weights are random bytes with finite scales, several copies of each matrix in turn so that
// no call finds its weights in the L2 cache. Times: a CUDA graph of 20 calls, replayed 10 times,
// the median replay over 20.

#include "lucepy-kernels.cuh"
#include "lucepy-deltanet.cuh"
#include "lucepy-gemm.cuh"
#include "lucepy-repack.cuh"
#include "lucepy-f8.cuh"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

using namespace lucepy;

#define CHECK(x)                                                                                \
    do {                                                                                        \
        cudaError_t e_ = (x);                                                                   \
        if (e_ != cudaSuccess) {                                                                \
            std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));    \
            std::exit(1);                                                                       \
        }                                                                                       \
    } while (0)

namespace {

const char * kind_name(int k) {
    switch (k) {
        case Q4_0: return "q4_0";
        case Q8_0: return "q8_0";
        case Q4_K: return "q4_K";
        case Q6_K: return "q6_K";
        case Q4_1: return "q4_1";
        case Q5_1: return "q5_1";
        case Q5_K: return "q5_K";
        default: return "iq4_xs";
    }
}

int block_bytes(int k) {
    return with_kind(k, [](auto kk) { return Layout<decltype(kk)::value>::bytes; });
}

int block_values(int k) {
    return with_kind(k, [](auto kk) { return 32 * Layout<decltype(kk)::value>::pieces; });
}

void put_half(uint8_t * p, float v) {
    const __half h = __float2half(v);
    std::memcpy(p, &h, 2);
}

// random quants with finite, moderate scales
void fill_block(int k, uint8_t * b, std::mt19937 & rng) {
    std::uniform_real_distribution<float> scale(0.002f, 0.02f);
    for (int i = 0; i < block_bytes(k); i += 4) {
        const uint32_t r = rng();
        std::memcpy(b + i, &r, std::min(4, block_bytes(k) - i));
    }
    if (k == Q4_0 || k == Q8_0) {
        put_half(b, scale(rng));
    } else if (k == Q4_1 || k == Q5_1) {
        put_half(b, scale(rng));
        put_half(b + 2, -scale(rng));
    } else if (k == Q4_K || k == Q5_K) {
        put_half(b, scale(rng) / 16);
        put_half(b + 2, scale(rng) / 16);
    } else if (k == IQ4_XS) {
        put_half(b, scale(rng) / 64);
    } else {
        put_half(b + 208, scale(rng) / 16);
    }
}

template <int K>
float host_dot_row(const uint8_t * row, int npieces, const int8_t * xq, const float2 * xds) {
    using L = Layout<K>;
    double sum = 0;
    for (int piece = 0; piece < npieces; piece++) {
        Piece p;
        unpack<K>(row + (piece / L::pieces) * L::bytes, piece % L::pieces, p);
        for (int k = 0; k < planes_of(K); k++) {
            const int64_t at = int64_t(piece) * planes_of(K) + k;
            int x[8];
            std::memcpy(x, xq + at * 32, 32);
            sum += dot(p, x, xds[at].x, xds[at].y);
        }
    }
    return float(sum);
}

float host_dot(int k, const uint8_t * row, int npieces, const int8_t * xq, const float2 * xds) {
    return with_kind(k, [&](auto kk) {
        return host_dot_row<decltype(kk)::value>(row, npieces, xq, xds);
    });
}

float host_glu(int op, float x, float g) {
    if (op == GLU_GEGLU) {
        const float c = 0.79788456080286535588f;
        return x * 0.5f * g * (1.0f + std::tanh(c * g * (1.0f + 0.044715f * g * g)));
    }
    return x * g / (1.0f + std::exp(-g));
}

// a plain streaming read: every 16 bytes once, one sum per thread written
__global__ void read_all(const int4 * p, int64_t n, int * out) {
    int acc = 0;
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
         i += int64_t(gridDim.x) * blockDim.x) {
        const int4 v = __ldcs(p + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x7fffffff) {
        out[0] = acc;  // never, in practice: keeps the loads
    }
}

template <typename F> void raise_smem(F kernel, int smem) {
    if (smem > 48 * 1024) {
        CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    }
}

template <int K, bool GATE, int R, int U, int SPLIT, int P = 64, int ST = 3>
void launch_gemv(const Args & a, cudaStream_t s) {
    const int smem = gemv_smem<K, GATE, R, U, P, ST>(a.npieces, SPLIT);
    auto kernel = gemv<K, GATE, R, U, SPLIT, P, ST>;
    raise_smem(kernel, smem);
    const int64_t warps = int64_t((a.nrows + R - 1) / R) * SPLIT;
    kernel<<<unsigned((warps + GV_WARPS - 1) / GV_WARPS), GV_WARPS * 32, smem, s>>>(a);
}

// warps of the kernel that fit on the GPU at once
template <typename F> int64_t slots_of(F kernel, int smem) {
    raise_smem(kernel, smem);
    int per_sm = 0, sms = 0;
    CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, GV_WARPS * 32, smem));
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    return int64_t(per_sm) * GV_WARPS * sms;
}

// the split that lucepy-mm.cu chooses (gemv_split), from the occupancy calculator's slots
template <int K, bool GATE, int U> void launch_auto(const Args & a, cudaStream_t s) {
    auto slots = [](auto kernel, int smem) { return slots_of(kernel, smem); };
    switch (gemv_pick<K, GATE, 1, U>(a.nrows, a.npieces, slots)) {
        case 1: launch_gemv<K, GATE, 1, U, 1>(a, s); break;
        case 2: launch_gemv<K, GATE, 1, U, 2>(a, s); break;
        default: launch_gemv<K, GATE, 1, U, 4>(a, s); break;
    }
}

struct Shape {
    const char * what;
    int k;     // row length (values)
    int rows;
    bool gate;
};

struct Variant {
    std::string name;
    std::function<void(const Args &, cudaStream_t)> run;
};

// the split lucepy-mm.cu chooses, then each split; two rows a warp
template <int K, int U> std::vector<Variant> variants(bool gate) {
    if (gate) {
        return {{"auto", launch_auto<K, true, U>},
                {"split 1", launch_gemv<K, true, 1, U, 1>},
                {"split 2", launch_gemv<K, true, 1, U, 2>},
                {"split 4", launch_gemv<K, true, 1, U, 4>}};
    }
    return {{"auto", launch_auto<K, false, U>},
            {"split 1", launch_gemv<K, false, 1, U, 1>},
            {"split 2", launch_gemv<K, false, 1, U, 2>},
            {"split 4", launch_gemv<K, false, 1, U, 4>},
            {"R2", launch_gemv<K, false, 2, U, 1>}};
}

template <int K> std::vector<Variant> variants(bool gate, int unit) {
    return unit == 16 ? variants<K, 16>(gate)
         : unit == 8  ? variants<K, 8>(gate)
                      : variants<K, 4>(gate);
}

std::vector<Variant> variants_of(int k, bool gate, int unit) {
    return with_kind(k, [&](auto kk) { return variants<decltype(kk)::value>(gate, unit); });
}

float median(std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

// time per call (us) of `run(i)` for calls i = 0..19 captured in a graph; under a profiler
// (BENCH_ONCE set) one call and no time, so that each variant launches its kernels twice
float time_calls(cudaStream_t s, const std::function<void(int)> & run) {
    if (std::getenv("BENCH_ONCE")) {
        run(0);
        CHECK(cudaStreamSynchronize(s));
        return 0.0f;
    }
    for (int i = 0; i < 3; i++) {
        run(i);
    }
    CHECK(cudaStreamSynchronize(s));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < 20; i++) {
        run(i);
    }
    CHECK(cudaStreamEndCapture(s, &graph));
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    std::vector<float> t;
    for (int rep = 0; rep < 20; rep++) {
        CHECK(cudaEventRecord(e0, s));
        CHECK(cudaGraphLaunch(exec, s));
        CHECK(cudaEventRecord(e1, s));
        CHECK(cudaEventSynchronize(e1));
        float ms;
        CHECK(cudaEventElapsedTime(&ms, e0, e1));
        t.push_back(ms * 1e3f / 20);
    }
    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphDestroy(graph));
    CHECK(cudaEventDestroy(e0));
    CHECK(cudaEventDestroy(e1));
    return median(t);
}

int failures = 0;
int g_sms = 0;  // the GPU's multiprocessors: the streaming read runs 16 blocks on each

void bench(int k, const Shape & sh, cudaStream_t s, std::mt19937 & rng) {
    const int npieces = sh.k / 32;
    const int64_t row_bytes = int64_t(sh.k / block_values(k)) * block_bytes(k);
    const int64_t mat_bytes = row_bytes * sh.rows;
    const int64_t touched = mat_bytes * (sh.gate ? 2 : 1);
    const int copies = int(std::max<int64_t>(2, (int64_t(1) << 30) / touched));  // >= 1 GiB

    std::vector<uint8_t> host(mat_bytes * 2);  // the product's matrix, then the gate's
    for (int64_t b = 0; b < int64_t(host.size()) / block_bytes(k); b++) {
        fill_block(k, host.data() + b * block_bytes(k), rng);
    }
    uint8_t * w;
    CHECK(cudaMalloc(&w, size_t(touched) * copies));
    for (int c = 0; c < copies; c++) {
        CHECK(cudaMemcpy(w + touched * c, host.data(), size_t(touched), cudaMemcpyHostToDevice));
    }

    std::vector<float> x(sh.k);
    std::uniform_real_distribution<float> val(-1.0f, 1.0f);
    for (float & v : x) {
        v = val(rng);
    }
    float * dx;
    int8_t * xq;
    float2 * xds;
    float * dst;
    CHECK(cudaMalloc(&dx, x.size() * sizeof(float)));
    const int planes = planes_of(k);
    CHECK(cudaMalloc(&xq, size_t(npieces) * planes * 32));
    CHECK(cudaMalloc(&xds, size_t(npieces) * planes * sizeof(float2)));
    CHECK(cudaMalloc(&dst, size_t(sh.rows) * sizeof(float)));
    CHECK(cudaMemcpy(dx, x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice));
    quantize<<<dim3((npieces + 7) / 8, 1), 256, 0, s>>>(dx, sh.k, npieces, 1, planes, xq, xds);
    std::vector<int8_t> hq(size_t(npieces) * planes * 32);
    std::vector<float2> hds(size_t(npieces) * planes);
    CHECK(cudaMemcpy(hq.data(), xq, hq.size(), cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(hds.data(), xds, hds.size() * sizeof(float2), cudaMemcpyDeviceToHost));

    // the exact math on the host, for a sample of rows
    std::vector<int> check_rows;
    for (int r = 0; r < sh.rows; r += std::max(1, sh.rows / 61)) {
        check_rows.push_back(r);
    }
    check_rows.push_back(sh.rows - 1);
    std::vector<float> want(check_rows.size());
    float scale = 0;
    for (size_t i = 0; i < check_rows.size(); i++) {
        const int r = check_rows[i];
        float v = host_dot(k, host.data() + r * row_bytes, npieces, hq.data(), hds.data());
        if (sh.gate) {
            const uint8_t * gate_row = host.data() + mat_bytes + r * row_bytes;
            const float g = host_dot(k, gate_row, npieces, hq.data(), hds.data());
            v = host_glu(GLU_SWIGLU, v, g);
        }
        want[i] = v;
        scale = std::max(scale, std::fabs(v));
    }

    Args a = {};
    a.row_stride = row_bytes;
    a.xq = reinterpret_cast<const int *>(xq);
    a.xds = xds;
    a.dst = dst;
    a.glu_op = GLU_SWIGLU;
    a.nrows = sh.rows;
    a.npieces = npieces;
    const int unit = row_bytes % 16 == 0 ? 16 : row_bytes % 8 == 0 ? 8 : 4;

    int * sink;
    CHECK(cudaMalloc(&sink, sizeof(int)));
    const float t_read = time_calls(s, [&](int i) {
        const int4 * from = reinterpret_cast<const int4 *>(w + touched * (i % copies));
        read_all<<<g_sms * 16, 256, 0, s>>>(from, touched / 16, sink);
    });
    std::printf("%-5s %-10s k=%-6d rows=%-7d %7.1f MB  read: %7.2f us %6.0f GB/s\n",
                kind_name(k), sh.what, sh.k, sh.rows, touched / 1e6, t_read,
                touched / t_read / 1e3);

    for (const Variant & v : variants_of(k, sh.gate, unit)) {
        auto run = [&](int i) {
            Args b = a;
            b.w = w + touched * (i % copies);
            b.gate = sh.gate ? b.w + mat_bytes : nullptr;
            v.run(b, s);
        };
        CHECK(cudaMemset(dst, 0, size_t(sh.rows) * sizeof(float)));
        run(0);
        CHECK(cudaGetLastError());
        std::vector<float> got(sh.rows);
        CHECK(cudaMemcpy(got.data(), dst, got.size() * sizeof(float), cudaMemcpyDeviceToHost));
        float err = 0;
        for (size_t i = 0; i < check_rows.size(); i++) {
            err = std::max(err, std::fabs(got[check_rows[i]] - want[i]));
        }
        const float rel = err / std::max(scale, 1e-30f);
        const bool ok = rel < 1e-4f;
        failures += !ok;
        const float t = time_calls(s, run);
        std::printf("      %-10s %8.2f us %6.0f GB/s  %.2fx read   err %.1e%s\n", v.name.c_str(),
                    t, touched / t / 1e3, t_read / t, rel, ok ? "" : "  WRONG");
    }
    CHECK(cudaFree(w));
    CHECK(cudaFree(dx));
    CHECK(cudaFree(xq));
    CHECK(cudaFree(xds));
    CHECK(cudaFree(dst));
    CHECK(cudaFree(sink));
}


// --- 2 to 16 columns: gemm -------------------------------------------------------------------

// the exact math on the rounded weights and on the halves gemm multiplies (x rounded as
// to_halves rounds it), a row and column
template <int K>
double host_gemm_row(const uint8_t * row, int npieces, const float * xr) {
    using L = Layout<K>;
    double sum = 0;
    for (int piece = 0; piece < npieces; piece++) {
        Piece p;
        unpack<K>(row + (piece / L::pieces) * L::bytes, piece % L::pieces, p);
        for (int i = 0; i < 32; i++) {
            const int q = int(int8_t(p.q[i / 4] >> (8 * (i % 4))));
            const double w = double(p.scale[i / 16]) * q - p.bias;
            sum += w * xr[piece * 32 + i];
        }
    }
    return sum;
}

double host_gemm(int k, const uint8_t * row, int npieces, const float * xr) {
    return with_kind(k, [&](auto kk) {
        return host_gemm_row<decltype(kk)::value>(row, npieces, xr);
    });
}

// A product's results dst [ncols][nrows] (on the device) against the host's exact sums of the
// rows `check_rows` of `host` (kind k, rows row_bytes apart) and x [ncols][npieces x 32], every
// col_step-th column: the worst column's largest error over its largest exact sum
double worst_error(int k, const std::vector<uint8_t> & host, int64_t row_bytes, int npieces,
                   const float * x, const float * dst, int nrows, int ncols,
                   const std::vector<int> & check_rows, int col_step = 1) {
    std::vector<float> got(size_t(ncols) * nrows);
    CHECK(cudaMemcpy(got.data(), dst, got.size() * sizeof(float), cudaMemcpyDeviceToHost));
    double worst = 0;
    for (int c = 0; c < ncols; c += col_step) {
        double err = 0, scale = 0;
        for (int r : check_rows) {
            const double want = host_gemm(k, host.data() + r * row_bytes, npieces,
                                          x + size_t(c) * npieces * 32);
            err = std::max(err, std::fabs(got[size_t(c) * nrows + r] - want));
            scale = std::max(scale, std::fabs(want));
        }
        worst = std::max(worst, err / std::max(scale, 1e-30));
    }
    return worst;
}

// CTAs of the kernel that fit on an SM at once
template <typename F> int ctas_per_sm(F kernel, int threads, int smem) {
    raise_smem(kernel, smem);
    int per_sm = 0;
    CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
    return per_sm;
}

// a product's kernel by `plan`, then (`sum`) gemm_sum adding its parts in order
template <typename F>
void launch_planned(F kernel, int threads, int smem, const GemmPlan & plan, GemmArgs a,
                    float * parts_buf, cudaStream_t s, bool sum = true) {
    raise_smem(kernel, smem);
    a.per_part = plan.per_part;
    a.parts = parts_buf;
    kernel<<<plan.grid, threads, smem, s>>>(a);
    if (plan.grid.y > 1 && sum) {
        const int64_t n = int64_t(a.nrows) * a.ncols;
        gemm_sum<<<unsigned((n + 255) / 256), 256, 0, s>>>(
            a.parts, int(plan.grid.y), a.nrows, a.ncols, a.dst, a.dst_stride, nullptr, 0);
    }
}

template <int K, int NT, int P, int ST, int W, int MINB = 16 / W, int MOST = 16>
void launch_gemm(GemmArgs a, float * parts_buf, cudaStream_t s) {
    auto kernel = gemm<K, NT, P, ST, W, MINB>;
    using G = Gm<K, NT, P, ST, W>;
    const int per_sm = ctas_per_sm(kernel, W * 32, G::smem);
    launch_planned(kernel, W * 32, G::smem,
                   gemm_plan(a.nrows, a.npieces, G::rows, P, int64_t(per_sm) * g_sms, MOST), a,
                   parts_buf, s);
}

struct GemmVariant {
    std::string name;
    std::function<void(const GemmArgs &, float *, cudaStream_t)> run;
    bool partial = false;  // leaves out part of the work (--anatomy): timed, its result not checked
};

// lucepy-mm.cu's launch, then others measured against it (docs/BENCHMARKS.md, sessions 17 and
// 20): more CTAs an SM, more stages, smaller chunks, 8 warps and one part were all slower or
// the same; so was a warp streaming its own rows (gemm_w, at 627d6e3), the parts of a
// split product as a cluster adding them up in place of gemm_sum (cluster_sum, at ae2cd28), and
// two accumulators a tile (CHAINS, at f7dc19f)
template <int K, int NT> std::vector<GemmVariant> gemm_variants() {
    std::vector<GemmVariant> out = {
        {"gemm", launch_gemm<K, NT, 8, 2, 4>},  // as lucepy-mm.cu launches it
        {"3 stages", launch_gemm<K, NT, 8, 3, 4>},
        {"4 stages", launch_gemm<K, NT, 8, 4, 4>},
        {"16 pieces 3st", launch_gemm<K, NT, 16, 3, 4>},
        {"5 a SM", launch_gemm<K, NT, 8, 2, 4, 5>},
        {"8 warps", launch_gemm<K, NT, 8, 2, 8>},
        {"one part", launch_gemm<K, NT, 8, 2, 4, 4, 1>}};
    if constexpr (Layout<K>::pieces <= 4) {  // chunks of 4 pieces: Q4_0 and Q8_0
        out.push_back({"P4 3st 6/SM", launch_gemm<K, NT, 4, 3, 4, 6>});
        out.push_back({"P4 2st 8/SM", launch_gemm<K, NT, 4, 2, 4, 8>});
        out.push_back({"P4 4st 5/SM", launch_gemm<K, NT, 4, 4, 4, 5>});
    }
    return out;
}

template <int K> std::vector<GemmVariant> gemm_variants(int ncols) {
    return ncols <= GM_COL_TILE ? gemm_variants<K, 1>() : gemm_variants<K, 2>();
}

std::vector<GemmVariant> gemm_variants_of(int k, int ncols) {
    return with_kind(k, [&](auto kk) { return gemm_variants<decltype(kk)::value>(ncols); });
}

// gemm_r's plan (lucepy-mm.cu's gemm_r_plan) for CTAs of W warps, per_sm of them an SM
GemmPlan gemm_r_plan_at(const GemmArgs & a, int W, int per_sm, int most = 16,
                        double start = 0.35) {
    return gemm_plan_in(a.nrows, a.npieces, W * 16, 8,
                        gemm_parts_by_cost(a.nrows, a.npieces, a.ncols, W * 16, 8,
                                           int64_t(per_sm) * g_sms, most, start));
}

// build R (GemmR, GemmRB) on its plan, of at most MOST parts, for PLAN_SM CTAs an SM (whatever
// fits), or for as many as fit (0)
template <typename R, int MOST = 16, int PLAN_SM = 0>
void launch_build(GemmArgs a, float * parts_buf, cudaStream_t s) {
    constexpr int threads = R::warps * 32;
    const int per_sm = PLAN_SM ? PLAN_SM : ctas_per_sm(R::kernel(), threads, R::smem);
    launch_planned(R::kernel(), threads, R::smem, gemm_r_plan_at(a, R::warps, per_sm, MOST), a,
                   parts_buf, s);
}

template <int NT, int W, int MINB = 16 / W, int MOST = 16, int XCH = gemm_r_xch(NT),
          int PLAN_SM = 0>
void launch_gemm_r(GemmArgs a, float * parts_buf, cudaStream_t s) {
    launch_build<GemmR<NT, W, MINB, XCH>, MOST, PLAN_SM>(a, parts_buf, s);
}

template <int NT> std::vector<GemmVariant> gemm_r_variants() {
    // (capped parts, session 26: at 16 columns only the FFN up gained, 3 %; session 28: even
    // shares of the (tile, chunk) steps in one wave, and the last CTA of a tile adding its
    // parts in place of gemm_sum, both slower; session 29: gemm_parts' rule against
    // gemm_parts_by_cost's, which is the same or faster everywhere; session 30: 3 CTAs an SM
    // (room for more registers) the same; a tile's parts as a cluster adding them up, slower;
    // gemm_r on Hopper's wgmma, at 16 columns slower; docs/BENCHMARKS.md; session 34: two
    // chunks of activations a stage and a barrier, faster at 9-16 columns only: gemm_r_xch;
    // session 35: 5 CTAs an SM (96 registers, 72 bytes spilled at 16 columns) 7-17 % slower
    // at 16 columns on five of six products, 4 % faster on the stacked up and gate; session
    // 37, unspilled: 6.5 % faster on the stack, where the model runs it, slower elsewhere;
    // session 38: 5 CTAs an SM on 4's plan (so on fewer SMs), 3 and 4 chunks a barrier, and
    // the weights two or three chunks ahead in the L2 (cp.async.bulk.prefetch), all slower;
    // session 40: gemm_rb with its parts capped, 0.8 us faster on the DeltaNet inputs at 16
    // columns (dn_in), the same or slower elsewhere; gemm_rb with two tiles of 16 rows a warp
    // (each activation fragment read from shared memory for two tiles' mmas; 122 registers,
    // CTAs of 128 rows), 2-12 % slower at 16 columns but on the DeltaNet inputs, 0.7 us faster;
    // gemm_rb in even shares of the tiles, one part, a CTA a slot (3-4 tiles each on the FFN
    // stack, where 16 SMs ran a fifth 64-row CTA and ended 6.7 us after the rest): the stack
    // the same at 16 columns, 5 % faster at 8 (still slower than gemm_r there), the rest slower;
    // gemm_rb on a hybrid plan (whole CTAs for the row blocks every SM takes alike, the rest
    // in parts of a few chunks): the stack at 16 columns 36.97 us where 39.86 alone, qkv slower;
    // in the model (session 41) its stack no sooner and glu_halves 3 us slower: removed;
    // session 43: at 16 columns each column tile its own warp, two warps reading a tile's
    // weights from gemm_rb's shared stage (72-74 registers, 3 or 6 CTAs an SM), 1.3-1.5x
    // gemm_rb's time on every product: the unpacking done twice costs more than the shorter
    // chains gain)
    return {{"repacked", launch_gemm_r<NT, 4>},
            {"rp bulk", launch_build<GemmRB<NT>>},  // lucepy-mm.cu's where bulk_product
            {"rp bulk <= 2 parts", launch_build<GemmRB<NT>, 2>},
            {"rp bulk <= 3 parts", launch_build<GemmRB<NT>, 3>},
            {"rp bulk <= 4 parts", launch_build<GemmRB<NT>, 4>},
            {"rp bulk <= 6 parts", launch_build<GemmRB<NT>, 6>},
            {"rp bulk 4 CTAs an SM", launch_build<GemmRB<NT, 4>>},
            {"rp other chunks a barrier", launch_gemm_r<NT, 4, 4, 16, 3 - gemm_r_xch(NT)>},
            {"rp 8 warps", launch_gemm_r<NT, 8>},
            {"rp 3 chunks a barrier", launch_gemm_r<NT, 4, 4, 16, 3>},
            {"rp 4 chunks a barrier, 3 CTAs", launch_gemm_r<NT, 4, 3, 16, 4>},
            {"rp 5 CTAs an SM", launch_gemm_r<NT, 4, 5, 16, 1>},
            {"rp 5 CTAs on 4's plan", launch_gemm_r<NT, 4, 5, 16, 1, 4>},
            {"rp <= 4 parts", launch_gemm_r<NT, 4, 4, 4>},
            {"rp <= 2 parts", launch_gemm_r<NT, 4, 4, 2>}};
}

// --- --anatomy: what gemm_r's time at 2-16 columns is made of (docs/BENCHMARKS.md, session 34) ---

bool g_anatomy = false;
int g_smem_per_sm = 0, g_smem_reserved = 0;

// Its loads alone: each warp's chunks of weights a chunk ahead in registers, XORed together.
__global__ void __launch_bounds__(128) gemm_loads(const GemmArgs a) {
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int row0 = blockIdx.x * 64;
    const int chunk0 = blockIdx.y * a.per_part;
    const int nchunks = max(0, min(a.per_part, a.npieces / 8 - chunk0));
    if (warp * 16 >= min(64, a.nrows - row0)) {
        return;
    }
    const uint8_t * wp = warp_tile_at(a, row0, warp, chunk0, a.npieces / RP_GROUP);
    const uint4 * wq = reinterpret_cast<const uint4 *>(wp) + rp_slot(lane);
    const uint32_t * wd = reinterpret_cast<const uint32_t *>(wp + 1024) + lane;
    RpGroup buf[2][2];
    auto load = [&](RpGroup (&b)[2], int ch) {
        if (ch < nchunks) {
            for (int j = 0; j < 2; j++) {
                b[j] = load_lane(wq + j * RP_U4, wd + j * RP_BYTES / 4);
            }
            wq += 2 * RP_U4;
            wd += 2 * RP_BYTES / 4;
        }
    };
    auto fold = [](const RpGroup (&b)[2]) {
        uint32_t x = 0;
        for (const RpGroup & g : b) {
            x ^= g.a.x ^ g.a.y ^ g.a.z ^ g.a.w ^ g.b.x ^ g.b.y ^ g.b.z ^ g.b.w ^ g.d;
        }
        return x;
    };
    uint32_t x = 0;
    load(buf[0], 0);
    for (int ch = 0; ch < nchunks; ch += 2) {
        load(buf[1], ch + 1);
        x ^= fold(buf[0]);
        if (ch + 1 < nchunks) {
            load(buf[0], ch + 2);
            x ^= fold(buf[1]);
        }
    }
    if (x == 0x9E3779B9u) {  // keeps the loads
        a.dst[row0 + warp * 16] = 1.0f;
    }
}

// Nothing: a grid's launch and, with gemm_sum, the split's sums alone.
__global__ void gemm_empty(const GemmArgs a) {
    if (a.nrows < 0) {
        a.dst[0] = 0.0f;
    }
}

// `kernel` on gemm_r<NT>'s plan, at no more CTAs an SM than gemm_r (its shared memory made so),
// then gemm_sum if `sum`
template <int NT, typename K>
void launch_as_gemm_r(K kernel, const GemmArgs & a, float * parts_buf, bool sum, cudaStream_t s) {
    using R = GemmR<NT>;
    const int per_sm = ctas_per_sm(R::kernel(), GM_WARPS * 32, R::smem);
    const int smem = std::max(R::smem,
                              g_smem_per_sm / (per_sm + 1) - g_smem_reserved + 128);
    launch_planned(kernel, GM_WARPS * 32, smem, gemm_r_plan_at(a, GM_WARPS, per_sm), a,
                   parts_buf, s, sum);
}

template <int NT> std::vector<GemmVariant> gemm_r_anatomy() {
    auto part = [](const char * name, auto kernel, bool sum) {
        return GemmVariant{name,
                           [=](const GemmArgs & a, float * p, cudaStream_t s) {
                               launch_as_gemm_r<NT>(kernel, a, p, sum, s);
                           },
                           true};
    };
    constexpr int X = gemm_r_xch(NT);
    return {{"repacked", launch_gemm_r<NT, 4>},
            part("no sum", gemm_r<NT>, false),
            part("loads only", gemm_loads, false),
            part("compute only", gemm_r<NT, 4, 4, X, RP_LOADS>, false),
            part("compute - unpack", gemm_r<NT, 4, 4, X, RP_LOADS | RP_UNPACK>, false),
            part("compute - shared", gemm_r<NT, 4, 4, X, RP_LOADS | RP_SHARED>, false),
            part("compute - mma", gemm_r<NT, 4, 4, X, RP_LOADS | RP_MMA>, false),
            part("empty grid", gemm_empty, false),
            part("empty + sum", gemm_empty, true)};
}

// --- --f8: gemm_f8 (lucepy-f8.cuh) on the repacked copies at 9-16 columns ---------------------

bool g_f8 = false;

// to_e4m3 of the unrounded activations, then gemm_f8 as lucepy-mm.cu plans it (5 CTAs an SM),
// its parts added by gemm_sum: each result against the host's exact sums of the unrounded x
// (within 4e-3 of a column's largest: two e4m3 terms an activation), and its time
void bench_f8(int k, const Shape & sh, const std::vector<uint8_t> & host, int64_t row_bytes,
              const uint8_t * wr, int64_t mat_bytes, int copies, const std::vector<float> & x,
              const float * dx, int ncols, float * dst, float * parts,
              const std::vector<int> & check_rows, float t1, cudaStream_t s) {
    const int npieces = sh.k / 32;
    int compiled = 0;
    int * flag;
    CHECK(cudaMalloc(&flag, sizeof(int)));
    f8_compiled<<<1, 1, 0, s>>>(flag);
    CHECK(cudaMemcpy(&compiled, flag, sizeof(int), cudaMemcpyDeviceToHost));
    CHECK(cudaFree(flag));
    if (!compiled) {
        std::printf("         gemm_f8: not in this build (sm_90a code)\n");
        return;
    }
    uint8_t * buf;
    CHECK(cudaMalloc(&buf, size_t(f8_bytes(npieces))));
    const Halves rec = f8_at(buf, npieces);
    auto convert = [&]() {
        to_e4m3<<<dim3(unsigned(segments(npieces)), unsigned(F8_COLS)), TH_THREADS, 0, s>>>(
            dx, sh.k, npieces, ncols, rec);
    };
    const float t_conv = time_calls(s, [&](int) { convert(); });
    convert();
    using R = GemmF8<5>;
    GemmArgs g = {};
    g.x = rec;
    g.dst = dst;
    g.dst_stride = sh.rows;
    g.nrows = sh.rows;
    g.npieces = npieces;
    g.ncols = ncols;
    // lucepy-mm.cu's plan (5 CTAs an SM, up to 16 parts), then others: fewer parts, or the plan
    // for 4 or 6 CTAs an SM (the kernel's occupancy unchanged)
    struct Variant {
        const char * name;
        int per_sm, most;
    };
    const Variant variants[] = {{"f8", R::minb, 16}, {"f8 <= 2 parts", R::minb, 2},
                                {"f8 <= 4 parts", R::minb, 4}, {"f8 plan 4 an SM", 4, 16},
                                {"f8 plan 6 an SM", 6, 16}};
    // and lucepy-mm.cu's plan with its 2 parts paired (f8_paired: each row tile's parts a
    // cluster that adds them, no gemm_sum), where the plan has 2; with a tail (f8_tail: the row
    // tiles past the last whole wave of one CTA an SM cut into parts), where it has 1
    const GemmPlan model = gemm_r_plan_at(g, R::warps, R::minb, 16, R::start);
    const TailPlan tail = tail_plan(int(model.grid.x), npieces / 8, g_sms,
                                    int64_t(R::minb) * g_sms);
    unsigned * count = nullptr;
    float * tail_sums = nullptr;
    CHECK(cudaMalloc(&count, 128 * sizeof(unsigned)));
    CHECK(cudaMemset(count, 0, 128 * sizeof(unsigned)));
    CHECK(cudaMalloc(&tail_sums, size_t(model.grid.x) * 8 * GM_WARPS * 32 * 8 * sizeof(float)));
    for (int vi = 0; vi <= int(std::size(variants)) + 1; vi++) {
        const bool paired = vi == int(std::size(variants));
        const bool tailed = vi == int(std::size(variants)) + 1;
        if ((paired && model.grid.y != F8_PAIR_MOST) ||
            (tailed && (model.grid.y != 1 || tail.parts == 0))) {
            continue;
        }
        const Variant & v = paired   ? Variant{"f8 paired", R::minb, 16}
                            : tailed ? Variant{"f8 tailed", R::minb, 16}
                                     : variants[vi];
        GemmPlan plan = gemm_r_plan_at(g, R::warps, v.per_sm, v.most, R::start);
        if (tailed) {
            plan.grid.x = unsigned(tail.ctas);
        }
        auto run = [&](int i) {
            GemmArgs b = g;
            b.w = wr + mat_bytes * (i % copies);
            if (tailed) {
                b.tail = {tail_sums, count, tail.from, tail.parts, tail.chunks};
            }
            auto go = [&](auto kernel, int smem) {
                if (!paired) {
                    launch_planned(kernel, R::warps * 32, smem, plan, b, parts, s);
                    return;
                }
                const int bytes = gemm_f8_pair_smem<F8_STAGES>(F8_PAIR_MOST);
                raise_smem(kernel, bytes);
                b.per_part = plan.per_part;
                cudaLaunchAttribute attr = {};
                attr.id = cudaLaunchAttributeClusterDimension;
                attr.val.clusterDim.x = 1;
                attr.val.clusterDim.y = plan.grid.y;
                attr.val.clusterDim.z = 1;
                cudaLaunchConfig_t cfg = {};
                cfg.gridDim = plan.grid;
                cfg.blockDim = dim3(unsigned(R::warps * 32));
                cfg.dynamicSmemBytes = size_t(bytes);
                cfg.stream = s;
                cfg.attrs = &attr;
                cfg.numAttrs = 1;
                CHECK(cudaLaunchKernelEx(&cfg, kernel, b));
            };
            if (k == Q4_K) {
                using RK = GemmF8<5, RpQ4_K>;
                go(RK::kernel(), RK::smem);
            } else {
                go(R::kernel(), R::smem);
            }
        };
        CHECK(cudaMemset(dst, 0, size_t(ncols) * sh.rows * sizeof(float)));
        run(0);
        CHECK(cudaGetLastError());
        CHECK(cudaStreamSynchronize(s));
        const double worst = worst_error(k, host, row_bytes, npieces, x.data(), dst, sh.rows,
                                         ncols, check_rows);
        const bool ok = worst < 4e-3;
        failures += !ok;
        const float t = time_calls(s, run);
        std::printf("         %-16s %8.2f us  %.2fx one column   %6.0f GB/s   err %.1e (exact x), "
                    "%ux%u CTAs; to_e4m3 %.2f us%s\n",
                    v.name, t, t / t1, mat_bytes / t / 1e3, worst, plan.grid.x, plan.grid.y,
                    t_conv, ok ? "" : "  WRONG");
    }
    CHECK(cudaFree(count));
    CHECK(cudaFree(tail_sums));
    CHECK(cudaFree(buf));
}

// --- --timeline: where the lives of gemm_r's and gemm_rb's CTAs go (BENCHMARKS, session 36) ---

bool g_timeline = false;

double quantile(std::vector<double> v, double f) {
    if (v.empty()) {
        return 0.0;
    }
    std::sort(v.begin(), v.end());
    return v[size_t(f * double(v.size() - 1))];
}

// `kernel` (a build of gemm_r or gemm_rb stamping: RP_STAMPS, `smem` bytes) on its plan,
// `what` naming it: `args(i)` gives the i-th call's arguments (its weights' copy); the third
// call's stamps are read
template <typename F>
void timeline(const char * what, F kernel, int smem, const std::function<GemmArgs(int)> & args,
              float * parts_buf, cudaStream_t s) {
    const int per_sm = ctas_per_sm(kernel, GM_WARPS * 32, smem);
    const GemmPlan plan = gemm_r_plan_at(args(0), GM_WARPS, per_sm);
    const size_t n = size_t(plan.grid.x) * plan.grid.y;
    uint64_t * stamps = nullptr;
    CHECK(cudaMalloc(&stamps, n * RP_STAMP_WORDS * sizeof(uint64_t)));
    for (int i = 0; i < 3; i++) {
        GemmArgs a = args(i);
        a.stamps = stamps;
        launch_planned(kernel, GM_WARPS * 32, smem, plan, a, parts_buf, s);
    }
    CHECK(cudaStreamSynchronize(s));
    std::vector<uint64_t> h(n * RP_STAMP_WORDS);
    CHECK(cudaMemcpy(h.data(), stamps, h.size() * sizeof(uint64_t), cudaMemcpyDeviceToHost));
    CHECK(cudaFree(stamps));
    uint64_t t0 = ~uint64_t(0), t1 = 0;
    double clocks = 0, ns = 0;
    for (size_t i = 0; i < n; i++) {
        const uint64_t * e = &h[i * RP_STAMP_WORDS];
        t0 = std::min(t0, e[RP_AT_START_NS]);
        t1 = std::max(t1, e[RP_AT_END_NS]);
        clocks += double(e[RP_AT_END] - e[RP_AT_START]);
        ns += double(e[RP_AT_END_NS] - e[RP_AT_START_NS]);
    }
    const double ghz = clocks / ns;
    auto us = [&](uint64_t from, uint64_t to) { return (double(to) - double(from)) / ghz / 1e3; };
    const int chunks = std::min(int(RP_STAMP_CHUNKS), plan.per_part);
    std::vector<double> life, first, epilogue, rest, starts, ends, period[RP_STAMP_CHUNKS];
    std::vector<double> busy(g_sms, 0.0), last_end(g_sms, 0.0);
    std::vector<int> ctas(g_sms, 0);
    for (size_t i = 0; i < n; i++) {
        const uint64_t * e = &h[i * RP_STAMP_WORDS];
        life.push_back(us(e[RP_AT_START], e[RP_AT_END]));
        first.push_back(us(e[RP_AT_START], e[RP_AT_FIRST_BARRIER]));
        epilogue.push_back(us(e[RP_AT_LOOP_END], e[RP_AT_END]));
        for (int c = 0; c + 1 < chunks; c++) {
            period[c].push_back(us(e[RP_AT_CHUNK + c], e[RP_AT_CHUNK + c + 1]));
        }
        const int left = std::max(1, plan.per_part - chunks + 1);  // the chunks after the stamped
        rest.push_back(us(e[RP_AT_CHUNK + chunks - 1], e[RP_AT_LOOP_END]) / left);
        starts.push_back((e[RP_AT_START_NS] - t0) / 1e3);
        ends.push_back((e[RP_AT_END_NS] - t0) / 1e3);
        const uint64_t sm = e[RP_AT_SM];
        if (sm < uint64_t(g_sms)) {
            busy[sm] += (e[RP_AT_END_NS] - e[RP_AT_START_NS]) / 1e3;
            last_end[sm] = std::max(last_end[sm], ends.back());
            ctas[sm]++;
        }
    }
    const double span = (t1 - t0) / 1e3;
    double slots_busy = 0;
    for (double b : busy) {
        slots_busy += b / (span * per_sm * g_sms);
    }
    std::printf("         timeline (%s): %zu CTAs (%u x %u), %d chunks each, %d an SM, %.2f GHz; "
                "span %.2f us, CTA slots busy %.0f %%\n",
                what, n, plan.grid.x, plan.grid.y, plan.per_part, per_sm, ghz, span,
                100 * slots_busy);
    auto spread = [](const char * what, const std::vector<double> & v) {
        std::printf(" %s %.2f / %.2f / %.2f", what, quantile(v, 0.1), quantile(v, 0.5),
                    quantile(v, 0.9));
    };
    std::printf("           us, 10th / 50th / 90th percentile:");
    spread("life", life);
    spread("to the first barrier", first);
    spread("after the last chunk", epilogue);
    std::printf("\n           chunks (median us): first %d:", chunks);
    for (int c = 0; c + 1 < chunks; c++) {
        std::printf(" %.2f", quantile(period[c], 0.5));
    }
    std::printf(", then %.2f a chunk\n", quantile(rest, 0.5));
    std::printf("           starts (us from the first) median %.2f, 90th %.2f, last %.2f; ends "
                "10th %.2f, median %.2f, 90th %.2f, last %.2f\n",
                quantile(starts, 0.5), quantile(starts, 0.9), quantile(starts, 1.0),
                quantile(ends, 0.1), quantile(ends, 0.5), quantile(ends, 0.9),
                quantile(ends, 1.0));
    // an SM's last end by how many CTAs it ran: whether the SMs given more of them end last (at
    // 16 columns on an H200 they end 1-1.5 us after the others, a third more work in 7 % more
    // time: docs/BENCHMARKS.md, session 37)
    std::printf("           SMs by their CTAs (count: SMs, their last ends' median and last us):");
    for (int c = 1; c <= *std::max_element(ctas.begin(), ctas.end()); c++) {
        std::vector<double> at;
        for (int sm = 0; sm < g_sms; sm++) {
            if (ctas[sm] == c) {
                at.push_back(last_end[sm]);
            }
        }
        if (!at.empty()) {
            std::printf(" %d: %zu, %.2f, %.2f;", c, at.size(), quantile(at, 0.5),
                        quantile(at, 1.0));
        }
    }
    std::printf("\n");
}

// gemm_r<NT> and gemm_rb<NT> as the model builds them, stamping, each on its own plan
template <int NT>
void gemm_r_timeline(const std::function<GemmArgs(int)> & args, float * parts_buf,
                     cudaStream_t s) {
    timeline("gemm_r", gemm_r<NT, GM_WARPS, 16 / GM_WARPS, gemm_r_xch(NT), RP_STAMPS>,
             gemm_r_smem<NT>(), args, parts_buf, s);
    timeline("gemm_rb", gemm_rb<NT, GemmRB<NT>::minb, RP_STAMPS>, GemmRB<NT>::smem, args,
             parts_buf, s);
}

// Past 16 columns (a prefill's): gemm_r over slices of NT tiles of 8 columns, in turn. (A CTA
// of 64 rows by 128 columns unpacking each weight once into shared memory, gemm_rp at 2b70e3d,
// took 1.16-1.45x ggml's mmq's time at 512 columns: removed; docs/BENCHMARKS.md, session 25.)
template <int NT, int MINB>
void launch_gemm_r_slices(GemmArgs a, float * parts_buf, cudaStream_t s) {
    const int nsegs = segments(a.npieces);
    for (int c0 = 0; c0 < a.ncols; c0 += NT * GM_COL_TILE) {
        GemmArgs b = a;
        b.x.xh += int64_t(c0) * a.npieces * 4;
        b.x.xinv += int64_t(c0) * nsegs;
        b.dst += int64_t(c0) * a.dst_stride;
        b.ncols = std::min(NT * GM_COL_TILE, a.ncols - c0);
        launch_gemm_r<NT, 4, MINB>(b, parts_buf, s);
    }
}

// f(L()) with L the repacked layout (lucepy-layouts.cuh) of kind k: Q4_0, Q4_K, Q5_K or Q6_K
template <typename F> void with_kind_layout(int k, F && f) {
    switch (k) {
        case Q4_K: f(RpQ4_K()); break;
        case Q5_K: f(RpQ5_K()); break;
        case Q6_K: f(RpQ6_K()); break;
        default: f(RpQ4_0());
    }
}

// Q4_K repacked (repack_q4_k): gemm_r and gemm_rb as the Q4_0 layout's model builds
template <int NT> std::vector<GemmVariant> gemm_rk_variants() {
    return {{"rk", launch_build<GemmR<NT, 4, 4, gemm_r_xch(NT), RpQ4_K>>},
            {"rk 5 CTAs an SM", launch_build<GemmR<NT, 4, 5, gemm_r_xch(NT), RpQ4_K>>},
            {"rk bulk", launch_build<GemmRB<NT, 5, RpQ4_K>>},
            {"rk bulk <= 3 parts", launch_build<GemmRB<NT, 5, RpQ4_K>, 3>}};
}

std::vector<GemmVariant> gemm_r_variants_of(int ncols, int k = Q4_0) {
    if (k == Q5_K || k == Q6_K) {  // gemm_rb always, as lucepy-mm.cu launches them
        std::vector<GemmVariant> out;
        with_kind_layout(k, [&](auto layout) {
            using L = decltype(layout);
            if (ncols <= GM_COL_TILE) {
                out = {{"bulk", launch_build<GemmRB<1, 6, L>>},
                       {"bulk 5 CTAs", launch_build<GemmRB<1, 5, L>>}};
            } else if (ncols <= 16) {
                out = {{"bulk", launch_build<GemmRB<2, 5, L>>},
                       {"bulk 4 CTAs", launch_build<GemmRB<2, 4, L>>}};
            }
        });
        return out;
    }
    if (k == Q4_K) {
        return ncols <= 8 ? gemm_rk_variants<1>() : ncols <= 16 ? gemm_rk_variants<2>()
                                                                : std::vector<GemmVariant>{};
    }
    if (ncols <= 8) {
        return g_anatomy ? gemm_r_anatomy<1>() : gemm_r_variants<1>();
    }
    if (ncols <= 16) {
        return g_anatomy ? gemm_r_anatomy<2>() : gemm_r_variants<2>();
    }
    std::vector<GemmVariant> out = {{"rp 32 a pass", launch_gemm_r_slices<4, 3>}};
    if (ncols % 64 == 0) {
        out.push_back({"rp 64 a pass", launch_gemm_r_slices<8, 2>});
    }
    return out;
}

template <int SPLIT, int U, bool GATE = false, class L = RpQ4_0>
void launch_gemv_r(const Args & a, cudaStream_t s) {
    constexpr int WARPS = gemv_r_warps<SPLIT>();
    const int64_t warps = int64_t(a.nrows / RP_ROWS) * SPLIT;
    gemv_r<SPLIT, U, GATE, L><<<unsigned((warps + WARPS - 1) / WARPS), WARPS * 32, 0, s>>>(a);
}

using GemvR = std::pair<const char *, void (*)(const Args &, cudaStream_t)>;

// gemv_r's splits on kind k's repacked layout (GATE: with ggml's fused gate); a K type's
// super-block a step
template <bool GATE> std::vector<GemvR> gemv_r_variants(int k) {
    std::vector<GemvR> out;
    with_kind_layout(k, [&](auto layout) {
        using L = decltype(layout);
        constexpr int U = L::pair ? 2 : 1;
        out = {{"split 2", launch_gemv_r<2, U, GATE, L>},
               {"split 4", launch_gemv_r<4, U, GATE, L>},
               {"split 8", launch_gemv_r<8, U, GATE, L>}};
        if constexpr (!GATE) {
            out.push_back({"split 16", launch_gemv_r<16, U, false, L>});
        }
        if constexpr (!GATE && !L::pair) {
            out.push_back({"split 32", launch_gemv_r<32, 1, false, L>});
            out.push_back({"split 4 U2", launch_gemv_r<4, 2, false, L>});
            out.push_back({"split 8 U2", launch_gemv_r<8, 2, false, L>});
            out.push_back({"split 16 U2", launch_gemv_r<16, 2, false, L>});
        }
    });
    return out;
}

// Q4_0 rows rearranged as gemm_r and gemv_r read them (lucepy-layouts.cuh: the layout), on the host
std::vector<uint8_t> host_repack(const uint8_t * src, int64_t row_stride, int nrows,
                                 int npieces) {
    const int ngroups = npieces / RP_GROUP;
    std::vector<uint8_t> out(size_t(nrows) * npieces * 18);
    for (int tile = 0; tile < nrows / RP_ROWS; tile++) {
        for (int grp = 0; grp < ngroups; grp++) {
            uint8_t * o = out.data() + repacked_at(tile, grp, ngroups);
            for (int r = 0; r < RP_ROWS; r++) {
                const uint8_t * row = src + int64_t(RP_ROWS * tile + r) * row_stride;
                for (int j = 0; j < RP_GROUP; j++) {
                    const uint8_t * b = row + int64_t(RP_GROUP * grp + j) * 18;
                    std::memcpy(o + 64 * r + 16 * rp_turn(r, j), b + 2, 16);
                    std::memcpy(o + 1024 + 4 * (4 * (r % 8) + j) + 2 * (r / 8), b, 2);
                }
            }
        }
    }
    return out;
}

template <int MT, class L = RpQ4_0> void launch_gemm_rq(const GemmArgs & a, cudaStream_t s) {
    raise_smem(gemm_rq<MT, L>, gemm_rq_smem<MT, L>());
    const dim3 grid(unsigned(a.nrows / (64 * MT)), unsigned(a.ncols / RQ_COLS));
    gemm_rq<MT, L><<<grid, 128, gemm_rq_smem<MT, L>(), s>>>(a);
}

// One column with ggml's fused gate (SwiGLU), the gate another copy of the same matrix: gemv as
// lucepy-mm.cu launches it on the original layout, and gemv_r's splits on the repacked one.
void bench_fused_gate(int k, const Shape & sh, const std::vector<uint8_t> & host,
                      int64_t row_bytes, uint8_t * w, uint8_t * wr, int64_t mat_bytes,
                      int copies, const Args & a1, const std::vector<int8_t> & hq,
                      const std::vector<float2> & hds, int unit, float * dst, cudaStream_t s) {
    const int npieces = sh.k / 32;
    const std::vector<GemvR> fused = gemv_r_variants<true>(k);
    const Variant gemv_gate = variants_of(k, true, unit)[0];
    for (int side = 0; side < 1 + int(std::size(fused)); side++) {
        uint8_t * const base = side == 0 ? w : wr;
        auto run = [&](int i) {
            Args b = a1;
            b.w = base + mat_bytes * (i % copies);
            b.gate = base + mat_bytes * ((i + 1) % copies);
            b.glu_op = GLU_SWIGLU;
            if (side == 0) {
                gemv_gate.run(b, s);
            } else {
                fused[side - 1].second(b, s);
            }
        };
        CHECK(cudaMemset(dst, 0, size_t(sh.rows) * sizeof(float)));
        run(0);
        CHECK(cudaGetLastError());
        std::vector<float> got(sh.rows);
        CHECK(cudaMemcpy(got.data(), dst, got.size() * sizeof(float), cudaMemcpyDeviceToHost));
        double err = 0, scale = 0;
        for (int r = 0; r < sh.rows; r += std::max(1, sh.rows / 61)) {
            const float v = host_dot(k, host.data() + r * row_bytes, npieces, hq.data(), hds.data());
            const double want = host_glu(GLU_SWIGLU, v, v);
            err = std::max(err, std::fabs(got[r] - want));
            scale = std::max(scale, std::fabs(want));
        }
        const double rel = err / std::max(scale, 1e-30);
        const bool ok = rel < 1e-4;
        failures += !ok;
        const float t = time_calls(s, run);
        std::printf("      fused gate: %-12s %7.2f us   err %.1e%s\n",
                    side == 0 ? "gemv" : fused[side - 1].first, t, rel, ok ? "" : "  WRONG");
    }
}

// A prefill's columns on the repacked copies: to_halves_col's activations (one scale a
// column, rounded the same way on the host) and gemm_rq, against the host's exact math.
void bench_prefill(int k, const Shape & sh, const std::vector<uint8_t> & host, int64_t row_bytes,
                   uint8_t * wr, int64_t mat_bytes, int copies, const float * dx,
                   const std::vector<float> & x, int ncols, float * dst, float t1,
                   cudaStream_t s) {
    const int npieces = sh.k / 32;
    std::vector<float> xr(size_t(ncols) * sh.k);
    for (int c = 0; c < ncols; c++) {
        float amax = 0;
        for (int i = 0; i < sh.k; i++) {
            amax = std::max(amax, std::fabs(x[size_t(c) * sh.k + i]));
        }
        const float scale = segment_scale(amax);
        for (int i = 0; i < sh.k; i++) {
            const float v = x[size_t(c) * sh.k + i];
            xr[size_t(c) * sh.k + i] = __half2float(__float2half(v * scale)) / scale;
        }
    }
    uint8_t * buf;
    CHECK(cudaMalloc(&buf, size_t(halves_bytes(npieces, ncols))));
    const Halves hc = halves_at(buf, npieces, ncols);
    auto convert = [&]() { to_halves_col<<<ncols, 256, 0, s>>>(dx, sh.k, npieces, hc); };
    const float t_conv = time_calls(s, [&](int) { convert(); });
    convert();
    std::printf("      %d columns: to_halves_col %.2f us\n", ncols, t_conv);
    GemmArgs g = {};
    g.x = hc;
    g.dst = dst;
    g.dst_stride = sh.rows;
    g.nrows = sh.rows;
    g.npieces = npieces;
    g.ncols = ncols;
    std::pair<const char *, void (*)(const GemmArgs &, cudaStream_t)> kernels[2];
    with_kind_layout(k, [&](auto layout) {
        using L = decltype(layout);
        kernels[0] = {"rq 64 rows", launch_gemm_rq<1, L>};
        kernels[1] = {"rq 128 rows", launch_gemm_rq<2, L>};
    });
    std::vector<int> check_rows;
    for (int r = 0; r < sh.rows; r += std::max(1, sh.rows / 37)) {
        check_rows.push_back(r);
    }
    for (const auto & kernel : kernels) {
        if (sh.rows % (&kernel == &kernels[0] ? 64 : 128) != 0) {
            continue;
        }
        CHECK(cudaMemset(dst, 0, size_t(ncols) * sh.rows * sizeof(float)));
        GemmArgs b = g;
        b.w = wr;
        kernel.second(b, s);
        CHECK(cudaGetLastError());
        const double worst = worst_error(k, host, row_bytes, npieces, xr.data(), dst, sh.rows,
                                         ncols, check_rows, std::max(1, ncols / 24));
        const bool ok = worst < 2e-3;
        failures += !ok;
        const float t = time_calls(s, [&](int i) {
            GemmArgs c = g;
            c.w = wr + mat_bytes * (i % copies);
            kernel.second(c, s);
        });
        std::printf("         %-12s %8.2f us  %.2fx one column   err %.1e%s\n", kernel.first, t,
                    t / t1, worst, ok ? "" : "  WRONG");
    }
    CHECK(cudaFree(buf));
}

constexpr int MAX_GEMM_COLS = 16;  // gemm's; past them only gemm_r's slices

// One product (a gate fused or not: a verify's rows take up and gate apart) times 1 column
// (gemv, the split lucepy-mm.cu chooses) and times each count of `cols`, against one column.
void bench_cols(int k, const Shape & sh, const std::vector<int> & cols, cudaStream_t s,
                std::mt19937 & rng) {
    const int npieces = sh.k / 32;
    const int64_t row_bytes = int64_t(sh.k / block_values(k)) * block_bytes(k);
    const int64_t mat_bytes = row_bytes * sh.rows;
    // BENCH_IN_L2=1: the calls all read the first copy, so that a matrix under the L2's size is
    // read from there (what the products cost with their weights' DRAM traffic left out); the
    // second stays, as the device's repacking writes there
    const int made = int(std::max<int64_t>(2, (int64_t(1) << 30) / mat_bytes));
    const int copies = std::getenv("BENCH_IN_L2") ? 1 : made;
    std::vector<uint8_t> host(mat_bytes);
    for (int64_t b = 0; b < mat_bytes / block_bytes(k); b++) {
        fill_block(k, host.data() + b * block_bytes(k), rng);
    }
    uint8_t * w;
    CHECK(cudaMalloc(&w, size_t(mat_bytes) * made));
    for (int c = 0; c < made; c++) {
        CHECK(cudaMemcpy(w + mat_bytes * c, host.data(), size_t(mat_bytes),
                         cudaMemcpyHostToDevice));
    }
    // the same copies repacked (lucepy-layouts.cuh) where a layout takes them: the K types by
    // the device (a super-block a CTA; the results are checked), Q4_0 below
    uint8_t * wr = nullptr;
    const bool k_type = k == Q4_K || k == Q5_K || k == Q6_K;
    if (k_type && repackable(sh.rows, npieces)) {
        CHECK(cudaMalloc(&wr, size_t(mat_bytes) * made));
        const dim3 grid(unsigned(npieces / 8), unsigned(sh.rows / RP_ROWS));
        with_kind_layout(k, [&](auto layout) {
            for (int c = 0; c < made; c++) {
                decltype(layout)::repack<<<grid, 128, 0, s>>>(
                    w + mat_bytes * c, row_bytes, npieces / RP_GROUP, wr + mat_bytes * c);
            }
        });
        CHECK(cudaGetLastError());
    }
    if (k == Q4_0 && repackable(sh.rows, npieces)) {
        const std::vector<uint8_t> rp = host_repack(host.data(), row_bytes, sh.rows, npieces);
        CHECK(cudaMalloc(&wr, size_t(mat_bytes) * made));
        for (int c = 0; c < made; c++) {
            CHECK(cudaMemcpy(wr + mat_bytes * c, rp.data(), size_t(mat_bytes),
                             cudaMemcpyHostToDevice));
        }
        // the device's repacking of the same rows: the host's bytes
        const dim3 grid(unsigned(npieces / RP_GROUP), unsigned(sh.rows / RP_ROWS));
        repack_q4_0<<<grid, 64, 0, s>>>(w, row_bytes, npieces / RP_GROUP, wr + mat_bytes);
        CHECK(cudaGetLastError());
        std::vector<uint8_t> got(mat_bytes);
        CHECK(cudaMemcpy(got.data(), wr + mat_bytes, size_t(mat_bytes), cudaMemcpyDeviceToHost));
        const bool same = got == rp;
        failures += !same;
        std::printf("%-5s %-10s repack_q4_0 on the device: %s\n", kind_name(k), sh.what,
                    same ? "the host's bytes" : "WRONG");
    }
    const int most = *std::max_element(cols.begin(), cols.end());
    std::vector<float> x(size_t(most) * sh.k);
    std::uniform_real_distribution<float> val(-1.0f, 1.0f);
    for (int c = 0; c < most; c++) {
        const float mag = c == 1 ? 3000.0f : 1.0f;  // one column with a large scale
        const float spike = c == 0 ? 90000.0f : 0.0f;  // and a value past a half's range
        for (int i = 0; i < sh.k; i++) {
            x[size_t(c) * sh.k + i] = mag * val(rng);
        }
        x[size_t(c) * sh.k + sh.k / 3] += spike;
    }
    float *dx, *dst, *parts;
    uint8_t * act;
    CHECK(cudaMalloc(&dx, x.size() * sizeof(float)));
    CHECK(cudaMemcpy(dx, x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice));
    CHECK(cudaMalloc(&act, size_t(std::max<int64_t>(halves_bytes(npieces, most),
                                                    int64_t(npieces) * 2 * 40))));
    CHECK(cudaMalloc(&dst, size_t(most) * sh.rows * sizeof(float)));
    CHECK(cudaMalloc(&parts, size_t(16) * most * sh.rows * sizeof(float)));

    // one column: gemv as lucepy-mm.cu launches it
    const int planes = planes_of(k);
    int8_t * xq = reinterpret_cast<int8_t *>(act);
    float2 * xds = reinterpret_cast<float2 *>(act + int64_t(npieces) * planes * 32);
    quantize<<<dim3((npieces + 7) / 8, 1), 256, 0, s>>>(dx, sh.k, npieces, 1, planes, xq, xds);
    Args a1 = {};
    a1.row_stride = row_bytes;
    a1.xq = reinterpret_cast<const int *>(xq);
    a1.xds = xds;
    a1.dst = dst;
    a1.nrows = sh.rows;
    a1.npieces = npieces;
    const int unit = row_bytes % 16 == 0 ? 16 : row_bytes % 8 == 0 ? 8 : 4;
    const Variant gemv1 = variants_of(k, false, unit)[0];
    const float t1 = time_calls(s, [&](int i) {
        Args b = a1;
        b.w = w + mat_bytes * (i % copies);
        gemv1.run(b, s);
    });
    std::printf("%-5s %-10s k=%-6d rows=%-7d %7.1f MB  1 column (gemv): %7.2f us\n", kind_name(k),
                sh.what, sh.k, sh.rows, mat_bytes / 1e6, t1);
    if (wr) {  // one column on the repacked copies: against the host's math on the same int8
        std::vector<int8_t> hq(size_t(npieces) * 32);
        std::vector<float2> hds(npieces);
        CHECK(cudaMemcpy(hq.data(), xq, hq.size(), cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(hds.data(), xds, hds.size() * sizeof(float2), cudaMemcpyDeviceToHost));
        const std::vector<GemvR> gemv_rs = gemv_r_variants<false>(k);
        for (const auto & variant : gemv_rs) {
            const char * name = variant.first;
            void (*const launch)(const Args &, cudaStream_t) = variant.second;
            CHECK(cudaMemset(dst, 0, size_t(sh.rows) * sizeof(float)));
            Args b = a1;
            b.w = wr;
            launch(b, s);
            CHECK(cudaGetLastError());
            std::vector<float> got(sh.rows);
            CHECK(cudaMemcpy(got.data(), dst, got.size() * sizeof(float),
                             cudaMemcpyDeviceToHost));
            double err = 0, scale = 0;
            for (int r = 0; r < sh.rows; r += std::max(1, sh.rows / 61)) {
                const double want =
                    host_dot(k, host.data() + r * row_bytes, npieces, hq.data(), hds.data());
                err = std::max(err, std::fabs(got[r] - want));
                scale = std::max(scale, std::fabs(want));
            }
            const double rel = err / std::max(scale, 1e-30);
            const bool ok = rel < 1e-4;
            failures += !ok;
            const float t = time_calls(s, [&](int i) {
                Args c = a1;
                c.w = wr + mat_bytes * (i % copies);
                launch(c, s);
            });
            std::printf("      gemv_r %-12s %7.2f us  %.2fx gemv  %6.0f GB/s  err %.1e%s\n", name,
                        t, t / t1, mat_bytes / t / 1e3, rel, ok ? "" : "  WRONG");
        }
        if (sh.gate) {  // ggml's fused gate: the gate another copy of the same matrix
            bench_fused_gate(k, sh, host, row_bytes, w, wr, mat_bytes, copies, a1, hq, hds, unit,
                             dst, s);
        }
    }

    std::vector<int> check_rows;
    for (int r = 0; r < sh.rows; r += std::max(1, sh.rows / 37)) {
        check_rows.push_back(r);
    }
    check_rows.push_back(sh.rows - 1);
    for (int ncols : cols) {
        // the activations as to_halves rounds them
        std::vector<float> xr(size_t(ncols) * sh.k);
        constexpr int SEG = GM_SEG * 32;  // values a segment
        for (int c = 0; c < ncols; c++) {
            for (int s0 = 0; s0 < sh.k; s0 += SEG) {
                const int end = std::min(sh.k, s0 + SEG);
                float amax = 0;
                for (int i = s0; i < end; i++) {
                    amax = std::max(amax, std::fabs(x[size_t(c) * sh.k + i]));
                }
                const float scale = segment_scale(amax);
                for (int i = s0; i < end; i++) {
                    const float v = x[size_t(c) * sh.k + i];
                    xr[size_t(c) * sh.k + i] = __half2float(__float2half(v * scale)) / scale;
                }
            }
        }
        const Halves halves = halves_at(act, npieces, ncols);
        auto convert = [&]() {
            const dim3 grid(unsigned(segments(npieces)), unsigned(padded_cols(ncols)));
            to_halves<<<grid, TH_THREADS, 0, s>>>(dx, sh.k, npieces, ncols, halves);
        };
        const float t_conv = time_calls(s, [&](int) { convert(); });
        convert();
        GemmArgs g = {};
        g.row_stride = row_bytes;
        g.x = halves;
        g.dst = dst;
        g.dst_stride = sh.rows;
        g.nrows = sh.rows;
        g.npieces = npieces;
        g.ncols = ncols;
        std::printf("      %2d columns: to_halves %.2f us\n", ncols, t_conv);
        std::vector<GemmVariant> vs;  // gemm's launches to 16 columns, then the repacked ones
        if (ncols <= MAX_GEMM_COLS) {
            vs = gemm_variants_of(k, ncols);
            if (std::getenv("BENCH_FEW")) {
                vs.resize(1);  // lucepy-mm.cu's launch only
            }
        }
        const size_t n_plain = vs.size();
        if (wr) {
            for (const GemmVariant & v : gemm_r_variants_of(ncols, k)) {
                vs.push_back(v);
            }
        }
        for (size_t vi = 0; vi < vs.size(); vi++) {
            const GemmVariant & v = vs[vi];
            uint8_t * const base = vi < n_plain ? w : wr;
            auto run = [&](int i) {
                GemmArgs b = g;
                b.w = base + mat_bytes * (i % copies);
                v.run(b, parts, s);
            };
            CHECK(cudaMemset(dst, 0, size_t(ncols) * sh.rows * sizeof(float)));
            run(0);
            CHECK(cudaGetLastError());
            const double worst = worst_error(k, host, row_bytes, npieces, xr.data(), dst,
                                             sh.rows, ncols, check_rows);
            const bool ok = v.partial || worst < 2e-3;
            failures += !ok;
            const float t = time_calls(s, run);
            std::printf("         %-12s %8.2f us  %.2fx one column   %6.0f GB/s   err %.1e%s\n",
                        v.name.c_str(), t, t / t1, mat_bytes / t / 1e3, worst,
                        v.partial ? "  (a part)" : ok ? "" : "  WRONG");
        }
        if (wr && k == Q4_0 && g_timeline && ncols <= MAX_GEMM_COLS) {  // (Q4_0's builds)
            auto args = [&](int i) {
                GemmArgs b = g;
                b.w = wr + mat_bytes * (i % copies);
                return b;
            };
            if (ncols <= GM_COL_TILE) {
                gemm_r_timeline<1>(args, parts, s);
            } else {
                gemm_r_timeline<2>(args, parts, s);
            }
        }
        if (wr && (k == Q4_0 || k == Q4_K) && g_f8 && ncols > GM_COL_TILE && ncols <= F8_COLS) {
            bench_f8(k, sh, host, row_bytes, wr, mat_bytes, copies, x, dx, ncols, dst, parts,
                     check_rows, t1, s);
        }
        if (wr && ncols % RQ_COLS == 0) {
            bench_prefill(k, sh, host, row_bytes, wr, mat_bytes, copies,
                          dx, x, ncols, dst, t1, s);
        }
    }
    CHECK(cudaFree(w));
    if (wr) {
        CHECK(cudaFree(wr));
    }
    CHECK(cudaFree(dx));
    CHECK(cudaFree(act));
    CHECK(cudaFree(dst));
    CHECK(cudaFree(parts));
}

// --- --e4m3: f8_of (the records' conversion) against the non-saturating one, every float -----

// over every bit pattern from `first` on, a grid-stride walk: counts[0] the patterns of |x| <= 448
// whose f8_of byte and two terms (f8_terms) differ from the non-saturating conversion's,
// counts[1] the others (past 448, inf, NaN) whose f8_of byte is not a NaN, counts[2] those seen
__global__ void e4m3_check(uint64_t first, uint64_t n, unsigned long long * counts) {
    unsigned long long bad = 0, loud = 0, seen = 0;
    auto nosat = [](float a) { return __nv_cvt_float_to_fp8(a, __NV_NOSAT, __NV_E4M3); };
    for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < n;
         i += uint64_t(gridDim.x) * blockDim.x) {
        const float x = __uint_as_float(uint32_t(first + i));
        seen++;
        const __nv_fp8_storage_t b = f8_of(x);
        if (fabsf(x) <= 448.0f) {
            uint32_t h, l;
            const float sum = f8_terms(x, h, l);
            const __nv_fp8_storage_t h0 = nosat(x);
            const float hf = __half2float(__half(__nv_cvt_fp8_to_halfraw(h0, __NV_E4M3)));
            const __nv_fp8_storage_t l0 = nosat(x - hf);
            const float lf = __half2float(__half(__nv_cvt_fp8_to_halfraw(l0, __NV_E4M3)));
            bad += b != h0 || h != h0 || l != l0 ||
                   __float_as_uint(sum) != __float_as_uint(hf + lf);
        } else {
            loud += (b & 0x7F) != 0x7F;
        }
    }
    atomicAdd(&counts[0], bad);
    atomicAdd(&counts[1], loud);
    atomicAdd(&counts[2], seen);
}

void check_e4m3(cudaStream_t s) {
    unsigned long long * counts;
    CHECK(cudaMalloc(&counts, 3 * sizeof(unsigned long long)));
    CHECK(cudaMemsetAsync(counts, 0, 3 * sizeof(unsigned long long), s));
    cudaEvent_t t0, t1;
    CHECK(cudaEventCreate(&t0));
    CHECK(cudaEventCreate(&t1));
    CHECK(cudaEventRecord(t0, s));
    e4m3_check<<<unsigned(g_sms) * 8, 256, 0, s>>>(0, uint64_t(1) << 32, counts);
    CHECK(cudaEventRecord(t1, s));
    CHECK(cudaStreamSynchronize(s));
    CHECK(cudaGetLastError());
    unsigned long long h[3];
    CHECK(cudaMemcpy(h, counts, sizeof(h), cudaMemcpyDeviceToHost));
    float ms = 0.0f;
    CHECK(cudaEventElapsedTime(&ms, t0, t1));
    std::printf("e4m3: %llu floats in %.0f ms; |x| <= 448 not the non-saturating bytes: %llu; "
                "past it, inf or NaN not a NaN: %llu\n",
                h[2], ms, h[0], h[1]);
    failures += h[0] != 0 || h[1] != 0 || h[2] != (uint64_t(1) << 32);
    CHECK(cudaFree(counts));
}

// --- a verify's residual sum and the next RMS norm: two kernels or one (--sum-norm) -----------

// sum_norm_halves as lucepy-mm.cu launches it: clusters of CL CTAs along x (no PDL here); F8:
// its e4m3 records (16 columns) where halves; PUSH false: the values read across the cluster
template <int CL, bool F8 = false, bool PUSH = true>
void launch_sum_norm(const SumNorm & a, cudaStream_t s) {
    cudaLaunchAttribute attr = cluster_attr(CL);
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(CL, unsigned(F8 ? F8_COLS : padded_cols(a.ncols)));
    cfg.blockDim = dim3(NORM_THREADS);
    cfg.stream = s;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    CHECK(cudaLaunchKernelEx(&cfg, sum_norm_halves<CL, F8, PUSH>, a));
}

// The 27B-shaped model's 5,120-value residual stream at `ncols` columns, after a product of
// `nparts` parts: gemm_sum then norm_halves (one part: the product's store added the residual,
// so norm_halves alone) against sum_norm_halves, every byte of both ways' results compared (the
// sum, the norm's result, the halves and their scales) and each way's time per call; then
// sum_norm_halves writing gemm_f8's e4m3 records where halves (parts only: its sum and norm's
// result compared too), what the records cost the kernel that writes them; and sum_norm_halves
// reading the others' values across the cluster after a barrier (PULL) where sending them, its
// results compared byte for byte too.
void bench_sum_norm(int ncols, int nparts, cudaStream_t s, std::mt19937 & rng) {
    constexpr int N = 5120;
    constexpr int CL = N / NORM_THREADS;
    constexpr float EPS = 1e-6f;
    const int64_t npieces = N / 32;
    const size_t col_bytes = size_t(N) * sizeof(float);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_real_distribution<float> uniform(0.5f, 1.5f);
    std::vector<float> hp(size_t(nparts) * ncols * N), hr(size_t(ncols) * N), hw(N);
    for (float & v : hp) {
        v = normal(rng) / float(nparts);
    }
    for (float & v : hr) {
        v = normal(rng);
    }
    for (float & v : hw) {
        v = uniform(rng);
    }
    float *parts, *res, *w;
    CHECK(cudaMalloc(&parts, hp.size() * sizeof(float)));
    CHECK(cudaMalloc(&res, hr.size() * sizeof(float)));
    CHECK(cudaMalloc(&w, col_bytes));
    CHECK(cudaMemcpy(parts, hp.data(), hp.size() * sizeof(float), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(res, hr.data(), hr.size() * sizeof(float), cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(w, hw.data(), col_bytes, cudaMemcpyHostToDevice));
    const size_t hb = size_t(halves_bytes(npieces, ncols));
    struct Out {
        float *sum, *normed;
        uint8_t * halves;
    } out[4];
    const size_t fb = size_t(f8_bytes(npieces));
    for (Out & o : out) {
        CHECK(cudaMalloc(&o.sum, col_bytes * ncols));
        CHECK(cudaMalloc(&o.normed, col_bytes * ncols));
        CHECK(cudaMalloc(&o.halves, std::max(hb, fb)));
        CHECK(cudaMemset(o.halves, 0, std::max(hb, fb)));
    }
    // one part: the sums with the residual are already in place, as the product's store left them
    if (nparts == 1) {
        std::vector<float> sums(hr.size());
        for (size_t i = 0; i < sums.size(); i++) {
            sums[i] = hp[i] + hr[i];
        }
        for (Out & o : out) {
            CHECK(cudaMemcpy(o.sum, sums.data(), sums.size() * sizeof(float),
                             cudaMemcpyHostToDevice));
        }
    }
    auto apart = [&](int) {
        const Out & o = out[0];
        if (nparts > 1) {
            const int64_t n = int64_t(N) * ncols;
            gemm_sum<<<unsigned((n + 255) / 256), 256, 0, s>>>(parts, nparts, N, ncols, o.sum, N,
                                                                res, N);
        }
        norm_halves<<<unsigned(padded_cols(ncols)), NORM_THREADS, 0, s>>>(
            o.sum, N, w, o.normed, N, N, EPS, ncols, halves_at(o.halves, npieces, ncols));
    };
    auto joined_as = [&](const Out & o, bool f8, bool push = true) {
        SumNorm a = {};
        if (nparts > 1) {
            a.src = parts;
            a.src_col = N;
            a.part_stride = int64_t(ncols) * N;
            a.residual = res;
            a.res_stride = N;
            a.sum = o.sum;
            a.sum_stride = N;
        } else {
            a.src = o.sum;
            a.src_col = N;
        }
        a.nparts = nparts;
        a.w = w;
        a.normed = o.normed;
        a.normed_stride = N;
        a.n = N;
        a.ncols = ncols;
        a.eps = EPS;
        a.out = f8 ? f8_at(o.halves, npieces) : halves_at(o.halves, npieces, ncols);
        if (!push) {
            launch_sum_norm<CL, false, false>(a, s);
        } else {
            f8 ? launch_sum_norm<CL, true>(a, s) : launch_sum_norm<CL>(a, s);
        }
    };
    auto joined = [&](int) { joined_as(out[1], false); };
    auto records = [&](int) { joined_as(out[2], true); };
    auto pulled = [&](int) { joined_as(out[3], false, false); };
    apart(0);
    joined(0);
    pulled(0);
    if (nparts > 1) {
        records(0);
    }
    CHECK(cudaStreamSynchronize(s));
    CHECK(cudaGetLastError());
    auto same_bytes = [](const void * a, const void * b, size_t bytes) {
        std::vector<uint8_t> ha(bytes), hb(bytes);
        CHECK(cudaMemcpy(ha.data(), a, bytes, cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(hb.data(), b, bytes, cudaMemcpyDeviceToHost));
        return ha == hb;
    };
    auto same_as = [&](const Out & o) {
        return same_bytes(out[0].sum, o.sum, col_bytes * ncols) &&
               same_bytes(out[0].normed, o.normed, col_bytes * ncols) &&
               same_bytes(out[0].halves, o.halves, hb);
    };
    const bool same = same_as(out[1]), same_pulled = same_as(out[3]);
    failures += !same + !same_pulled;
    const float t_apart = time_calls(s, apart);
    const float t_joined = time_calls(s, joined);
    const float t_pulled = time_calls(s, pulled);
    std::printf("sum+norm %5d values, %2d columns, %2d parts: %s %7.2f us, sum_norm_halves %7.2f "
                "us (%.2fx)%s; pulling the values %7.2f us%s\n",
                N, ncols, nparts, nparts > 1 ? "gemm_sum + norm_halves" : "norm_halves",
                t_apart, t_joined, t_joined / t_apart, same ? "" : "  WRONG (not the same bytes)",
                t_pulled, same_pulled ? "" : "  WRONG (not the same bytes)");
    if (nparts > 1 && ncols > GM_COL_TILE) {  // (gemm_f8's columns)
        const bool kept = same_bytes(out[1].sum, out[2].sum, col_bytes * ncols) &&
                          same_bytes(out[1].normed, out[2].normed, col_bytes * ncols);
        failures += !kept;
        const float t_records = time_calls(s, records);
        std::printf("   writing e4m3 records where halves: %7.2f us (+%.2f)%s\n", t_records,
                    t_records - t_joined, kept ? "" : "  WRONG (not the same sum and norm)");
    }
    for (Out & o : out) {
        CHECK(cudaFree(o.sum));
        CHECK(cudaFree(o.normed));
        CHECK(cudaFree(o.halves));
    }
    CHECK(cudaFree(parts));
    CHECK(cudaFree(res));
    CHECK(cudaFree(w));
}

// The 27B-shaped model's FFN GLU at 16 columns (17,408 values a column; the gate and up of a
// column side by side, as its stacked product writes them): glu_halves writing the down
// product's halves and writing gemm_f8's e4m3 records (`f8_single`'s down), us a call, the
// GLU's results of both ways compared byte for byte. (Session 55's trace: 4.5 us a call with
// records where 3.0 with halves.)
void bench_glu(cudaStream_t s, std::mt19937 & rng) {
    constexpr int N = 17408;
    constexpr int COLS = 16;
    constexpr int npieces = N / 32;
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> h(size_t(2) * N * COLS);
    for (float & v : h) {
        v = normal(rng);
    }
    float * ab;
    CHECK(cudaMalloc(&ab, h.size() * sizeof(float)));
    CHECK(cudaMemcpy(ab, h.data(), h.size() * sizeof(float), cudaMemcpyHostToDevice));
    const size_t bytes = size_t(std::max(halves_bytes(npieces, COLS), f8_bytes(npieces)));
    float * dst[2];
    uint8_t * out[2];
    for (int i = 0; i < 2; i++) {
        CHECK(cudaMalloc(&dst[i], size_t(N) * COLS * sizeof(float)));
        CHECK(cudaMalloc(&out[i], bytes));
        CHECK(cudaMemset(out[i], 0, bytes));
    }
    auto glu = [&](bool f8) {
        return [&, f8](int) {
            const unsigned cols = unsigned(f8 ? F8_COLS : padded_cols(COLS));
            const dim3 grid(unsigned(segments(npieces)), cols);
            if (f8) {
                glu_halves<true><<<grid, GLU_WARPS * 32, 0, s>>>(
                    ab, ab + N, 2 * N, 1, 0, dst[1], npieces, COLS, f8_at(out[1], npieces));
            } else {
                glu_halves<false><<<grid, GLU_WARPS * 32, 0, s>>>(
                    ab, ab + N, 2 * N, 1, 0, dst[0], npieces, COLS,
                    halves_at(out[0], npieces, COLS));
            }
        };
    };
    glu(false)(0);
    glu(true)(0);
    CHECK(cudaStreamSynchronize(s));
    CHECK(cudaGetLastError());
    std::vector<float> d0(size_t(N) * COLS), d1(d0.size());
    CHECK(cudaMemcpy(d0.data(), dst[0], d0.size() * sizeof(float), cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(d1.data(), dst[1], d1.size() * sizeof(float), cudaMemcpyDeviceToHost));
    const bool same = std::memcmp(d0.data(), d1.data(), d0.size() * sizeof(float)) == 0;
    failures += !same;
    const float t_halves = time_calls(s, glu(false));
    const float t_records = time_calls(s, glu(true));
    std::printf("glu %5d values, %2d columns: writing halves %7.2f us, e4m3 records %7.2f us "
                "(+%.2f)%s\n",
                N, COLS, t_halves, t_records, t_records - t_halves,
                same ? "" : "  WRONG (not the same GLU)");
    for (int i = 0; i < 2; i++) {
        CHECK(cudaFree(dst[i]));
        CHECK(cudaFree(out[i]));
    }
    CHECK(cudaFree(ab));
}

// --- --overlap: a product beside the DeltaNet recurrence, on two streams ----------------------
//
// A verify layer of qwen35 runs its stacked inputs' product (qkv, z, alpha, beta: 16,480 rows),
// then the conv step and the recurrence (about 15 us at 16 tokens, latency-bound: 384 CTAs of 4
// warps), and only the gated norm after them reads z. Were z's 6,144 rows a product of their own
// on a second stream beside the conv and the recurrence, the stacked product would lose a third
// of its rows. Whether the two share the SMs well enough: `delta_net` (the 27B-shaped model's 48
// heads, 16 tokens) alone, z's product (6,144 x 5,120 repacked Q4_0, 16 columns: gemm_r<2> as
// lucepy-mm.cu launches it, and planned for 1-3 CTAs an SM) alone, the two one after the other,
// and the two side by side (fork and join in the graph), us a call. Each side's results are
// compared byte for byte with its own run alone.
struct DnBuffers {
    float *q, *k, *v, *g, *beta, *states, *pristine, *attn;
    int H = 48, hk = 16, T = 16, copies = 20;
    int64_t state_floats() const { return int64_t(DN_S) * DN_S * H; }
};

DnBuffers make_dn(std::mt19937 & rng, int T = 16) {
    DnBuffers b;
    b.T = T;
    std::normal_distribution<float> nd(0.0f, 1.0f / std::sqrt(float(DN_S)));
    std::uniform_real_distribution<float> gate(-1.0f, -0.05f), beta(0.05f, 0.95f);
    auto upload = [](const std::vector<float> & h, float ** d) {
        CHECK(cudaMalloc(d, h.size() * sizeof(float)));
        CHECK(cudaMemcpy(*d, h.data(), h.size() * sizeof(float), cudaMemcpyHostToDevice));
    };
    auto random = [&](size_t n, auto & dist, float times, float ** d) {
        std::vector<float> h(n);
        for (float & x : h) {
            x = dist(rng) * times;
        }
        upload(h, d);
    };
    random(size_t(DN_S) * b.hk * b.T, nd, 1.0f, &b.q);
    random(size_t(DN_S) * b.hk * b.T, nd, 1.0f, &b.k);
    random(size_t(DN_S) * b.H * b.T, nd, 8.0f, &b.v);
    random(size_t(b.H) * b.T, gate, 1.0f, &b.g);
    random(size_t(b.H) * b.T, beta, 1.0f, &b.beta);
    random(size_t(b.state_floats()), nd, 1.0f, &b.pristine);
    CHECK(cudaMalloc(&b.states, size_t(b.state_floats()) * b.copies * sizeof(float)));
    for (int c = 0; c < b.copies; c++) {
        CHECK(cudaMemcpy(b.states + b.state_floats() * c, b.pristine,
                         size_t(b.state_floats()) * sizeof(float), cudaMemcpyDeviceToDevice));
    }
    CHECK(cudaMalloc(&b.attn, size_t(DN_S) * b.H * b.T * sizeof(float)));
    return b;
}

// the recurrence of state copy `c` in place, as a verify runs it (no PDL here), on shape D
template <class D = DnModel> void launch_dn(const DnBuffers & b, int c, cudaStream_t s) {
    DeltaNetArgs a = {};
    a.q = b.q;
    a.k = b.k;
    a.sq1 = DN_S;
    a.sq2 = int64_t(DN_S) * b.hk;
    a.sq3 = a.sq2 * b.T;
    a.v = b.v;
    a.sv1 = DN_S;
    a.sv2 = int64_t(DN_S) * b.H;
    a.sv3 = a.sv2 * b.T;
    a.g = b.g;
    a.beta = b.beta;
    a.sb1 = 1;
    a.sb2 = b.H;
    a.sb3 = int64_t(b.H) * b.T;
    a.s0 = b.states + b.state_floats() * c;
    a.attn = b.attn;
    a.state = b.states + b.state_floats() * c;
    a.H = b.H;
    a.N = 1;
    a.T = b.T;
    a.hk = b.hk;
    a.rq3 = 1;
    a.scale = 1.0f / std::sqrt(float(DN_S));
    delta_net<D><<<dim3(unsigned(b.H), 1, unsigned(D::z)), D::threads, 0, s>>>(a);
}

// f(std::integral_constant<size_t, i>) for i = 0 .. N - 1, on the host
template <size_t... I, typename F> void for_each_index_of(F && f, std::index_sequence<I...>) {
    (f(std::integral_constant<size_t, I>{}), ...);
}

template <size_t N, typename F> void for_each_index(F && f) {
    for_each_index_of(f, std::make_index_sequence<N>());
}

// --delta-net: `delta_net` on each CTA shape (warps, columns a lane, lanes a column) for the
// 27B-shaped model's 48 heads, us a call, each shape's attention and state against the host's recurrence in double
// (the largest error over the largest magnitude) and byte for byte against the model's shape
// (each column's arithmetic is the same whatever the shape)
void bench_delta_net(cudaStream_t s, std::mt19937 & rng) {
    using Shapes = std::tuple<DnModel, DnShape<4, 1>, DnShape<2, 1>, DnShape<4, 2>,
                              DnShape<2, 2>, DnShape<1, 2>, DnShape<2, 4>, DnShape<1, 4>,
                              DnShape<4, 1, 4>, DnShape<2, 1, 4>, DnShape<8, 1, 4>,
                              DnShape<4, 2, 4>>;
    constexpr int NS = std::tuple_size<Shapes>::value;
    for (int T : {1, 2, 4, 8, 9, 16, 40, 512}) {
        DnBuffers b = make_dn(rng, T);
        b.copies = T > 40 ? 2 : b.copies;
        const int S = DN_S, H = b.H;
        auto down = [](const float * d, size_t n) {
            std::vector<float> h(n);
            CHECK(cudaMemcpy(h.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost));
            return h;
        };
        const std::vector<float> q = down(b.q, size_t(S) * b.hk * T);
        const std::vector<float> k = down(b.k, size_t(S) * b.hk * T);
        const std::vector<float> v = down(b.v, size_t(S) * H * T);
        const std::vector<float> g = down(b.g, size_t(H) * T);
        const std::vector<float> beta = down(b.beta, size_t(H) * T);
        const std::vector<float> s0 = down(b.pristine, size_t(b.state_floats()));
        std::vector<double> m(s0.begin(), s0.end());
        std::vector<double> attn(size_t(S) * H * T);
        for (int t = 0; t < T; t++) {
            for (int h = 0; h < H; h++) {
                const float * qt = &q[(size_t(t) * b.hk + h % b.hk) * S];
                const float * kt = &k[(size_t(t) * b.hk + h % b.hk) * S];
                const double decay = std::exp(double(g[size_t(t) * H + h]));
                for (int c = 0; c < S; c++) {
                    double * col = &m[(size_t(h) * S + c) * S];
                    double kv = 0.0;
                    for (int r = 0; r < S; r++) {
                        kv += col[r] * kt[r];
                    }
                    const double delta =
                        (v[(size_t(t) * H + h) * S + c] - decay * kv) * beta[size_t(t) * H + h];
                    double o = 0.0;
                    for (int r = 0; r < S; r++) {
                        col[r] = decay * col[r] + kt[r] * delta;
                        o += col[r] * qt[r];
                    }
                    attn[(size_t(t) * H + h) * S + c] = o / std::sqrt(double(S));
                }
            }
        }
        auto err = [](const std::vector<float> & got, const std::vector<double> & want) {
            double e = 0.0, big = 0.0;
            for (size_t i = 0; i < want.size(); i++) {
                e = std::max(e, std::fabs(double(got[i]) - want[i]));
                big = std::max(big, std::fabs(want[i]));
            }
            return e / big;
        };
        std::vector<float> model;  // the model's shape's attention, then its state
        std::printf("delta_net %3d tokens, us (warps x columns a lane x lanes a column):", T);
        for_each_index<NS>([&](auto i) {
            using D = std::tuple_element_t<decltype(i)::value, Shapes>;
            CHECK(cudaMemcpy(b.states, b.pristine, size_t(b.state_floats()) * sizeof(float),
                             cudaMemcpyDeviceToDevice));
            launch_dn<D>(b, 0, s);
            CHECK(cudaStreamSynchronize(s));
            CHECK(cudaGetLastError());
            std::vector<float> got = down(b.attn, attn.size());
            const std::vector<float> st = down(b.states, size_t(b.state_floats()));
            const double e_attn = err(got, attn), e_state = err(st, m);
            got.insert(got.end(), st.begin(), st.end());
            if (model.empty()) {
                model = got;
            }
            const bool same = std::memcmp(got.data(), model.data(), got.size() * 4) == 0;
            const float us = time_calls(s, [&](int c) { launch_dn<D>(b, c % b.copies, s); });
            std::printf("  %dx%dx%d %.2f", D::warps, D::per_lane, D::lanes, us);
            if (!(e_attn < 1e-4 && e_state < 1e-4) || !same) {
                std::printf(" (WRONG: attention %.2e, state %.2e%s)", e_attn, e_state,
                            same ? "" : ", not the model's bytes");
                failures++;
            }
        });
        std::printf("\n");
        for (float * d : {b.q, b.k, b.v, b.g, b.beta, b.states, b.pristine, b.attn}) {
            CHECK(cudaFree(d));
        }
    }
}

// --mma-rate: mma.sync m16n8k16 (halves, f32 sums) alone on every SM, as many warps an SM as
// gemm_rb runs and more, each warp CHAINS independent sums, and beside each mma ALU pairs of the
// unpacking's instructions (a lop3 and an hfma2 that make its next A registers: gemm_rb issues 2
// pairs a mma at 16 columns, 4 at 8). Each CTA's warp 0 counts the SM's cycles over its loop,
// so the rate comes as cycles a mma on each of the SM's four schedulers, beside TFLOP/s: what a
// product of halves on mma.sync can reach, against gemm_rb's 17-20 cycles a mma at 16 columns
// (session 40's timelines: 1.2-1.6 us a chunk of 8 words of 4 mmas, 4 warps a scheduler).
// the end of a rate kernel: its sums kept (stored never, but the compiler cannot know) and warp
// 0's count of the SM's cycles over the loop, for its CTA
__device__ __forceinline__ void rate_end(float sum, float * sink, long long * cycles,
                                         long long spent) {
    if (sum == 1234.5f) {
        sink[0] = sum;
    }
    if (threadIdx.x == 0) {
        cycles[blockIdx.x] = spent;
    }
}

// d = a b + c on mma.sync m16n8k32, s8 inputs and s32 sums (d and c may be the same registers)
__device__ __forceinline__ void mma_16832_s8(int32_t (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1, const int32_t (&c)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%10,%11,%12,%13};\n"
        : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(c[0]), "r"(c[1]),
          "r"(c[2]), "r"(c[3]));
#endif
}

template <int CHAINS, int ALU>
__global__ void __launch_bounds__(128) mma_rate(float * sink, long long * cycles, int iters) {
    const uint32_t lane = threadIdx.x % 32;
    uint32_t a[4] = {0x3c003c00u ^ lane, 0x3c003c01u ^ lane, 0x3c003c02u, 0x3c003c03u};
    const uint32_t b0 = 0x3c003c00u + lane, b1 = 0x3c003c10u + lane;
    float acc[CHAINS][4] = {};
    uint32_t x = lane * 0x01010101u;
    const long long t0 = clock64();
    for (int i = 0; i < iters; i++) {
#pragma unroll
        for (int c = 0; c < CHAINS; c++) {
#pragma unroll
            for (int u = 0; u < ALU; u++) {
                const __half2 h = nibble_halves((x + c * 0x11111111u) >> (4 * (u % 4)));
                const __half2 r = __hfma2(h, __float2half2_rn(0.5f), __float2half2_rn(-516.0f));
                a[u % 4] = *reinterpret_cast<const uint32_t *>(&r);
            }
            mma_16816(acc[c], a, b0, b1);
        }
        x += 0x9e3779b9u;
    }
    const long long t1 = clock64();
    float sum = 0.0f;
#pragma unroll
    for (int c = 0; c < CHAINS; c++) {
        sum += acc[c][0] + acc[c][1] + acc[c][2] + acc[c][3];
    }
    rate_end(sum, sink, cycles, t1 - t0);
}

// the same loop on mma.sync m16n8k32 of bytes: s8 with s32 sums, or e4m3 with f32 sums. Each does
// twice a m16n8k16's multiply-adds: the rate says whether a product of bytes (Q4_0's nibbles as
// s8, scaled a block at a time) would halve the tensor cores' part of a 16-column product.
template <int CHAINS, bool FP8>
__global__ void __launch_bounds__(128) mma_rate_k32(float * sink, long long * cycles, int iters) {
    const uint32_t lane = threadIdx.x % 32;
    const uint32_t a[4] = {0x01020304u ^ lane, 0x05060708u, 0x01010101u ^ lane, 0x02020202u};
    const uint32_t b0 = 0x01030507u + lane, b1 = 0x02040608u;
    int32_t iacc[CHAINS][4] = {};
    float facc[CHAINS][4] = {};
    const long long t0 = clock64();
    for (int i = 0; i < iters; i++) {
#pragma unroll
        for (int c = 0; c < CHAINS; c++) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
            if constexpr (FP8) {
                asm volatile(
                    "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, "
                    "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                    : "+f"(facc[c][0]), "+f"(facc[c][1]), "+f"(facc[c][2]), "+f"(facc[c][3])
                    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
            } else {
                mma_16832_s8(iacc[c], a, b0, b1, iacc[c]);
            }
#endif
        }
    }
    const long long t1 = clock64();
    float sum = 0.0f;
#pragma unroll
    for (int c = 0; c < CHAINS; c++) {
        sum += facc[c][0] + facc[c][1] + float(iacc[c][2] + iacc[c][3] + iacc[c][0] + iacc[c][1]);
    }
    rate_end(sum, sink, cycles, t1 - t0);
}

// One Q4_0 piece (16 rows x 32 values, two rows a lane) against 16 columns as gemm_rb works it,
// and three other ways: the loads from shared memory, the unpacking and the mmas of each, on
// registers and shared memory alone (no copies; a barrier every chunk of 8 pieces, as gemm_rb's).
//   PR_HALVES: 2 words and 2 scales, 2 x 16 B of activations; a row's word as 4 registers of
//           halves (lop3 1024 + n, less 1032, times d; a shift for each nibble past the first,
//           where gemm_rb takes the high nibbles unshifted with an fma: about 30 instructions a
//           chunk more than its 403); 4 m16n8k16 (2 column tiles, the low and the high 16
//           values) on 2 chains of sums
//   PR_CHAINS: the same on 4 chains (the low and the high values' sums apart)
//   PR_SUMS: a register of halves in 2 instructions: lop3 then one fma, (1024 + n) d - 1024 d =
//           n d (exact but for its one rounding; the high nibbles unshifted as 1024 + 16 n, so
//           16 n d, their sums apart and scaled by 1/16 at the end), the 8 d a value less taken
//           off a chunk at a time: an m16n8k8 of the rows' scales by the columns' block sums
//           times -8, each block's sum worked out by one thread from the chunk's activations
//   PR_SUMS_PRE: PR_SUMS with the block sums written beforehand (as the activations' producer
//           could write them beside the halves): the chunk loads them, sums none
//   PR_BYTES: the same words and scales, 2 x 8 B of s8 activations and 2 x 16 B of their
//           scales; a row's word as 2 registers of s8 16 (n - 8) (lop3 (w & F0F0F0F0) ^
//           80808080, and of w << 4 alike); 2 m16n8k32 on a constant sum (0x4B400000:
//           12582912.0f as bits, so that the s32 sum reads as a float offset by it) and per
//           output two fmas: the column's scale with the offset's, then the row's scale.
enum PieceWay { PR_HALVES, PR_CHAINS, PR_SUMS, PR_SUMS_PRE, PR_BYTES };

__device__ __forceinline__ void mma_1688(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(b));
#endif
}

// the nibbles at bits 4..7 and 20..23 of `bits` as the halves 1024 + 16 n (one lop3)
__device__ __forceinline__ __half2 nibble_halves16(uint32_t bits) {
    uint32_t h;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(h) : "r"(bits), "r"(0x00F000F0u), "r"(0x64006400u));
    return as_h2(h);
}

template <int WAY>
__global__ void __launch_bounds__(128) piece_rate(float * sink, long long * cycles, int iters) {
    // shared layouts free of bank conflicts, as gemm_rb's: 16 rows of a chunk's weights (a pitch
    // of 144 bytes: 8 pieces' words, then their scales), 16 columns of its activations (halves:
    // 8 pieces of 64 bytes and 64 over; bytes: of 32 and 32 over), and for the bytes each
    // piece's column scales with their offsets' (two floats a column), for the sums' way each
    // column's 8 block sums (halves)
    constexpr bool BYTES = WAY == PR_BYTES;
    constexpr bool SUMS = WAY == PR_SUMS || WAY == PR_SUMS_PRE;
    constexpr int W_PITCH = 144, X_AT = 4096, X_PITCH = BYTES ? 288 : 576, S_AT = 13312;
    constexpr int SIZE = 14336;
    __shared__ __align__(16) uint8_t smem[SIZE + 32];
    const uint32_t lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    for (int i = threadIdx.x; i < (SIZE + 32) / 4; i += blockDim.x) {
        reinterpret_cast<uint32_t *>(smem)[i] = (i & 1) ? 0x3c003c00u ^ i : 0x01020304u * i;
    }
    __syncthreads();
    float acc[2][4] = {}, acc2[2][4] = {};
    const long long t0 = clock64();
    for (int it = 0; it < iters; it += 8) {
        __syncthreads();  // (gemm_rb's barrier a chunk)
        const uint8_t * base = smem + ((it >> 3) & 1) * 16;  // (so no load leaves the loop)
        if constexpr (WAY == PR_SUMS) {  // a block's sum of a column, by thread 8 c + block
            const int c = threadIdx.x / 8, blk = threadIdx.x % 8;
            const uint4 * xs =
                reinterpret_cast<const uint4 *>(base + X_AT + c * X_PITCH + blk * 64);
            __half2 h = __float2half2_rn(0.0f);
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const uint4 v = xs[q];
                h = __hadd2(h, __hadd2(__hadd2(as_h2(v.x), as_h2(v.y)),
                                       __hadd2(as_h2(v.z), as_h2(v.w))));
            }
            const __half sum = __hmul(__hadd(__low2half(h), __high2half(h)), __float2half(-8.0f));
            // (read back by the chunk after: a chunk's sums lag it by one, as they would in
            // gemm_rb, so that its one barrier a chunk serves both)
            *reinterpret_cast<__half *>(smem + S_AT + c * 16 + blk * 2) = sum;
        }
        if constexpr (SUMS) {  // the 8 d a value off: the rows' scales times the block sums
            const uint8_t * wr = base + g * W_PITCH + 128;
            const uint32_t da = *reinterpret_cast<const uint32_t *>(wr + 4 * t);
            const uint32_t db = *reinterpret_cast<const uint32_t *>(wr + 8 * W_PITCH + 4 * t);
#pragma unroll
            for (int nt = 0; nt < 2; nt++) {
                const uint32_t sb =
                    *reinterpret_cast<const uint32_t *>(smem + S_AT + (nt * 8 + g) * 16 + 4 * t);
                mma_1688(acc[nt], da, db, sb);
            }
        }
#pragma unroll
        for (int piece = 0; piece < 8; piece++) {  // a chunk's 8 pieces, unrolled as gemm_rb's
            const uint8_t * wr = base + g * W_PITCH;
            const uint32_t w0 = *reinterpret_cast<const uint32_t *>(wr + piece * 16 + 4 * t);
            const uint32_t w1 =
                *reinterpret_cast<const uint32_t *>(wr + 8 * W_PITCH + piece * 16 + 4 * t);
            const __half d0 = *reinterpret_cast<const __half *>(wr + 128 + 2 * piece);
            const __half d1 = *reinterpret_cast<const __half *>(wr + 8 * W_PITCH + 128 + 2 * piece);
            if constexpr (!BYTES) {
                __half2 lo0[2], hi0[2], lo1[2], hi1[2];
                const __half2 dd0 = __half2half2(d0), dd1 = __half2half2(d1);
                if constexpr (SUMS) {
                    const __half2 k = __float2half2_rn(-1024.0f);
                    const __half2 m0 = __hmul2(dd0, k), m1 = __hmul2(dd1, k);
                    lo0[0] = __hfma2(nibble_halves(w0), dd0, m0);
                    lo0[1] = __hfma2(nibble_halves(w0 >> 8), dd0, m0);
                    hi0[0] = __hfma2(nibble_halves16(w0), dd0, m0);
                    hi0[1] = __hfma2(nibble_halves16(w0 >> 8), dd0, m0);
                    lo1[0] = __hfma2(nibble_halves(w1), dd1, m1);
                    lo1[1] = __hfma2(nibble_halves(w1 >> 8), dd1, m1);
                    hi1[0] = __hfma2(nibble_halves16(w1), dd1, m1);
                    hi1[1] = __hfma2(nibble_halves16(w1 >> 8), dd1, m1);
                } else {
                    const __half2 off = __float2half2_rn(1032.0f);
                    lo0[0] = __hmul2(__hsub2(nibble_halves(w0), off), dd0);
                    lo0[1] = __hmul2(__hsub2(nibble_halves(w0 >> 8), off), dd0);
                    hi0[0] = __hmul2(__hsub2(nibble_halves(w0 >> 4), off), dd0);
                    hi0[1] = __hmul2(__hsub2(nibble_halves(w0 >> 12), off), dd0);
                    lo1[0] = __hmul2(__hsub2(nibble_halves(w1), off), dd1);
                    lo1[1] = __hmul2(__hsub2(nibble_halves(w1 >> 8), off), dd1);
                    hi1[0] = __hmul2(__hsub2(nibble_halves(w1 >> 4), off), dd1);
                    hi1[1] = __hmul2(__hsub2(nibble_halves(w1 >> 12), off), dd1);
                }
                const uint32_t a_lo[4] = {as_u32(lo0[0]), as_u32(lo1[0]), as_u32(lo0[1]),
                                          as_u32(lo1[1])};
                const uint32_t a_hi[4] = {as_u32(hi0[0]), as_u32(hi1[0]), as_u32(hi0[1]),
                                          as_u32(hi1[1])};
#pragma unroll
                for (int nt = 0; nt < 2; nt++) {
                    const uint4 x = *reinterpret_cast<const uint4 *>(
                        base + X_AT + (nt * 8 + g) * X_PITCH + piece * 64 + 16 * t);
                    mma_16816(acc[nt], a_lo, x.x, x.y);
                    mma_16816(WAY == PR_HALVES ? acc[nt] : acc2[nt], a_hi, x.z, x.w);
                }
            } else {
                uint32_t a[4];
                const uint32_t m = 0xF0F0F0F0u, x8 = 0x80808080u;
                asm("lop3.b32 %0, %1, %2, %3, 0x6A;" : "=r"(a[2]) : "r"(w0), "r"(m), "r"(x8));
                asm("lop3.b32 %0, %1, %2, %3, 0x6A;" : "=r"(a[0]) : "r"(w0 << 4), "r"(m), "r"(x8));
                asm("lop3.b32 %0, %1, %2, %3, 0x6A;" : "=r"(a[3]) : "r"(w1), "r"(m), "r"(x8));
                asm("lop3.b32 %0, %1, %2, %3, 0x6A;" : "=r"(a[1]) : "r"(w1 << 4), "r"(m), "r"(x8));
                const float f0 = __half2float(d0), f1 = __half2float(d1);
#pragma unroll
                for (int nt = 0; nt < 2; nt++) {
                    const uint2 b = *reinterpret_cast<const uint2 *>(
                        base + X_AT + (nt * 8 + g) * X_PITCH + piece * 32 + 8 * t);
                    const float4 sc = *reinterpret_cast<const float4 *>(
                        base + S_AT + (piece * 16 + nt * 8 + 2 * t) * 8);
                    constexpr int32_t MAGIC = 0x4B400000;
                    constexpr int32_t start[4] = {MAGIC, MAGIC, MAGIC, MAGIC};
                    int32_t dsum[4];
                    mma_16832_s8(dsum, a, b.x, b.y, start);
                    acc[nt][0] = fmaf(f0, fmaf(__int_as_float(dsum[0]), sc.x, sc.z), acc[nt][0]);
                    acc[nt][1] = fmaf(f0, fmaf(__int_as_float(dsum[1]), sc.y, sc.w), acc[nt][1]);
                    acc[nt][2] = fmaf(f1, fmaf(__int_as_float(dsum[2]), sc.x, sc.z), acc[nt][2]);
                    acc[nt][3] = fmaf(f1, fmaf(__int_as_float(dsum[3]), sc.y, sc.w), acc[nt][3]);
                }
            }
        }
    }
    const long long t1 = clock64();
    float sum = 0.0f;
#pragma unroll
    for (int nt = 0; nt < 2; nt++) {
#pragma unroll
        for (int j = 0; j < 4; j++) {
            sum += acc[nt][j] + acc2[nt][j] * (SUMS ? 0.0625f : 1.0f);
        }
    }
    rate_end(sum, sink, cycles, t1 - t0);
}

void bench_mma_rate(cudaStream_t s) {
    constexpr int ITERS = 1024;
    float * sink;
    long long * cycles;
    CHECK(cudaMalloc(&sink, sizeof(float)));
    CHECK(cudaMalloc(&cycles, sizeof(long long) * g_sms * 16));
    std::printf("mma.sync m16n8k16 f32 sums on %d SMs: cycles a mma a scheduler (TFLOP/s)\n",
                g_sms);
    std::printf("warps/SM chains  mma alone       +2 pairs        +4 pairs\n");
    auto one = [&](auto kernel, int per_sm, int chains, int k16s = 1) {
        const int ctas = g_sms * per_sm;
        const float us =
            time_calls(s, [&](int) { kernel<<<ctas, 128, 0, s>>>(sink, cycles, ITERS); });
        std::vector<long long> c(ctas);
        CHECK(cudaMemcpy(c.data(), cycles, sizeof(long long) * ctas, cudaMemcpyDeviceToHost));
        std::sort(c.begin(), c.end());
        const double mmas_a_scheduler = double(per_sm) * 4 / 4 * ITERS * chains;  // 4 warps a CTA
        const double flops = double(ctas) * 4 * ITERS * chains * 4096.0 * k16s;
        std::printf(" %6.2f (%5.0f)", double(c[ctas / 2]) / mmas_a_scheduler, flops / us / 1e6);
    };
    for (int per_sm : {1, 2, 4, 5, 8}) {
        for_each_index<3>([&](auto ci) {
            constexpr int CH = 1 << decltype(ci)::value;
            std::printf("%-8d %-6d", 4 * per_sm, CH);
            one(mma_rate<CH, 0>, per_sm, CH);
            one(mma_rate<CH, 2>, per_sm, CH);
            one(mma_rate<CH, 4>, per_sm, CH);
            std::printf("\n");
        });
    }
    std::printf("\nm16n8k32 (twice the multiply-adds a mma): cycles a mma a scheduler (TFLOP/s)\n");
    std::printf("warps/SM chains  s8 (s32 sums)   e4m3 (f32 sums)\n");
    for (int per_sm : {1, 2, 4, 8}) {
        for_each_index<2>([&](auto ci) {
            constexpr int CH = 2 << decltype(ci)::value;  // (ptxas drops a lone s8 chain's loop)
            std::printf("%-8d %-6d", 4 * per_sm, CH);
            one(mma_rate_k32<CH, false>, per_sm, CH, 2);
            one(mma_rate_k32<CH, true>, per_sm, CH, 2);
            std::printf("\n");
        });
    }
    std::printf("\na Q4_0 piece against 16 columns, loads from shared memory, unpacking and "
                "mmas: cycles a piece a scheduler\n");
    std::printf("warps/SM  halves          4 chains        block sums      sums written    "
                "bytes\n");
    for (int per_sm : {4, 5, 6, 8}) {
        std::printf("%-9d", 4 * per_sm);
        one(piece_rate<PR_HALVES>, per_sm, 1, 4);
        one(piece_rate<PR_CHAINS>, per_sm, 1, 4);
        one(piece_rate<PR_SUMS>, per_sm, 1, 4);
        one(piece_rate<PR_SUMS_PRE>, per_sm, 1, 4);
        one(piece_rate<PR_BYTES>, per_sm, 1, 4);
        std::printf("\n");
    }
    CHECK(cudaGetLastError());
    CHECK(cudaFree(sink));
    CHECK(cudaFree(cycles));
}

void bench_overlap(cudaStream_t s, std::mt19937 & rng) {
    constexpr int K = 5120, ROWS = 6144, NCOLS = 16;
    const int npieces = K / 32;
    const int64_t row_bytes = int64_t(npieces) * 18;
    const int64_t mat_bytes = row_bytes * ROWS;
    const int copies = int((int64_t(1) << 30) / mat_bytes);
    std::vector<uint8_t> host(mat_bytes);
    for (int64_t b = 0; b < mat_bytes / 18; b++) {
        fill_block(Q4_0, host.data() + b * 18, rng);
    }
    const std::vector<uint8_t> rp = host_repack(host.data(), row_bytes, ROWS, npieces);
    uint8_t * wr;
    CHECK(cudaMalloc(&wr, size_t(mat_bytes) * copies));
    for (int c = 0; c < copies; c++) {
        CHECK(cudaMemcpy(wr + mat_bytes * c, rp.data(), size_t(mat_bytes),
                         cudaMemcpyHostToDevice));
    }
    std::vector<float> x(size_t(NCOLS) * K);
    std::uniform_real_distribution<float> val(-1.0f, 1.0f);
    for (float & v : x) {
        v = val(rng);
    }
    float *dx, *dst, *parts;
    uint8_t * act;
    CHECK(cudaMalloc(&dx, x.size() * sizeof(float)));
    CHECK(cudaMemcpy(dx, x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice));
    CHECK(cudaMalloc(&act, size_t(halves_bytes(npieces, NCOLS))));
    CHECK(cudaMalloc(&dst, size_t(NCOLS) * ROWS * sizeof(float)));
    CHECK(cudaMalloc(&parts, size_t(16) * NCOLS * ROWS * sizeof(float)));
    const Halves halves = halves_at(act, npieces, NCOLS);
    to_halves<<<dim3(unsigned(segments(npieces)), unsigned(padded_cols(NCOLS))), TH_THREADS, 0,
                s>>>(dx, K, npieces, NCOLS, halves);
    GemmArgs g = {};
    g.row_stride = row_bytes;
    g.x = halves;
    g.dst = dst;
    g.dst_stride = ROWS;
    g.nrows = ROWS;
    g.npieces = npieces;
    g.ncols = NCOLS;
    const DnBuffers dn = make_dn(rng);

    cudaStream_t s2;
    CHECK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
    cudaEvent_t fork, join;
    CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
    CHECK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
    using Launch = void (*)(GemmArgs, float *, cudaStream_t);
    const std::pair<const char *, Launch> plans[] = {
        {"gemm_r<2>, its plan", launch_build<GemmR<2>>},
        {"gemm_r<2>, 1 CTA an SM", launch_build<GemmR<2>, 16, 1>},
        {"gemm_r<2>, 2 CTAs an SM", launch_build<GemmR<2>, 16, 2>},
        {"gemm_r<2>, 3 CTAs an SM", launch_build<GemmR<2>, 16, 3>}};
    auto product = [&](Launch launch, int i, cudaStream_t on) {
        GemmArgs b = g;
        b.w = wr + mat_bytes * (i % copies);
        launch(b, parts, on);
    };
    // both sides once from the pristine state: what each writes, alone or side by side
    auto results = [&](auto run) {
        CHECK(cudaMemcpy(dn.states, dn.pristine, size_t(dn.state_floats()) * sizeof(float),
                         cudaMemcpyDeviceToDevice));
        CHECK(cudaMemset(dst, 0, size_t(NCOLS) * ROWS * sizeof(float)));
        CHECK(cudaMemset(dn.attn, 0, size_t(DN_S) * dn.H * dn.T * sizeof(float)));
        run();
        CHECK(cudaStreamSynchronize(s));
        CHECK(cudaGetLastError());
        std::vector<float> out(size_t(NCOLS) * ROWS + size_t(DN_S) * dn.H * dn.T);
        CHECK(cudaMemcpy(out.data(), dst, size_t(NCOLS) * ROWS * sizeof(float),
                         cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(out.data() + size_t(NCOLS) * ROWS, dn.attn,
                         size_t(DN_S) * dn.H * dn.T * sizeof(float), cudaMemcpyDeviceToHost));
        return out;
    };
    const float t_dn = time_calls(s, [&](int i) { launch_dn(dn, i % dn.copies, s); });
    std::printf("overlap: delta_net alone (48 heads, 16 tokens) %7.2f us\n", t_dn);
    for (const auto & plan : plans) {
        const Launch launch = plan.second;
        const float t_p = time_calls(s, [&](int i) { product(launch, i, s); });
        const float t_serial = time_calls(s, [&](int i) {
            launch_dn(dn, i % dn.copies, s);
            product(launch, i, s);
        });
        auto side_by_side = [&](int i, bool product_first) {
            CHECK(cudaEventRecord(fork, s));
            CHECK(cudaStreamWaitEvent(s2, fork, 0));
            if (product_first) {
                product(launch, i, s2);
                launch_dn(dn, i % dn.copies, s);
            } else {
                launch_dn(dn, i % dn.copies, s);
                product(launch, i, s2);
            }
            CHECK(cudaEventRecord(join, s2));
            CHECK(cudaStreamWaitEvent(s, join, 0));
        };
        const std::vector<float> alone = results([&] {
            launch_dn(dn, 0, s);
            product(launch, 0, s);
        });
        const std::vector<float> both = results([&] { side_by_side(0, false); });
        const bool same = both == alone;
        failures += !same;
        const float t_both = time_calls(s, [&](int i) { side_by_side(i, false); });
        const float t_first = time_calls(s, [&](int i) { side_by_side(i, true); });
        std::printf("  z's product, %-24s alone %7.2f us, after delta_net %7.2f, beside it %7.2f "
                    "(launched first %7.2f)%s\n",
                    plan.first, t_p, t_serial, t_both, t_first, same ? "" : "  WRONG");
    }
    CHECK(cudaEventDestroy(fork));
    CHECK(cudaEventDestroy(join));
    CHECK(cudaStreamDestroy(s2));
    for (float * p : {dn.q, dn.k, dn.v, dn.g, dn.beta, dn.states, dn.pristine, dn.attn, dx, dst,
                      parts}) {
        CHECK(cudaFree(p));
    }
    CHECK(cudaFree(wr));
    CHECK(cudaFree(act));
}

}  // namespace

int main(int argc, char ** argv) {
    bool quick = false;
    const char * only_kind = nullptr;
    const char * only_shape = nullptr;
    std::vector<int> cols;  // --cols 2,4,8,16: gemm against one column
    bool sum_norm = false;  // --sum-norm: a verify's residual sum and next norm, 2 kernels or 1
    bool overlap = false;   // --overlap: z's product beside the DeltaNet recurrence
    bool recurrence = false;  // --delta-net: its CTA shapes
    bool mma = false;         // --mma-rate: the tensor cores' rate on mma.sync
    bool e4m3 = false;        // --e4m3: the records' conversion against the non-saturating one
    for (int i = 1; i < argc; i++) {
        if (std::strcmp(argv[i], "--quick") == 0) {
            quick = true;
        } else if (std::strcmp(argv[i], "--sum-norm") == 0) {
            sum_norm = true;
        } else if (std::strcmp(argv[i], "--overlap") == 0) {
            overlap = true;
        } else if (std::strcmp(argv[i], "--delta-net") == 0) {
            recurrence = true;
        } else if (std::strcmp(argv[i], "--mma-rate") == 0) {
            mma = true;
        } else if (std::strcmp(argv[i], "--e4m3") == 0) {
            e4m3 = true;
        } else if (std::strcmp(argv[i], "--anatomy") == 0) {
            g_anatomy = true;
        } else if (std::strcmp(argv[i], "--timeline") == 0) {
            g_timeline = true;
        } else if (std::strcmp(argv[i], "--f8") == 0) {
            g_f8 = true;
        } else if (std::strcmp(argv[i], "--kind") == 0 && i + 1 < argc) {
            only_kind = argv[++i];
        } else if (std::strcmp(argv[i], "--shape") == 0 && i + 1 < argc) {
            only_shape = argv[++i];
        } else if (std::strcmp(argv[i], "--cols") == 0 && i + 1 < argc) {
            for (char * at = argv[++i]; *at;) {
                const int n = int(std::strtol(at, &at, 10));
                if (n < 1 || (n > MAX_GEMM_COLS && n % 32 != 0) || n > 1024) {
                    std::fprintf(stderr, "--cols: counts of 1 to 16 columns, or multiples of 32 "
                                         "to 1024 (the repacked Q4_0 only)\n");
                    return 2;
                }
                cols.push_back(n);
                at += *at == ',';
            }
        } else {
            std::fprintf(stderr,
                         "usage: %s [--quick] [--kind KIND] [--shape NAME] [--cols 2,4,8,16] "
                         "[--sum-norm] [--overlap] [--delta-net] [--mma-rate] [--e4m3] "
                         "[--anatomy] [--timeline] [--f8]\n",
                         argv[0]);
            return 2;
        }
    }
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    g_sms = prop.multiProcessorCount;
    g_smem_per_sm = int(prop.sharedMemPerMultiprocessor);
    g_smem_reserved = int(prop.reservedSharedMemPerBlock);
    std::printf("%s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount,
                prop.l2CacheSize >> 20);
    cudaStream_t s;
    CHECK(cudaStreamCreate(&s));
    std::mt19937 rng(7);
    if (mma) {
        bench_mma_rate(s);
        return 0;
    }
    if (e4m3) {
        check_e4m3(s);
        return failures ? 1 : 0;
    }
    if (recurrence) {
        bench_delta_net(s, rng);
        std::printf(failures ? "%d WRONG\n" : "every shape near the host's, the model's bytes\n",
                    failures);
        return failures ? 1 : 0;
    }
    if (overlap) {
        bench_overlap(s, rng);
        std::printf(failures ? "%d WRONG\n" : "side by side, both wrote their own bytes\n",
                    failures);
        return failures ? 1 : 0;
    }
    if (sum_norm) {  // the parts gemm_r splits the model's 5,120-row products into: 1, 3-5
        for (int ncols : {2, 9, 16}) {
            for (int nparts : {1, 3, 4, 5}) {
                bench_sum_norm(ncols, nparts, s, rng);
            }
        }
        bench_glu(s, rng);
        std::printf(failures ? "%d WRONG\n" : "both ways wrote the same bytes\n", failures);
        return failures ? 1 : 0;
    }
    // Qwen3.6-27B's decode products (n_embd 5120, n_ff 17408), and its Q6_K output head
    const Shape shapes[] = {
        {"ffn_up+gate", 5120, 17408, true},
        {"ffn_up|gate", 5120, 2 * 17408, false},  // the two stacked: one verify product
        {"ffn_down", 17408, 5120, false},
        {"qkv", 5120, 10240, false},
        {"dn_in", 5120, 16480, false},  // qwen35's DeltaNet inputs stacked: qkv, z, alpha, beta
        {"attn_out", 6144, 5120, false},
        {"attn_k", 5120, 1024, false},
        {"output", 5120, 248320, false},
    };
    for (int k : {Q4_0, Q4_K, Q8_0, Q6_K, Q5_K, IQ4_XS, Q4_1, Q5_1}) {
        const bool more = k == Q5_K || k == IQ4_XS || k == Q4_1 || k == Q5_1;
        if (more && !only_kind) {
            continue;  // the types beyond the 27B-shaped Q4_0 and Q4_K_M files: when named
        }
        for (const Shape & sh : shapes) {
            if ((sh.rows > 100000 && k != Q6_K) || (quick && k == Q8_0)) {
                continue;  // the output head is Q6_K in the Q4_0 and Q4_K_M files
            }
            if ((only_kind && std::strcmp(only_kind, kind_name(k)) != 0) ||
                (only_shape && std::strcmp(only_shape, sh.what) != 0)) {
                continue;
            }
            if (cols.empty()) {
                bench(k, sh, s, rng);
            } else {
                bench_cols(k, sh, cols, s, rng);
            }
        }
    }
    std::printf(failures ? "%d WRONG\n" : "all results match the host's\n", failures);
    return failures ? 1 : 0;
}
