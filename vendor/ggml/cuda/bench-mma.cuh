// Part of bench-kernels.cu (one program; each part includes the part before it): --mma-rate and
// --overlap.

#pragma once

#include "bench-dn.cuh"

namespace {

template <int CHAINS, int ALU>
__global__ void __launch_bounds__(128) mma_rate(float * sink, long long * cycles, int iters) {
    const uint32_t lane = threadIdx.x % 32;
    uint32_t a[4] = {0x3c003c00u ^ lane, 0x3c003c01u ^ lane, 0x3c003c02u, 0x3c003c03u};
    const uint32_t b0 = 0x3c003c00u + lane, b1 = 0x3c003c10u + lane;
    float acc[CHAINS][4] = {};
    uint32_t x = lane * 0x01010101u;
    const long long t0 = clock64();
    for (int i = 0; i < iters; i++) {
#pragma unroll
        for (int c = 0; c < CHAINS; c++) {
#pragma unroll
            for (int u = 0; u < ALU; u++) {
                const __half2 h = nibble_halves((x + c * 0x11111111u) >> (4 * (u % 4)));
                const __half2 r = __hfma2(h, __float2half2_rn(0.5f), __float2half2_rn(-516.0f));
                a[u % 4] = *reinterpret_cast<const uint32_t *>(&r);
            }
            mma_16816(acc[c], a, b0, b1);
        }
        x += 0x9e3779b9u;
    }
    const long long t1 = clock64();
    float sum = 0.0f;
#pragma unroll
    for (int c = 0; c < CHAINS; c++) {
        sum += acc[c][0] + acc[c][1] + acc[c][2] + acc[c][3];
    }
    rate_end(sum, sink, cycles, t1 - t0);
}

// the same loop on mma.sync m16n8k32 of bytes: s8 with s32 sums, or e4m3 with f32 sums. Each does
// twice a m16n8k16's multiply-adds: the rate says whether a product of bytes (Q4_0's nibbles as
// s8, scaled a block at a time) would halve the tensor cores' part of a 16-column product.
template <int CHAINS, bool FP8>
__global__ void __launch_bounds__(128) mma_rate_k32(float * sink, long long * cycles, int iters) {
    const uint32_t lane = threadIdx.x % 32;
    const uint32_t a[4] = {0x01020304u ^ lane, 0x05060708u, 0x01010101u ^ lane, 0x02020202u};
    const uint32_t b0 = 0x01030507u + lane, b1 = 0x02040608u;
    int32_t iacc[CHAINS][4] = {};
    float facc[CHAINS][4] = {};
    const long long t0 = clock64();
    for (int i = 0; i < iters; i++) {
#pragma unroll
        for (int c = 0; c < CHAINS; c++) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
            if constexpr (FP8) {
                asm volatile(
                    "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, "
                    "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                    : "+f"(facc[c][0]), "+f"(facc[c][1]), "+f"(facc[c][2]), "+f"(facc[c][3])
                    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
            } else {
                mma_16832_s8(iacc[c], a, b0, b1, iacc[c]);
            }
#endif
        }
    }
    const long long t1 = clock64();
    float sum = 0.0f;
#pragma unroll
    for (int c = 0; c < CHAINS; c++) {
        sum += facc[c][0] + facc[c][1] + float(iacc[c][2] + iacc[c][3] + iacc[c][0] + iacc[c][1]);
    }
    rate_end(sum, sink, cycles, t1 - t0);
}

// One Q4_0 piece (16 rows x 32 values, two rows a lane) against 16 columns as gemm_rb works it,
// and three other ways: the loads from shared memory, the unpacking and the mmas of each, on
// registers and shared memory alone (no copies; a barrier every chunk of 8 pieces, as gemm_rb's).
//   PR_HALVES: 2 words and 2 scales, 2 x 16 B of activations; a row's word as 4 registers of
//           halves (lop3 1024 + n, less 1032, times d; a shift for each nibble past the first,
//           where gemm_rb takes the high nibbles unshifted with an fma: about 30 instructions a
//           chunk more than its 403); 4 m16n8k16 (2 column tiles, the low and the high 16
//           values) on 2 chains of sums
//   PR_CHAINS: the same on 4 chains (the low and the high values' sums apart)
//   PR_SUMS: a register of halves in 2 instructions: lop3 then one fma, (1024 + n) d - 1024 d =
//           n d (exact but for its one rounding; the high nibbles unshifted as 1024 + 16 n, so
//           16 n d, their sums apart and scaled by 1/16 at the end), the 8 d a value less taken
//           off a chunk at a time: an m16n8k8 of the rows' scales by the columns' block sums
//           times -8, each block's sum worked out by one thread from the chunk's activations
//   PR_SUMS_PRE: PR_SUMS with the block sums written beforehand (as the activations' producer
//           could write them beside the halves): the chunk loads them, sums none
//   PR_BYTES: the same words and scales, 2 x 8 B of s8 activations and 2 x 16 B of their
//           scales; a row's word as 2 registers of s8 16 (n - 8) (lop3 (w & F0F0F0F0) ^
//           80808080, and of w << 4 alike); 2 m16n8k32 on a constant sum (0x4B400000:
//           12582912.0f as bits, so that the s32 sum reads as a float offset by it) and per
//           output two fmas: the column's scale with the offset's, then the row's scale.
enum PieceWay { PR_HALVES, PR_CHAINS, PR_SUMS, PR_SUMS_PRE, PR_BYTES };

__device__ __forceinline__ void mma_1688(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(b));
#endif
}

