// Host check of lucepy-plan.h's hybrid_of (tests/test_cuda_kernels.py): reads lines of
// "blocks nchunks sms per_sm" on stdin, writes for each "whole parts per ctas" on stdout.
#include "lucepy-plan.h"

#include <cstdio>

int main() {
    int blocks, nchunks, sms;
    long long per_sm;
    while (scanf("%d %d %d %lld", &blocks, &nchunks, &sms, &per_sm) == 4) {
        const lucepy::Hybrid h = lucepy::hybrid_of(blocks, nchunks, sms, per_sm);
        printf("%d %d %d %d\n", h.whole, h.parts, h.per, h.ctas);
    }
    return 0;
}
