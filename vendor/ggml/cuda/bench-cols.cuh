// Part of bench-kernels.cu (one program; each part includes the part before it): --cols: each
// launch of 2-16 columns against one column's.

#pragma once

#include "bench-repacked.cuh"

namespace {

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

}  // namespace
