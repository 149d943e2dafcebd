// Part of bench-kernels.cu (one program; each part includes the part before it): --f8: gemm_f8 on
// the repacked copies at 9-16 columns.

#pragma once

#include "bench-gemm.cuh"

namespace {

// --- --f8: gemm_f8 (lucepy-f8.cuh) on the repacked copies at 9-16 columns ---------------------

bool g_f8 = false;

// to_e4m3 of the unrounded activations, then gemm_f8 as lucepy-repacked.cu plans it (5 CTAs an SM),
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
    // lucepy-repacked.cu's plan (5 CTAs an SM, up to 16 parts), then others: fewer parts, or the
    // plan for 4 or 6 CTAs an SM (the kernel's occupancy unchanged)
    struct Variant {
        const char * name;
        int per_sm, most;
    };
    const Variant variants[] = {{"f8", R::minb, 16}, {"f8 <= 2 parts", R::minb, 2},
                                {"f8 <= 4 parts", R::minb, 4}, {"f8 plan 4 an SM", 4, 16},
                                {"f8 plan 6 an SM", 6, 16}};
    // and lucepy-repacked.cu's plan with its 2 parts paired (f8_paired: each row tile's parts a
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

}  // namespace
