// The first part of bench-kernels.cu (one program, one translation unit; each part includes the
// part before it): the matrices' bytes, the host's math and the launch helpers the other parts
// share.

#pragma once

#include "lucepy-kernels.cuh"
#include "lucepy-ops.cuh"
#include "lucepy-deltanet.cuh"
#include "lucepy-recurrence.cuh"
#include "lucepy-gemm.cuh"
#include "lucepy-repack.cuh"
#include "lucepy-bulk.cuh"
#include "lucepy-prefill.cuh"
#include "lucepy-f8.cuh"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

using namespace lucepy;

#define CHECK(x)                                                                                \
    do {                                                                                        \
        cudaError_t e_ = (x);                                                                   \
        if (e_ != cudaSuccess) {                                                                \
            std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));    \
            std::exit(1);                                                                       \
        }                                                                                       \
    } while (0)

namespace {

const char * kind_name(int k) {
    switch (k) {
        case Q4_0: return "q4_0";
        case Q8_0: return "q8_0";
        case Q4_K: return "q4_K";
        case Q6_K: return "q6_K";
        case Q4_1: return "q4_1";
        case Q5_1: return "q5_1";
        case Q5_K: return "q5_K";
        default: return "iq4_xs";
    }
}

int block_bytes(int k) {
    return with_kind(k, [](auto kk) { return Layout<decltype(kk)::value>::bytes; });
}

int block_values(int k) {
    return with_kind(k, [](auto kk) { return 32 * Layout<decltype(kk)::value>::pieces; });
}

void put_half(uint8_t * p, float v) {
    const __half h = __float2half(v);
    std::memcpy(p, &h, 2);
}

// random quants with finite, moderate scales
void fill_block(int k, uint8_t * b, std::mt19937 & rng) {
    std::uniform_real_distribution<float> scale(0.002f, 0.02f);
    for (int i = 0; i < block_bytes(k); i += 4) {
        const uint32_t r = rng();
        std::memcpy(b + i, &r, std::min(4, block_bytes(k) - i));
    }
    if (k == Q4_0 || k == Q8_0) {
        put_half(b, scale(rng));
    } else if (k == Q4_1 || k == Q5_1) {
        put_half(b, scale(rng));
        put_half(b + 2, -scale(rng));
    } else if (k == Q4_K || k == Q5_K) {
        put_half(b, scale(rng) / 16);
        put_half(b + 2, scale(rng) / 16);
    } else if (k == IQ4_XS) {
        put_half(b, scale(rng) / 64);
    } else {
        put_half(b + 208, scale(rng) / 16);
    }
}

template <int K>
float host_dot_row(const uint8_t * row, int npieces, const int8_t * xq, const float2 * xds) {
    using L = Layout<K>;
    double sum = 0;
    for (int piece = 0; piece < npieces; piece++) {
        Piece p;
        unpack<K>(row + (piece / L::pieces) * L::bytes, piece % L::pieces, p);
        for (int k = 0; k < planes_of(K); k++) {
            const int64_t at = int64_t(piece) * planes_of(K) + k;
            int x[8];
            std::memcpy(x, xq + at * 32, 32);
            sum += dot(p, x, xds[at].x, xds[at].y);
        }
    }
    return float(sum);
}

float host_dot(int k, const uint8_t * row, int npieces, const int8_t * xq, const float2 * xds) {
    return with_kind(k, [&](auto kk) {
        return host_dot_row<decltype(kk)::value>(row, npieces, xq, xds);
    });
}

float host_glu(int op, float x, float g) {
    if (op == GLU_GEGLU) {
        const float c = 0.79788456080286535588f;
        return x * 0.5f * g * (1.0f + std::tanh(c * g * (1.0f + 0.044715f * g * g)));
    }
    return x * g / (1.0f + std::exp(-g));
}

// a plain streaming read: every 16 bytes once, one sum per thread written
__global__ void read_all(const int4 * p, int64_t n, int * out) {
    int acc = 0;
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
         i += int64_t(gridDim.x) * blockDim.x) {
        const int4 v = __ldcs(p + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x7fffffff) {
        out[0] = acc;  // never, in practice: keeps the loads
    }
}

template <typename F> void raise_smem(F kernel, int smem) {
    if (smem > 48 * 1024) {
        CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    }
}

template <int K, bool GATE, int R, int U, int SPLIT, int P = 64, int ST = 3>
void launch_gemv(const Args & a, cudaStream_t s) {
    const int smem = gemv_smem<K, GATE, R, U, P, ST>(a.npieces, SPLIT);
    auto kernel = gemv<K, GATE, R, U, SPLIT, P, ST>;
    raise_smem(kernel, smem);
    const int64_t warps = int64_t((a.nrows + R - 1) / R) * SPLIT;
    kernel<<<unsigned((warps + GV_WARPS - 1) / GV_WARPS), GV_WARPS * 32, smem, s>>>(a);
}

// warps of the kernel that fit on the GPU at once
template <typename F> int64_t slots_of(F kernel, int smem) {
    raise_smem(kernel, smem);
    int per_sm = 0, sms = 0;
    CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, GV_WARPS * 32, smem));
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    return int64_t(per_sm) * GV_WARPS * sms;
}

// the split that lucepy-mm.cu chooses (gemv_split), from the occupancy calculator's slots
template <int K, bool GATE, int U> void launch_auto(const Args & a, cudaStream_t s) {
    auto slots = [](auto kernel, int smem) { return slots_of(kernel, smem); };
    switch (gemv_pick<K, GATE, 1, U>(a.nrows, a.npieces, slots)) {
        case 1: launch_gemv<K, GATE, 1, U, 1>(a, s); break;
        case 2: launch_gemv<K, GATE, 1, U, 2>(a, s); break;
        default: launch_gemv<K, GATE, 1, U, 4>(a, s); break;
    }
}

}  // namespace
