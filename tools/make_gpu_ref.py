"""llama.cpp reference logits for the GPU tests, computed here with llama-cpp-python's CPU build,
for the byte-identical tiny models the tests generate there (keyed by the GGUF identity).

    python tools/make_gpu_ref.py .gpuref      # then carry .gpuref; tests read LUCEPY_GPU_REF

On the H200, llama-cpp-python 0.3.36 over the CUDA build's libllama segfaults for these prompts
(GPU and CPU paths alike; docs/BENCHMARKS.md), so the reference is made where it runs.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

import numpy as np  # noqa: E402
from conftest import HPARAMS  # noqa: E402
from test_reference import CHUNK, N_GEN, prompt  # noqa: E402

from lucepy.gguf import GGUFFile  # noqa: E402
from lucepy.testing.tiny import write_dequantized_twin, write_qwen35  # noqa: E402


def reference(path: Path, tokens: list[int], dst: Path, force=None) -> dict:
    cmd = [
        sys.executable,
        str(ROOT / "tests" / "llama_ref.py"),
        str(path),
        str(CHUNK),
        str(N_GEN),
        str(tokens),
        str(dst),
    ]
    if force is not None:
        cmd += ["--force", str([int(t) for t in force])]
    subprocess.run(cmd, check=True)
    return dict(np.load(dst))


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name, hp in HPARAMS.items():
            for wtype in ("f32", "q8_0"):
                path = write_qwen35(Path(tmp) / f"{name}-{wtype}.gguf", weight_type=wtype, **hp)
                with GGUFFile(path) as f:
                    ident, n_vocab = f.identity(), len(f.get("tokenizer.ggml.tokens"))
                tokens = prompt(n_vocab)
                ref = reference(path, tokens, Path(tmp) / "ref.npz")
                if wtype != "f32":  # the exact math of the same rounded weights, same tokens
                    twin = write_dequantized_twin(Path(tmp) / "twin.gguf", weight_type=wtype, **hp)
                    exact = reference(twin, tokens, Path(tmp) / "exact.npz", ref["tokens"])
                    ref.update(prompt_exact=exact["prompt"], steps_exact=exact["steps"])
                np.savez(out / f"{ident}.npz", **ref)
                print(f"{name}-{wtype}: {ident[:16]}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else ".gpuref"))
