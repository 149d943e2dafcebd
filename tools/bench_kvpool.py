"""KV Flash on a GPU (issue 14): decode speed and GPU memory at long depths, with a KV pool of a
few thousand tokens, with the full cache, and llama-bench's on the same build, model and GPU.

    python tools/bench_kvpool.py measure MODEL --llama-bench BUILD/llama-bench --json kv.json
    python tools/bench_kvpool.py report kv.json --md kv.md

``measure`` goes depth by depth (8k, 32k, 128k by default) and, at each, runs three processes one
after the other: llama-bench (``-p 0 -n 128 -d DEPTH -r 3``, flash attention, all layers on the
GPU), lucepy with the full cache, lucepy with ``--kv-pool``. lucepy's runs prefill DEPTH random
tokens in steps of 512 (the pool pages chunks out as it goes), decode 8 tokens as a warm-up, then
time 3 runs of 128 decode steps; its figure is their median, llama.cpp's the median of its 3
``samples_ns``. lucepy's runs continue one sequence, so they start at DEPTH + 8, + 136 and + 264
(llama-bench restores its state to DEPTH before each run). GPU memory is the peak of the GPU's
``memory.used`` (nvidia-smi, every 100 ms) while each process ran, less what was used before it
started: the same measure for both. lucepy also reads the device's free memory after its runs.
The JSON is rewritten after every process, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from bench_gpu import llama_median  # tools/, beside this script

CHUNK = 512
DECODE_TOKENS = 128
WARMUP_TOKENS = 8
REPEATS = 3


class PeakMemory:
    """The peak of one GPU's ``memory.used`` (MiB) while the block runs, sampled by nvidia-smi."""

    def __init__(self, gpu: int):
        self.gpu, self.samples = gpu, []

    def _query(self) -> int:
        out = subprocess.run(
            [
                "nvidia-smi",
                f"--id={self.gpu}",
                "--query-gpu=memory.used",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        return int(out.stdout.split()[0])

    def __enter__(self) -> PeakMemory:
        self.before = self._query()
        self.proc = subprocess.Popen(
            [
                "nvidia-smi",
                f"--id={self.gpu}",
                "--query-gpu=memory.used",
                "--format=csv,noheader,nounits",
                "-lms",
                "100",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        return self

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.strip().isdigit():
                self.samples.append(int(line))

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait()
        self.reader.join(timeout=5)

    @property
    def peak_mib(self) -> int | None:
        return max(self.samples) - self.before if self.samples else None


# --- one lucepy process: prefill to a depth, then time decode ---


def lucepy_run(args: argparse.Namespace) -> int:
    from lucepy.ggml import ffi
    from lucepy.runtime.config import RuntimeConfig
    from lucepy.runtime.devices import find_device
    from lucepy.runtime.engine import Engine

    cfg = RuntimeConfig(
        device=args.device, max_ctx=args.depth + 512, chunk=CHUNK, kv_pool=args.pool
    )
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    with Engine(args.model, cfg, tokenizer=False) as engine:
        load_s = time.perf_counter() - t0
        n_vocab = engine.params.n_vocab
        t0 = time.perf_counter()
        engine.prefill(rng.integers(0, n_vocab, args.depth).tolist(), chunk=CHUNK)
        fill_s = time.perf_counter() - t0
        tokens = rng.integers(0, n_vocab, DECODE_TOKENS).tolist()
        for t in tokens[:WARMUP_TOKENS]:
            engine.decode(t)
        rates = []
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            for t in tokens:
                engine.decode(t)
            rates.append(DECODE_TOKENS / (time.perf_counter() - t0))
        free, total = ffi.new("size_t *"), ffi.new("size_t *")
        engine.lib.ggml_backend_dev_memory(find_device(engine.lib, args.device), free, total)
        result = {
            "depth": args.depth,
            "pool": args.pool,
            "load_s": load_s,
            "fill_tok_s": args.depth / fill_s,
            "tg_tok_s": statistics.median(rates),
            "tg_runs": rates,
            "device_used_mib": (total[0] - free[0]) / 2**20,
            "pager": engine.pool_report(),
            "graphs": [
                {"kept": len(s.graphs), "bytes": s.graphs.nbytes, "evicted": s.graphs.evicted}
                for s in engine.shards
            ],
        }
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(json.dumps(result), flush=True)
    return 0


# --- the whole comparison ---


class Measure:
    def __init__(self, args: argparse.Namespace):
        self.args, self.out = args, Path(args.json)
        self.results: dict = {"model": args.model, "pool": args.pool, "rows": []}

    def save(self, row: dict) -> None:
        self.results["rows"].append(row)
        self.out.write_text(json.dumps(self.results, indent=1))
        print(json.dumps(row), flush=True)

    def child(self, what: str, depth: int, cmd: list[str], result: Path | None) -> None:
        t0 = time.perf_counter()
        with PeakMemory(self.args.gpu) as mem:
            proc = subprocess.run(cmd, capture_output=True, text=True)
        row = {
            "what": what,
            "depth": depth,
            "peak_mib": mem.peak_mib,
            "wall_s": time.perf_counter() - t0,
            "rc": proc.returncode,
        }
        if proc.returncode:
            row["error"] = (proc.stderr or proc.stdout)[-2000:]
        elif result is None:  # llama-bench: its JSON on stdout
            row["llama_bench"] = json.loads(proc.stdout)
        else:
            row["lucepy"] = json.loads(result.read_text())
        self.save(row)

    def run(self) -> int:
        args = self.args
        tmp = Path(tempfile.mkdtemp()) / "lucepy.json"  # OUTDIR holds only what is kept
        for depth in args.depths:
            self.child(
                "llama.cpp",
                depth,
                [
                    args.llama_bench,
                    "-m",
                    args.model,
                    "-ngl",
                    "99",
                    "-fa",
                    "1",
                    "-p",
                    "0",
                    "-n",
                    str(DECODE_TOKENS),
                    "-d",
                    str(depth),
                    "-r",
                    str(REPEATS),
                    "-o",
                    "json",
                ],
                None,
            )
            for what, pool in (("full", 0), ("pool", args.pool)):
                self.child(
                    what,
                    depth,
                    [
                        sys.executable,
                        __file__,
                        "lucepy",
                        args.model,
                        "--device",
                        args.device,
                        "--depth",
                        str(depth),
                        "--pool",
                        str(pool),
                        "--json",
                        str(tmp),
                    ],
                    tmp,
                )
        return 1 if any(r["rc"] for r in self.results["rows"]) else 0


# --- the report ---


def llama_tg(row: dict) -> float | None:
    """llama-bench's decode figure: the median of its samples (never its mean, avg_ts)."""
    for e in row.get("llama_bench", []):
        if e.get("n_gen") and (got := llama_median(e)) is not None:
            return got.tok_s
    return None


def report(args: argparse.Namespace) -> int:
    data = json.loads(Path(args.json).read_text())
    rows: dict[int, dict[str, dict]] = {}  # depth -> "llama.cpp", "full" or "pool" -> row
    for r in data["rows"]:
        rows.setdefault(r["depth"], {})[r["what"]] = r
    lines = [
        f"| depth | llama.cpp tok/s | lucepy full tok/s | lucepy pool {data['pool']} tok/s | "
        "pool / llama.cpp | pool / full | GPU MiB llama.cpp / full / pool |",
        "|---|---|---|---|---|---|---|",
    ]

    def tok_s(r: dict | None) -> float | None:
        if r is None or r.get("rc"):
            return None
        return llama_tg(r) if "llama_bench" in r else r["lucepy"]["tg_tok_s"]

    def cell(x: float | None, fmt: str = "{:,.1f}") -> str:
        return "—" if x is None else fmt.format(x)

    for depth in sorted(rows):
        got = rows[depth]
        ref, full, pool = (got.get(k) for k in ("llama.cpp", "full", "pool"))
        a, b, c = tok_s(ref), tok_s(full), tok_s(pool)
        mem = " / ".join(cell(r and r.get("peak_mib"), "{:,}") for r in (ref, full, pool))
        lines.append(
            f"| {depth:,} | {cell(a)} | {cell(b)} | {cell(c)} | "
            f"{cell(c / a if a and c else None, '{:.2f}×')} | "
            f"{cell(c / b if b and c else None, '{:.2f}×')} | {mem} |"
        )
    pools = [tok_s(g.get("pool")) for _, g in sorted(rows.items())]
    if len(pools) > 1 and all(pools):
        lines += [
            "",
            f"Pool decode, deepest against shallowest: {pools[-1] / pools[0]:.3f}× "
            "(goal: within ±10 %).",
        ]
    for depth, got in sorted(rows.items()):
        for what, r in got.items():
            if r.get("rc"):
                lines.append(f"- {what} at {depth:,}: failed: {r.get('error', '')[-300:]}")
            elif "lucepy" in r:
                lu = r["lucepy"]
                runs = ", ".join(f"{x:.1f}" for x in lu["tg_runs"])
                lines.append(
                    f"- lucepy {what} at {depth:,}: prefill {lu['fill_tok_s']:,.0f} tok/s, "
                    f"decode runs {runs} tok/s, device used "
                    f"{lu['device_used_mib']:,.0f} MiB, graphs {json.dumps(lu.get('graphs'))}, "
                    f"pager {json.dumps(lu['pager'])}"
                )
    text = "\n".join(lines) + "\n"
    if args.md:
        Path(args.md).write_text(text)
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="tools/bench_kvpool.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="llama-bench, lucepy full and lucepy pool, depth by depth")
    m.add_argument("model")
    m.add_argument("--llama-bench", required=True, help="the llama-bench of the same ggml build")
    m.add_argument("--json", required=True, help="results, rewritten after every process")
    m.add_argument(
        "--depths", type=lambda s: [int(x) for x in s.split(",")], default=[8192, 32768, 131072]
    )
    m.add_argument("--pool", type=int, default=4096)
    m.add_argument("--device", default="cuda:0")
    m.add_argument(
        "--gpu",
        type=int,
        default=int(os.environ.get("GPU_INDEX", "0")),
        help="nvidia-smi's index of that GPU",
    )
    one = sub.add_parser("lucepy", help="one lucepy process (measure runs it)")
    one.add_argument("model")
    one.add_argument("--device", default="cuda:0")
    one.add_argument("--depth", type=int, required=True)
    one.add_argument("--pool", type=int, default=0)
    one.add_argument("--json", required=True)
    r = sub.add_parser("report", help="the table, as markdown")
    r.add_argument("json")
    r.add_argument("--md")
    args = ap.parse_args(argv)
    if args.cmd == "measure":
        return Measure(args).run()
    return lucepy_run(args) if args.cmd == "lucepy" else report(args)


if __name__ == "__main__":
    sys.exit(main())
