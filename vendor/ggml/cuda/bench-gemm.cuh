// Part of bench-kernels.cu (one program; each part includes the part before it): 2 to 16 columns:
// gemm's and gemm_r's launches, and --anatomy.

#pragma once

#include "bench-gemv.cuh"

namespace {

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

// gemm_r's plan (lucepy-repacked.cu's gemm_r_plan) for CTAs of W warps, per_sm of them an SM
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
            {"rp bulk", launch_build<GemmRB<NT>>},  // lucepy-repacked.cu's where bulk_product
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

}  // namespace
