// lucepy's own kernels (issue 19, decision 12), hooked into the pinned ggml-cuda: the host side of
// the products, their routes, plans and launches on ggml's blocks, and the one entry that routes
// every product (lucepy-repacked.cu takes those of repacked matrices; lucepy-launch.cuh holds the
// launch templates both use; lucepy-state.cu keeps the switches, counters, each context's state
// and the graph's scan; lucepy-fuse.cu and lucepy-deltanet.cu take the other ops;
// lucepy-host.cuh declares what they share). The kernels are lucepy-kernels.cuh,
// lucepy-gemm.cuh, lucepy-repack.cuh and lucepy-f8.cuh; hooks.patch shows where ggml calls in.
//
// Measured on an H200 (docs/BENCHMARKS.md): on by default for compute capability 9.0 and newer
// (Hopper on), where they were measured; LUCEPY_CUDA_KERNELS=0 or =1 forces them off or on.

#include "lucepy-launch.cuh"

#include <algorithm>
#include <atomic>
#include <type_traits>

#if !defined(GGML_USE_HIP) && !defined(GGML_USE_MUSA)

namespace lucepy {

// 2 columns: gemm too. ggml's kernels (dp4a, like gemv) verified 2 tokens of the 27B-shaped Q4_0
// model on the H200 in 11.6 ms against gemm's 13.1 when gemm was new (session 17), so 2 was
// theirs; in session 41 the model with gemm at 3 columns took 8.64 ms (Q4_0 blocks) and 10.76
// (Q4_K_M) where 2 columns on ggml's took 9.12 and 11.79 (docs/BENCHMARKS.md).
constexpr int MIN_GEMM_COLS = 2;
// Up to GGML_VECTOR_COLS columns (ggml's MMVQ_MAX_BATCH_SIZE), a product too small to give gemm
// a CTA for each of the GPU's multiprocessors (row tiles times the most parts its pieces allow)
// is ggml's too: there its vector kernel is faster (SmolLM2-135M's products of 576-1,536 rows,
// 9-24 row tiles, verified 3 and 4 tokens in 1.81 and 1.86 ms on gemm against 1.70 and 1.71 on
// ggml's on the H200; docs/BENCHMARKS.md). The 27B-shaped model's products all have enough.
constexpr int GGML_VECTOR_COLS = 8;

bool gemm_fills(int64_t nrows, int64_t npieces, int device) {
    const int64_t parts = gemm_max_parts(npieces, gemm_chunk<Q4_0>());
    return row_tiles(nrows, GM_WARPS * 16) * parts >= ggml_cuda_info().devices[device].nsm;
}

// whether lucepy's kernels take a product of `ncols` columns with this weight (as far as its
// columns and size decide)
bool takes_cols(const ggml_tensor * src0, int64_t ncols, int device) {
    if (ncols == 1) {
        return true;
    }
    if (ncols < MIN_GEMM_COLS || ncols > MAX_COLS) {
        return false;
    }
    return ncols > GGML_VECTOR_COLS || gemm_fills(src0->ne[1], src0->ne[0] / 32, device);
}

void run_quantize(const ggml_tensor * src1, int64_t npieces, int planes, uint8_t * buf,
                  cudaStream_t stream) {
    const int64_t ncols = src1->ne[1];
    g_quantized.fetch_add(1, std::memory_order_relaxed);
    if (planes == F8_PLANES) {
        const dim3 grid{unsigned(segments(int(npieces))), unsigned(F8_COLS)};
        ggml_cuda_kernel_launch(to_e4m3,
                                ggml_cuda_kernel_launch_params(grid, TH_THREADS, 0, stream),
                                static_cast<const float *>(src1->data),
                                src1->nb[1] / int64_t(sizeof(float)), int(npieces), int(ncols),
                                f8_at(buf, npieces));
        return;
    }
    if (planes == 0) {
        const dim3 grid{unsigned(segments(int(npieces))), unsigned(padded_cols(int(ncols)))};
        ggml_cuda_kernel_launch(to_halves,
                                ggml_cuda_kernel_launch_params(grid, TH_THREADS, 0, stream),
                                static_cast<const float *>(src1->data),
                                src1->nb[1] / int64_t(sizeof(float)), int(npieces), int(ncols),
                                halves_at(buf, npieces, int(ncols)));
        return;
    }
    const Planes out = planes_at(buf, npieces, ncols, planes);
    constexpr int WARPS = 8;
    const dim3 grid(unsigned((npieces + WARPS - 1) / WARPS), unsigned(ncols));
    ggml_cuda_kernel_launch(quantize, ggml_cuda_kernel_launch_params(grid, WARPS * 32, 0, stream),
                            static_cast<const float *>(src1->data),
                            src1->nb[1] / int64_t(sizeof(float)), int(npieces), int(ncols), planes,
                            out.xq, out.xds);
}

// the quantized activations of src1 on ctx's stream: kept ones, or quantized now into a slot
uint8_t * kept_quantized(ContextState & st, ggml_backend_cuda_context & ctx,
                         const ggml_tensor * src1, int64_t npieces, int planes) {
    bool fresh = false;
    uint8_t * buf = claim(st, src1, npieces, planes, &fresh);
    if (fresh) {
        run_quantize(src1, npieces, planes, buf, ctx.stream());
    }
    return buf;
}

using Launch = void (*)(const Args &, cudaStream_t, int device);

// one column: a warp per row (and its gate row)
template <int K, int U> Launch pick_unit(bool gate) {
    return gate ? &launch<K, true, 1, U> : &launch<K, false, 1, U>;
}

template <int K> Launch pick(bool gate, int unit) {
    return unit == 16 ? pick_unit<K, 16>(gate)
         : unit == 8  ? pick_unit<K, 8>(gate)
                      : pick_unit<K, 4>(gate);
}

// norm_halves of `ncols` columns of x (16-byte aligned, as w and dst), a CTA a padded column
void launch_norm_halves(const float * x, int64_t x_stride, const float * w, float * dst,
                        int64_t dst_stride, int n, float eps, int ncols, const Halves & out,
                        cudaStream_t stream) {
    ggml_cuda_kernel_launch(norm_halves,
                            ggml_cuda_kernel_launch_params(dim3(unsigned(padded_cols(ncols))),
                                                           NORM_THREADS, 0, stream),
                            x, x_stride, w, dst, dst_stride, n, eps, ncols, out);
}

// glu_halves of `ncols` columns of `npieces` pieces (its arguments), a CTA a segment of a column
// (f8: `out` e4m3 records, F8_COLS columns)
void launch_glu_halves(const float * a, const float * b, int64_t col_stride, int nparts,
                       int64_t part_stride, float * dst, int npieces, int ncols,
                       const Halves & out, cudaStream_t stream, bool f8) {
    const dim3 grid{unsigned(segments(npieces)), unsigned(f8 ? F8_COLS : padded_cols(ncols))};
    ggml_cuda_kernel_launch(f8 ? glu_halves<true> : glu_halves<false>,
                            ggml_cuda_kernel_launch_params(grid, GLU_WARPS * 32, 0, stream), a, b,
                            col_stride, nparts, part_stride, dst, npieces, ncols, out);
}

// f(std::integral_constant<int, CL>) for the cluster size `cl` (2-8) of sum_norm_halves, and
// what f returns: the one switch from a column's size to the kernel's template
template <typename F> auto with_cluster(int64_t cl, F && f) {
    switch (cl) {
        case 2: return f(std::integral_constant<int, 2>{});
        case 3: return f(std::integral_constant<int, 3>{});
        case 4: return f(std::integral_constant<int, 4>{});
        case 5: return f(std::integral_constant<int, 5>{});
        case 6: return f(std::integral_constant<int, 6>{});
        case 7: return f(std::integral_constant<int, 7>{});
        case 8: return f(std::integral_constant<int, 8>{});
        default: GGML_ABORT("lucepy: sum_norm_halves in clusters of %d", int(cl));
    }
}

// Whether sum_norm_halves takes a column of n values on the device: a cluster of n /
// NORM_THREADS CTAs (2-8) that it can launch (asked once a device and size)
bool sum_norm_fits(int device, int64_t n) {
    const int64_t cl = n / NORM_THREADS;
    if (n % NORM_THREADS != 0 || cl < 2 || cl > 8 || ggml_cuda_info().devices[device].cc < 900) {
        return false;
    }
    static int fits[GGML_CUDA_MAX_DEVICES][9] = {};  // 0 not asked, 1 yes, 2 no
    int & known = fits[device][cl];
    if (known == 0) {
        cudaLaunchAttribute attr = cluster_attr(int(cl));
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(unsigned(cl), 16);
        cfg.blockDim = dim3(NORM_THREADS);
        cfg.attrs = &attr;
        cfg.numAttrs = 1;
        int clusters = 0;
        const void * kernel = with_cluster(cl, [](auto k) {
            return reinterpret_cast<const void *>(sum_norm_halves<decltype(k)::value>);
        });
        const bool ok = cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) == cudaSuccess;
        (void) cudaGetLastError();  // (a refusal is an answer, not an error to keep)
        known = ok && clusters > 0 ? 1 : 2;
    }
    return known == 1;
}

