// lucepy's own kernels (issue 19, decision 12): a split product's sums, its residual and the RMS
// norm after it in one kernel of a cluster a column (`sum_norm_halves`); included by
// lucepy-gemm.cuh.

#pragma once

#include "lucepy-records.cuh"

namespace lucepy {

// --- a split product's sums, its residual and the RMS norm after it, in one kernel ---------------
//
// A verify layer's output product and its skip connection (ggml's MUL_MAT and ADD), then the
// next block's RMS norm times its weight (RMS_NORM and MUL), whose result goes to products:
// where gemm_sum added the product's parts and the residual and norm_halves then normed the sum
// in a CTA of its own a column (16 SMs for 16 columns), a cluster of CL CTAs holds a column of
// CL x NORM_THREADS values, a thread a value: each adds its value's parts and residual as
// gemm_sum does (bit for bit) and writes the sum; the cluster's CTAs then read each other's
// values through distributed shared memory, so that each thread sums the squares of values tid,
// tid + NORM_THREADS, ... in norm_scale's (ggml's) order, and every CTA finds norm_halves' factor
// bit for bit; a CTA's two segments' halves as to_halves writes them. lucepy-mm.cu launches it
// after a product in parts: of one part, whose store wrote the sums, norm_halves alone took
// 0.78x its time (bench-kernels --sum-norm, which times both ways).
//
// PUSH (the default): each thread sends its value to its place in every CTA of the cluster
// (st.async, completing bytes on the receiver's mbarrier), each CTA waits on its own mbarrier
// and sums the squares from its shared memory, and no CTA waits for another at its end. Without
// it (PULL, for comparison) each CTA reads the others' values after a cluster barrier, and a
// second keeps every CTA until all have read: each barrier's release is a MEMBAR.ALL.GPU in
// sm_90's code, waiting on every global store before it (Nsight Compute: membar the largest
// stall after the loads').

// the cluster's barrier, in two halves: arrive (what this thread wrote before is seen by those
// that wait after) and wait
__device__ __forceinline__ void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// the cluster's barrier's arrival that orders nothing (only that every CTA has reached it)
__device__ __forceinline__ void cluster_arrive_relaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
}

// shared address `at` (of this CTA's layout) in the cluster's CTA `rank` (mapa)
__device__ __forceinline__ uint32_t cluster_at(uint32_t at, int rank) {
    uint32_t remote = at;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(at), "r"(rank));
#endif
    return remote;
}

// v into the float at `local`'s place in the shared memory of the cluster's CTA `rank`, its 4
// bytes completing on that CTA's mbarrier at `bar`'s place (st.async)
__device__ __forceinline__ void cluster_send(const float * local, uint32_t bar, int rank, float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];"
                 ::"r"(cluster_at(shared_at(local), rank)), "r"(__float_as_uint(v)),
                 "r"(cluster_at(bar, rank))
                 : "memory");
#endif
}

// v[0..3] into the 16 bytes at shared address `at` (of this CTA's layout) in the cluster's CTA
// `rank`, completing on that CTA's mbarrier at `bar` (st.async, one 16-byte store)
__device__ __forceinline__ void cluster_send4(uint32_t at, uint32_t bar, int rank,
                                              const float * v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile(
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, "
        "[%5];" ::"r"(cluster_at(at, rank)),
        "r"(__float_as_uint(v[0])), "r"(__float_as_uint(v[1])), "r"(__float_as_uint(v[2])),
        "r"(__float_as_uint(v[3])), "r"(cluster_at(bar, rank))
        : "memory");
#endif
}

// the CTAs of this CTA's cluster (1 where it was launched without clusters), and its rank there
__device__ __forceinline__ uint32_t cluster_ctas() {
    uint32_t n = 1;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
#endif
    return n;
}

__device__ __forceinline__ uint32_t cluster_rank() {
    uint32_t r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
    return r;
}

// the float at `local`'s place in the shared memory of the cluster's CTA `rank`
__device__ __forceinline__ float cluster_load(const float * local, int rank) {
    float v = 0.0f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("ld.shared::cluster.f32 %0, [%1];"
                 : "=f"(v)
                 : "r"(cluster_at(shared_at(local), rank))
                 : "memory");
#endif
    return v;
}

// the launch attribute of clusters of `cl` CTAs along x (sum_norm_halves' launches and its
// occupancy query)
inline cudaLaunchAttribute cluster_attr(int cl) {
    cudaLaunchAttribute attr = {};
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = unsigned(cl);
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    return attr;
}

