// Part of bench-kernels.cu (one program; each part includes the part before it): --timeline, the
// repacked types' gemm_rb and gemv_r launches, the fused gate and prefill.

#pragma once

#include "bench-f8.cuh"

namespace {

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
    if (k == Q5_K || k == Q6_K) {  // gemm_rb always, as lucepy-repacked.cu launches it
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

}  // namespace
