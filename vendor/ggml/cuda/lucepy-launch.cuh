// lucepy's own kernels (issue 19, decision 12): the launch templates of the products' host side
// that lucepy-mm.cu and lucepy-repacked.cu share: a kernel's CTA slots on a device, gemv's launch
// by its split, launches in clusters, and a product in parts with what adds them.

#pragma once

#include "lucepy-host.cuh"
#include "lucepy-repack.cuh"
#include "lucepy-bulk.cuh"
#include "lucepy-prefill.cuh"
#include "lucepy-f8.cuh"

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <vector>

#if !defined(GGML_USE_HIP) && !defined(GGML_USE_MUSA)

namespace lucepy {

// lucepy-mm.cu's, that lucepy-repacked.cu calls too
void launch_sum_norm(ggml_backend_cuda_context & ctx, const GemmArgs & a, int parts,
                     const NormAfter & norm);
bool f8_paired(int parts);
void launch_glu_halves(const float * a, const float * b, int64_t col_stride, int nparts,
                       int64_t part_stride, float * dst, int npieces, int ncols,
                       const Halves & out, cudaStream_t stream, bool f8);
uint8_t * product_activations(ggml_backend_cuda_context & ctx, ContextState & st,
                              const ggml_tensor * src1, int64_t npieces, int planes,
                              ggml_cuda_pool_alloc<uint8_t> & scratch);

// lucepy-repacked.cu's, that lucepy-mm.cu calls
bool repacked_of(const ggml_tensor * t);
Args gemv_args(const ggml_tensor * src0, const ggml_tensor * dst,
               const ggml_cuda_mm_fusion_args_host * fusion, const Planes & quantized);
GemmArgs gemm_args(const ggml_tensor * src0, const ggml_tensor * dst, const Halves & x,
                   const ggml_tensor * residual);
bool fusion_taken(const ggml_cuda_mm_fusion_args_host * fusion, const ggml_tensor * src0,
                  bool repacked, int64_t ncols);
void repacked_mul_mat(ggml_backend_cuda_context & ctx, const ggml_tensor * src0,
                      const ggml_tensor * src1, ggml_tensor * dst,
                      const ggml_cuda_mm_fusion_args_host * fusion, const ggml_tensor * residual,
                      const NormAfter * norm);

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

}  // namespace lucepy

#endif