struct SumNorm {
    const float * src;       // the product's parts, part_stride apart, or (one part) its sums
    int64_t src_col;         // a column's stride in src
    int64_t part_stride;
    int nparts;
    const float * residual;  // or null (one part: the product added it)
    int64_t res_stride;
    float * sum;             // where the sums plus the residual go (the ADD's), or null (one part)
    int64_t sum_stride;
    const float * w;         // the norm's weight
    float * normed;          // the MUL's result
    int64_t normed_stride;
    int n;                   // values a column: NORM_THREADS x CL
    int ncols;
    float eps;
    Halves out;              // for the products after it (padding columns zeros)
    bool late;               // the product after it let start at the end (below), not at once
};

// Grid (CL, padded columns), clusters of CL x 1, NORM_THREADS threads (two segments) a CTA, a
// thread a value: CL CTAs a column where norm_halves has one. F8: the products' activations as
// e4m3 records (a.out as f8_at gives them, 16 columns), not halves. `late`: the product after it
// (programmatic dependent launch) may start only once every CTA has written its results, not
// at the kernel's start: a CTA of 1,024 threads holds 40,960 of an SM's 65,536 registers, so
// the product's CTAs launched early crowd onto the other SMs and onto 3 slots of these, and
// come out less even than when launched onto empty SMs (a 16-token verify 0.02-0.025 decode
// steps less, docs/BENCHMARKS.md session 58).
template <int CL, bool F8 = false, bool PUSH = true>
__global__ void __launch_bounds__(NORM_THREADS) sum_norm_halves(const SumNorm a) {
    static_assert(NORM_THREADS == 2 * GM_SEG * 32, "a CTA two segments");
    if (!a.late) {
        LUCEPY_PDL_LAUNCH();
    }
    const int c = blockIdx.y;
    const bool real = c < a.ncols;
    const int e = blockIdx.x * NORM_THREADS + threadIdx.x;  // of the column
    const float wi = a.w[e];
    __shared__ float xs[PUSH ? CL : 1][NORM_THREADS];  // PUSH: [CTA k][t], value k NORM_THREADS + t
    __shared__ uint64_t landed;                        // PUSH: every CTA's values here
    const uint32_t bar = shared_at(&landed);
    if constexpr (PUSH) {
        if (threadIdx.x == 0) {
            mbar_init(bar, 1);
            mbar_expect(bar, CL * NORM_THREADS * sizeof(float));
            mbar_init_fence();
        }
        cluster_arrive_relaxed();
        cluster_wait();  // every CTA's mbarrier is ready before any value is sent to it
    }
    LUCEPY_PDL_SYNC();  // the parts: the product has finished
    float v = 0.0f;
    if (real) {
        v = parts_sum(a.src + c * a.src_col + e, a.nparts, a.part_stride);
        if (a.residual) {
            v += a.residual[c * a.res_stride + e];
        }
        if (a.sum) {
            a.sum[c * a.sum_stride + e] = v;
        }
    }
    float sq = 0.0f;
    if constexpr (PUSH) {
#pragma unroll
        for (int k = 0; k < CL; k++) {
            cluster_send(&xs[blockIdx.x][threadIdx.x], bar, k, v);
        }
        mbar_wait<true>(bar, 0);  // every CTA's values have landed here
#pragma unroll
        for (int k = 0; k < CL; k++) {
            sq += xs[k][threadIdx.x] * xs[k][threadIdx.x];
        }
    } else {
        xs[0][threadIdx.x] = v;
        cluster_arrive();
        cluster_wait();  // every CTA of the column has its values in place
#pragma unroll
        for (int k = 0; k < CL; k++) {
            const float xk = cluster_load(xs[0] + threadIdx.x, k);
            sq += xk * xk;
        }
        cluster_arrive();  // this CTA has read the others' values (they may exit once all have)
    }
    const float scale = rsqrtf(block_sum<NORM_THREADS>(sq) / float(a.n) + a.eps);
    const float u = scale * v * wi;
    if (real) {
        a.normed[c * a.normed_stride + e] = u;
    }
    if constexpr (F8) {
        segment_e4m3<2>({u}, a.out, c, a.n / 32, 2 * blockIdx.x);
    } else {
        segment_halves<2, 1>({u}, a.out, c, a.n / 32, 2 * blockIdx.x);
    }
    if (a.late) {
        LUCEPY_PDL_LAUNCH();
    }
    if constexpr (!PUSH) {
        cluster_wait();  // no CTA's shared memory goes while another reads it
    }
}

}  // namespace lucepy
