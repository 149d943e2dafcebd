"""llama.cpp reference logits for the GPU tests, computed here with llama-cpp-python's CPU build,
for the byte-identical tiny models the tests generate there (keyed by the GGUF identity).

    python tools/make_gpu_ref.py .gpuref            # here; tools/prepare_gpu_carry.sh runs it
    python tools/make_gpu_ref.py --check .gpuref    # there; tools/gpu_run.sh runs it first

On the H200, llama-cpp-python 0.3.36 over the CUDA build's libllama segfaults for these prompts
(GPU and CPU paths alike; docs/BENCHMARKS.md), so the reference is made where it runs.
``manifest.json``, written last, records what each reference was made for (the model's GGUF
identity, the prompt, CHUNK and N_GEN). ``--check`` writes the tiny models again (under a second,
no llama.cpp needed) and compares, so a reference gone stale fails before the GPU tests run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

import numpy as np  # noqa: E402
from conftest import HPARAMS  # noqa: E402
from test_gpu import GEMMA4, GEMMA4_CTX, PARITY, REPACKED, gemma4_prompt  # noqa: E402
from test_reference import CHUNK, N_GEN, prompt  # noqa: E402

from lucepy.gguf import GGUFFile  # noqa: E402
from lucepy.testing.tiny import write_dequantized_twin, write_qwen35  # noqa: E402

MANIFEST = "manifest.json"
FIX = (
    "on the CPU machine, run tools/prepare_gpu_carry.sh (or just python tools/make_gpu_ref.py "
    '.gpuref), then carry [".whl", ".sdist", ".gpuref"]'
)


class Model(NamedTuple):
    label: str
    path: Path
    tokens: list[int]
    n_ctx: int
    flash_attn: bool
    twin: Callable[[Path], Path] | None  # writes the f32 twin of a quantized model


def tiny_models(tmp: Path) -> Iterator[Model]:
    """Each model the GPU tests compare with llama.cpp: the tiny qwen35 models they write
    (conftest.py), and the converter-made gemma4 fixture."""
    for name, wtype in [*PARITY, *REPACKED]:
        hp = HPARAMS[name]
        path = write_qwen35(tmp / f"{name}-{wtype}.gguf", weight_type=wtype, **hp)
        with GGUFFile(path) as f:
            tokens = prompt(len(f.get("tokenizer.ggml.tokens")))
        twin = None
        if wtype != "f32":

            def twin(dst: Path, wtype=wtype, hp=hp) -> Path:
                return write_dequantized_twin(dst, weight_type=wtype, **hp)

        yield Model(f"{name}-{wtype}", path, tokens, 256, True, twin)
    with GGUFFile(GEMMA4) as f:
        tokens = gemma4_prompt(len(f.get("tokenizer.ggml.tokens")))
    yield Model("gemma4-f32", GEMMA4, tokens, GEMMA4_CTX, False, None)


def made_for(model: Model) -> dict:
    """What a reference is valid for: its manifest entry."""
    with GGUFFile(model.path) as f:
        ident = f.identity()
    digest = hashlib.sha256(json.dumps(model.tokens).encode()).hexdigest()[:16]
    return {
        "identity": ident, "prompt_sha256": digest, "chunk": CHUNK, "n_gen": N_GEN,
        "n_ctx": model.n_ctx, "flash_attn": model.flash_attn,
    }  # fmt: skip


def reference(path: Path, model: Model, dst: Path, force=None) -> dict:
    cmd = [
        sys.executable,
        str(ROOT / "tests" / "llama_ref.py"),
        str(path),
        str(CHUNK),
        str(N_GEN),
        str(model.tokens),
        str(dst),
        "--n-ctx",
        str(model.n_ctx),
        *([] if model.flash_attn else ["--no-fa"]),
    ]
    if force is not None:
        cmd += ["--force", str([int(t) for t in force])]
    subprocess.run(cmd, check=True)
    return dict(np.load(dst))


def make(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)  # a run cut short leaves no manifest: --check fails
    manifest = {}
    with tempfile.TemporaryDirectory() as tmp:
        for model in tiny_models(Path(tmp)):
            manifest[model.label] = made_for(model)
            ref = reference(model.path, model, Path(tmp) / "ref.npz")
            if model.twin is not None:  # the exact math of the same rounded weights, same tokens
                twin = model.twin(Path(tmp) / "twin.gguf")
                exact = reference(twin, model, Path(tmp) / "exact.npz", ref["tokens"])
                ref.update(prompt_exact=exact["prompt"], steps_exact=exact["steps"])
            ident = manifest[model.label]["identity"]
            np.savez(out / f"{ident}.npz", **ref)
            print(f"{model.label}: {ident[:16]}")
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def problems(out: Path) -> list[str]:
    """Why ``out`` lacks a reference the GPU tests will look for; empty when it has them all."""
    if not (out / MANIFEST).is_file():
        return [f"no {out / MANIFEST} (never made, or made by a run cut short)"]
    manifest = json.loads((out / MANIFEST).read_text())
    found = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in tiny_models(Path(tmp)):
            want, had = made_for(model), manifest.get(model.label, {})
            changed = [k for k in want if had.get(k) != want[k]]
            if changed:
                found.append(
                    f"{model.label}: made for another {' and '.join(changed)} than the tests'"
                )
            elif not (out / f"{want['identity']}.npz").is_file():
                found.append(f"{model.label}: {want['identity']}.npz is missing")
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tools/make_gpu_ref.py", description=__doc__)
    ap.add_argument("out", nargs="?", default=".gpuref", type=Path)
    ap.add_argument("--check", action="store_true", help="compare with the tests' models only")
    args = ap.parse_args(argv)
    if not args.check:
        make(args.out)
        return 0
    found = problems(args.out)
    for p in found:
        print(f"{args.out}: stale or incomplete: {p}", file=sys.stderr)
    if found:
        print(f"to make it again: {FIX}", file=sys.stderr)
        return 1
    print(f"{args.out}: current for all {len(PARITY) + len(REPACKED) + 1} tiny models")
    return 0


if __name__ == "__main__":
    sys.exit(main())
