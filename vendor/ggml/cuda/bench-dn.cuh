// Part of bench-kernels.cu (one program; each part includes the part before it): --overlap's
// buffers and --delta-net: the recurrence's CTA shapes.

#pragma once

#include "bench-norm.cuh"

namespace {

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

}  // namespace
