// lucepy's own kernels (issue 19, decision 12), hooked into the pinned ggml-cuda: the host side of
// the products, their routes, plans and launches (lucepy-state.cu keeps the switches, counters,
// each context's state and the graph's scan; lucepy-fuse.cu and lucepy-deltanet.cu take the
// other ops; lucepy-host.cuh declares what they share). The kernels are lucepy-kernels.cuh,
// lucepy-gemm.cuh, lucepy-repack.cuh and lucepy-f8.cuh; hooks.patch shows where ggml calls in.
//
// Measured on an H200 (docs/BENCHMARKS.md): on by default for compute capability 9.0 and newer
// (Hopper on), where they were measured; LUCEPY_CUDA_KERNELS=0 or =1 forces them off or on.

#include "lucepy-host.cuh"
#include "lucepy-repack.cuh"
#include "lucepy-bulk.cuh"
#include "lucepy-prefill.cuh"
#include "lucepy-f8.cuh"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

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

// CTAs of `threads` threads and `smem` bytes of shared memory of a kernel that fit on a device
// at once, asked once per kernel, device and size (a product's activations set gemv's size: a few
// a model).
template <typename F> int64_t cta_slots(F kernel, int threads, int smem, int device) {
    struct Slots {
        F kernel;
        int device, smem;
        int64_t ctas;
    };
    static std::vector<Slots> known;
    static std::mutex mutex;
    std::lock_guard<std::mutex> lock(mutex);
    for (const Slots & s : known) {
        if (s.kernel == kernel && s.device == device && s.smem == smem) {
            return s.ctas;
        }
    }
    int per_sm = 0;
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
    const int64_t sms = ggml_cuda_info().devices[device].nsm;
    known.push_back({kernel, device, smem, std::max<int64_t>(1, int64_t(per_sm) * sms)});
    return known.back().ctas;
}

// warps of gemv that fit at once
template <typename F> int64_t warp_slots(F kernel, int smem, int device) {
    return cta_slots(kernel, GV_WARPS * 32, smem, device) * GV_WARPS;
}

template <int K, bool GATE, int R, int U, int SPLIT>
void launch_split(const Args & a, cudaStream_t stream) {
    const int64_t warps = int64_t((a.nrows + R - 1) / R) * SPLIT;
    const dim3 grid(unsigned((warps + GV_WARPS - 1) / GV_WARPS));
    const int smem = gemv_smem<K, GATE, R, U>(a.npieces, SPLIT);
    const auto params = ggml_cuda_kernel_launch_params(grid, GV_WARPS * 32, smem, stream);
    ggml_cuda_kernel_launch(gemv<K, GATE, R, U, SPLIT>, params, a);
}

// a warp for each R rows (or 2 or 4 for each, gemv_split), copies of U bytes
template <int K, bool GATE, int R, int U>
void launch(const Args & a, cudaStream_t stream, int device) {
    static bool raised[GGML_CUDA_MAX_DEVICES] = {};
    once_a_device(raised, device, [device] {  // every size that fits (lucepy_cuda_mul_mat checks)
        const int most = int(ggml_cuda_info().devices[device].smpbo);
        for (auto kernel :
             {gemv<K, GATE, R, U, 1>, gemv<K, GATE, R, U, 2>, gemv<K, GATE, R, U, 4>}) {
            CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            most));
        }
    });
    auto slots = [device](auto kernel, int smem) { return warp_slots(kernel, smem, device); };
    switch (gemv_pick<K, GATE, R, U>(a.nrows, a.npieces, slots)) {
        case 1: launch_split<K, GATE, R, U, 1>(a, stream); break;
        case 2: launch_split<K, GATE, R, U, 2>(a, stream); break;
        default: launch_split<K, GATE, R, U, 4>(a, stream); break;
    }
}

// one column: a warp per row (and its gate row)
template <int K, int U> Launch pick_unit(bool gate) {
    return gate ? &launch<K, true, 1, U> : &launch<K, false, 1, U>;
}

template <int K> Launch pick(bool gate, int unit) {
    return unit == 16 ? pick_unit<K, 16>(gate)
         : unit == 8  ? pick_unit<K, 8>(gate)
                      : pick_unit<K, 4>(gate);
}

