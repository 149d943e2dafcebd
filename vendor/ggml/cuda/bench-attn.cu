// lucepy's attention of 1-16 queries (lucepy-attn.cuh) alone on a GPU, without ggml: the
// 27B-shaped model's heads (256 values, 24 query heads over 4 KV heads) over caches of 256 to
// 8,192 rows, each of its splits' counts: us a call (attn_few and, past one split, attn_join),
// K and V bytes read a second, and the result against the host's attention in double on the
// same f16 cache. For the caches past the 1,024 rows that lucepy-attn.cu takes today: whether
// more splits, or none of ggml's fixup, would pay there.
//
//     nvcc -O3 -std=c++17 -arch=sm_90 -o bench-attn bench-attn.cu
//     ./bench-attn [--rows 256,1024,4096,8192] [--queries 1,16] [--splits 0,4,8,16,32,64]
//     (splits 0: lucepy-attn.cu's choice, attn_splits; past 16, attn_join<D, true> joins them)
//
// The cache is random f16, several copies in turn so that no call finds its K and V in the L2
// cache; the mask lets each query see the rows before it (the last 16 rows the step's own).
// Times: a CUDA graph of 20 calls, replayed 10 times, the median replay over 11.

#include "lucepy-attn.cuh"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

using namespace lucepy;

#define CHECK(x)                                                                           \
    do {                                                                                   \
        cudaError_t err_ = (x);                                                            \
        if (err_ != cudaSuccess) {                                                         \
            std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(err_)); \
            std::exit(1);                                                                  \
        }                                                                                  \
    } while (0)

constexpr int D = 256, NH = 24, NKV = 4;
constexpr int CALLS = 20, REPLAYS = 10, TIMES = 11;

static std::vector<int> ints(const char * text) {
    std::vector<int> out;
    for (std::string s = text; !s.empty();) {
        const size_t comma = s.find(',');
        out.push_back(std::atoi(s.substr(0, comma).c_str()));
        s = comma == std::string::npos ? "" : s.substr(comma + 1);
    }
    return out;
}

// the host's attention in double of query row (t, h) over the cache's f16 values
static void exact_row(const std::vector<float> & q, const std::vector<__half> & kv, int n_kv,
                      const std::vector<float> & mask, int t, int h, float scale, double * out) {
    const int g = h / (NH / NKV);
    const int64_t row = int64_t(NKV) * D;  // a cache row: every KV head's K (and V after)
    std::vector<double> s(n_kv);
    double top = -INFINITY;
    for (int j = 0; j < n_kv; j++) {
        double dot = 0.0;
        for (int d = 0; d < D; d++) {
            const double k = __half2float(kv[j * row + g * D + d]);
            dot += double(q[(int64_t(t) * NH + h) * D + d]) * k;
        }
        s[j] = scale * dot + mask[int64_t(t) * n_kv + j];
        top = std::max(top, s[j]);
    }
    double sum = 0.0;
    for (int d = 0; d < D; d++) {
        out[d] = 0.0;
    }
    const int64_t v_at = int64_t(n_kv) * row;  // V's rows after K's
    for (int j = 0; j < n_kv; j++) {
        const double p = std::exp(s[j] - top);
        sum += p;
        for (int d = 0; d < D; d++) {
            out[d] += p * double(__half2float(kv[v_at + j * row + g * D + d]));
        }
    }
    for (int d = 0; d < D; d++) {
        out[d] /= sum;
    }
}