// The product `a` (its parts `parts`, at a.parts where more than one, else its sums with the
// residual at a.dst) as the ADD's result, then `norm` of it: in parts, one sum_norm_halves where
// gemm_sum and norm_halves ran; of one part (its tile's store wrote the sums), norm_halves alone,
// which sum_norm_halves took 1.27-1.28x the time of there (bench-kernels --sum-norm, H100)
void launch_sum_norm(ggml_backend_cuda_context & ctx, const GemmArgs & a, int parts,
                     const NormAfter & norm) {
    const int64_t npieces = a.nrows / 32;
    const bool f8 = parts > 1 && norm.planes == F8_PLANES;  // (one part: halves, then to_e4m3)
    uint8_t * buf = prepared(state_of(ctx), norm.mul, npieces, f8 ? F8_PLANES : 0);
    const Halves out = f8 ? f8_at(buf, npieces) : halves_at(buf, npieces, a.ncols);
    float * normed = static_cast<float *>(norm.mul->data);
    const int64_t normed_stride = norm.mul->nb[1] / int64_t(sizeof(float));
    cudaStream_t stream = ctx.stream();
    if (parts == 1) {
        launch_norm_halves(a.dst, a.dst_stride, norm.w, normed, normed_stride, a.nrows, norm.eps,
                           a.ncols, out, stream);
        return;
    }
    SumNorm s = {};
    s.src = a.parts;
    s.src_col = a.nrows;
    s.part_stride = int64_t(a.ncols) * a.nrows;
    s.nparts = parts;
    s.residual = a.residual;
    s.res_stride = a.res_stride;
    s.sum = a.dst;
    s.sum_stride = a.dst_stride;
    s.w = norm.w;
    s.normed = normed;
    s.normed_stride = normed_stride;
    s.n = a.nrows;
    s.ncols = a.ncols;
    s.eps = norm.eps;
    s.out = out;
    // LUCEPY_CUDA_SN_LATE=0: the product after it let start at once, for comparison
    static const bool late = switched_on("LUCEPY_CUDA_SN_LATE");
    s.late = late;
    // LUCEPY_CUDA_SN_PUSH=0: the values read across the cluster after a barrier, for comparison
    static const bool push = switched_on("LUCEPY_CUDA_SN_PUSH");
    with_cluster(a.nrows / NORM_THREADS, [&](auto k) {
        constexpr int CL = decltype(k)::value;
        if (f8) {  // (16 columns of records: the padding ones zeros)
            launch_clustered(push ? sum_norm_halves<CL, true> : sum_norm_halves<CL, true, false>,
                             dim3(CL, unsigned(F8_COLS)), NORM_THREADS, CL, stream, s);
        } else {
            launch_clustered(push ? sum_norm_halves<CL> : sum_norm_halves<CL, false, false>,
                             dim3(CL, unsigned(padded_cols(s.ncols))), NORM_THREADS, CL, stream,
                             s);
        }
    });
    g_joined.fetch_add(1, std::memory_order_relaxed);  // gemm_sum's launch holds the norm
}

