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
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

import numpy as np  # noqa: E402
from conftest import HPARAMS  # noqa: E402
from test_reference import CHUNK, N_GEN, prompt  # noqa: E402

from lucepy.gguf import GGUFFile  # noqa: E402
from lucepy.testing.tiny import write_dequantized_twin, write_qwen35  # noqa: E402

MANIFEST = "manifest.json"
WEIGHT_TYPES = ("f32", "q8_0")  # tests/test_gpu.py's parametrization
FIX = (
    "on the CPU machine, run tools/prepare_gpu_carry.sh (or just python tools/make_gpu_ref.py "
    '.gpuref), then carry [".whl", ".sdist", ".gpuref"]'
)


def tiny_models(tmp: Path) -> Iterator[tuple[str, dict, str, Path]]:
    """(label, hparams, weight type, path) of each model the GPU tests write (conftest.py)."""
    for name, hp in HPARAMS.items():
        for wtype in WEIGHT_TYPES:
            path = write_qwen35(tmp / f"{name}-{wtype}.gguf", weight_type=wtype, **hp)
            yield f"{name}-{wtype}", hp, wtype, path


def made_for(path: Path) -> tuple[dict, list[int]]:
    """What a reference is valid for (its manifest entry), and the test's prompt for ``path``."""
    with GGUFFile(path) as f:
        ident, n_vocab = f.identity(), len(f.get("tokenizer.ggml.tokens"))
    tokens = prompt(n_vocab)
    digest = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]
    return {"identity": ident, "prompt_sha256": digest, "chunk": CHUNK, "n_gen": N_GEN}, tokens


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


def make(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)  # a run cut short leaves no manifest: --check fails
    manifest = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, hp, wtype, path in tiny_models(Path(tmp)):
            manifest[label], tokens = made_for(path)
            ref = reference(path, tokens, Path(tmp) / "ref.npz")
            if wtype != "f32":  # the exact math of the same rounded weights, same tokens
                twin = write_dequantized_twin(Path(tmp) / "twin.gguf", weight_type=wtype, **hp)
                exact = reference(twin, tokens, Path(tmp) / "exact.npz", ref["tokens"])
                ref.update(prompt_exact=exact["prompt"], steps_exact=exact["steps"])
            np.savez(out / f"{manifest[label]['identity']}.npz", **ref)
            print(f"{label}: {manifest[label]['identity'][:16]}")
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def problems(out: Path) -> list[str]:
    """Why ``out`` lacks a reference the GPU tests will look for; empty when it has them all."""
    if not (out / MANIFEST).is_file():
        return [f"no {out / MANIFEST} (never made, or made by a run cut short)"]
    manifest = json.loads((out / MANIFEST).read_text())
    found = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, *_, path in tiny_models(Path(tmp)):
            want, _ = made_for(path)
            had = manifest.get(label, {})
            changed = [k for k in want if had.get(k) != want[k]]
            if changed:
                found.append(f"{label}: made for another {' and '.join(changed)} than the tests'")
            elif not (out / f"{want['identity']}.npz").is_file():
                found.append(f"{label}: {want['identity']}.npz is missing")
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
    print(f"{args.out}: current for all {len(HPARAMS) * len(WEIGHT_TYPES)} tiny models")
    return 0


if __name__ == "__main__":
    sys.exit(main())
