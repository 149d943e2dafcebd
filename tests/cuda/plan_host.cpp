// Host check of vendor/ggml/cuda/lucepy-plan.h (tests/test_cuda_kernels.py): reads lines of
// "nrows npieces cta_rows P slots" on stdin, writes for each "parts most" (gemm_parts, and
// gemm_max_parts) on stdout.
#include "lucepy-plan.h"

#include <cstdio>

int main() {
    int nrows, npieces, cta_rows, P;
    long long slots;
    while (scanf("%d %d %d %d %lld", &nrows, &npieces, &cta_rows, &P, &slots) == 5) {
        printf("%d %d\n", lucepy::gemm_parts(nrows, npieces, cta_rows, P, slots),
               lucepy::gemm_max_parts(npieces, P));
    }
    return 0;
}