// Whether gemm_f8's parts are added in a cluster (lucepy-f8.cuh: F8_PAIR_MOST) where there is no
// norm after the product, not by gemm_sum (the attention's qkv and the DeltaNet inputs of the
// 27B-shaped model at 16 columns, in 2 parts). LUCEPY_CUDA_F8_PAIR=0 leaves them to gemm_sum,
// for comparison.
bool f8_paired(int parts) {
    static const bool on = switched_on("LUCEPY_CUDA_F8_PAIR");
    return on && parts > 1 && parts <= F8_PAIR_MOST;
}

// 3 to 16 columns: gemm on to_halves' activations, in parts where its rows are few
template <int K, int NT>
void launch_gemm(ggml_backend_cuda_context & ctx, const GemmArgs & base, const NormAfter * norm) {
    constexpr int P = gemm_chunk<K>();
    using G = Gm<K, NT, P>;
    static int64_t slots[GGML_CUDA_MAX_DEVICES] = {};
    auto kernel = gemm<K, NT, P>;
    const int64_t room = slots_of(kernel, G::smem, ctx.device, slots);
    launch_in_parts(ctx, kernel, G::smem, gemm_plan(base.nrows, base.npieces, G::rows, P, room),
                    base, norm);
}

template <int K>
void run_gemm(ggml_backend_cuda_context & ctx, const GemmArgs & a, const NormAfter * norm) {
    if (a.ncols <= GM_COL_TILE) {
        launch_gemm<K, 1>(ctx, a, norm);
    } else {
        launch_gemm<K, 2>(ctx, a, norm);
    }
}

