"""Where a decode step and a 16-token verify spend their time on one device: Python input
writes, the graph compute (its launch, which returns before the device is done, then the wait
for the device), and the output read. Medians over repeats, in ms. A launch that takes about
as long as the wait's device time means the kernels went out one by one (no CUDA graph).

    python tools/profile_gpu.py MODEL [--device cuda:0] [--depth 512]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from lucepy.ggml import Sched
from lucepy.runtime.config import RuntimeConfig
from lucepy.runtime.engine import Engine
from lucepy.runtime.pipeline import Step


def profile(engine: Engine, tokens: np.ndarray, step: Step, repeats: int = 30) -> dict:
    shard = engine.shards[0]
    pos0 = engine.n_past
    lib = shard.lib
    parts = {"prepare": [], "launch": [], "wait": [], "read": [], "total": []}
    for _ in range(repeats + 3):
        t0 = time.perf_counter()
        batch = engine.pipeline.slots.batch(tokens, pos0)
        spec = shard.spec(batch, step.logits, step.verify, step.capture)
        g = shard.prepare(spec, batch)
        t1 = time.perf_counter()
        if isinstance(g.alloc, Sched):
            lib.ggml_backend_sched_graph_compute_async(g.alloc.ptr, g.gf)
            t2 = time.perf_counter()
            lib.ggml_backend_sched_synchronize(g.alloc.ptr)
        else:
            lib.ggml_backend_graph_compute_async(shard.backend.ptr, g.gf)
            t2 = time.perf_counter()
            lib.ggml_backend_synchronize(shard.backend.ptr)
        t3 = time.perf_counter()
        shard.read(g, step.want)
        t4 = time.perf_counter()
        for k, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0), strict=True):
            parts[k].append(v * 1e3)
    return {k: round(statistics.median(v[3:]), 3) for k, v in parts.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--depth", type=int, default=512)
    args = ap.parse_args()
    cfg = RuntimeConfig(device=args.device, max_ctx=args.depth + 64)
    with Engine(args.model, cfg, tokenizer=False) as engine:
        engine.reset()
        engine.prefill(np.arange(1, args.depth + 1) % min(1000, engine.params.n_vocab))
        out = {
            "decode (logits)": profile(engine, np.array([5]), Step()),
            "decode (argmax)": profile(engine, np.array([5]), Step(want="argmax")),
            "prefill 16": profile(engine, np.arange(16) + 7, Step()),
            "verify 16 (argmax)": profile(
                engine, np.arange(16) + 7, Step(logits="all", want="argmax", verify=True)
            ),
        }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
