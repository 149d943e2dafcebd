// Part of bench-kernels.cu (one program; each part includes the part before it): --e4m3, --sum-norm
// and the GLU's records.

#pragma once

#include "bench-cols.cuh"

namespace {

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

}  // namespace
