// lucepy's product kernels (lucepy-kernels.cuh, lucepy-gemm.cuh; lucepy-repack.cuh's on a
// repacked copy of the same matrix: Q4_0, Q4_K, Q5_K, Q6_K) alone on a GPU, without ggml:
// each way to launch them on the decode shapes of the 27B-shaped model, their time per call and
// the weight bytes read per second, and each result against the same math on the host
// (lucepy-quants.cuh), on the same rounded weights and activations. One column (gemv: rows per
// warp, warps per row) against a plain streaming read of the same bytes; with --cols, gemm for
// those counts of columns (stages, warps, parts) against gemv's one column.
//
//     nvcc -O3 -std=c++17 -arch=sm_90 -o bench-kernels bench-kernels.cu
//     ./bench-kernels [--quick] [--kind KIND] [--shape NAME] [--cols 1,2,4,8,16]
//     (KIND: q4_0, q4_K, q8_0, q6_K by default; also q5_K, iq4_xs, q4_1, q5_1 when named)
//     BENCH_ONCE=1 ncu --kernel-name regex:gemv ./bench-kernels --quick --shape ffn_down
//     (BENCH_FEW=1: of gemm's launches only lucepy-mm.cu's, beside the repacked Q4_0's)
//     ./bench-kernels --sum-norm   (a verify's residual sum and next RMS norm: gemm_sum and
//     norm_halves against sum_norm_halves, their results compared byte for byte; then the FFN's
//     GLU writing halves and writing e4m3 records)
//     ./bench-kernels --e4m3   (f8_of against the non-saturating conversion, every float)
//     ./bench-kernels --overlap   (a product on a second stream beside the DeltaNet recurrence)
//     ./bench-kernels --mma-rate   (mma.sync's rate alone: warps an SM, chains, unpacking beside;
//     m16n8k32 on s8 and e4m3; a Q4_0 piece at 16 columns from shared memory four ways)
//     ./bench-kernels --delta-net   (the recurrence's CTA shapes, warps and columns a lane, at 1
//     to 512 tokens: us a call, each against the host's recurrence in double and the model's)
//     BENCH_FEW=1 ./bench-kernels --kind q4_0 --cols 16 --anatomy   (the repacked Q4_0's gemm_r
//     beside itself with parts of its work left out: its loads alone, its compute alone, ...)
//     ./bench-kernels --kind q4_0 --cols 8,16 --timeline   (gemm_r's and gemm_rb's CTAs, each
//     stamping its start, first barrier, chunks and end: their lives, waits and the tail)
//     BENCH_FEW=1 ./bench-kernels --kind q4_0 --cols 9,16 --f8   (gemm_f8 on Hopper's FP8
//     wgmma beside gemm_rb: time, and error against the exact sums of the unrounded x)
//     BENCH_IN_L2=1 ...   (each matrix one copy, read from the L2 cache where it fits)
//     BENCH_FEW=1 ./bench-kernels --kind q6_K --cols 1,2,16   (Q6_K repacked: gemv_r's splits
//     against the blocks' gemv, gemm_rb against their gemm; --kind q5_K the same for Q5_K)
//
// The weights are random bytes with finite scales, several copies of each matrix in turn so that
// no call finds its weights in the L2 cache. Times: a CUDA graph of 20 calls, replayed 10 times,
// the median replay over 20.

#include "bench-common.cuh"
#include "bench-gemv.cuh"
#include "bench-gemm.cuh"
#include "bench-f8.cuh"
#include "bench-repacked.cuh"
#include "bench-cols.cuh"
#include "bench-norm.cuh"
#include "bench-dn.cuh"
#include "bench-mma.cuh"

