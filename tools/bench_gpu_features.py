"""DFlash and prefix-cache figures on one GPU, for the 27B-shaped model of tools/gpu_run.sh.

    python tools/bench_gpu_features.py MODEL [--device cuda:0] [--out results.json]

A random 1-layer DFlash draft (hidden 5120, block 16, the real draft's target layers) accepts
nothing, so this measures what each speculative step costs on the GPU, not what a trained draft
gains. The prefix cache part times the first token of a 2048-token prompt: cold, RAM, disk.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from lucepy.decode.ar import generate
from lucepy.engine import open_engine
from lucepy.gguf import GGUFFile
from lucepy.models import architecture_for
from lucepy.runtime.config import RuntimeConfig
from lucepy.testing.tiny import Qwen35Spec
from lucepy.testing.tiny_draft import write_dflash

TARGET_LAYERS = (2, 17, 32, 47, 62)  # MODELS.md: HF ids 1, 16, 31, 46, 61, stored +1


def params(model: Path):
    with GGUFFile(model) as f:
        return architecture_for(f).from_gguf(f).p


def draft_for(model: Path, out: Path) -> Path:
    p = params(model)
    layers = (
        TARGET_LAYERS if p.n_layer == 64 else tuple(1 + i * (p.n_layer - 2) // 4 for i in range(5))
    )
    target = Qwen35Spec(n_embd=p.n_embd, n_vocab=p.n_vocab)
    return write_dflash(
        out,
        target,
        n_head=32,
        n_head_kv=8,
        head_dim=128,
        n_ff=4096,
        target_layers=layers,
        block_size=16,
    )


def dflash(model: Path, draft: Path, device: str) -> dict:
    prompt = np.random.default_rng(0).integers(0, params(model).n_vocab, 256).tolist()
    out = {}
    for label, d in (("plain", None), ("draft", draft)):
        cfg = RuntimeConfig(device=device, max_ctx=1024, draft=str(d) if d else None)
        with open_engine(model, cfg, tokenizer=False) as engine:
            gen = [generate(engine, prompt, 128) for _ in range(2)][-1]
        out[label] = {
            "decode_tok_s": gen.timings.decode_tok_s,
            "accept": gen.accept.to_dict() if gen.accept else None,
        }
    return out


def ttft(model: Path, device: str, tmp: Path) -> dict:
    prompt = np.random.default_rng(1).integers(0, params(model).n_vocab, 2048).tolist()
    cfg = RuntimeConfig(
        device=device,
        max_ctx=2304,
        prefix_cache_slots=2,
        kv_cache_dir=str(tmp / "kv"),
        disk_prefix_cache="full",
    )
    with open_engine(model, cfg, tokenizer=False) as engine:
        generate(engine, prompt[64:128], 1)  # graphs and CUDA warm-up; not a prefix of prompt
        cold, ram = generate(engine, prompt, 1), generate(engine, prompt, 1)
    with open_engine(model, cfg, tokenizer=False) as engine:
        disk = generate(engine, prompt, 1)
    return {
        k: {"ttft_ms": g.timings.prefill_ms, **g.cache}
        for k, g in (("cold", cold), ("ram", ram), ("disk", disk))
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        draft = draft_for(args.model, Path(tmp) / "draft.gguf")
        result = {
            "dflash": dflash(args.model, draft, args.device),
            "ttft": ttft(args.model, args.device, Path(tmp)),
        }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
