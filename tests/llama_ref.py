"""llama.cpp (llama-cpp-python) in a process of its own: the prompt's logits at every position,
then a greedy continuation with the logits of each step. The GPU tests use it so that libllama's
CUDA context and lucepy's never share a process.

    python tests/llama_ref.py MODEL CHUNK N_GEN TOKENS_JSON OUT.npz [--gpu] [--force TOKENS_JSON]
        [--n-ctx N] [--no-fa]
"""

from __future__ import annotations

import json
import sys

import numpy as np


def main(
    model: str,
    chunk: int,
    n_gen: int,
    tokens: list[int],
    out: str,
    gpu: bool,
    force: list[int] | None = None,
    n_ctx: int = 256,
    flash_attn: bool = True,
) -> None:
    """``force``: feed these tokens after the prompt instead of the greedy ones."""
    import llama_cpp

    # one eval call per CHUNK tokens: llama.cpp processes each call as one batch
    llm = llama_cpp.Llama(
        model_path=model,
        n_ctx=n_ctx,
        n_gpu_layers=-1 if gpu else 0,
        logits_all=True,
        flash_attn=flash_attn,
        verbose=False,
    )
    for start in range(0, len(tokens), chunk):
        llm.eval(tokens[start : start + chunk])
    prompt = np.array(llm.scores[: len(tokens)], dtype=np.float32)
    last, steps, greedy = prompt[-1], [], []
    for _ in range(n_gen):
        greedy.append(int(np.argmax(last)) if force is None else force[len(greedy)])
        steps.append(last)
        llm.eval([greedy[-1]])
        last = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
    np.savez(out, prompt=prompt, steps=np.array(steps), tokens=np.array(greedy))


if __name__ == "__main__":
    a = sys.argv[1:]
    forced = json.loads(a[a.index("--force") + 1]) if "--force" in a else None
    n_ctx = int(a[a.index("--n-ctx") + 1]) if "--n-ctx" in a else 256
    main(
        a[0],
        int(a[1]),
        int(a[2]),
        json.loads(a[3]),
        a[4],
        "--gpu" in a,
        forced,
        n_ctx,
        "--no-fa" not in a,
    )
