// lucepy's attention for a few queries (lucepy-attn.cuh's kernels) hooked into ggml-cuda:
// which FLASH_ATTN_EXT nodes it takes, its launch, the splits' scratch from the context's pool.

#include "lucepy-host.cuh"
#include "lucepy-attn.cuh"

#include <cstring>

#if !defined(GGML_USE_HIP) && !defined(GGML_USE_MUSA)

namespace lucepy {

template <int D>
void launch_attn(AttnArgs a, int tiles, int nkv, int nseq, ggml_backend_cuda_context & ctx) {
    static bool raised[GGML_CUDA_MAX_DEVICES] = {};
    once_a_device(raised, ctx.device, [] {
        CUDA_CHECK(cudaFuncSetAttribute(attn_few<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        attn_smem<D>()));
    });
    a.splits = attn_splits(a.n_kv, tiles * nkv * nseq, ggml_cuda_info().devices[ctx.device].nsm);
    const int64_t rows = int64_t(nseq) * nkv * a.ratio * a.T;
    ggml_cuda_pool_alloc<float> part(ctx.pool(), a.splits > 1 ? a.splits * rows * D : 1);
    ggml_cuda_pool_alloc<float2> part_ms(ctx.pool(), a.splits > 1 ? a.splits * rows : 1);
    a.part = part.get(), a.part_ms = part_ms.get();
    const dim3 grid(unsigned(tiles * a.splits), unsigned(nkv), unsigned(nseq));
    const int threads = D / AT_DW * 32, smem = attn_smem<D>();
    ggml_cuda_kernel_launch(attn_few<D>,
                            ggml_cuda_kernel_launch_params(grid, threads, smem, ctx.stream()), a);
    if (a.splits > 1) {
        const dim3 rows_grid(unsigned(a.ratio * a.T), unsigned(nkv), unsigned(nseq));
        ggml_cuda_kernel_launch(a.splits > AT_SPLITS ? attn_join<D, true> : attn_join<D>,
                                ggml_cuda_kernel_launch_params(rows_grid, D / 4, 0, ctx.stream()),
                                a);
    }
}

// FLASH_ATTN_EXT at node i on lucepy's kernel: 1, or 0 where it does not take the node
int attn_nodes(ggml_backend_cuda_context & ctx, const ggml_cgraph * cgraph, int i) {
    // LUCEPY_CUDA_ATTN=0: ggml's kernel, for comparison
    static const bool on = switched_on("LUCEPY_CUDA_ATTN");
    // LUCEPY_CUDA_ATTN_KEYS=N: caches of up to N rows, to measure the longer ones
    static const int most_keys = switched_count("LUCEPY_CUDA_ATTN_KEYS", AT_MAX_KEYS);
    const ggml_tensor * dst = cgraph->nodes[i];
    const ggml_tensor * q = dst->src[0];
    const ggml_tensor * k = dst->src[1];
    const ggml_tensor * v = dst->src[2];
    const ggml_tensor * mask = dst->src[3];
    const int cc = ggml_cuda_info().devices[ctx.device].cc;
    if (!on || !GGML_CUDA_CC_IS_NVIDIA(cc) || cc < GGML_CUDA_CC_AMPERE || dst->src[4] != nullptr) {
        return 0;
    }
    float scale = 0.0f, max_bias = 0.0f, softcap = 0.0f;
    std::memcpy(&scale, dst->op_params + 0, sizeof(float));
    std::memcpy(&max_bias, dst->op_params + 1, sizeof(float));
    std::memcpy(&softcap, dst->op_params + 2, sizeof(float));
    const int64_t D = q->ne[0], T = q->ne[1], nh = q->ne[2], n_kv = k->ne[1], nkv = k->ne[2];
    const bool shapes = (D == 128 || D == 256) && k->ne[0] == D && v->ne[0] == D &&
                        v->ne[1] == n_kv && v->ne[2] == nkv && T >= 1 && T <= MAX_COLS &&
                        nkv > 0 && nh % nkv == 0 && n_kv > 0 && n_kv <= most_keys &&
                        n_kv % 2 == 0 && k->ne[3] == q->ne[3] && v->ne[3] == q->ne[3] &&
                        dst->ne[0] == D && dst->ne[1] == nh && dst->ne[2] == T &&
                        max_bias == 0.0f && softcap == 0.0f;
    const bool types = q->type == GGML_TYPE_F32 && k->type == GGML_TYPE_F16 &&
                       v->type == GGML_TYPE_F16 && dst->type == GGML_TYPE_F32 &&
                       ggml_is_contiguous(dst) && q->nb[0] == sizeof(float) &&
                       k->nb[0] == 2 && v->nb[0] == 2;
    // 16-byte loads of q, 16-byte copies of K and V rows, 4-byte loads of the mask
    const bool aligned = strides_aligned(q, 16) && strides_aligned(k, 16) &&
                         strides_aligned(v, 16) && uintptr_t(dst->data) % 16 == 0;
    const bool masks = mask == nullptr ||
                       (mask->type == GGML_TYPE_F16 && mask->ne[0] >= n_kv && mask->ne[1] >= T &&
                        mask->nb[0] == 2 && strides_aligned(mask, 4));
    if (!shapes || !types || !aligned || !masks) {
        return 0;
    }
    AttnArgs a{};
    a.q = static_cast<const char *>(q->data);
    a.q1 = q->nb[1], a.q2 = q->nb[2], a.q3 = q->nb[3];
    a.k = static_cast<const char *>(k->data);
    a.k1 = k->nb[1], a.k2 = k->nb[2], a.k3 = k->nb[3];
    a.v = static_cast<const char *>(v->data);
    a.v1 = v->nb[1], a.v2 = v->nb[2], a.v3 = v->nb[3];
    if (mask) {
        a.mask = static_cast<const char *>(mask->data);
        a.m1 = mask->nb[1], a.m2 = mask->nb[2], a.m3 = mask->nb[3];
        a.mh = int(mask->ne[2]), a.ms = int(mask->ne[3]);
    }
    a.dst = static_cast<float *>(dst->data);
    a.T = int(T), a.nh = int(nh), a.ratio = int(nh / nkv), a.n_kv = int(n_kv);
    a.scale = scale * 1.4426950408889634f;
    const int tiles = int((a.ratio * T + AT_ROWS - 1) / AT_ROWS);
    if (D == 256) {
        launch_attn<256>(a, tiles, int(nkv), int(q->ne[3]), ctx);
    } else {
        launch_attn<128>(a, tiles, int(nkv), int(q->ne[3]), ctx);
    }
    g_ops++;
    return 1;
}

}  // namespace lucepy

#endif
