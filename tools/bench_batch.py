"""Many clients at once: `lucepy serve --parallel N` through the official `openai` client against
`llama-server -np N` (the same clients) and llama.cpp's batched decoding (llama-batched-bench) of
the same GGUF, in one run.

    python3 tools/bench_batch.py [--model M.gguf] [--device cpu|cuda:0] [--clients 1,4,8,32]
        [--tokens 256] [--threads T] [--llama-server BIN] [--llama-batched-bench BIN]
        [--json OUT] [--md OUT]

llama-server: built from the pinned source (its tools/server, target llama-server, same CMake
flags as the build lucepy loads), ``-np N -c N*max_ctx -fa on``, the same N clients and prompts.

lucepy: `lucepy serve --parallel N` in its own process (N = clients; 1: the one-at-a-time
worker), N clients here started together, each streaming a completion of exactly ``--tokens``
tokens (``ignore_eos``, greedy) after a held-out chat prompt (tools/dflash_prompts.json,
cycled).
Aggregate: all completion tokens over the wall time from the first request to the last token;
time to first token: the median over clients. Each level runs ``--repeats`` times (3), each run a
fresh server (no cache carried over) after a warm-up request, lucepy's and llama-server's runs
taking turns; the table gives the medians of the runs (all samples in the JSON).
"engine": the same requests on a ``Batcher`` in this process, with no server, as often
(``--no-engine`` leaves it out).

llama.cpp: llama-batched-bench, built from the pinned source against the same build,
``-npp P -ntg TOKENS -npl N`` with P the mean prompt length: N
sequences prefilled together, then decoded together. Its aggregate: (N x TOKENS) over its
prefill plus decode time, and its decode-only rate. The methods differ: lucepy's clients join a
running server through HTTP and its prompts are fed a chunk per step between decode steps.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

from lucepy.catalog import smollm2_file
from lucepy.decode.batch import Batcher
from lucepy.engine import Engine
from lucepy.runtime.config import RuntimeConfig

PROMPTS = Path(__file__).with_name("dflash_prompts.json")
# the warm-up's prompt: no measured prompt starts with it, so no side gets a cache hit from it
WARM_UP = list(range(100, 116))


def one_client(client, prompt: list[int], n: int) -> dict:
    t0 = time.perf_counter()
    first, tokens = None, 0
    stream = client.completions.create(
        model="m", prompt=prompt, max_tokens=n, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    pieces = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            first = first or time.perf_counter()
            pieces += 1
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    tokens = tokens or pieces  # a server that sends no usage: one piece a token
    end = time.perf_counter()
    return {"t0": t0, "first": first or end, "end": end, "tokens": tokens}


@contextlib.contextmanager
def lucepy_serve(args, n: int):
    """`lucepy serve MODEL --parallel N` in its own process, as a user runs it; yields its URL."""
    cmd = [sys.executable, "-m", "lucepy", "serve", str(args.model), "--port", "0",
           "--device", args.device, "--max-ctx", str(args.max_ctx),
           "--parallel", str(n)]  # fmt: skip
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        seen = []
        while line := proc.stderr.readline():
            seen.append(line)
            found = re.search(r"serving \S+ on (http://\S+)", line)
            if found:
                break
        else:
            raise SystemExit("lucepy serve exited before serving:\n" + "".join(seen))
        threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep the pipe drained
        yield found.group(1)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextlib.contextmanager
def llama_serve(args, n: int):
    """llama-server of the same build with ``-np N``, each slot ``--max-ctx`` positions."""
    port = 18000 + n
    cmd = [args.llama_server, "-m", str(args.model), "--port", str(port), "-np", str(n),
           "-c", str(n * args.max_ctx), "-fa", "on", "--no-webui"]  # fmt: skip
    if args.threads:
        cmd += ["-t", str(args.threads)]
    if args.device != "cpu":
        cmd += ["-ngl", "99"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            with contextlib.suppress(OSError, ValueError):
                with urllib.request.urlopen(url + "/health", timeout=1) as r:
                    if r.status == 200:
                        break
            if proc.poll() is not None:
                raise SystemExit(f"llama-server exited ({proc.returncode}): {' '.join(cmd)}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def lucepy_level(args, prompts, n: int) -> dict:
    return server_level(lucepy_serve(args, n), prompts, n, args.tokens)


def server_level(serving, prompts, n: int, tokens_each: int) -> dict:
    with (
        serving as url,
        openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0) as client,
    ):
        one_client(client, WARM_UP, 8)  # warm-up: graphs built
        with ThreadPoolExecutor(n) as pool:
            runs = list(
                pool.map(lambda i: one_client(client, prompts[i % len(prompts)], tokens_each),
                         range(n))
            )  # fmt: skip
    tokens = sum(r["tokens"] for r in runs)
    wall = max(r["end"] for r in runs) - min(r["t0"] for r in runs)
    ttft = statistics.median(r["first"] - r["t0"] for r in runs)
    return {"tok_s": round(tokens / wall, 2), "ttft_ms": round(ttft * 1e3, 1), "tokens": tokens}


def engine_level(args, prompts, n: int) -> dict:
    """The same requests on a Batcher with no server: what the engine does, as
    llama-batched-bench measures llama.cpp (no HTTP, no client in this process)."""
    cfg = RuntimeConfig(
        device=args.device, threads=args.threads, max_ctx=args.max_ctx, parallel=max(n, 2)
    )
    with Engine(args.model, cfg, tokenizer=False) as engine:
        batcher = Batcher(engine)
        batcher.submit(WARM_UP, 8, stop_at_end=False)
        batcher.run()  # warm-up
        t0 = time.perf_counter()
        reqs = [
            batcher.submit(prompts[i % len(prompts)], args.tokens, stop_at_end=False)
            for i in range(n)
        ]
        batcher.run()
        wall = time.perf_counter() - t0
    return {"tok_s": round(n * args.tokens / wall, 2),
            "ttft_ms": round(statistics.median(r.t_first - t0 for r in reqs) * 1e3, 1)}  # fmt: skip


def llama_level(args, prompt_len: int, n: int) -> dict:
    cmd = [
        args.llama_batched_bench, "-m", str(args.model), "-c", str(n * (prompt_len + args.tokens)),
        "-b", "2048", "-ub", "512", "-npp", str(prompt_len), "-ntg", str(args.tokens),
        "-npl", str(n), "-fa", "on", "--output-format", "jsonl",
    ]  # fmt: skip
    if args.threads:
        cmd += ["-t", str(args.threads)]
    if args.device != "cpu":
        cmd += ["-ngl", "99"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    row = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    total_s = row["t_pp"] + row["t_tg"]
    return {
        "tok_s": round(n * args.tokens / total_s, 2),
        "decode_tok_s": round(row["speed_tg"], 2),
        "prefill_s": round(row["t_pp"], 3),
    }


def markdown(res: dict) -> str:
    lines = [
        f"Medians of {res['repeats']} runs per level and side, each on a fresh server.",
        "",
        "| clients | lucepy server tok/s | TTFT ms | lucepy engine tok/s | TTFT ms "
        "| llama.cpp tok/s | server / llama.cpp | engine / llama.cpp "
        "| llama.cpp decode-only tok/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for n, r in res["levels"].items():
        lu, en, ll = r["lucepy"], r.get("engine"), r.get("llama.cpp")
        ratios = [f"{x['tok_s'] / ll['tok_s']:.2f}x" if ll and x else "" for x in (lu, en)]
        engine = f"{en['tok_s']:.1f} | {en['ttft_ms']:.0f}" if en else " | "
        lines.append(
            f"| {n} | {lu['tok_s']:.1f} | {lu['ttft_ms']:.0f} | {engine} | "
            f"{ll['tok_s'] if ll else ''} | {ratios[0]} | {ratios[1]} | "
            f"{ll['decode_tok_s'] if ll else ''} |"
        )
    if any("llama-server" in r for r in res["levels"].values()):
        lines += [
            "",
            "| clients | lucepy server tok/s | TTFT ms | llama-server -np N tok/s | TTFT ms "
            "| lucepy / llama-server |",
            "|---|---|---|---|---|---|",
        ]
        for n, r in res["levels"].items():
            lu, ls = r["lucepy"], r["llama-server"]
            lines.append(
                f"| {n} | {lu['tok_s']:.1f} | {lu['ttft_ms']:.0f} | {ls['tok_s']:.1f} | "
                f"{ls['ttft_ms']:.0f} | {lu['tok_s'] / ls['tok_s']:.2f}x |"
            )
    return "\n".join(lines) + "\n"


def median_of(runs: list[dict]) -> dict:
    """The median aggregate and time to first token of several runs of one level, and the runs."""
    out = {key: statistics.median(r[key] for r in runs) for key in runs[0] if key != "tokens"}
    return {**out, "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--clients", default="1,4,8,32")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3, help="runs per level and side (medians)")
    ap.add_argument("--max-ctx", type=int, default=1024, help="positions per sequence")
    ap.add_argument("--llama-batched-bench", help="llama-batched-bench of the same build")
    ap.add_argument("--llama-server", help="llama-server of the same build")
    ap.add_argument("--no-engine", action="store_true", help="leave out the engine side")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--md", type=Path)
    args = ap.parse_args()
    args.model = args.model or Path(smollm2_file())
    prompts = json.loads(PROMPTS.read_text())["heldout"]
    prompt_len = round(statistics.mean(len(p) for p in prompts))
    res: dict = {"model": str(args.model), "device": args.device, "tokens": args.tokens,
                 "repeats": args.repeats, "prompt_len_mean": prompt_len, "levels": {}}  # fmt: skip
    for n in (int(x) for x in args.clients.split(",")):
        sides: dict[str, list] = {}
        for _ in range(args.repeats):  # the sides take turns, so that drift touches both
            sides.setdefault("lucepy", []).append(lucepy_level(args, prompts, n))
            if args.llama_server:
                run = server_level(llama_serve(args, n), prompts, n, args.tokens)
                sides.setdefault("llama-server", []).append(run)
            if not args.no_engine:
                sides.setdefault("engine", []).append(engine_level(args, prompts, n))
            if args.llama_batched_bench:
                sides.setdefault("llama.cpp", []).append(llama_level(args, prompt_len, n))
        level = {side: median_of(runs) for side, runs in sides.items()}
        res["levels"][n] = level
        print(n, json.dumps({k: {m: v[m] for m in v if m != "runs"} for k, v in level.items()}),
              flush=True)  # fmt: skip
        if args.json:
            args.json.write_text(json.dumps(res, indent=1) + "\n")
    table = markdown(res)
    print(table)
    if args.md:
        args.md.write_text(table)


if __name__ == "__main__":
    main()