// the nibbles at bits 4..7 and 20..23 of `bits` as the halves 1024 + 16 n (one lop3)
__device__ __forceinline__ __half2 nibble_halves16(uint32_t bits) {
    uint32_t h;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(h) : "r"(bits), "r"(0x00F000F0u), "r"(0x64006400u));
    return as_h2(h);
}

template <int WAY>
__global__ void __launch_bounds__(128) piece_rate(float * sink, long long * cycles, int iters) {
    // shared layouts free of bank conflicts, as gemm_rb's: 16 rows of a chunk's weights (a pitch
    // of 144 bytes: 8 pieces' words, then their scales), 16 columns of its activations (halves:
    // 8 pieces of 64 bytes and 64 over; bytes: of 32 and 32 over), and for the bytes each
    // piece's column scales with their offsets' (two floats a column), for the sums' way each
    // column's 8 block sums (halves)
    constexpr bool BYTES = WAY == PR_BYTES;
    constexpr bool SUMS = WAY == PR_SUMS || WAY == PR_SUMS_PRE;
    constexpr int W_PITCH = 144, X_AT = 4096, X_PITCH = BYTES ? 288 : 576, S_AT = 13312;
    constexpr int SIZE = 14336;
    __shared__ __align__(16) uint8_t smem[SIZE + 32];
    const uint32_t lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    for (int i = threadIdx.x; i < (SIZE + 32) / 4; i += blockDim.x) {
        reinterpret_cast<uint32_t *>(smem)[i] = (i & 1) ? 0x3c003c00u ^ i : 0x01020304u * i;
    }
    __syncthreads();
    float acc[2][4] = {}, acc2[2][4] = {};
    const long long t0 = clock64();
    for (int it = 0; it < iters; it += 8) {
        __syncthreads();  // (gemm_rb's barrier a chunk)
        const uint8_t * base = smem + ((it >> 3) & 1) * 16;  // (so no load leaves the loop)
        if constexpr (WAY == PR_SUMS) {  // a block's sum of a column, by thread 8 c + block
            const int c = threadIdx.x / 8, blk = threadIdx.x % 8;
            const uint4 * xs =
                reinterpret_cast<const uint4 *>(base + X_AT + c * X_PITCH + blk * 64);
            __half2 h = __float2half2_rn(0.0f);
#pragma unroll
            for (int q = 0; q < 4; q++) {
                const uint4 v = xs[q];
                h = __hadd2(h, __hadd2(__hadd2(as_h2(v.x), as_h2(v.y)),
                                       __hadd2(as_h2(v.z), as_h2(v.w))));
            }
            const __half sum = __hmul(__hadd(__low2half(h), __high2half(h)), __float2half(-8.0f));
            // (read back by the chunk after: a chunk's sums lag it by one, as they would in
            // gemm_rb, so that its one barrier a chunk serves both)
            *reinterpret_cast<__half *>(smem + S_AT + c * 16 + blk * 2) = sum;
        }
        if constexpr (SUMS) {  // the 8 d a value off: the rows' scales times the block sums
            const uint8_t * wr = base + g * W_PITCH + 128;
            const uint32_t da = *reinterpret_cast<const uint32_t *>(wr + 4 * t);
            const uint32_t db = *reinterpret_cast<const uint32_t *>(wr + 8 * W_PITCH + 4 * t);
#pragma unroll
            for (int nt = 0; nt < 2; nt++) {
                const uint32_t sb =
                    *reinterpret_cast<const uint32_t *>(smem + S_AT + (nt * 8 + g) * 16 + 4 * t);
                mma_1688(acc[nt], da, db, sb);
            }
        }
#pragma unroll
        for (int piece = 0; piece < 8; piece++) {  // a chunk's 8 pieces, unrolled as gemm_rb's
            const uint8_t * wr = base + g * W_PITCH;
            const uint32_t w0 = *reinterpret_cast<const uint32_t *>(wr + piece * 16 + 4 * t);
            const uint32_t w1 =
                *reinterpret_cast<const uint32_t *>(wr + 8 * W_PITCH + piece * 16 + 4 * t);
            const __half d0 = *reinterpret_cast<const __half *>(wr + 128 + 2 * piece);
            const __half d1 = *reinterpret_cast<const __half *>(wr + 8 * W_PITCH + 128 + 2 * piece);
            if constexpr (!BYTES) {
                __half2 lo0[2], hi0[2], lo1[2], hi1[2];
                const __half2 dd0 = __half2half2(d0), dd1 = __half2half2(d1);
                if constexpr (SUMS) {
                    const __half2 k = __float2half2_rn(-1024.0f);
                    const __half2 m0 = __hmul2(dd0, k), m1 = __hmul2(dd1, k);
                    lo0[0] = __hfma2(nibble_halves(w0), dd0, m0);
                    lo0[1] = __hfma2(nibble_halves(w0 >> 8), dd0, m0);
                    hi0[0] = __hfma2(nibble_halves16(w0), dd0, m0);
                    hi0[1] = __hfma2(nibble_halves16(w0 >> 8), dd0, m0);
                    lo1[0] = __hfma2(nibble_halves(w1), dd1, m1);
                    lo1[1] = __hfma2(nibble_halves(w1 >> 8), dd1, m1);
                    hi1[0] = __hfma2(nibble_halves16(w1), dd1, m1);
                    hi1[1] = __hfma2(nibble_halves16(w1 >> 8), dd1, m1);
                } else {
                    const __half2 off = __float2half2_rn(1032.0f);
                    lo0[0] = __hmul2(__hsub2(nibble_halves(w0), off), dd0);
                    lo0[1] = __hmul2(__hsub2(nibble_halves(w0 >> 8), off), dd0);
                    hi0[0] = __hmul2(__hsub2(nibble_halves(w0 >> 4), off), dd0);
                    hi0[1] = __hmul2(__hsub2(nibble_halves(w0 >> 12), off), dd0);
                    lo1[0] = __hmul2(__hsub2(nibble_halves(w1), off), dd1);
                    lo1[1] = __hmul2(__hsub2(nibble_halves(w1 >> 8), off), dd1);
                    hi1[0] = __hmul2(__hsub2(nibble_halves(w1 >> 4), off), dd1);
                    hi1[1] = __hmul2(__hsub2(nibble_halves(w1 >> 12), off), dd1);
                }
                const uint32_t a_lo[4] = {as_u32(lo0[0]), as_u32(lo1[0]), as_u32(lo0[1]),
                                          as_u32(lo1[1])};
                const uint32_t a_hi[4] = {as_u32(hi0[0]), as_u32(hi1[0]), as_u32(hi0[1]),
                                          as_u32(hi1[1])};
#pragma unroll
                for (int nt = 0; nt < 2; nt++) {
                    const uint4 x = *reinterpret_cast<const uint4 *>(
                        base + X_AT + (nt * 8 + g) * X_PITCH + piece * 64 + 16 * t);
                    mma_16816(acc[nt], a_lo, x.x, x.y);
                    mma_16816(WAY == PR_HALVES ? acc[nt] : acc2[nt], a_hi, x.z, x.w);
                }
            } else {
                uint32_t a[4];
                const uint32_t m = 0xF0F0F0F0u, x8 = 0x80808080u;
                asm("lop3.b32 %0, %1, %2, %3, 0x6A;" : "=r"(a[2]) : "r"(w0), "r"(m), "r"(x8));
                asm("lop3.b32 %0, %1, %2, %3, 0x6A;" : "=r"(a[0]) : "r"(w0 << 4), "r"(m), "r"(x8));
                asm("lop3.b32 %0, %1, %2, %3, 0x6A;" : "=r"(a[3]) : "r"(w1), "r"(m), "r"(x8));
                asm("lop3.b32 %0, %1, %2, %3, 0x6A;" : "=r"(a[1]) : "r"(w1 << 4), "r"(m), "r"(x8));
                const float f0 = __half2float(d0), f1 = __half2float(d1);
#pragma unroll
                for (int nt = 0; nt < 2; nt++) {
                    const uint2 b = *reinterpret_cast<const uint2 *>(
                        base + X_AT + (nt * 8 + g) * X_PITCH + piece * 32 + 8 * t);
                    const float4 sc = *reinterpret_cast<const float4 *>(
                        base + S_AT + (piece * 16 + nt * 8 + 2 * t) * 8);
                    constexpr int32_t MAGIC = 0x4B400000;
                    constexpr int32_t start[4] = {MAGIC, MAGIC, MAGIC, MAGIC};
                    int32_t dsum[4];
                    mma_16832_s8(dsum, a, b.x, b.y, start);
                    acc[nt][0] = fmaf(f0, fmaf(__int_as_float(dsum[0]), sc.x, sc.z), acc[nt][0]);
                    acc[nt][1] = fmaf(f0, fmaf(__int_as_float(dsum[1]), sc.y, sc.w), acc[nt][1]);
                    acc[nt][2] = fmaf(f1, fmaf(__int_as_float(dsum[2]), sc.x, sc.z), acc[nt][2]);
                    acc[nt][3] = fmaf(f1, fmaf(__int_as_float(dsum[3]), sc.y, sc.w), acc[nt][3]);
                }
            }
        }
    }
    const long long t1 = clock64();
    float sum = 0.0f;
#pragma unroll
    for (int nt = 0; nt < 2; nt++) {
#pragma unroll
        for (int j = 0; j < 4; j++) {
            sum += acc[nt][j] + acc2[nt][j] * (SUMS ? 0.0625f : 1.0f);
        }
    }
    rate_end(sum, sink, cycles, t1 - t0);
}

