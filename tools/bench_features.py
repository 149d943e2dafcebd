"""CPU benchmarks of the split, DFlash and prefix-cache features, in one run, as markdown.

    python tools/bench_features.py [--threads 2] [--out results.md]

Writes its models into a temp dir: the ~100M qwen35 bench preset (q8_0), a random DFlash draft
for it, and the tiny favoured target/draft pair of the tests (a draft that agrees often).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from lucepy.decode.ar import generate
from lucepy.engine import open_engine
from lucepy.runtime.config import RuntimeConfig
from lucepy.testing.tiny import bench_spec, write_qwen35
from lucepy.testing.tiny_draft import write_agreeing_pair, write_dflash


def median_ms(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def decode_rate(path, cfg, prompt, n=64) -> float:
    with open_engine(path, cfg, tokenizer=False) as e:
        gen = [generate(e, prompt, n) for _ in range(3)][-1]
        return gen.timings.decode_tok_s


def split_rows(model, threads) -> list[str]:
    prompt = list(range(1, 257))
    rows, base = [], None
    for devices in ("cpu", "cpu,cpu", "cpu,cpu@worker"):
        cfg = RuntimeConfig(device=devices, threads=threads, max_ctx=512)
        rate = decode_rate(model, cfg, prompt)
        base = base or rate
        rows.append(f"| {devices} | {rate:.1f} | {rate / base:.2f}× |")
    return rows


def draft_rows(pairs, threads) -> list[str]:
    rows = []
    for label, target, draft in pairs:
        prompt = list(range(3, 60))
        plain = RuntimeConfig(threads=threads, max_ctx=512)
        spec = RuntimeConfig(threads=threads, max_ctx=512, draft=str(draft))
        base = decode_rate(target, plain, prompt, 128)
        with open_engine(target, spec, tokenizer=False) as e:
            gen = [generate(e, prompt, 128) for _ in range(3)][-1]
        tau = gen.accept.mean_len
        rows.append(
            f"| {label} | {base:.1f} | {gen.timings.decode_tok_s:.1f} | "
            f"{gen.timings.decode_tok_s / base:.2f}× | {tau:.2f} |"
        )
    return rows


def verify_row(model, threads) -> str:
    cfg = RuntimeConfig(threads=threads, max_ctx=1024)
    with open_engine(model, cfg, tokenizer=False) as e:
        e.reset()
        e.prefill(list(range(1, 513)))
        block = list(range(600, 616))

        def verify():
            e.verify(block, greedy=True)
            e.rollback(1)
            e.n_past -= 1

        def decode():
            e.decode(5)
            e.n_past -= 1

        v, d = median_ms(verify, 9), median_ms(decode, 9)
    return (
        f"| 16-token verify + rollback | {v:.2f} ms | 1-token decode | {d:.2f} ms | {v / d:.2f}× |"
    )


def ttft_rows(model, threads, tmp: Path) -> list[str]:
    prompt = np.random.default_rng(0).integers(0, 8000, 2048).tolist()
    cache = dict(prefix_cache_slots=2, kv_cache_dir=str(tmp / "kv"), disk_prefix_cache="full")
    cfg = RuntimeConfig(threads=threads, max_ctx=2304, **cache)
    out = []
    with open_engine(model, cfg, tokenizer=False) as e:
        cold = generate(e, prompt, 1)
        ram = generate(e, prompt, 1)
    with open_engine(model, cfg, tokenizer=False) as e:
        disk = generate(e, prompt, 1)
    for label, gen in (("cold", cold), ("RAM hit", ram), ("disk hit", disk)):
        c = gen.cache
        out.append(
            f"| {label} | {gen.timings.prefill_ms:.1f} ms | {c['hit']} | "
            f"{c['restored_tokens']} | {c['prefilled_tokens']} |"
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        spec = bench_spec(weight_type="q8_0")
        model = write_qwen35(d / "bench.gguf", spec)
        rand = write_dflash(
            d / "rand.gguf",
            spec,
            n_head=8,
            n_head_kv=2,
            head_dim=64,
            n_ff=1024,
            target_layers=(1, 6, 11),
            block_size=16,
        )
        tiny, agree = write_agreeing_pair(d)
        drafts = draft_rows(
            [
                ("bench 106M q8_0 / random 1-layer draft", model, rand),
                ("tiny favoured / agreeing draft", tiny, agree),
            ],
            args.threads,
        )
        lines = [
            "### DFlash (greedy, 128 generated)",
            "",
            "| target / draft | plain tok/s | with draft tok/s | ratio | tau |",
            "|---|---|---|---|---|",
            *drafts,
            "",
            "### Verify cost (bench model, context 512)",
            "",
            "| | | | | ratio |",
            "|---|---|---|---|---|",
            verify_row(model, args.threads),
            "",
            "### Time to first token, 2048-token prompt (bench model)",
            "",
            "| case | TTFT | hit | restored | prefilled |",
            "|---|---|---|---|---|",
            *ttft_rows(model, args.threads, d),
            "",
            "### Split (decode tok/s, 256-token prompt, 64 generated)",
            "",
            "| devices | decode tok/s | vs unsplit |",
            "|---|---|---|",
            *split_rows(model, args.threads),
        ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
