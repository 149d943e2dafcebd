"""lucepy's side of the GPU benchmark (tools/gpu_run.sh), through the Engine API, and the report
that sets it beside llama-bench's JSON from the same ggml build, model and GPU.

    python tools/bench_gpu.py measure MODEL --device cuda:0 --json lucepy.json
    python tools/bench_gpu.py report lucepy.json --llama-bench llama.json --md bench.md

``measure`` writes its JSON after every figure, so a run cut short keeps what it measured. Figures
follow llama-bench: prefill in chunks of 512 (its default ubatch) from an empty context; decode of
fixed random tokens (no sampling), at an empty context and after ``--depth`` tokens; each is the
median of ``--repeats`` runs after a warm-up. ``verify`` is the 16-token forward of a DFlash
step (``Engine.verify`` then ``rollback``), set against one decode step at the same depth, one
that reads the logits back and a greedy one (``Engine.decode_greedy``: its argmax alone, as the
verify reads its rows'), all timed in turn (``in_turn``).
``report`` sets medians beside medians: llama-bench's is taken from its per-repetition
``samples_ns``, never from its mean ``avg_ts``, which a slow first repetition pulls down.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np

from lucepy.decode.verify_len import median_s
from lucepy.runtime.config import RuntimeConfig
from lucepy.runtime.engine import Engine

CHUNK = 512
PREFILL_LENS = (512, 4096)
DECODE_TOKENS = 128
VERIFY_BLOCK = 16


def verify_step(engine: Engine, block: list[int]) -> None:
    """A DFlash step's verify of ``block`` and its rollback, keeping one token (the position
    creeps by one a call), as every benchmark of the verify times it."""
    engine.verify(block, greedy=True)
    engine.rollback(1)


def in_turn(engine: Engine, block: list[int], rounds: int) -> dict[str, float]:
    """``verify_step`` of ``block`` with its rollback left running (a GPU shard's
    ``async_rollback``: it ends under the next call's host work, as in a DFlash loop) and then
    waited for, a decode step (the logits read back) and a greedy one (its argmax alone, as a
    verify reads its rows'): one of each a round, in that order (so the decode steps hold no
    rollback), ``rounds`` rounds after one of warm-up. The median seconds of each: "left",
    "waited", "decode", "greedy"."""
    defaults = [shard.async_rollback for shard in engine.shards]

    def verify(waited: bool) -> None:
        for shard, left in zip(engine.shards, defaults, strict=True):
            shard.async_rollback = left and not waited
        verify_step(engine, block)

    steps: dict[str, Callable[[], object]] = {
        "left": lambda: verify(False),
        "waited": lambda: verify(True),
        "decode": lambda: engine.decode(block[0]),
        "greedy": lambda: engine.decode_greedy(block[0]),
    }
    times: dict[str, list[float]] = {key: [] for key in steps}
    try:
        for r in range(rounds + 1):
            for key, run in steps.items():
                t0 = time.perf_counter()
                run()
                if r > 0:
                    times[key].append(time.perf_counter() - t0)
    finally:
        engine.pipeline.settle()
        for shard, left in zip(engine.shards, defaults, strict=True):
            shard.async_rollback = left
    return {key: statistics.median(t) for key, t in times.items()}


class Bench:
    def __init__(self, engine: Engine, repeats: int, out: Path):
        self.engine, self.repeats, self.out = engine, repeats, out
        self.rng = np.random.default_rng(0)
        self.results: dict = {"chunk": CHUNK, "repeats": repeats}

    def tokens(self, n: int) -> list[int]:
        return self.rng.integers(0, self.engine.params.n_vocab, n).tolist()

    def record(self, key: str, value: dict) -> None:
        self.results[key] = value
        self.out.write_text(json.dumps(self.results, indent=1))
        print(f"{key}: {json.dumps(value)}", flush=True)

    def prefill(self, n: int) -> None:
        tokens = self.tokens(n)

        def run():
            self.engine.reset()
            self.engine.prefill(tokens, chunk=CHUNK)

        s = median_s(run, self.repeats)
        self.record(
            f"pp{n}", {"tokens": n, "depth": 0, "ms": 1e3 * s, "tok_s": n / s, **self.graphs()}
        )

    def graphs(self) -> dict:
        """The first shard's graph cache: what it holds, and how many it has freed so far."""
        cache = self.engine.shards[0].graphs
        sizes = [g.nbytes / 2**20 for g in cache.values()]
        return {
            "graphs": len(sizes),
            "graph_mib_max": max(sizes, default=0),
            "evicted": cache.evicted,
        }

    def decode(self, depth: int) -> None:
        """``DECODE_TOKENS`` decode steps from the current position (which must be ``depth``).
        At depth 0 each run starts from an empty cache, as llama-bench's do."""
        engine = self.engine
        tokens = self.tokens(DECODE_TOKENS)
        for t in tokens[:8]:  # warm-up: the decode graph of this window
            engine.decode(t)
        rates = []
        for _ in range(self.repeats):
            if depth == 0:
                engine.reset()
            t0 = time.perf_counter()
            for t in tokens:
                engine.decode(t)
            rates.append(DECODE_TOKENS / (time.perf_counter() - t0))
        tok_s = statistics.median(rates)
        self.record(
            f"tg{DECODE_TOKENS}@d{depth}",
            {"tokens": DECODE_TOKENS, "depth": depth, "tok_s": tok_s, "ms_per_token": 1e3 / tok_s},
        )

    def verify(self, depth: int) -> None:
        """A 16-token verify forward (its rollback left running, and waited for) and the two
        kinds of decode step, in turn from the current position."""
        block = self.tokens(VERIFY_BLOCK)
        med = in_turn(self.engine, block, max(self.repeats, 5))
        self.record(
            f"verify{VERIFY_BLOCK}@d{depth}",
            {
                "tokens": VERIFY_BLOCK,
                "depth": depth,
                "verify_ms": 1e3 * med["left"],
                "verify_waited_ms": 1e3 * med["waited"],
                "decode_ms": 1e3 * med["decode"],
                "ratio": med["left"] / med["decode"],
                "greedy_decode_ms": 1e3 * med["greedy"],
                "greedy_ratio": med["left"] / med["greedy"],
            },
        )

    def fill(self, depth: int) -> None:
        """Reset and prefill ``depth`` tokens (timed once: a long prefill of its own)."""
        self.engine.reset()
        t0 = time.perf_counter()
        self.engine.prefill(self.tokens(depth), chunk=CHUNK)
        s = time.perf_counter() - t0
        self.record(
            f"fill{depth}", {"tokens": depth, "ms": 1e3 * s, "tok_s": depth / s, **self.graphs()}
        )


def plan(bench: Bench, depth: int) -> list[tuple[str, Callable[[], object]]]:
    """The figures in order; those after ``fill`` run at ``depth`` and need it to have run."""
    engine = bench.engine
    return [
        *((f"pp{n}", lambda n=n: bench.prefill(n)) for n in PREFILL_LENS),
        ("tg@d0", lambda: (engine.reset(), bench.decode(0))),
        ("verify@d0", lambda: (engine.reset(), bench.verify(0))),
        ("fill", lambda: bench.fill(depth)),
        (f"tg@d{depth}", lambda: bench.decode(depth)),
        (f"verify@d{depth}", lambda: bench.verify(depth)),
    ]


def measure(args: argparse.Namespace) -> int:
    max_ctx = max(args.depth, *PREFILL_LENS) + 1024  # + decode runs and creeping verifies
    cfg = RuntimeConfig(device=args.device, max_ctx=max_ctx, chunk=CHUNK)
    t0 = time.perf_counter()
    failed = []
    with Engine(args.model, cfg, tokenizer=False) as engine:
        bench = Bench(engine, args.repeats, Path(args.json))
        load_s = time.perf_counter() - t0
        bench.record("setup", {"model": str(args.model), "device": args.device, "load_s": load_s})
        for name, run in plan(bench, args.depth):
            if "fill" in failed and name.endswith(f"@d{args.depth}"):
                continue
            try:
                run()
            except Exception as err:  # one broken figure must not cost the others
                failed.append(name)
                bench.record(f"error {name}", {"error": f"{type(err).__name__}: {err}"})
                engine.reset()
    return 1 if failed else 0


# --- the report: lucepy beside llama-bench ---


class Sampled(NamedTuple):
    tok_s: float  # the median over llama-bench's repetitions
    n: int  # how many repetitions


def llama_median(e: dict) -> Sampled | None:
    """The median of llama-bench's per-repetition samples, like lucepy's figures: its mean
    (``avg_ts``) is pulled down by a first repetition that is often slow, so it is never used."""
    tokens = int(e.get("n_prompt", 0)) + int(e.get("n_gen", 0))
    if e.get("samples_ns"):  # times, as lucepy takes the median of times
        return Sampled(tokens * 1e9 / statistics.median(e["samples_ns"]), len(e["samples_ns"]))
    if e.get("samples_ts"):
        return Sampled(statistics.median(e["samples_ts"]), len(e["samples_ts"]))
    return None


def llama_rows(paths: list[str]) -> tuple[dict[tuple[str, int], Sampled], list[str]]:
    """llama-bench JSON entries as {(test, depth): median}, e.g. ("pp512", 0), and the entries
    left out for want of samples."""
    rows, missing = {}, []
    for path in paths:
        for e in json.loads(Path(path).read_text() or "[]"):
            test = f"pp{e['n_prompt']}" if e.get("n_gen", 0) == 0 else f"tg{e['n_gen']}"
            key = (test, int(e.get("n_depth", 0)))
            if (got := llama_median(e)) is None:
                missing.append(f"{test} @ d{key[1]} in {path}")
            else:
                rows[key] = got
    return rows, missing


def _row(name: str, ours: float | None, ref: float | None, unit: str) -> str:
    def cell(x):
        return "—" if x is None else f"{x:,.1f}"

    better = None
    if ours and ref:
        better = ours / ref if unit == "tok/s" else ref / ours
    ratio = "—" if better is None else f"{better:.2f}×"
    return f"| {name} | {cell(ref)} | {cell(ours)} | {unit} | {ratio} |"


def report_lines(ours: dict, llama: dict[tuple[str, int], Sampled], depth: int) -> list[str]:
    ref = {key: got.tok_s for key, got in llama.items()}
    lines = [
        "| test | llama.cpp | lucepy | unit | lucepy/llama.cpp speed |",
        "|---|---|---|---|---|",
    ]
    for n in PREFILL_LENS:
        lines.append(
            _row(f"pp{n}", ours.get(f"pp{n}", {}).get("tok_s"), ref.get((f"pp{n}", 0)), "tok/s")
        )
    for d in (0, depth):
        got = ours.get(f"tg{DECODE_TOKENS}@d{d}", {}).get("tok_s")
        lines.append(
            _row(f"tg{DECODE_TOKENS} @ d{d}", got, ref.get((f"tg{DECODE_TOKENS}", d)), "tok/s")
        )
    for d in (0, depth):
        v = ours.get(f"verify{VERIFY_BLOCK}@d{d}", {})
        pp16 = ref.get((f"pp{VERIFY_BLOCK}", d))
        ref_ms = 1e3 * VERIFY_BLOCK / pp16 if pp16 else None
        lines.append(_row(f"16-token forward @ d{d}", v.get("verify_ms"), ref_ms, "ms"))
        tg = ref.get((f"tg{DECODE_TOKENS}", d))
        lines.append(
            _row(f"1-token decode @ d{d}", v.get("decode_ms"), 1e3 / tg if tg else None, "ms")
        )
        lines.append(
            _row(
                f"1-token greedy decode (argmax read) @ d{d}",
                v.get("greedy_decode_ms"),
                1e3 / tg if tg else None,
                "ms",
            )
        )
    for d in (0, depth):
        v = ours.get(f"verify{VERIFY_BLOCK}@d{d}", {})
        if "ratio" in v:
            greedy = v.get("greedy_ratio")
            lines.append(
                f"\nlucepy's {VERIFY_BLOCK}-token verify at d{d}: {v['ratio']:.2f} decode steps, "
                + (f"{greedy:.2f} greedy decode steps" if greedy else "no greedy step timed")
            )
    return lines


def report(args: argparse.Namespace) -> int:
    ours = json.loads(Path(args.lucepy).read_text()) if Path(args.lucepy).exists() else {}
    ref, missing = llama_rows([p for p in args.llama_bench if Path(p).exists()])
    setup = ours.get("setup", {})
    fill = ours.get(f"fill{args.depth}", {}).get("tok_s", float("nan"))
    counts = "/".join(str(n) for n in sorted({got.n for got in ref.values()})) or "?"
    lines = [
        f"# GPU benchmark: {setup.get('model', '?')} on {setup.get('device', '?')}",
        "",
        *report_lines(ours, ref, args.depth),
        "",
        f"Medians on both sides: lucepy's of {ours.get('repeats', '?')} timed runs, llama.cpp's of "
        f"its {counts} samples per test (llama-bench's samples_ns; its mean, avg_ts, is not "
        "used: its first repetition is often slow).",
        "",
        f"lucepy: load {setup.get('load_s', float('nan')):.1f} s, prefill of {args.depth} tokens "
        f"{fill:,.0f} tok/s. llama.cpp's 16-token forward is its pp16 at that depth, its decode "
        "step 1 / tg128.",
        *(f"- lucepy {k}: {v['error']}" for k, v in ours.items() if k.startswith("error")),
        *(f"- llama.cpp {m}: no samples_ns or samples_ts, left out" for m in missing),
    ]
    text = "\n".join(lines) + "\n"
    if args.md:
        Path(args.md).write_text(text)
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tools/bench_gpu.py", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="time lucepy on one device")
    m.add_argument("model")
    m.add_argument("--device", default="cuda:0")
    m.add_argument("--json", required=True, help="results, rewritten after every figure")
    m.add_argument("--depth", type=int, default=8192)
    m.add_argument("--repeats", type=int, default=3)
    r = sub.add_parser("report", help="lucepy beside llama-bench, as markdown")
    r.add_argument("lucepy", help="measure's JSON")
    r.add_argument("--llama-bench", nargs="*", default=[], help="llama-bench -o json outputs")
    r.add_argument("--md", help="write the markdown here too")
    r.add_argument("--depth", type=int, default=8192)
    args = ap.parse_args(argv)
    return measure(args) if args.cmd == "measure" else report(args)


if __name__ == "__main__":
    sys.exit(main())