// whether a CTA fits the device's shared memory, fused or not (on an H200 the activations of a
// row of up to about 5,000 pieces, 170,000 values, do; of Q8_0's two planes, 2,500)
template <int K> int most_smem(int64_t npieces) {
    const int n = int(npieces);
    return std::max(gemv_smem<K, false, 1, 16>(n, 1), gemv_smem<K, true, 1, 16>(n, 1));
}

bool fits(int kind, int64_t npieces, int device) {
    if (npieces > INT32_MAX / 128) {
        return false;
    }
    const int smem =
        with_kind(kind, [&](auto k) { return most_smem<decltype(k)::value>(npieces); });
    return size_t(smem) <= ggml_cuda_info().devices[device].smpbo;
}

// the kind of a ggml type, and the bytes of gemv's chunk of a row; false for a type not ours
bool kind_of(ggml_type type, int & kind, int & chunk) {
    switch (type) {
        case GGML_TYPE_Q4_0: kind = Q4_0; break;
        case GGML_TYPE_Q8_0: kind = Q8_0; break;
        case GGML_TYPE_Q4_K: kind = Q4_K; break;
        case GGML_TYPE_Q6_K: kind = Q6_K; break;
        case GGML_TYPE_Q4_1: kind = Q4_1; break;
        case GGML_TYPE_Q5_1: kind = Q5_1; break;
        case GGML_TYPE_Q5_K: kind = Q5_K; break;
        case GGML_TYPE_IQ4_XS: kind = IQ4_XS; break;
        default: return false;
    }
    chunk = with_kind(kind, [](auto k) { return Gv<decltype(k)::value, false, 1, 16>::bytes; });
    return true;
}

