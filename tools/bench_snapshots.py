"""What disk prefix snapshots cost a long prompt: prefill time, files and bytes per policy.

    python tools/bench_snapshots.py MODEL [--tokens 4000] [--policies off,full,16] [--repeats 3]

Each policy gets its own engine; every timed run starts from an empty cache directory, so each
one prefills the whole prompt and writes everything its policy writes. Prints one markdown row a
policy: the median time, its ratio to ``off``, the files and bytes written, with the bytes as a
ratio to ``full`` (one snapshot of the whole prompt), and the time to serve the prompt plus one
token from what was written (one run; RAM slots are off, so it reads the disk).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from lucepy.cache.disk import SUFFIX, DiskCache
from lucepy.engine import open_engine
from lucepy.runtime.config import RuntimeConfig


def run(model: Path, policy: str, prompt: list[int], repeats: int, threads: int) -> dict:
    work = Path(tempfile.mkdtemp(prefix="lucepy-snap-"))
    cfg = RuntimeConfig(
        threads=threads,
        max_ctx=len(prompt) + 64,
        kv_cache_dir=str(work),
        disk_prefix_cache=policy,
        prefix_cache_slots=0,
    )
    times, files = [], []
    try:
        with open_engine(model, cfg, tokenizer=False) as engine:
            for i in range(repeats + 1):  # the first run warms up
                shutil.rmtree(work)
                work.mkdir()
                cache = engine.prefix_cache
                if cache is not None:
                    cache.disk = DiskCache(work, cache.disk.fingerprint, cache.disk.budget)
                t0 = time.perf_counter()
                if cache is None:
                    engine.reset()
                    engine.prefill(prompt)
                else:
                    cache.start(prompt, None)
                if i:
                    times.append(time.perf_counter() - t0)
                    files = sorted(work.glob(f"*{SUFFIX}"))
            growth = engine.state_growth()
            hit = None
            if engine.prefix_cache is not None:  # a resent, one token longer prompt
                engine.prefix_cache.forget()
                t0 = time.perf_counter()
                engine.prefix_cache.start([*prompt, 5], None)
                hit = time.perf_counter() - t0
        return {
            "hit": hit,
            "s": statistics.median(times),
            "files": len(files),
            "bytes": sum(p.stat().st_size for p in files),
            "growth": growth,
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--policies", default="off,full,16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 300, args.tokens)]
    results = {
        p: run(args.model, p, prompt, args.repeats, args.threads) for p in args.policies.split(",")
    }
    per_row, whole = next(iter(results.values()))["growth"]
    print(
        f"{args.model.name}: {args.tokens} tokens; state grows {per_row} B a token, {whole} B whole"
    )
    print("| policy | prefill s (median) | x off | files | bytes | x full | restore + 1 token |")
    print("|---|---|---|---|---|---|---|")
    off = results.get("off", {}).get("s")
    full = results.get("full", {}).get("bytes")
    for policy, r in results.items():
        x_off = f"{r['s'] / off:.2f}" if off else "-"
        x_full = f"{r['bytes'] / full:.2f}" if full and r["bytes"] else "-"
        hit = f"{r['hit'] * 1e3:.1f} ms" if r["hit"] is not None else "-"
        row = f"| {policy} | {r['s']:.3f} | {x_off} | {r['files']} | {r['bytes']:,} | {x_full}"
        print(f"{row} | {hit} |")


if __name__ == "__main__":
    main()
