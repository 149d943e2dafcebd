// Part of bench-kernels.cu (one program; each part includes the part before it): one column: gemv's
// launches against a streaming read of the same bytes.

#pragma once

#include "bench-common.cuh"

namespace {

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

}  // namespace