void bench_mma_rate(cudaStream_t s) {
    constexpr int ITERS = 1024;
    float * sink;
    long long * cycles;
    CHECK(cudaMalloc(&sink, sizeof(float)));
    CHECK(cudaMalloc(&cycles, sizeof(long long) * g_sms * 16));
    std::printf("mma.sync m16n8k16 f32 sums on %d SMs: cycles a mma a scheduler (TFLOP/s)\n",
                g_sms);
    std::printf("warps/SM chains  mma alone       +2 pairs        +4 pairs\n");
    auto one = [&](auto kernel, int per_sm, int chains, int k16s = 1) {
        const int ctas = g_sms * per_sm;
        const float us =
            time_calls(s, [&](int) { kernel<<<ctas, 128, 0, s>>>(sink, cycles, ITERS); });
        std::vector<long long> c(ctas);
        CHECK(cudaMemcpy(c.data(), cycles, sizeof(long long) * ctas, cudaMemcpyDeviceToHost));
        std::sort(c.begin(), c.end());
        const double mmas_a_scheduler = double(per_sm) * 4 / 4 * ITERS * chains;  // 4 warps a CTA
        const double flops = double(ctas) * 4 * ITERS * chains * 4096.0 * k16s;
        std::printf(" %6.2f (%5.0f)", double(c[ctas / 2]) / mmas_a_scheduler, flops / us / 1e6);
    };
    for (int per_sm : {1, 2, 4, 5, 8}) {
        for_each_index<3>([&](auto ci) {
            constexpr int CH = 1 << decltype(ci)::value;
            std::printf("%-8d %-6d", 4 * per_sm, CH);
            one(mma_rate<CH, 0>, per_sm, CH);
            one(mma_rate<CH, 2>, per_sm, CH);
            one(mma_rate<CH, 4>, per_sm, CH);
            std::printf("\n");
        });
    }
    std::printf("\nm16n8k32 (twice the multiply-adds a mma): cycles a mma a scheduler (TFLOP/s)\n");
    std::printf("warps/SM chains  s8 (s32 sums)   e4m3 (f32 sums)\n");
    for (int per_sm : {1, 2, 4, 8}) {
        for_each_index<2>([&](auto ci) {
            constexpr int CH = 2 << decltype(ci)::value;  // (ptxas drops a lone s8 chain's loop)
            std::printf("%-8d %-6d", 4 * per_sm, CH);
            one(mma_rate_k32<CH, false>, per_sm, CH, 2);
            one(mma_rate_k32<CH, true>, per_sm, CH, 2);
            std::printf("\n");
        });
    }
    std::printf("\na Q4_0 piece against 16 columns, loads from shared memory, unpacking and "
                "mmas: cycles a piece a scheduler\n");
    std::printf("warps/SM  halves          4 chains        block sums      sums written    "
                "bytes\n");
    for (int per_sm : {4, 5, 6, 8}) {
        std::printf("%-9d", 4 * per_sm);
        one(piece_rate<PR_HALVES>, per_sm, 1, 4);
        one(piece_rate<PR_CHAINS>, per_sm, 1, 4);
        one(piece_rate<PR_SUMS>, per_sm, 1, 4);
        one(piece_rate<PR_SUMS_PRE>, per_sm, 1, 4);
        one(piece_rate<PR_BYTES>, per_sm, 1, 4);
        std::printf("\n");
    }
    CHECK(cudaGetLastError());
    CHECK(cudaFree(sink));
    CHECK(cudaFree(cycles));
}

