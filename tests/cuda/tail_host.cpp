// Host check of lucepy-plan.h's tail_plan (tests/test_cuda_kernels.py): reads lines of
// "tiles nchunks sms slots most" on stdin, writes for each "from parts chunks ctas" on stdout.
#include "lucepy-plan.h"

#include <cstdio>

int main() {
    int tiles, nchunks, sms, most;
    long long slots;
    while (scanf("%d %d %d %lld %d", &tiles, &nchunks, &sms, &slots, &most) == 5) {
        const lucepy::TailPlan p = lucepy::tail_plan(tiles, nchunks, sms, slots, most);
        printf("%d %d %d %d\n", p.from, p.parts, p.chunks, p.ctas);
    }
    return 0;
}
