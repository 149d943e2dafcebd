"""A MoE model's prefill with and without routing counts, against llama-bench, in one run:
the check behind docs/BENCHMARKS.md's qwen35moe pp512 figures.

    python3 tools/bench_prefill.py MODEL LLAMA_BENCH [--device cuda:0]

Two engines each way (counted, uncounted, in turns), each timing ``Engine.prefill`` of the same
512 random tokens 7 times; the median of the last 5. Then ``llama-bench -ngl 99 -fa 1 -p 512 -n 0
-r 5`` of the same build: the median of its samples.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time

import numpy as np
from bench_gpu import llama_median  # tools/, beside this script

from lucepy.runtime.config import RuntimeConfig
from lucepy.runtime.engine import Engine

TOKENS, RUNS, WARM_UP = 512, 7, 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("llama_bench")
    ap.add_argument("--device", default="cuda:0")
    args = ap.parse_args()
    tokens = np.random.default_rng(0).integers(0, 200000, TOKENS).tolist()
    for counted in (False, True, False, True):
        cfg = RuntimeConfig(device=args.device, max_ctx=2048, count_experts=counted)
        with Engine(args.model, cfg, tokenizer=False) as engine:
            rates = []
            for _ in range(RUNS):
                engine.reset()
                t0 = time.perf_counter()
                engine.prefill(tokens, chunk=TOKENS)
                rates.append(TOKENS / (time.perf_counter() - t0))
        label = "counted" if counted else "uncounted"
        print(label, round(statistics.median(rates[WARM_UP:]), 1), [round(r) for r in rates])
    cmd = [args.llama_bench, "-m", args.model, "-ngl", "99", "-fa", "1", "-p", str(TOKENS),
           "-n", "0", "-r", "5", "-o", "json"]  # fmt: skip
    for row in json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout):
        samples = [TOKENS * 1e9 / s for s in row["samples_ns"]]
        print("llama-bench", round(llama_median(row).tok_s, 1), [round(s) for s in samples])


if __name__ == "__main__":
    main()
