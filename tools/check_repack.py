"""The logits of a Q4_0 model on lucepy's CUDA kernels with its weights repacked
(LUCEPY_CUDA_REPACK=1: vendor/ggml/cuda/lucepy-layouts.cuh) against the same kernels on the blocks
and against ggml's kernels: a prefill of --prompt random tokens in one chunk (a prefill's product,
gemm_rq), then --steps decode steps of fixed random tokens (gemv_r), one engine a side in turn.
Prints each side's relative error from ggml's kernels, step by step (the last prompt position
first), and how often its top token is ggml's.

    python tools/check_repack.py MODEL --device cuda:0
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from lucepy.ggml import load
from lucepy.ggml.kernels import cuda_kernels
from lucepy.runtime.config import RuntimeConfig
from lucepy.runtime.engine import Engine

SIDES = {"ggml's kernels": (False, "0"), "own kernels": (True, "0"), "own, repacked": (True, "1")}


def logits_of(engine: Engine, prompt: list[int], steps: list[int]) -> np.ndarray:
    rows = [np.array(engine.prefill(prompt, chunk=len(prompt)), dtype=np.float64)]
    rows += [np.array(engine.decode(t), dtype=np.float64) for t in steps]
    return np.stack(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args()
    kernels = cuda_kernels(load())
    if kernels is None:
        raise SystemExit("check_repack: the loaded ggml has no lucepy kernels")
    got = {}
    for name, (on, repack) in SIDES.items():
        kernels.set(on)
        os.environ["LUCEPY_CUDA_REPACK"] = repack
        calls = kernels.calls
        cfg = RuntimeConfig(device=args.device, max_ctx=2048, chunk=args.prompt)
        with Engine(args.model, cfg, tokenizer=False) as engine:
            rng = np.random.default_rng(0)
            prompt = rng.integers(0, engine.params.n_vocab, args.prompt).tolist()
            steps = rng.integers(0, engine.params.n_vocab, args.steps).tolist()
            got[name] = logits_of(engine, prompt, steps)
        print(f"{name}: {kernels.calls - calls} products on lucepy's kernels", flush=True)
    ref = got["ggml's kernels"]
    for name, rows in got.items():
        err = np.linalg.norm(rows - ref, axis=1) / np.linalg.norm(ref, axis=1)
        same = float(np.mean(rows.argmax(axis=1) == ref.argmax(axis=1)))
        print(
            f"{name}: relative error from ggml's {' '.join(f'{e:.1e}' for e in err)}; "
            f"top token ggml's {same:.0%}"
        )


if __name__ == "__main__":
    main()