int main(int argc, char ** argv) {
    bool quick = false;
    const char * only_kind = nullptr;
    const char * only_shape = nullptr;
    std::vector<int> cols;  // --cols 2,4,8,16: gemm against one column
    bool sum_norm = false;  // --sum-norm: a verify's residual sum and next norm, 2 kernels or 1
    bool overlap = false;   // --overlap: z's product beside the DeltaNet recurrence
    bool recurrence = false;  // --delta-net: its CTA shapes
    bool mma = false;         // --mma-rate: the tensor cores' rate on mma.sync
    bool e4m3 = false;        // --e4m3: the records' conversion against the non-saturating one
    for (int i = 1; i < argc; i++) {
        if (std::strcmp(argv[i], "--quick") == 0) {
            quick = true;
        } else if (std::strcmp(argv[i], "--sum-norm") == 0) {
            sum_norm = true;
        } else if (std::strcmp(argv[i], "--overlap") == 0) {
            overlap = true;
        } else if (std::strcmp(argv[i], "--delta-net") == 0) {
            recurrence = true;
        } else if (std::strcmp(argv[i], "--mma-rate") == 0) {
            mma = true;
        } else if (std::strcmp(argv[i], "--e4m3") == 0) {
            e4m3 = true;
        } else if (std::strcmp(argv[i], "--anatomy") == 0) {
            g_anatomy = true;
        } else if (std::strcmp(argv[i], "--timeline") == 0) {
            g_timeline = true;
        } else if (std::strcmp(argv[i], "--f8") == 0) {
            g_f8 = true;
        } else if (std::strcmp(argv[i], "--kind") == 0 && i + 1 < argc) {
            only_kind = argv[++i];
        } else if (std::strcmp(argv[i], "--shape") == 0 && i + 1 < argc) {
            only_shape = argv[++i];
        } else if (std::strcmp(argv[i], "--cols") == 0 && i + 1 < argc) {
            for (char * at = argv[++i]; *at;) {
                const int n = int(std::strtol(at, &at, 10));
                if (n < 1 || (n > MAX_GEMM_COLS && n % 32 != 0) || n > 1024) {
                    std::fprintf(stderr, "--cols: counts of 1 to 16 columns, or multiples of 32 "
                                         "to 1024 (the repacked Q4_0 only)\n");
                    return 2;
                }
                cols.push_back(n);
                at += *at == ',';
            }
        } else {
            std::fprintf(stderr,
                         "usage: %s [--quick] [--kind KIND] [--shape NAME] [--cols 2,4,8,16] "
                         "[--sum-norm] [--overlap] [--delta-net] [--mma-rate] [--e4m3] "
                         "[--anatomy] [--timeline] [--f8]\n",
                         argv[0]);
            return 2;
        }
    }
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    g_sms = prop.multiProcessorCount;
    g_smem_per_sm = int(prop.sharedMemPerMultiprocessor);
    g_smem_reserved = int(prop.reservedSharedMemPerBlock);
    std::printf("%s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount,
                prop.l2CacheSize >> 20);
    cudaStream_t s;
    CHECK(cudaStreamCreate(&s));
    std::mt19937 rng(7);
    if (mma) {
        bench_mma_rate(s);
        return 0;
    }
    if (e4m3) {
        check_e4m3(s);
        return failures ? 1 : 0;
    }
    if (recurrence) {
        bench_delta_net(s, rng);
        std::printf(failures ? "%d WRONG\n" : "every shape near the host's, the model's bytes\n",
                    failures);
        return failures ? 1 : 0;
    }
    if (overlap) {
        bench_overlap(s, rng);
        std::printf(failures ? "%d WRONG\n" : "side by side, both wrote their own bytes\n",
                    failures);
        return failures ? 1 : 0;
    }
    if (sum_norm) {  // the parts gemm_r splits the model's 5,120-row products into: 1, 3-5
        for (int ncols : {2, 9, 16}) {
            for (int nparts : {1, 3, 4, 5}) {
                bench_sum_norm(ncols, nparts, s, rng);
            }
        }
        bench_glu(s, rng);
        std::printf(failures ? "%d WRONG\n" : "both ways wrote the same bytes\n", failures);
        return failures ? 1 : 0;
    }
    // Qwen3.6-27B's decode products (n_embd 5120, n_ff 17408), and its Q6_K output head
    const Shape shapes[] = {
        {"ffn_up+gate", 5120, 17408, true},
        {"ffn_up|gate", 5120, 2 * 17408, false},  // the two stacked: one verify product
        {"ffn_down", 17408, 5120, false},
        {"qkv", 5120, 10240, false},
        {"dn_in", 5120, 16480, false},  // qwen35's DeltaNet inputs stacked: qkv, z, alpha, beta
        {"attn_out", 6144, 5120, false},
        {"attn_k", 5120, 1024, false},
        {"output", 5120, 248320, false},
    };
    for (int k : {Q4_0, Q4_K, Q8_0, Q6_K, Q5_K, IQ4_XS, Q4_1, Q5_1}) {
        const bool more = k == Q5_K || k == IQ4_XS || k == Q4_1 || k == Q5_1;
        if (more && !only_kind) {
            continue;  // the types beyond the 27B-shaped Q4_0 and Q4_K_M files: when named
        }
        for (const Shape & sh : shapes) {
            if ((sh.rows > 100000 && k != Q6_K) || (quick && k == Q8_0)) {
                continue;  // the output head is Q6_K in the Q4_0 and Q4_K_M files
            }
            if ((only_kind && std::strcmp(only_kind, kind_name(k)) != 0) ||
                (only_shape && std::strcmp(only_shape, sh.what) != 0)) {
                continue;
            }
            if (cols.empty()) {
                bench(k, sh, s, rng);
            } else {
                bench_cols(k, sh, cols, s, rng);
            }
        }
    }
    std::printf(failures ? "%d WRONG\n" : "all results match the host's\n", failures);
    return failures ? 1 : 0;
}
