"""Needle in a haystack with KV Flash's pool: recall of a fact placed at 10 depths of a long
prompt, with the full cache and with pools of each size and ranking.

    python tools/niah_kvpool.py [--model GGUF] [--tokens 8000] [--pools 1024,2048]
        [--needles 3] [--threads N] [--out niah.json]

The haystack is the docstrings of Python's standard library modules (nothing is downloaded);
the needle says "The secret code of the vault is <word>-<number>." and the question, at the end
in the model's chat template, asks for it. A run recalls the needle when the greedy answer (24
tokens) holds its number. Each depth has ``--needles`` needles (other words and numbers).
Prints a markdown table (rows: cache; columns: depth) and writes the runs as JSON.
"""

from __future__ import annotations

import argparse
import importlib
import json
import random
import time

import numpy as np

from lucepy.catalog import smollm2_file
from lucepy.cli import chat_prompt
from lucepy.runtime.config import RuntimeConfig
from lucepy.runtime.engine import Engine
from lucepy.runtime.tokenizer import Tokenizer

MODULES = (
    "argparse asyncio collections contextlib csv dataclasses datetime decimal difflib email "
    "enum fractions functools heapq http.client inspect io itertools json logging mailbox "
    "math multiprocessing os pathlib pickle random re shutil socket sqlite3 statistics string "
    "subprocess tarfile tempfile textwrap threading typing unittest urllib.request uuid zipfile"
).split()
WORDS = ("amber", "cobalt", "falcon", "harbor", "juniper", "lantern", "meadow", "orchid", "quartz")
QUESTION = "What is the secret code of the vault? Answer with the code only."
DEPTHS = [i / 9 for i in range(10)]  # 0 %, 11 %, ..., 100 % of the haystack


def haystack_sentences() -> list[str]:
    text = []
    for name in MODULES:
        doc = importlib.import_module(name).__doc__ or ""
        text += [s.strip() + "." for s in " ".join(doc.split()).split(". ") if len(s) > 20]
    return text


def prompt_tokens(tok: Tokenizer, sentences, n_tokens: int, depth: float, needle: str):
    """Chat-template tokens: about ``n_tokens`` of haystack with ``needle`` at ``depth``."""
    lengths = [len(tok.encode(s + " ")) for s in sentences]
    body, total, i = [], 0, 0
    while total < n_tokens:
        body.append(sentences[i % len(sentences)])
        total += lengths[i % len(sentences)]
        i += 1
    body.insert(round(depth * len(body)), needle)
    text = " ".join(body) + "\n\n" + QUESTION
    return tok.encode(chat_prompt(tok, text, None))


def answer(engine: Engine, tokens: list[int], n: int = 24) -> list[int]:
    engine.reset()
    logits = engine.prefill(tokens)
    out = []
    for _ in range(n):
        t = int(np.argmax(logits))
        if t == engine.tokenizer.eos:
            break
        out.append(t)
        logits = engine.decode(t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a GGUF (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--tokens", type=int, default=8000, help="haystack tokens")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--pools", default="1024,2048")
    ap.add_argument("--needles", type=int, default=3, help="needles per depth")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="niah.json")
    a = ap.parse_args()
    model = a.model or str(smollm2_file())
    rng = random.Random(0)
    needles = [
        (f"{rng.choice(WORDS)}-{rng.randrange(1000, 9999)}", d)
        for d in DEPTHS
        for _ in range(a.needles)
    ]
    caches = [("full", 0, "lru")]
    for pool in (int(p) for p in a.pools.split(",")):
        caches += [(f"pool {pool} {rank}", pool, rank) for rank in ("lru", "qk")]
    sentences = haystack_sentences()
    runs = []
    for name, pool, rank in caches:
        cfg = RuntimeConfig(max_ctx=a.ctx, threads=a.threads, kv_pool=pool, kv_pool_rank=rank)
        with Engine(model, cfg) as engine:
            tok = engine.tokenizer
            for code, depth in needles:
                needle = f"The secret code of the vault is {code}."
                tokens = prompt_tokens(tok, sentences, a.tokens, depth, needle)
                t0 = time.perf_counter()
                text = tok.decode(answer(engine, tokens))
                hit = code.split("-")[1] in text
                runs.append(
                    {
                        "cache": name,
                        "depth": round(depth, 3),
                        "code": code,
                        "prompt_tokens": len(tokens),
                        "answer": text,
                        "recalled": hit,
                        "seconds": round(time.perf_counter() - t0, 2),
                        "pool": engine.pool_report(),
                    }
                )
                print(
                    f"{name:16} depth {depth:4.0%} {code:14} {'hit ' if hit else 'miss'} {text!r}"
                )
    with open(a.out, "w") as f:
        json.dump(runs, f, indent=1)
    head = "| cache | " + " | ".join(f"{d:.0%}" for d in DEPTHS) + " | all |"
    print(head + "\n|" + "---|" * (len(DEPTHS) + 2))
    for name, _, _ in caches:
        mine = [r for r in runs if r["cache"] == name]
        cells = []
        for d in DEPTHS:
            at = [r["recalled"] for r in mine if r["depth"] == round(d, 3)]
            cells.append(f"{sum(at)}/{len(at)}")
        print(
            f"| {name} | "
            + " | ".join(cells)
            + f" | {sum(r['recalled'] for r in mine)}/{len(mine)} |"
        )


if __name__ == "__main__":
    main()
