"""One Q4_0 matrix product alone on a GPU through the loaded ggml: the Qwen3.6-27B-shaped model's
products (random blocks) times N f32 columns, each a graph of that one product computed
--repeats times after a warm-up; the median compute in us. With LUCEPY_CUDA_KERNELS=0 the
products are ggml's (its mat-vec kernel to 8 columns, mmq past that: a prefill's), to set beside
vendor/ggml/cuda/bench-kernels.cu's times of lucepy's kernels on the same shapes.

    LUCEPY_CUDA_KERNELS=0 python tools/bench_gpu_product.py --cols 16,64,512
"""

from __future__ import annotations

import argparse

import numpy as np
from bench_cpu_kernel import product_us

from lucepy.ggml import load
from lucepy.runtime.devices import open_backend

GGML_TYPE_Q4_0 = 2
SHAPES = {  # name -> (rows, row length), as bench-kernels.cu names them
    "ffn_up+gate": (17408, 5120),
    "ffn_down": (5120, 17408),
    "qkv": (10240, 5120),
    "attn_out": (5120, 6144),
}


def q4_0_blocks(n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` Q4_0 blocks: random nibbles and a scale in [2e-3, 2e-2)."""
    blocks = rng.integers(0, 256, (n, 18), dtype=np.uint8)
    blocks[:, :2] = rng.uniform(2e-3, 2e-2, (n, 1)).astype(np.float16).view(np.uint8)
    return blocks


def timed_us(lib, backend, rows: int, K: int, cols: int, repeats: int) -> float:
    """The median of ``repeats`` computes of the product, in us."""
    rng = np.random.default_rng(0)
    blocks = q4_0_blocks(rows * K // 32, rng)
    return float(
        np.median(product_us(lib, backend, GGML_TYPE_Q4_0, blocks, rows, K, cols, rng, repeats))
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--cols", default="16,64,512")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    lib = load()
    backend = open_backend(lib, args.device)
    try:
        for name, (rows, K) in SHAPES.items():
            for cols in (int(c) for c in args.cols.split(",")):
                us = timed_us(lib, backend, rows, K, cols, args.repeats)
                print(f"{name:12s} {rows:6d} x {K:6d}  {cols:4d} columns: {us:9.1f} us", flush=True)
    finally:
        backend.close()


if __name__ == "__main__":
    main()