// `kernel` in clusters (the launch attribute `cluster`), with `smem` bytes of dynamic shared
// memory, and with programmatic dependent launch where ggml_cuda_kernel_launch would use it
template <typename... Args>
void launch_clusters(void (*kernel)(Args...), dim3 grid, int threads, int smem,
                     cudaLaunchAttribute cluster, cudaStream_t stream, Args... args) {
    cudaLaunchAttribute attrs[2] = {cluster};
    unsigned nattrs = 1;
#if defined(GGML_CUDA_USE_PDL)
    static const bool pdl = [] {
        const char * env = getenv("GGML_CUDA_PDL");
        return env == nullptr || std::atoi(env) != 0;
    }();
    if (pdl && ggml_cuda_kernel_can_use_pdl(reinterpret_cast<const void *>(kernel))) {
        attrs[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attrs[1].val.programmaticStreamSerializationAllowed = 1;
        nattrs = 2;
    }
#endif
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(unsigned(threads));
    cfg.dynamicSmemBytes = size_t(smem);
    cfg.stream = stream;
    cfg.attrs = attrs;
    cfg.numAttrs = nattrs;
    CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

// the same in clusters of `cluster` CTAs along x, no dynamic shared memory
template <typename... Args>
void launch_clustered(void (*kernel)(Args...), dim3 grid, int threads, int cluster,
                      cudaStream_t stream, Args... args) {
    launch_clusters(kernel, grid, threads, 0, cluster_attr(cluster), stream, args...);
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
// A tensor-core product of 4-warp CTAs of `smem` bytes (gemm, gemm_r) by `plan`, its parts
// added in order by gemm_sum, or with `norm` (the RMS norm after the product's residual ADD) by
// sum_norm_halves, or (`paired`: gemm_f8, where f8_paired) by the CTAs of a row tile's parts, a
// cluster, themselves
template <typename F>
void launch_in_parts(ggml_backend_cuda_context & ctx, F kernel, int smem, const GemmPlan & plan,
                     const GemmArgs & base, const NormAfter * norm = nullptr,
                     bool paired = false) {
    const int parts = int(plan.grid.y);
    GemmArgs a = base;
    a.per_part = plan.per_part;
    cudaStream_t stream = ctx.stream();
    if (paired && !norm && f8_paired(parts)) {
        cudaLaunchAttribute cluster = cluster_attr(1);
        cluster.val.clusterDim.y = unsigned(parts);
        launch_clusters(kernel, plan.grid, GM_WARPS * 32, gemm_f8_pair_smem<F8_STAGES>(parts),
                        cluster, stream, a);
        g_paired.fetch_add(1, std::memory_order_relaxed);
        return;
    }
    ggml_cuda_pool_alloc<float> sums(ctx.pool());
    if (parts > 1) {
        a.parts = sums.alloc(size_t(parts) * a.ncols * a.nrows);
    }
    ggml_cuda_kernel_launch(kernel,
                            ggml_cuda_kernel_launch_params(plan.grid, GM_WARPS * 32, smem, stream),
                            a);
    if (norm) {
        launch_sum_norm(ctx, a, parts, *norm);
    } else if (parts > 1) {
        const int64_t n = int64_t(a.nrows) * a.ncols;
        const dim3 sum_grid(unsigned((n + 255) / 256));
        ggml_cuda_kernel_launch(gemm_sum, ggml_cuda_kernel_launch_params(sum_grid, 256, 0, stream),
                                static_cast<const float *>(a.parts), parts, a.nrows, a.ncols, a.dst,
                                a.dst_stride, a.residual, a.res_stride);
    }
}

// CTAs of `kernel` (4 warps, `smem` bytes) at once on a device, asked once a device (`slots`:
// the kernel's own table). Its limit on dynamic shared memory raised to `smem` where that is
// past the default 48 KB, never lowered under it (a paired gemm_f8 takes 4 KB more than its
// plan's CTAs: launched under a limit of its plan's bytes, it failed)
template <typename F>
int64_t slots_of(F kernel, int smem, int device, int64_t (&slots)[GGML_CUDA_MAX_DEVICES]) {
    if (slots[device] == 0) {
        CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        std::max(smem, 48 * 1024)));
        slots[device] = cta_slots(kernel, GM_WARPS * 32, smem, device);
    }
    return slots[device];
}

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
    static_assert(R::warps == GM_WARPS, "lucepy-mm.cu launches CTAs of GM_WARPS warps");
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

bool lucepy_cuda_mul_mat(ggml_backend_cuda_context & ctx, const ggml_tensor * src0,
                         const ggml_tensor * src1, ggml_tensor * dst,
                         const ggml_cuda_mm_fusion_args_host * fusion) {
    return lucepy::mul_mat(ctx, src0, src1, dst, fusion, nullptr);
}

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

bool lucepy_cuda_mul_mat(ggml_backend_cuda_context &, const ggml_tensor *, const ggml_tensor *,
                         ggml_tensor *, const ggml_cuda_mm_fusion_args_host *) {
    return false;
}

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
