// lucepy's own kernels (issue 19, decision 12), hooked into the pinned ggml-cuda: the host side of
// the products of repacked matrices (lucepy-layouts.cuh: Q4_0, Q4_K, Q5_K and Q6_K), their
// registry (lucepy_cuda_repack, lucepy_cuda_bytes_gone), routes, plans and launches on gemv_r,
// gemm_r, gemm_rb, gemm_rq and gemm_f8, and a verify's FFN gate and up as one product
// (glu_pair_nodes). lucepy-mm.cu routes every product; lucepy-launch.cuh holds the launch
// templates both use. hooks.patch compiles this file for sm_90a too (gemm_f8's wgmmas) and
// defines LUCEPY_F8 for it, which f8_on reads here, in the file that launches them.

#include "lucepy-launch.cuh"

#include <atomic>
#include <iterator>
#include <map>
#include <mutex>
#include <type_traits>

#if !defined(GGML_USE_HIP) && !defined(GGML_USE_MUSA)

namespace lucepy {

// Whether this build and device run gemm_f8 (its sm_90a code: a GPU of compute capability 9.0;
// LUCEPY_CUDA_F8=0 leaves it to gemm_rb, for comparison)
bool f8_on(int device) {
#if defined(LUCEPY_F8)
    static const bool wanted = switched_on("LUCEPY_CUDA_F8");
    return wanted && ggml_cuda_info().devices[device].cc == GGML_CUDA_CC_HOPPER;
#else
    (void) device;
    return false;
#endif
}

// Whether gemm_f8 can take a product of matrix w at ncols columns: w repacked Q4_0 or Q4_K,
// 9-16 columns, on a device that runs it
bool f8_matrix(const ggml_tensor * w, int64_t ncols, int device) {
    return f8_on(device) && ncols > GM_COL_TILE && ncols <= F8_COLS &&
           (w->type == GGML_TYPE_Q4_0 || w->type == GGML_TYPE_Q4_K) && repacked_of(w);
}

// Whether gemm_f8 takes an FFN's gate and up m1, m2 (glu_pair_at's) as one product: both
// matrices its, of one type. (glu_pair_nodes checks the rest.)
bool f8_pair(const ggml_tensor * m1, const ggml_tensor * m2, int device) {
    const int64_t ncols = m1->src[1]->ne[1];
    return m1->src[0]->type == m2->src[0]->type && f8_matrix(m1->src[0], ncols, device) &&
           f8_matrix(m2->src[0], ncols, device);
}

// --- Q4_0, Q4_K, Q5_K and Q6_K repacked (lucepy-layouts.cuh, lucepy-repack.cuh) ----------------
//
// lucepy_cuda_repack rewrites a Q4_0, Q4_K, Q5_K or Q6_K weight in place into lucepy's layout
// (Q5_K and Q6_K on compute capability 9.0 and newer: their 2-16 column kernel is gemm_rb) and
// records its bytes; from then on every product of them is ours (repacked_mul_mat), whatever
// LUCEPY_CUDA_KERNELS says, since ggml's kernels cannot read them.

struct Repacked {
    uintptr_t end;
    int64_t ne0;        // values a row
    int64_t row_bytes;  // of a row of blocks
    ggml_type type;     // the blocks' (Q4_0, Q4_K, Q5_K, Q6_K)
};

// whether lucepy-layouts.cuh's layouts take a matrix of these blocks
bool repackable_type(ggml_type type) {
    return type == GGML_TYPE_Q4_0 || type == GGML_TYPE_Q4_K || type == GGML_TYPE_Q5_K ||
           type == GGML_TYPE_Q6_K;
}

// f(L()) with L the layout (lucepy-layouts.cuh) of a repacked matrix of these blocks
template <typename F> void with_layout(ggml_type type, F && f) {
    switch (type) {
        case GGML_TYPE_Q4_K: f(RpQ4_K()); break;
        case GGML_TYPE_Q5_K: f(RpQ5_K()); break;
        case GGML_TYPE_Q6_K: f(RpQ6_K()); break;
        default: f(RpQ4_0());
    }
}

// whether the layout of these blocks needs gemm_rb (the TMA unit: compute capability 9.0 and
// newer) at 2-16 columns
bool bulk_only_type(ggml_type type) {
    bool only = false;
    with_layout(type, [&](auto layout) { only = !decltype(layout)::gemm_r; });
    return only;
}

std::mutex g_rp_mutex;
std::map<uintptr_t, Repacked> g_repacked;  // by the first byte
std::atomic<int> g_n_repacked{0};

// Whether a product's weights `t` lie in a repacked matrix: false, or true for a view that starts
// on a tile of 16 rows of it and spans whole tiles of 64 (gemm_rq's); a product's other read of
// them aborts, as no kernel could compute it. (Other ops' reads are not seen here: only a matrix
// that products alone read may be repacked.)
bool repacked_of(const ggml_tensor * t) {
    if (g_n_repacked.load(std::memory_order_relaxed) == 0 || !repackable_type(t->type) ||
        t->data == nullptr) {
        return false;
    }
    const uintptr_t at = uintptr_t(t->data);
    Repacked r;
    uintptr_t begin;
    {
        std::lock_guard<std::mutex> lock(g_rp_mutex);
        auto found = g_repacked.upper_bound(at);
        if (found == g_repacked.begin()) {
            return false;
        }
        --found;
        if (at >= found->second.end) {
            return false;
        }
        begin = found->first;
        r = found->second;
    }
    const bool whole_tiles = t->type == r.type && t->ne[0] == r.ne0 && t->nb[1] == r.row_bytes &&
                             (at - begin) % uintptr_t(RP_ROWS * r.row_bytes) == 0 &&
                             t->ne[1] % RP_ROWS == 0 && t->ne[2] == 1 && t->ne[3] == 1 &&
                             at + ggml_nbytes(t) <= r.end;
    if (!whole_tiles) {
        GGML_ABORT("lucepy: a read of a repacked matrix that is not whole tiles of 16 of its rows "
                   "in its type (%s); repack only matrices that products alone read",
                   t->name);
    }
    return true;
}

// The arguments of a one-column product (gemv, gemv_r) of src0 (and the fused gate) into dst,
// on activations quantized into `quantized`
Args gemv_args(const ggml_tensor * src0, const ggml_tensor * dst,
               const ggml_cuda_mm_fusion_args_host * fusion, const Planes & quantized) {
    const ggml_tensor * gate = fusion ? fusion->gate : nullptr;
    auto data = [](const ggml_tensor * t) {
        return t ? static_cast<const float *>(t->data) : nullptr;
    };
    Args a = {};
    a.w = static_cast<const uint8_t *>(src0->data);
    a.gate = gate ? static_cast<const uint8_t *>(gate->data) : nullptr;
    a.row_stride = src0->nb[1];
    a.xq = reinterpret_cast<const int *>(quantized.xq);
    a.xds = quantized.xds;
    a.dst = static_cast<float *>(dst->data);
    a.x_bias = data(fusion ? fusion->x_bias : nullptr);
    a.gate_bias = data(fusion ? fusion->gate_bias : nullptr);
    a.glu_op = fusion && fusion->glu_op == GGML_GLU_OP_GEGLU ? GLU_GEGLU : GLU_SWIGLU;
    a.nrows = int(src0->ne[1]);
    a.npieces = int(src0->ne[0] / 32);
    return a;
}

// The arguments of a product of 2 or more columns (gemm, gemm_r, gemm_rq) of src0 into dst, on
// the columns' halves `x`, plus `residual` (a tensor of dst's shape) or not
GemmArgs gemm_args(const ggml_tensor * src0, const ggml_tensor * dst, const Halves & x,
                   const ggml_tensor * residual) {
    GemmArgs g = {};
    if (residual) {
        g.residual = static_cast<const float *>(residual->data);
        g.res_stride = residual->nb[1] / int64_t(sizeof(float));
    }
    g.w = static_cast<const uint8_t *>(src0->data);
    g.row_stride = src0->nb[1];
    g.x = x;
    g.nrows = int(src0->ne[1]);
    g.npieces = int(src0->ne[0] / 32);
    g.ncols = int(dst->ne[1]);
    g.dst = static_cast<float *>(dst->data);
    g.dst_stride = dst->nb[1] / int64_t(sizeof(float));
    return g;
}

// Whether ggml's fusion around a product of src0 (`ncols` columns; `repacked`: repacked_of(src0),
// known to the caller) is one the kernels take: no scales, a SwiGLU or GeGLU gate of src0's type,
// shape and layout (repacked when src0 is), contiguous biases, and any of it on one column only
bool fusion_taken(const ggml_cuda_mm_fusion_args_host * fusion, const ggml_tensor * src0,
                  bool repacked, int64_t ncols) {
    if (!fusion) {
        return true;
    }
    const ggml_tensor * gate = fusion->gate;
    const bool plain_glu = !gate || fusion->glu_op == GGML_GLU_OP_SWIGLU ||
                           fusion->glu_op == GGML_GLU_OP_GEGLU;
    const bool same = !gate || (gate->type == src0->type && ggml_are_same_stride(gate, src0) &&
                                ggml_are_same_shape(gate, src0) &&
                                repacked_of(gate) == repacked);
    const bool biases = (!fusion->x_bias || ggml_is_contiguous(fusion->x_bias)) &&
                        (!fusion->gate_bias || (gate && ggml_is_contiguous(fusion->gate_bias)));
    const bool any = gate || fusion->x_bias || fusion->gate_bias;
    return !fusion->x_scale && !fusion->gate_scale && plain_glu && same && biases &&
           (!any || ncols == 1);
}

// SPLIT warps a tile of gemv_r on layout L (bench-kernels.cu on the 27B-shaped model's products,
// H200: Q4_0 4 at 1,088 tiles, 8 at 320-640, 32 at 64, with the fused gate 8 at 1,088; the K
// types a super-block a step: Q4_K's splits (session 42) Q5_K's best too where measured (session
// 44: 2 at 1,030-1,088 tiles, 4 at 640 and 2,176, 8 at 320), Q6_K's its own (session 43: 4 on the
// head, ffn down, qkv and attn out shapes, 2 at 1,024-2,047 tiles, 16 on 64))
template <bool GATE, class L = RpQ4_0> void launch_gemv_r(const Args & a, cudaStream_t stream) {
    const int64_t tiles = a.nrows / RP_ROWS;
    auto go = [&](auto kernel, int split) {
        const int warps = split > 4 ? split : 4;
        const dim3 grid(unsigned((tiles * split + warps - 1) / warps));
        ggml_cuda_kernel_launch(kernel, ggml_cuda_kernel_launch_params(grid, warps * 32, 0, stream),
                                a);
    };
    if constexpr (std::is_same_v<L, RpQ6_K>) {
        if (tiles < 128) {  // (with the gate 8: 16 warps of its registers spill)
            if constexpr (GATE) {
                go(gemv_r<8, 2, true, L>, 8);
            } else {
                go(gemv_r<16, 2, false, L>, 16);
            }
        } else if (tiles >= 1024 && tiles < 2048) {
            go(gemv_r<2, 2, GATE, L>, 2);
        } else {
            go(gemv_r<4, 2, GATE, L>, 4);
        }
        return;
    } else if constexpr (L::pair) {
        if (GATE || tiles >= 2048 || (tiles >= 512 && tiles < 1024)) {
            go(gemv_r<4, 2, GATE, L>, 4);
        } else if (tiles >= 1024) {
            go(gemv_r<2, 2, GATE, L>, 2);
        } else if (tiles >= 256) {
            go(gemv_r<8, 2, GATE, L>, 8);
        } else if constexpr (std::is_same_v<L, RpQ4_K>) {
            go(gemv_r<32, 2, GATE, L>, 32);
        } else {  // (Q5_K's registers spill at 32 warps a tile; 16 measured at 64 tiles)
            go(gemv_r<16, 2, GATE, L>, 16);
        }
        return;
    }
    if (tiles >= 1024 && !GATE) {
        go(gemv_r<4, 1, GATE>, 4);
    } else if (tiles >= 256) {
        go(gemv_r<8, 1, GATE>, 8);
    } else {
        go(gemv_r<32, 1, GATE>, 32);
    }
}

// The CTAs of build R (GemmR, GemmRB) that the device holds at once
template <typename R> int64_t slots_of_build(int device) {
    static_assert(R::warps == GM_WARPS, "lucepy-repacked.cu launches CTAs of GM_WARPS warps");
    static int64_t slots[GGML_CUDA_MAX_DEVICES] = {};
    return slots_of(R::kernel(), R::smem, device, slots);
}

// The plan of build R for `a` (its rows, the second matrix's too): the parts
// gemm_parts_by_cost picks for R's CTAs an SM
template <typename R> GemmPlan gemm_r_plan(int device, const GemmArgs & a) {
    const int64_t room = slots_of_build<R>(device);
    constexpr int rows = GM_WARPS * 16;
    return gemm_plan_in(a.nrows, a.npieces, rows, 8,
                        gemm_parts_by_cost(a.nrows, a.npieces, a.ncols, rows, 8, room, 16,
                                           R::start));
}

// Whether gemm_f8 computes an FFN's SWIGLU itself where it takes the gate and up as one product
// of one part (`gemm_f8`'s GLU build: each CTA the same 32 rows of both), the down's records
// then converted from the GLU's result by to_e4m3, where the stack's sums went to glu_halves,
// which wrote both (4.5-4.7 us a call). LUCEPY_CUDA_F8_GLU=0 keeps glu_halves, for comparison.
bool f8_glu() {
    static const bool on = switched_on("LUCEPY_CUDA_F8_GLU");
    return on;
}

// gemm_f8's tails' counts (F8Tail::count), TAIL_TILES for each of TAIL_SLICES contexts of a
// device (a context's slice: ContextState::tail_slice; contexts past TAIL_SLICES share, which
// matters only where two of them run such a product at once): zero when the module loads, and
// zero again after each launch
constexpr int TAIL_TILES = 128;
constexpr int TAIL_SLICES = 16;
__device__ unsigned g_tail_counts[TAIL_SLICES * TAIL_TILES];
std::atomic<int> g_tail_slices{0};

// A tail for gemm_f8's one-part product of `tiles` row tiles (build R) in g.tail (tail_plan:
// the tiles past the last whole wave of one CTA an SM each cut along k into parts), and the CTAs
// to launch; the parts' sums go to `sums` (scratch from ctx's pool). The 27B-shaped FFN stack at
// 16 columns on an H200: 544 tiles of 20 chunks on 132 SMs, 16 past 4 waves (session 53: the
// 16 SMs holding a 5th CTA ended at 37.4 us, the others at 31.6); with the tail 7 parts of 3
// chunks each of the 16: 31.1 us where 33.6 on Q4_0, 33.2 where 38.1 on Q4_K (bench-kernels
// --f8), the 16-token verify 0.005-0.016 decode steps less in turn (docs/BENCHMARKS.md, session
// 57). LUCEPY_CUDA_F8_TAIL=0 launches no tail, for comparison; =N (2 and more) at most N parts a
// tile (8 by default).
template <class R>
int f8_tail(ggml_backend_cuda_context & ctx, ContextState & st, GemmArgs & g, int tiles,
            ggml_cuda_pool_alloc<float> & sums) {
    static const int most = switched_count("LUCEPY_CUDA_F8_TAIL", 8);
    g.tail = {};
    const int sms = ggml_cuda_info().devices[ctx.device].nsm;
    const TailPlan plan = tail_plan(tiles, g.npieces / 8, sms, slots_of_build<R>(ctx.device),
                                    most);
    if (plan.parts == 0 || tiles - plan.from > TAIL_TILES) {
        return tiles;
    }
    if (st.tail_slice < 0) {
        st.tail_slice = g_tail_slices.fetch_add(1, std::memory_order_relaxed) % TAIL_SLICES;
    }
    static unsigned * counts[GGML_CUDA_MAX_DEVICES] = {};
    if (counts[ctx.device] == nullptr) {
        CUDA_CHECK(cudaGetSymbolAddress(reinterpret_cast<void **>(&counts[ctx.device]),
                                        g_tail_counts));
    }
    g.tail.sums = sums.alloc(size_t(tiles - plan.from) * plan.parts * GM_WARPS * 32 * 8);
    g.tail.count = counts[ctx.device] + st.tail_slice * TAIL_TILES;
    g.tail.from = plan.from;
    g.tail.parts = plan.parts;
    g.tail.chunks = plan.chunks;
    g_tailed.fetch_add(1, std::memory_order_relaxed);
    return plan.ctas;
}

// Whether gemm_f8 takes a product of w alone at ncols columns (f8_matrix's), its input as e4m3
// records: where each of its CTA slots gets at least 6 chunks. On the H200 at 16 columns
// (bench-kernels --f8, docs/BENCHMARKS.md session 54) the 27B-shaped model's ffn down (8.2 a
// slot) 20.8 us where gemm_rb takes 22.9, its DeltaNet inputs (7.8) 19.8 where 21.7; qkv (4.8)
// 14.8 where 15.3 on Q4_0 but 16.3 where 15.7 on Q4_K, attn out (2.9) slower on both.
// LUCEPY_CUDA_F8_SINGLE=0 leaves them to gemm_rb, for comparison; =N (2 and more) takes those
// of N chunks a slot and more instead of 6 (the attention's qkv of the 27B-shaped model has 6.8,
// its DeltaNet inputs 7.8), for an A/B of the line.
bool f8_single(const ggml_tensor * w, int64_t ncols, int device) {
    static const int least = switched_count("LUCEPY_CUDA_F8_SINGLE", 6);
    return least > 0 && f8_matrix(w, ncols, device) &&
           row_tiles(w->ne[1], GM_WARPS * 16) * (w->ne[0] / 256) >=
               int64_t(least) * slots_of_build<GemmF8<5>>(device);
}

// Whether gemm_rb (its weights by the TMA unit: Hopper and newer) takes a product of NT column
// tiles: where each of its CTA slots gets at least 4 chunks at two tiles (5 CTAs an SM), 6 at
// one (73 registers: 6 CTAs an SM). The 27B-shaped model's products on an H200
// (docs/BENCHMARKS.md): at two tiles faster at about 5 chunks a slot and more, slower at 3
// (session 38); at one tile ffn down (6.9 a slot) 18.1-18.4 us where gemm_r takes 19.3-19.6 at
// 2-8 columns, qkv (4.0) within 1 %, attn out (2.4) 3-4 % slower, and the FFN stack is faster
// on gemm_r at 5 CTAs an SM (session 39). The slots are those counts an SM, not what the
// build's registers allow now: the route stays where it was measured when the compiler's count
// moves (the one-tile build took 72 registers once GemmArgs grew, 7 CTAs an SM, and the
// 27B-shaped ffn down at 2-8 columns went to gemm_r, session 57).
template <int NT> bool bulk_product(int device, const GemmArgs & a) {
    if (ggml_cuda_info().devices[device].cc < 900) {
        return false;
    }
    constexpr int per_sm = NT == 2 ? 5 : 6;
    return row_tiles(a.nrows, GM_WARPS * 16) * (a.npieces / 8) >=
           int64_t(NT == 2 ? 4 : 6) * per_sm * ggml_cuda_info().devices[device].nsm;
}

// 2-16 columns on layout L: gemm_r, or gemm_rb where bulk_product, in parts where its rows are
// few; gemm_rb always where gemm_r does not take the layout (Q5_K's, Q6_K's)
template <int NT, class L = RpQ4_0>
void launch_gemm_r(ggml_backend_cuda_context & ctx, const GemmArgs & base,
                   const NormAfter * norm = nullptr) {
    auto go = [&](auto build) {
        using R = decltype(build);
        launch_in_parts(ctx, R::kernel(), R::smem, gemm_r_plan<R>(ctx.device, base), base, norm);
    };
    if constexpr (!L::gemm_r) {
        go(GemmRB<NT, NT == 2 ? 5 : 6, L>());
        g_bulk.fetch_add(1, std::memory_order_relaxed);
    } else if (bulk_product<NT>(ctx.device, base)) {
        go(GemmRB<NT, 5, L>());
        g_bulk.fetch_add(1, std::memory_order_relaxed);
    } else {
        go(GemmR<NT, GM_WARPS, 16 / GM_WARPS, gemm_r_xch(NT), L>());
    }
}

// a prefill's columns on layout L: to_halves_col into scratch (whole tiles of 64 columns), then
// gemm_rq
template <int MT, class L = RpQ4_0>
void launch_gemm_rq(ggml_backend_cuda_context & ctx, const GemmArgs & a) {
    static bool raised[GGML_CUDA_MAX_DEVICES] = {};
    once_a_device(raised, ctx.device, [] {
        CUDA_CHECK(cudaFuncSetAttribute(gemm_rq<MT, L>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        gemm_rq_smem<MT, L>()));
    });
    const dim3 grid(unsigned((a.nrows + 64 * MT - 1) / (64 * MT)),
                    unsigned((a.ncols + RQ_COLS - 1) / RQ_COLS));
    ggml_cuda_kernel_launch(
        gemm_rq<MT, L>,
        ggml_cuda_kernel_launch_params(grid, 128, gemm_rq_smem<MT, L>(), ctx.stream()), a);
}

// Whether a product of src0 reads src1 as e4m3 records on gemm_f8: the scan's want (f8_single's
// products), src0 one that gemm_f8 takes
bool f8_records(ContextState & st, const ggml_tensor * src0, const ggml_tensor * src1, int device) {
    const Wanted * want = wanted(st, src1);
    return want && want->src1 == src1 && want->planes == F8_PLANES &&
           f8_matrix(src0, src1->ne[1], device);
}

// repacked_mul_mat's products on layout L
template <class L>
void repacked_mul_mat_of(ggml_backend_cuda_context & ctx, const ggml_tensor * src0,
                         const ggml_tensor * src1, ggml_tensor * dst,
                         const ggml_cuda_mm_fusion_args_host * fusion, const ggml_tensor * residual,
                         const NormAfter * norm) {
    const int64_t ncols = src1->ne[1];
    const int64_t npieces = src0->ne[0] / 32;
    cudaStream_t stream = ctx.stream();
    ContextState & st = state_of(ctx);
    ggml_cuda_pool_alloc<uint8_t> scratch(ctx.pool());
    if (ncols == 1) {
        const Args a = gemv_args(
            src0, dst, fusion,
            planes_at(product_activations(ctx, st, src1, npieces, 1, scratch), npieces, 1, 1));
        a.gate ? launch_gemv_r<true, L>(a, stream) : launch_gemv_r<false, L>(a, stream);
        return;
    }
    if constexpr (std::is_same_v<L, RpQ4_0> || std::is_same_v<L, RpQ4_K>) {
        if (f8_records(st, src0, src1, ctx.device)) {
            const GemmArgs g = gemm_args(
                src0, dst,
                f8_at(product_activations(ctx, st, src1, npieces, F8_PLANES, scratch), npieces),
                residual);
            using R = GemmF8<5, L>;
            launch_in_parts(ctx, R::kernel(), R::smem, gemm_r_plan<R>(ctx.device, g), g, norm,
                            true);
            g_f8.fetch_add(1, std::memory_order_relaxed);
            return;
        }
    }
    if (ncols <= MAX_COLS) {
        const GemmArgs g = gemm_args(
            src0, dst,
            halves_at(product_activations(ctx, st, src1, npieces, 0, scratch), npieces,
                      int(ncols)),
            residual);
        if (ncols <= GM_COL_TILE) {
            launch_gemm_r<1, L>(ctx, g, norm);
        } else {
            launch_gemm_r<2, L>(ctx, g, norm);
        }
        return;
    }
    const int padded = int((ncols + RQ_COLS - 1) / RQ_COLS * RQ_COLS);
    uint8_t * buf = scratch.alloc(size_t(halves_bytes(npieces, padded)));
    const GemmArgs g = gemm_args(src0, dst, halves_at(buf, npieces, padded), nullptr);
    ggml_cuda_kernel_launch(to_halves_col,
                            ggml_cuda_kernel_launch_params(dim3(unsigned(ncols)), 256, 0, stream),
                            static_cast<const float *>(src1->data),
                            int64_t(src1->nb[1] / sizeof(float)), int(npieces), g.x);
    g.nrows % 128 == 0 ? launch_gemm_rq<2, L>(ctx, g) : launch_gemm_rq<1, L>(ctx, g);
}

void repacked_mul_mat(ggml_backend_cuda_context & ctx, const ggml_tensor * src0,
                      const ggml_tensor * src1, ggml_tensor * dst,
                      const ggml_cuda_mm_fusion_args_host * fusion, const ggml_tensor * residual,
                      const NormAfter * norm) {
    const int64_t ncols = src1->ne[1];
    const bool plain = src1->type == GGML_TYPE_F32 && dst->type == GGML_TYPE_F32 &&
                       src1->ne[0] == src0->ne[0] && dst->ne[0] == src0->ne[1] &&
                       dst->ne[1] == ncols && src1->ne[2] == 1 && src1->ne[3] == 1 &&
                       src1->nb[0] == sizeof(float) && dst->nb[0] == sizeof(float) &&
                       src1->nb[1] % sizeof(float) == 0 && dst->nb[1] % sizeof(float) == 0 &&
                       ncols >= 1 && ncols < INT32_MAX;
    if (!plain || !fusion_taken(fusion, src0, true, ncols)) {
        GGML_ABORT("lucepy: a product of a repacked matrix (%s) that its kernels do not take",
                   src0->name);
    }
    with_layout(src0->type, [&](auto layout) {
        repacked_mul_mat_of<decltype(layout)>(ctx, src0, src1, dst, fusion, residual, norm);
    });
}

// An FFN's two products of one input and their SWIGLU from node i, a MUL_MAT (a verify's gate
// and up, 2-16 columns, both repacked matrices of one type and shape): one gemm_r over both
// matrices' rows (the GLU's first source's first), its parts added by glu_halves as it applies
// the gate and writes the GLU's result and the down product's halves. The products' results are
// never written (the GLU alone reads them). On the H200 one launch over the two took 44.8 us
// where two took 25.3 each, 16 columns (bench-kernels.cu's ffn_up|gate). The nodes after i
// computed, or 0.
int glu_pair_nodes(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph, int i) {
    const ggml_tensor * m1 = cgraph->nodes[i];
    ggml_tensor * m2 = nullptr;
    ggml_tensor * glu = nullptr;
    const int i_glu = glu_pair_at(cgraph, i, m2, glu);
    if (i_glu == 0) {
        return 0;
    }
    const ggml_tensor * ma = glu->src[0];  // silu's
    const ggml_tensor * mb = glu->src[1];
    const ggml_tensor * x = m1->src[1];
    const ggml_tensor * wa = ma->src[0];
    const ggml_tensor * wb = mb->src[0];
    const int64_t ncols = x->ne[1];
    const int64_t n = wa->ne[1];
    auto result = [&](const ggml_tensor * t) {  // a product's result or the GLU's: f32 n x ncols
        return t->type == GGML_TYPE_F32 && t->ne[0] == n && t->ne[1] == ncols && t->ne[2] == 1 &&
               t->ne[3] == 1;
    };
    auto unkept = [](const ggml_tensor * t) {  // a product's: its result is never written
        return (t->flags & GGML_TENSOR_FLAG_OUTPUT) == 0;
    };
    const bool shapes = ncols >= 2 && ncols <= MAX_COLS &&
                        x->type == GGML_TYPE_F32 && x->ne[0] == wa->ne[0] && x->ne[2] == 1 &&
                        x->ne[3] == 1 && x->nb[0] == sizeof(float) &&
                        x->nb[1] % sizeof(float) == 0 && wb->type == wa->type &&
                        ggml_are_same_shape(wa, wb) && ggml_are_same_stride(wa, wb) &&
                        n % (GM_WARPS * 16) == 0 && 2 * n < INT32_MAX && result(ma) &&
                        result(mb) && result(glu) && ggml_is_contiguous(glu) && unkept(ma) &&
                        unkept(mb);
    if (!shapes || !repacked_of(wa) || !repacked_of(wb)) {
        return 0;
    }
    ContextState & st = state_of(ctx);
    const Wanted * want = wanted(st, glu);
    if (st.readers(m1) != 1 || st.readers(m2) != 1 || want == nullptr ||
        (want->planes != 0 && want->planes != F8_PLANES) || want->src1->ne[0] != n ||
        want->src1->ne[1] != ncols) {
        return 0;  // (the down product's halves or records: a column of it is the GLU's)
    }
    const int64_t npieces = wa->ne[0] / 32;
    const bool f8 = f8_pair(m1, m2, ctx.device);
    ggml_cuda_pool_alloc<uint8_t> scratch(ctx.pool());
    uint8_t * xbuf = product_activations(ctx, st, x, npieces, f8 ? F8_PLANES : 0, scratch);
    GemmArgs g = gemm_args(
        wa, ma, f8 ? f8_at(xbuf, npieces) : halves_at(xbuf, npieces, int(ncols)), nullptr);
    g.w2 = static_cast<const uint8_t *>(wb->data);
    g.rows2 = int(n);
    g.nrows = int(2 * n);
    const bool down_f8 = want->planes == F8_PLANES;  // (the scan's: gemm_f8 takes the down)
    ggml_cuda_pool_alloc<float> sums(ctx.pool());
    auto go = [&](auto build) {  // a GemmR or GemmRB
        using R = decltype(build);
        const GemmPlan plan = gemm_r_plan<R>(ctx.device, g);
        const int parts = int(plan.grid.y);
        g.per_part = plan.per_part;
        if constexpr (is_f8_build<R>::value) {
            if (parts == 1 && f8_glu()) {  // the SWIGLU in gemm_f8 (the down's input by its own
                                           // conversion: no records written here)
                g.dst = static_cast<float *>(glu->data);
                g.dst_stride = n;
                const int ctas = f8_tail<R>(ctx, st, g, int(n / 32), sums);
                ggml_cuda_kernel_launch(
                    R::glu_kernel(),
                    ggml_cuda_kernel_launch_params(dim3(unsigned(ctas)), GM_WARPS * 32, R::smem,
                                                   ctx.stream()),
                    g);
                return;
            }
        }
        uint8_t * down_buf = prepared(st, want->src1, n / 32, want->planes);
        const Halves out =
            down_f8 ? f8_at(down_buf, n / 32) : halves_at(down_buf, n / 32, int(ncols));
        float * buf = sums.alloc(size_t(parts) * ncols * 2 * n);
        g.parts = buf;  // split: the parts; one part: the sums straight, in the parts' layout
        g.dst = buf;
        g.dst_stride = 2 * n;
        ggml_cuda_kernel_launch(
            R::kernel(),
            ggml_cuda_kernel_launch_params(plan.grid, GM_WARPS * 32, R::smem, ctx.stream()), g);
        launch_glu_halves(buf, buf + n, 2 * n, parts, 2 * n * ncols,
                          static_cast<float *>(glu->data), int(n / 32), int(ncols), out,
                          ctx.stream(), down_f8);
    };
    // 5 CTAs an SM, a chunk of activations a stage: 96 registers, none spilled (on an H200 the
    // stack at 16 columns 41.2 us where 4 CTAs take 43.0, at 8 31.9 where 35.3; the other
    // products no faster so: docs/BENCHMARKS.md, session 37); at two column tiles gemm_rb
    // (39.5 us at 16 columns: session 38)
    // (Q4_K's layout the same builds; Q5_K's and Q6_K's gemm_rb's always)
    // (on the H200 the stack at 16 columns 36.6 us where gemm_rb takes 39.9, session 51; Q4_K's
    // 40.8 where 44.2, session 52)
    if (f8) {
        wa->type == GGML_TYPE_Q4_K ? go(GemmF8<5, RpQ4_K>()) : go(GemmF8<5>());
        g_f8.fetch_add(1, std::memory_order_relaxed);
    } else with_layout(wa->type, [&](auto layout) {
        using L = decltype(layout);
        if constexpr (!L::gemm_r) {
            ncols <= GM_COL_TILE ? go(GemmRB<1, 6, L>()) : go(GemmRB<2, 5, L>());
            g_bulk.fetch_add(1, std::memory_order_relaxed);
        } else if (ncols <= GM_COL_TILE) {
            go(GemmR<1, GM_WARPS, 5, 1, L>());
        } else if (bulk_product<2>(ctx.device, g)) {
            go(GemmRB<2, 5, L>());
            g_bulk.fetch_add(1, std::memory_order_relaxed);
        } else {
            go(GemmR<2, GM_WARPS, 5, 1, L>());
        }
    });
    g_calls.fetch_add(2, std::memory_order_relaxed);
    g_ops.fetch_add(1, std::memory_order_relaxed);
    return i_glu - i;
}

}  // namespace lucepy

