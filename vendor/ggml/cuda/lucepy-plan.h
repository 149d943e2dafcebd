// How a tensor-core product of lucepy's (gemm, gemm_r: lucepy-gemm.cuh, lucepy-repack.cuh) splits
// a row's pieces over several CTAs, whose sums gemm_sum adds. Plain C++: tests/test_cuda_kernels.py
// checks it on a machine without a GPU (tests/cuda/plan_host.cpp).
#pragma once

#include <algorithm>
#include <cstdint>

namespace lucepy {

// The most parts a product of `npieces` pieces splits into: at most `most`, every part keeping
// at least 2 chunks of P pieces.
inline int gemm_max_parts(int64_t npieces, int P, int most = 16) {
    const int64_t nchunks = (npieces + P - 1) / P;
    return int(std::max<int64_t>(1, std::min<int64_t>(most, nchunks / 2)));
}

// The parts a product of `nrows` rows and `npieces` pieces splits its pieces into, on a GPU with
// room for `slots` CTAs of `cta_rows` rows at once, up to gemm_max_parts: as many as still run in
// one wave of CTAs (each CTA then walks fewer chunks, at no cost in waves); past one wave, the
// fewest whose last wave is fullest (a larger count only where it fills 5 % more of it). (A
// product of a few row tiles, qwen35's 96-row DeltaNet alpha and beta, once took 1 part, as no
// part more filled 5 % more of the GPU: its 16-column product took 26 us, 20 chunks in a row.)
inline int gemm_parts(int nrows, int npieces, int cta_rows, int P, int64_t slots,
                      int most = 16) {
    const int64_t tiles = (nrows + cta_rows - 1) / cta_rows;
    const int top = gemm_max_parts(npieces, P, most);
    int best = 1;
    double fill = 0.0;
    for (int parts = 1; parts <= top; parts++) {
        const int64_t units = tiles * parts;
        const int64_t waves = (units + slots - 1) / slots;
        const double f = double(units) / double(waves * slots);
        if (waves == 1 || f > fill + 0.05) {
            best = parts;
            fill = f;
        }
    }
    return best;
}

}  // namespace lucepy