// the widest copy (16, 8 or 4 bytes) that every row start, chunk start and row end allows, or 0
int copy_unit(const ggml_tensor * src0, const ggml_tensor * gate, int chunk) {
    const size_t row = ggml_row_size(src0->type, src0->ne[0]);
    for (int unit = 16; unit >= 4; unit /= 2) {
        const bool fits = src0->nb[1] % unit == 0 && chunk % unit == 0 && row % unit == 0 &&
                          uintptr_t(src0->data) % unit == 0 &&
                          (!gate || uintptr_t(gate->data) % unit == 0);
        if (fits) {
            return unit;
        }
    }
    return 0;
}

bool no_op(const ggml_tensor * t) {
    return ggml_is_empty(t) || t->op == GGML_OP_NONE || t->op == GGML_OP_VIEW ||
           t->op == GGML_OP_RESHAPE || t->op == GGML_OP_PERMUTE || t->op == GGML_OP_TRANSPOSE;
}

// Whether node i of `g`, a MUL_MAT, and the two computing nodes after it are an FFN's gate and up
// products of one input and their SWIGLU (unswapped): the GLU's node index (the second product
// and the GLU into m2, glu), or 0. (glu_pair_nodes takes them as one product; the scan asks it
// too.)
int glu_pair_at(const ggml_cgraph * g, int i, ggml_tensor *& m2, ggml_tensor *& glu) {
    const ggml_tensor * m1 = g->nodes[i];
    const int i2 = next_op(g, i);
    const int i_glu = i2 < g->n_nodes ? next_op(g, i2) : i2;
    if (m1->op != GGML_OP_MUL_MAT || i_glu >= g->n_nodes) {
        return 0;
    }
    m2 = g->nodes[i2];
    glu = g->nodes[i_glu];
    const bool pair =
        m2->op == GGML_OP_MUL_MAT && m2->src[1] == m1->src[1] && glu->op == GGML_OP_GLU &&
        ggml_get_glu_op(glu) == GGML_GLU_OP_SWIGLU && ggml_get_op_params_i32(glu, 1) == 0 &&
        ((glu->src[0] == m1 && glu->src[1] == m2) || (glu->src[0] == m2 && glu->src[1] == m1));
    return pair ? i_glu : 0;
}

// src1 as a product's kernel reads it (`planes` int8 planes, or halves): kept for the graph's
// other products of it where it is a tensor of the graph, else into scratch (ggml's concurrent
// streams: nothing shared)
uint8_t * product_activations(ggml_backend_cuda_context & ctx, ContextState & st,
                              const ggml_tensor * src1, int64_t npieces, int planes,
                              ggml_cuda_pool_alloc<uint8_t> & scratch) {
    if (ctx.curr_stream_no == 0 && st.in_graph(src1)) {
        return kept_quantized(st, ctx, src1, npieces, planes);
    }
    uint8_t * buf = scratch.alloc(quantized_bytes(npieces, src1->ne[1], planes));
    run_quantize(src1, npieces, planes, buf, ctx.stream());
    return buf;
}