void bench_overlap(cudaStream_t s, std::mt19937 & rng) {
    constexpr int K = 5120, ROWS = 6144, NCOLS = 16;
    const int npieces = K / 32;
    const int64_t row_bytes = int64_t(npieces) * 18;
    const int64_t mat_bytes = row_bytes * ROWS;
    const int copies = int((int64_t(1) << 30) / mat_bytes);
    std::vector<uint8_t> host(mat_bytes);
    for (int64_t b = 0; b < mat_bytes / 18; b++) {
        fill_block(Q4_0, host.data() + b * 18, rng);
    }
    const std::vector<uint8_t> rp = host_repack(host.data(), row_bytes, ROWS, npieces);
    uint8_t * wr;
    CHECK(cudaMalloc(&wr, size_t(mat_bytes) * copies));
    for (int c = 0; c < copies; c++) {
        CHECK(cudaMemcpy(wr + mat_bytes * c, rp.data(), size_t(mat_bytes),
                         cudaMemcpyHostToDevice));
    }
    std::vector<float> x(size_t(NCOLS) * K);
    std::uniform_real_distribution<float> val(-1.0f, 1.0f);
    for (float & v : x) {
        v = val(rng);
    }
    float *dx, *dst, *parts;
    uint8_t * act;
    CHECK(cudaMalloc(&dx, x.size() * sizeof(float)));
    CHECK(cudaMemcpy(dx, x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice));
    CHECK(cudaMalloc(&act, size_t(halves_bytes(npieces, NCOLS))));
    CHECK(cudaMalloc(&dst, size_t(NCOLS) * ROWS * sizeof(float)));
    CHECK(cudaMalloc(&parts, size_t(16) * NCOLS * ROWS * sizeof(float)));
    const Halves halves = halves_at(act, npieces, NCOLS);
    to_halves<<<dim3(unsigned(segments(npieces)), unsigned(padded_cols(NCOLS))), TH_THREADS, 0,
                s>>>(dx, K, npieces, NCOLS, halves);
    GemmArgs g = {};
    g.row_stride = row_bytes;
    g.x = halves;
    g.dst = dst;
    g.dst_stride = ROWS;
    g.nrows = ROWS;
    g.npieces = npieces;
    g.ncols = NCOLS;
    const DnBuffers dn = make_dn(rng);

    cudaStream_t s2;
    CHECK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
    cudaEvent_t fork, join;
    CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
    CHECK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
    using Launch = void (*)(GemmArgs, float *, cudaStream_t);
    const std::pair<const char *, Launch> plans[] = {
        {"gemm_r<2>, its plan", launch_build<GemmR<2>>},
        {"gemm_r<2>, 1 CTA an SM", launch_build<GemmR<2>, 16, 1>},
        {"gemm_r<2>, 2 CTAs an SM", launch_build<GemmR<2>, 16, 2>},
        {"gemm_r<2>, 3 CTAs an SM", launch_build<GemmR<2>, 16, 3>}};
    auto product = [&](Launch launch, int i, cudaStream_t on) {
        GemmArgs b = g;
        b.w = wr + mat_bytes * (i % copies);
        launch(b, parts, on);
    };
    // both sides once from the pristine state: what each writes, alone or side by side
    auto results = [&](auto run) {
        CHECK(cudaMemcpy(dn.states, dn.pristine, size_t(dn.state_floats()) * sizeof(float),
                         cudaMemcpyDeviceToDevice));
        CHECK(cudaMemset(dst, 0, size_t(NCOLS) * ROWS * sizeof(float)));
        CHECK(cudaMemset(dn.attn, 0, size_t(DN_S) * dn.H * dn.T * sizeof(float)));
        run();
        CHECK(cudaStreamSynchronize(s));
        CHECK(cudaGetLastError());
        std::vector<float> out(size_t(NCOLS) * ROWS + size_t(DN_S) * dn.H * dn.T);
        CHECK(cudaMemcpy(out.data(), dst, size_t(NCOLS) * ROWS * sizeof(float),
                         cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(out.data() + size_t(NCOLS) * ROWS, dn.attn,
                         size_t(DN_S) * dn.H * dn.T * sizeof(float), cudaMemcpyDeviceToHost));
        return out;
    };
    const float t_dn = time_calls(s, [&](int i) { launch_dn(dn, i % dn.copies, s); });
    std::printf("overlap: delta_net alone (48 heads, 16 tokens) %7.2f us\n", t_dn);
    for (const auto & plan : plans) {
        const Launch launch = plan.second;
        const float t_p = time_calls(s, [&](int i) { product(launch, i, s); });
        const float t_serial = time_calls(s, [&](int i) {
            launch_dn(dn, i % dn.copies, s);
            product(launch, i, s);
        });
        auto side_by_side = [&](int i, bool product_first) {
            CHECK(cudaEventRecord(fork, s));
            CHECK(cudaStreamWaitEvent(s2, fork, 0));
            if (product_first) {
                product(launch, i, s2);
                launch_dn(dn, i % dn.copies, s);
            } else {
                launch_dn(dn, i % dn.copies, s);
                product(launch, i, s2);
            }
            CHECK(cudaEventRecord(join, s2));
            CHECK(cudaStreamWaitEvent(s, join, 0));
        };
        const std::vector<float> alone = results([&] {
            launch_dn(dn, 0, s);
            product(launch, 0, s);
        });
        const std::vector<float> both = results([&] { side_by_side(0, false); });
        const bool same = both == alone;
        failures += !same;
        const float t_both = time_calls(s, [&](int i) { side_by_side(i, false); });
        const float t_first = time_calls(s, [&](int i) { side_by_side(i, true); });
        std::printf("  z's product, %-24s alone %7.2f us, after delta_net %7.2f, beside it %7.2f "
                    "(launched first %7.2f)%s\n",
                    plan.first, t_p, t_serial, t_both, t_first, same ? "" : "  WRONG");
    }
    CHECK(cudaEventDestroy(fork));
    CHECK(cudaEventDestroy(join));
    CHECK(cudaStreamDestroy(s2));
    for (float * p : {dn.q, dn.k, dn.v, dn.g, dn.beta, dn.states, dn.pristine, dn.attn, dx, dst,
                      parts}) {
        CHECK(cudaFree(p));
    }
    CHECK(cudaFree(wr));
    CHECK(cudaFree(act));
}

}  // namespace
