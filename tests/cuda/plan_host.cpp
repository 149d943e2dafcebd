// Host check of vendor/ggml/cuda/lucepy-plan.h (tests/test_cuda_kernels.py): reads lines of
// "nrows npieces cta_rows P slots ncols start" on stdin, writes for each "parts most by_cost"
// (gemm_parts, gemm_max_parts, and gemm_parts_by_cost for `ncols` columns and a CTA's start of
// `start` chunks) on stdout.
#include "lucepy-plan.h"

#include <cstdio>

int main() {
    int nrows, npieces, cta_rows, P, ncols;
    long long slots;
    double start;
    while (scanf("%d %d %d %d %lld %d %lf", &nrows, &npieces, &cta_rows, &P, &slots, &ncols,
                 &start) == 7) {
        printf("%d %d %d\n", lucepy::gemm_parts(nrows, npieces, cta_rows, P, slots),
               lucepy::gemm_max_parts(npieces, P),
               lucepy::gemm_parts_by_cost(nrows, npieces, ncols, cta_rows, P, slots, 16, start));
    }
    return 0;
}
