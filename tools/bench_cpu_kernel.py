"""lucepy's Q4_1 and Q5_1 CPU kernels (vendor/ggml/cpu/lucepy-cpu.c) against ggml's mul_mat,
one product alone on the CPU backend: random blocks of SmolLM2-135M's product shapes times 1-256
f32 columns, each side a graph of that one product (ours with its Q8_1 copy, as a model's graph has
it), --repeats computes after a warm-up, the two sides taking turns twice; the median of
each side's timed computes.

    python tools/bench_cpu_kernel.py --threads 2 --cols 1,2,3,4,8,32,256 [--type q5_1]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from lucepy.ggml import cpu, load
from lucepy.ggml.owners import Allocator, Buffer, Context, tensor_set
from lucepy.runtime.devices import open_backend

SHAPES = {  # SmolLM2-135M: name -> (rows, row length)
    "ffn gate/up": (1536, 576),
    "ffn down": (576, 1536),
    "attn q/out": (576, 576),
}


def product_us(
    lib, backend, gtype, blocks, rows: int, K: int, cols: int, rng, repeats: int, rewrite=None
) -> list[float]:
    """``repeats`` computes of one product after one warm-up, in us: ``blocks`` (the bytes of
    ``rows`` x ``K`` weights of ``gtype``) times ``cols`` f32 columns drawn from ``rng``, a graph
    of that one MUL_MAT; ``rewrite(ctx, graph)`` before the graph is allocated."""
    ctx = Context(lib, 8, graph_nodes=16)
    try:
        w = lib.ggml_new_tensor_2d(ctx.ptr, gtype, K, rows)
        x = lib.ggml_new_tensor_2d(ctx.ptr, cpu.F32, K, cols)
        with Buffer(lib, ctx, backend, "benchmark"):
            tensor_set(lib, w, blocks)
            tensor_set(lib, x, rng.standard_normal((cols, K), dtype=np.float32))
            y = lib.ggml_mul_mat(ctx.ptr, w, x)
            gf = lib.ggml_new_graph_custom(ctx.ptr, 16, False)
            lib.ggml_build_forward_expand(gf, y)
            if rewrite is not None:
                rewrite(ctx.ptr, gf)
            with Allocator(lib, backend) as alloc:
                alloc.alloc(gf)
                times = []
                for _ in range(repeats + 1):
                    t = time.perf_counter()
                    lib.ggml_backend_graph_compute(backend.ptr, gf)
                    times.append(time.perf_counter() - t)
    finally:
        ctx.close()
    return [t * 1e6 for t in times[1:]]


def timed_us(lib, backend, kinds, gtype, rows: int, K: int, cols: int, ours: bool, repeats: int):
    """``repeats`` computes of the product after one warm-up, in us."""
    rng = np.random.default_rng(0)
    blocks = cpu.random_blocks(gtype, rows * K // cpu.QK, rng)

    def take(ctx, gf):
        if cpu.take_products(lib, ctx, gf, kinds) != 1:
            raise SystemExit(f"{cols} columns: the kernel does not take this product")

    rewrite = take if ours else None
    return product_us(lib, backend, gtype, blocks, rows, K, cols, rng, repeats, rewrite)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cols", default="3,4,8,32,256")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--type", default="q4_1", choices=[name for name, _ in cpu.KINDS.values()])
    args = ap.parse_args()
    gtype = next(t for t, (name, _) in cpu.KINDS.items() if name == args.type)
    lib = load()
    backend = open_backend(lib, "cpu", args.threads)
    kinds = cpu.kernels(lib, backend)
    if gtype not in kinds:
        raise SystemExit(f"no {args.type} kernel: {cpu.why_not()}")
    saved = cpu.MIN_COLS
    cpu.MIN_COLS = 1  # measure the column counts the models leave to ggml too
    print(f"{args.type}, {kinds[gtype].variant}, {args.threads} threads; us a product (median)")
    print("| product | columns | ggml us | ours us | ggml / ours |\n|---|---|---|---|---|")
    try:
        for name, (rows, K) in SHAPES.items():
            for cols in (int(c) for c in args.cols.split(",")):
                pooled: dict[bool, list[float]] = {False: [], True: []}
                for _ in range(2):
                    for side in (False, True):
                        pooled[side] += timed_us(
                            lib, backend, kinds, gtype, rows, K, cols, side, args.repeats
                        )
                theirs, ours = (float(np.median(pooled[side])) for side in (False, True))
                print(f"| {name} | {cols} | {theirs:.0f} | {ours:.0f} | {theirs / ours:.2f}x |")
    finally:
        cpu.MIN_COLS = saved
        backend.close()


if __name__ == "__main__":
    main()
