// How a tensor-core product of lucepy's (gemm, gemm_r: lucepy-gemm.cuh, lucepy-repack.cuh) splits
// a row's pieces over several CTAs, whose sums gemm_sum adds. Plain C++: tests/test_cuda_kernels.py
// checks it on a machine without a GPU (tests/cuda/plan_host.cpp).
#pragma once

#include <algorithm>
#include <cstdint>

namespace lucepy {

// The CTAs of `cta_rows` rows that cover `nrows` rows (a product's row tiles)
inline int64_t row_tiles(int64_t nrows, int cta_rows) {
    return (nrows + cta_rows - 1) / cta_rows;
}

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
    const int64_t tiles = row_tiles(nrows, cta_rows);
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

// gemm_r's choice (gemm_parts' with what the parts cost): the count whose estimated time is
// least, a count costing its waves of CTAs (each a CTA's start and store, then its chunks one
// after another) and, split, the kernel that adds the parts (its launch, and its reads of every
// part's `ncols` x `nrows` floats). In a chunk's time (about 1.3 us on the H200, a CTA's load of
// 64 rows' 8 pieces, 9 KB, at memory latency), fitted on the 27B-shaped model's products there
// (bench-kernels.cu, docs/BENCHMARKS.md session 29): a CTA's start 0.35 of one, the sums' launch
// 0.75, 3.9 MB of parts read one. gemm_parts' fullest last wave took 9 and 10 parts where 5
// were up to 13 % faster (the FFN's up, and its up and gate as one product, 16 columns). A
// build's CTA start in chunks is `start` (GemmF8::start is longer).
inline int gemm_parts_by_cost(int nrows, int npieces, int ncols, int cta_rows, int P,
                              int64_t slots, int most = 16, double start = 0.35) {
    const int64_t tiles = row_tiles(nrows, cta_rows);
    const int64_t nchunks = (npieces + P - 1) / P;
    const int top = gemm_max_parts(npieces, P, most);
    int best = 1;
    double least = 0.0;
    for (int parts = 1; parts <= top; parts++) {
        const int64_t per_part = (nchunks + parts - 1) / parts;
        const int64_t used = (nchunks + per_part - 1) / per_part;  // none empty
        const int64_t waves = (tiles * used + slots - 1) / slots;
        double t = double(waves) * (start + double(per_part));
        if (used > 1) {
            t += 0.75 + double(used) * double(nrows) * ncols * sizeof(float) / 3.9e6;
        }
        if (parts == 1 || t < least) {
            best = int(used);
            least = t;
        }
    }
    return best;
}

// A tail for a product of one part (gemm_f8's F8Tail, lucepy-f8.cuh): `tiles` row tiles of
// `nchunks` chunks on `sms` SMs with room for `slots` CTAs at once. Where the tiles leave a last
// wave of fewer CTAs than SMs (`rest` past whole waves of one CTA an SM), each of those tiles is
// cut along k into as many parts as the SMs take one each of (at most `most`, 2 chunks a part and
// more), so that no SM takes a whole tile more than the others: the CTAs from `from` on are
// `parts` a tile of `chunks` chunks each (the last part the rest), `ctas` CTAs in all. No tail
// (`parts` 0, `ctas` the tiles) where there is no such last wave, a cut would be under 2 parts,
// or the CTAs would not all fit at once.
struct TailPlan {
    int from;
    int parts;
    int chunks;
    int ctas;
};

inline TailPlan tail_plan(int tiles, int nchunks, int sms, int64_t slots, int most = 8) {
    const TailPlan none = {tiles, 0, 0, tiles};
    const int rest = sms > 0 ? tiles % sms : 0;
    if (tiles < sms || rest == 0) {
        return none;
    }
    const int cut = std::min({sms / rest, most, nchunks / 2});
    if (cut < 2) {
        return none;
    }
    const int chunks = (nchunks + cut - 1) / cut;
    const int parts = (nchunks + chunks - 1) / chunks;  // (none empty)
    const int ctas = tiles - rest + rest * parts;
    if (ctas > slots) {
        return none;
    }
    return {tiles - rest, parts, chunks, ctas};
}
}  // namespace lucepy