void lucepy_cuda_bytes_gone(const void * ptr, size_t size) {
    using namespace lucepy;
    if (g_n_repacked.load(std::memory_order_relaxed) == 0) {
        return;
    }
    const uintptr_t from = uintptr_t(ptr);
    const uintptr_t to = from + size;
    std::lock_guard<std::mutex> lock(g_rp_mutex);
    auto it = g_repacked.upper_bound(from);
    if (it != g_repacked.begin() && std::prev(it)->second.end > from) {
        --it;  // a matrix that begins before the range and reaches into it
    }
    while (it != g_repacked.end() && it->first < to) {
        it = g_repacked.erase(it);
        g_n_repacked.fetch_sub(1, std::memory_order_relaxed);
    }
}

#else  // HIP and MUSA builds take ggml's kernels

void lucepy_cuda_bytes_gone(const void *, size_t) {}

#endif

extern "C" {

int lucepy_cuda_repack(struct ggml_tensor * t) {
#if !defined(GGML_USE_HIP) && !defined(GGML_USE_MUSA)
    using namespace lucepy;
    const bool shape = repackable_type(t->type) && t->view_src == nullptr && t->data &&
                       ggml_is_contiguous(t) && t->ne[2] == 1 && t->ne[3] == 1 &&
                       t->ne[1] % RP_ROWS == 0 && t->ne[0] % (32 * 8) == 0 &&
                       t->ne[0] / 32 < INT32_MAX && t->ne[1] < INT32_MAX;
    if (!shape || repacked_of(t)) {
        return 0;
    }
    cudaPointerAttributes attr;
    if (cudaPointerGetAttributes(&attr, t->data) != cudaSuccess ||
        attr.type != cudaMemoryTypeDevice || !enabled(attr.device)) {
        (void) cudaGetLastError();
        return 0;
    }
    if (bulk_only_type(t->type) && ggml_cuda_info().devices[attr.device].cc < 900) {
        return 0;  // (its 2-16 column kernel takes its weights by the TMA unit)
    }
    ggml_cuda_set_device(attr.device);
    const size_t n = ggml_nbytes(t);
    uint8_t * copy = nullptr;
    CUDA_CHECK(cudaMalloc(&copy, n));
    CUDA_CHECK(cudaMemcpy(copy, t->data, n, cudaMemcpyDeviceToDevice));
    const int ngroups = int(t->ne[0] / 32 / RP_GROUP);
    const unsigned tiles = unsigned(t->ne[1] / RP_ROWS);
    with_layout(t->type, [&](auto layout) {  // a CTA a tile's group, or super-block (two groups)
        using L = decltype(layout);
        const dim3 grid(unsigned(L::pair ? ngroups / 2 : ngroups), tiles);
        L::repack<<<grid, L::pair ? 128 : 64>>>(copy, int64_t(t->nb[1]), ngroups,
                                                static_cast<uint8_t *>(t->data));
    });
    CUDA_CHECK(cudaGetLastError());
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaFree(copy));
    std::lock_guard<std::mutex> lock(g_rp_mutex);
    g_repacked[uintptr_t(t->data)] = {uintptr_t(t->data) + n, t->ne[0], int64_t(t->nb[1]),
                                      t->type};
    g_n_repacked.fetch_add(1, std::memory_order_relaxed);
    return 1;
#else
    (void) t;
    return 0;
#endif
}
}