static void run(int n_kv, int T, int splits_asked, int sms, std::mt19937 & rng) {
    const int ratio = NH / NKV, tiles = (ratio * T + AT_ROWS - 1) / AT_ROWS;
    const int splits = splits_asked > 0 ? std::min(splits_asked, AT_LONG_SPLITS)
                                        : attn_splits(n_kv, tiles * NKV, sms);
    const int64_t row = int64_t(NKV) * D;
    const int64_t copy_halves = 2 * int64_t(n_kv) * row;  // K's rows, then V's
    const int copies = int(std::max<int64_t>(2, (256ll << 20) / (copy_halves * 2)));
    std::normal_distribution<float> normal;
    std::vector<__half> kv(copy_halves);
    for (auto & x : kv) {
        x = __float2half(normal(rng));
    }
    std::vector<float> q(int64_t(T) * NH * D), mask(int64_t(T) * n_kv);
    for (auto & x : q) {
        x = 2.0f * normal(rng);
    }
    const int seen = n_kv - 16;  // the rows before the step
    for (int t = 0; t < T; t++) {
        for (int j = 0; j < n_kv; j++) {
            mask[int64_t(t) * n_kv + j] = j <= seen + t ? 0.0f : -INFINITY;
        }
    }
    std::vector<__half> mask_h(mask.size());
    for (size_t i = 0; i < mask.size(); i++) {
        mask_h[i] = __float2half(mask[i]);
    }
    __half * kv_d;
    float * q_d, * dst_d, * part_d;
    float2 * ms_d;
    __half * mask_d;
    const int64_t rows = int64_t(NKV) * ratio * T;
    CHECK(cudaMalloc(&kv_d, copies * copy_halves * 2));
    CHECK(cudaMalloc(&q_d, q.size() * 4));
    CHECK(cudaMalloc(&dst_d, q.size() * 4));
    CHECK(cudaMalloc(&part_d, AT_LONG_SPLITS * rows * D * 4));
    CHECK(cudaMalloc(&ms_d, AT_LONG_SPLITS * rows * 8));
    CHECK(cudaMalloc(&mask_d, mask_h.size() * 2));
    for (int c = 0; c < copies; c++) {
        CHECK(cudaMemcpy(kv_d + c * copy_halves, kv.data(), copy_halves * 2,
                         cudaMemcpyHostToDevice));
    }
    CHECK(cudaMemcpy(q_d, q.data(), q.size() * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(mask_d, mask_h.data(), mask_h.size() * 2, cudaMemcpyHostToDevice));
    CHECK(cudaFuncSetAttribute(attn_few<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               attn_smem<D>()));

    auto args = [&](int c) {
        AttnArgs a{};
        a.q = reinterpret_cast<const char *>(q_d);
        a.q1 = int64_t(NH) * D * 4, a.q2 = D * 4, a.q3 = 0;
        const __half * k = kv_d + c * copy_halves;
        a.k = reinterpret_cast<const char *>(k);
        a.v = reinterpret_cast<const char *>(k + int64_t(n_kv) * row);
        a.k1 = a.v1 = row * 2, a.k2 = a.v2 = D * 2, a.k3 = a.v3 = 0;
        a.mask = reinterpret_cast<const char *>(mask_d);
        a.m1 = int64_t(n_kv) * 2, a.m2 = a.m3 = 0, a.mh = a.ms = 1;
        a.dst = dst_d;
        a.T = T, a.nh = NH, a.ratio = ratio, a.n_kv = n_kv;
        a.scale = float(1.0 / std::sqrt(double(D)) * 1.4426950408889634);
        a.splits = splits, a.part = part_d, a.part_ms = ms_d;
        return a;
    };
    cudaStream_t stream;
    CHECK(cudaStreamCreate(&stream));
    auto launch = [&](int c) {
        const AttnArgs a = args(c);
        attn_few<D><<<dim3(tiles * splits, NKV, 1), D / AT_DW * 32, attn_smem<D>(), stream>>>(a);
        const dim3 rows_grid(ratio * T, NKV, 1);
        if (splits > AT_SPLITS) {
            attn_join<D, true><<<rows_grid, D / 4, 0, stream>>>(a);
        } else if (splits > 1) {
            attn_join<D><<<rows_grid, D / 4, 0, stream>>>(a);
        }
    };

    // the result of copy 0 against the host's
    launch(0);
    CHECK(cudaStreamSynchronize(stream));
    CHECK(cudaGetLastError());
    std::vector<float> got(q.size());
    CHECK(cudaMemcpy(got.data(), dst_d, got.size() * 4, cudaMemcpyDeviceToHost));
    double worst = 0.0;
    std::vector<double> want(D);
    for (int t = 0; t < T; t++) {
        for (int h = 0; h < NH; h += 5) {  // (every fifth head: the host's double is slow)
            exact_row(q, kv, n_kv, mask, t, h, float(1.0 / std::sqrt(double(D))), want.data());
            double err = 0.0, norm = 0.0;
            for (int d = 0; d < D; d++) {
                const double e = got[(int64_t(t) * NH + h) * D + d] - want[d];
                err += e * e, norm += want[d] * want[d];
            }
            worst = std::max(worst, std::sqrt(err / norm));
        }
    }

    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < CALLS; i++) {
        launch(i % copies);
    }
    CHECK(cudaStreamEndCapture(stream, &graph));
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    cudaEvent_t t0, t1;
    CHECK(cudaEventCreate(&t0));
    CHECK(cudaEventCreate(&t1));
    std::vector<float> times;
    for (int r = 0; r < TIMES + 1; r++) {
        CHECK(cudaEventRecord(t0, stream));
        for (int i = 0; i < REPLAYS; i++) {
            CHECK(cudaGraphLaunch(exec, stream));
        }
        CHECK(cudaEventRecord(t1, stream));
        CHECK(cudaEventSynchronize(t1));
        float ms = 0.0f;
        CHECK(cudaEventElapsedTime(&ms, t0, t1));
        if (r > 0) {  // (the first: warm-up)
            times.push_back(1e3f * ms / (REPLAYS * CALLS));
        }
    }
    std::sort(times.begin(), times.end());
    const float us = times[times.size() / 2];
    const double bytes = 2.0 * n_kv * NKV * D * 2;  // the K and V rows a call reads
    std::printf("rows %5d, %2d queries, %2d splits (%4d CTAs): %7.2f us a call, %7.1f GB/s of K "
                "and V; error %.2e of the exact\n",
                n_kv, T, splits, tiles * splits * NKV, us, bytes / (us * 1e3), worst);
    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphDestroy(graph));
    CHECK(cudaStreamDestroy(stream));
    for (void * p : {(void *) kv_d, (void *) q_d, (void *) dst_d, (void *) part_d, (void *) ms_d,
                     (void *) mask_d}) {
        CHECK(cudaFree(p));
    }
}

int main(int argc, char ** argv) {
    std::vector<int> rows = {256, 1024, 4096, 8192}, queries = {1, 16}, splits = {0};
    for (int i = 1; i + 1 < argc; i += 2) {
        const std::string flag = argv[i];
        auto & to = flag == "--rows" ? rows : flag == "--queries" ? queries : splits;
        if (flag != "--rows" && flag != "--queries" && flag != "--splits") {
            std::fprintf(stderr, "bench-attn: unknown flag %s\n", argv[i]);
            return 2;
        }
        to = ints(argv[i + 1]);
    }
    int sms = 0;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    std::mt19937 rng(59);
    for (int n : rows) {
        for (int T : queries) {
            for (int s : splits) {
                if (n % 2 != 0 || T < 1 || T > 16) {
                    std::fprintf(stderr, "bench-attn: rows even, 1-16 queries\n");
                    return 2;
                }
                run(n, T, s, sms, rng);
            }
        }
    }
    return 0;
}