// dst = src0 x src1 (with ggml's fusion, or plus `residual`, a tensor of dst's shape, for 2-16
// columns) by our kernels, true; or false, having done nothing
bool mul_mat(ggml_backend_cuda_context & ctx, const ggml_tensor * src0, const ggml_tensor * src1,
             ggml_tensor * dst, const ggml_cuda_mm_fusion_args_host * fusion,
             const ggml_tensor * residual, const NormAfter * norm) {
    const int64_t ncols = src1->ne[1];
    if (residual && (fusion || ncols < 2 || ncols > MAX_COLS)) {
        return false;
    }
    if (repacked_of(src0)) {  // ours whatever the switch: ggml's kernels cannot read it
        repacked_mul_mat(ctx, src0, src1, dst, fusion, residual, norm);
        g_calls.fetch_add(1, std::memory_order_relaxed);
        return true;
    }
    int kind, chunk;
    if (!enabled(ctx.device) || !kind_of(src0->type, kind, chunk)) {
        return false;
    }
    const int64_t pieces_per_block =
        with_kind(kind, [](auto k) { return Layout<decltype(k)::value>::pieces; });
    const bool shapes = ncols >= 1 && ncols <= MAX_COLS && src1->ne[0] == src0->ne[0] &&
                        src0->ne[0] % (32 * pieces_per_block) == 0 && src0->ne[1] < INT32_MAX &&
                        src0->ne[0] / 32 < INT32_MAX && dst->ne[0] == src0->ne[1] &&
                        dst->ne[1] == ncols && src0->ne[2] == 1 && src0->ne[3] == 1 &&
                        src1->ne[2] == 1 && src1->ne[3] == 1;
    const bool layouts = src1->type == GGML_TYPE_F32 && dst->type == GGML_TYPE_F32 &&
                         src0->nb[0] == ggml_type_size(src0->type) &&
                         src1->nb[0] == sizeof(float) && dst->nb[0] == sizeof(float) &&
                         src1->nb[1] % sizeof(float) == 0 && dst->nb[1] % sizeof(float) == 0;
    // weights only: a compute buffer may pad a tensor with bytes that ggml clears first
    const bool weights = src0->buffer && ggml_backend_buffer_get_usage(src0->buffer) !=
                                             GGML_BACKEND_BUFFER_USAGE_COMPUTE;
    const int cc = ggml_cuda_info().devices[ctx.device].cc;
    if (!shapes || !layouts || !weights || !GGML_CUDA_CC_IS_NVIDIA(cc) || cc < GGML_CUDA_CC_DP4A) {
        return false;
    }
    if (!takes_cols(src0, ncols, ctx.device)) {
        return false;
    }
    if (!fusion_taken(fusion, src0, false, ncols)) {  // (not repacked: checked first)
        return false;
    }
    const ggml_tensor * gate = fusion ? fusion->gate : nullptr;
    const int64_t npieces = src0->ne[0] / 32;
    cudaStream_t stream = ctx.stream();
    ContextState & st = state_of(ctx);
    ggml_cuda_pool_alloc<uint8_t> scratch(ctx.pool());
    auto activations = [&](int planes) {
        return product_activations(ctx, st, src1, npieces, planes, scratch);
    };

    if (ncols >= MIN_GEMM_COLS) {  // gemm: rows at the alignment the kind's loads need
        const size_t align =
            with_kind(kind, [](auto k) { return Layout<decltype(k)::value>::align; });
        if (src0->nb[1] % align != 0 || uintptr_t(src0->data) % align != 0) {
            return false;
        }
        const GemmArgs g =
            gemm_args(src0, dst, halves_at(activations(0), npieces, int(ncols)), residual);
        with_kind(kind, [&](auto k) { run_gemm<decltype(k)::value>(ctx, g, norm); });
        g_calls.fetch_add(1, std::memory_order_relaxed);
        return true;
    }
    if (residual) {
        return false;
    }
    GGML_ASSERT(norm == nullptr);  // (with a residual only)

    const int unit = copy_unit(src0, gate, chunk);
    if (unit == 0 || !fits(kind, npieces, ctx.device)) {
        return false;
    }
    const int planes = planes_of(kind);
    const Args a =
        gemv_args(src0, dst, fusion, planes_at(activations(planes), npieces, ncols, planes));

    const Launch run =
        with_kind(kind, [&](auto k) { return pick<decltype(k)::value>(gate != nullptr, unit); });
    run(a, stream, ctx.device);
    g_calls.fetch_add(1, std::memory_order_relaxed);
    return true;
}

}  // namespace lucepy

bool lucepy_cuda_mul_mat(ggml_backend_cuda_context & ctx, const ggml_tensor * src0,
                         const ggml_tensor * src1, ggml_tensor * dst,
                         const ggml_cuda_mm_fusion_args_host * fusion) {
    return lucepy::mul_mat(ctx, src0, src1, dst, fusion, nullptr);
}

#else  // HIP and MUSA builds take ggml's kernels

bool lucepy_cuda_mul_mat(ggml_backend_cuda_context &, const ggml_tensor *, const ggml_tensor *,
                         ggml_tensor *, const ggml_cuda_mm_fusion_args_host *) {
    return false;
}

#endif
