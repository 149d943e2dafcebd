"""lucepy's side of the MoE GPU benchmark (tools/gpu_run.sh with GPU_RUN_ARCH=qwen35moe), and the
report that sets it beside llama-bench's JSON from the same build, model and GPU.

    python tools/bench_moe.py measure MODEL --n-cpu-moe 20 --threads 8 --json lucepy.json
    python tools/bench_moe.py report lucepy.json --llama-bench all.json ncmoe.json --md moe.md

``measure`` loads each placement on its own:

1. every expert on the GPU: pp512 and tg128, as tools/bench_gpu.py measures them. Its routing
   counts (every token of those runs) become the hotness profile; then again without counting;
2. every layer split, with only its k least chosen experts in host RAM. With (1) and (3) this
   fits what a split layer costs a token and what one expert read from host RAM costs, and so
   the split cost in reads that the hotness placement weighs (``experts.SPLIT_COST``);
3. ``--n-cpu-moe N`` (all experts of the first N layers in host RAM, llama.cpp's placement) and
   hotness (the same bytes of experts on the GPU, placed by ``--moe-gpu-mb``), each with its cold
   experts computed by the CPU and read by the GPU from pinned host RAM (``--cold-experts
   device``), loaded together and their decodes taken in turns; pp512 of the hotness placement
   read by the GPU.

(2) and (3) measure tg128 only: their prompt processing runs the cold experts on the CPU, where
llama.cpp copies them to the GPU for big batches. Medians of ``--repeats`` runs after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from bench_gpu import llama_median, median_s  # tools/, beside this script

from lucepy.gguf import GGUFFile
from lucepy.runtime import experts
from lucepy.runtime.config import RuntimeConfig
from lucepy.runtime.engine import Engine

CHUNK, PROMPT, DECODE = 512, 512, 128


def measure_one(
    path: str, cfg: RuntimeConfig, repeats: int, prefill: bool,
    placement: experts.ExpertPlacement | None = None,
) -> tuple[dict, Engine]:  # fmt: skip
    """Figures of one placement (``placement``: this one, not the one ``cfg`` asks for); the
    engine is returned open (the caller reads its counts)."""
    t0 = time.perf_counter()
    chosen = experts.placement_for
    if placement is not None:
        experts.placement_for = lambda f, params, config: placement
    try:
        engine = Engine(path, cfg, tokenizer=False)
    finally:
        experts.placement_for = chosen
    out: dict = {"load_s": time.perf_counter() - t0}
    placed = engine.plan.experts
    out["policy"] = placed.policy if placed is not None else "all on the device"
    if placed is not None and placed.reads:
        out["policy"] += ", cold experts read by the device"
    if placed is None:  # all on the device: every layer's experts
        n_expert = engine.params.n_expert
        layers = experts.expert_layers(engine.file, engine.params.n_layer)
        device, host = sum(experts.expert_bytes(engine.file, il) for il in layers) * n_expert, 0
    else:
        device, host = placed.bytes()
        out["split_layers"] = len(placed.hot)
    out["expert_bytes_device"], out["expert_bytes_host"] = device, host
    out["weight_bytes_device"] = sum(s.weight_bytes for s in engine.shards)
    if prefill:
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, engine.params.n_vocab, PROMPT).tolist()

        def pp():
            engine.reset()
            engine.prefill(tokens, chunk=CHUNK)

        s = median_s(pp, repeats)
        out[f"pp{PROMPT}"] = {"ms": 1e3 * s, "tok_s": PROMPT / s}
    if repeats:
        out[f"tg{DECODE}"] = tg_only(engine, repeats)
    return out, engine


def measure(args: argparse.Namespace) -> int:
    out_path = Path(args.json)
    results: dict = {"model": args.model, "device": args.device, "threads": args.threads}
    profile = out_path.with_suffix(".profile.npz")
    base = {"device": args.device, "threads": args.threads, "max_ctx": 2048, "chunk": CHUNK}

    def save(key: str, value: dict) -> None:
        results[key] = value
        out_path.write_text(json.dumps(results, indent=1))
        print(f"{key}: {json.dumps(value)}", flush=True)

    figures, engine = measure_one(args.model, RuntimeConfig(**base), args.repeats, True)
    with engine:
        counts = engine.pipeline.expert_counts.counts.copy()
    np.savez(profile, counts=counts)
    figures["profile_tokens"] = int(counts.sum() // (counts.shape[0] * engine.params.n_expert_used))
    figures["profile_top10pct_share"] = experts.skew(counts)
    save("all_on_device", figures)

    base["count_experts"] = False  # the rest time the forward alone: no routing output
    figures, engine = measure_one(args.model, RuntimeConfig(**base), args.repeats, False)
    engine.close()
    save("all_on_device_uncounted", figures)

    # every layer split, its k least chosen experts in host RAM: the split's own cost
    with GGUFFile(args.model) as f:
        params = engine.params
        layers = experts.expert_layers(f, params.n_layer)
        k, X = params.n_expert_used, params.n_expert
        keep, reads = {}, []
        for il in layers:
            order, cost, _ = experts.layer_options(counts[il], k, 1)
            keep[il] = tuple(sorted(int(e) for e in order[: X - k]))
            reads.append(cost[X - k] - experts.SPLIT_COST)
        sizes = {il: experts.expert_bytes(f, il) for il in layers}
    forced = experts.ExpertPlacement("every layer split, k cold", X, keep, sizes, k)
    figures, engine = measure_one(args.model, RuntimeConfig(**base, n_cpu_moe=1), args.repeats,
                                  False, placement=forced)  # fmt: skip
    engine.close()
    figures["host_reads_per_layer"] = float(np.mean(reads))
    save("split_every_layer", figures)

    # --n-cpu-moe and hotness at the same bytes on the GPU, both loaded, their decodes taken in
    # turns: the host's memory bandwidth drifts by 10-20 % within a minute on these machines
    cfg = RuntimeConfig(**base, n_cpu_moe=args.n_cpu_moe)
    ncm, ncm_engine = measure_one(args.model, cfg, 0, False)
    budget_mb = ncm["expert_bytes_device"] / 2**20
    cfg = RuntimeConfig(**base, moe_device_mb=budget_mb, expert_profile=str(profile))
    hot, hot_engine = measure_one(args.model, cfg, 0, False)
    hot["split_cost"] = experts.SPLIT_COST
    read = {"cold_experts": "device"}
    ncm_read, ncm_read_engine = measure_one(
        args.model, RuntimeConfig(**base, n_cpu_moe=args.n_cpu_moe, **read), 0, False
    )
    cfg = RuntimeConfig(**base, moe_device_mb=budget_mb, expert_profile=str(profile), **read)
    hot_read, hot_read_engine = measure_one(args.model, cfg, args.repeats, True)
    placed = {"n_cpu_moe": (ncm, ncm_engine), "hotness": (hot, hot_engine),
              "n_cpu_moe_read": (ncm_read, ncm_read_engine),
              "hotness_read": (hot_read, hot_read_engine)}  # fmt: skip
    with ncm_engine, hot_engine, ncm_read_engine, hot_read_engine:
        rates: dict = {key: [] for key in placed}
        for _ in range(args.repeats):
            for key, (_, engine) in placed.items():
                rates[key] += tg_only(engine, 1)["runs"]
    for key, (figures, _) in placed.items():
        figures[f"tg{DECODE}"] = {"tok_s": statistics.median(rates[key]), "runs": rates[key]}
        save(key, figures)
    save("split_cost_fit", split_cost_fit(results, len(layers), k, args.n_cpu_moe))
    return 0


def split_cost_fit(results: dict, n_layers: int, k: int, n_cpu_moe: int) -> dict:
    """A split layer's fixed cost ``s`` and one host expert read's ``c`` (ms a token), from
    three decodes: all on the device, ``--n-cpu-moe`` (``n_cpu_moe`` layers of k reads each)
    and every layer split with few reads (``host_reads_per_layer``)."""
    try:
        base = 1e3 / results["all_on_device_uncounted"]["tg128"]["tok_s"]
        ncm = 1e3 / results["n_cpu_moe"]["tg128"]["tok_s"]
        split = results["split_every_layer"]
        every = 1e3 / split["tg128"]["tok_s"]
    except KeyError:
        return {}
    few = split["host_reads_per_layer"]
    a = (ncm - base) / n_cpu_moe  # s + k c
    b = (every - base) / n_layers  # s + few*c
    c = (a - b) / (k - few)
    s = a - k * c
    return {"split_ms": s, "read_ms": c, "split_cost": s / c if c > 0 else None}


def tg_only(engine: Engine, repeats: int) -> dict:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, engine.params.n_vocab, DECODE + 1).tolist()

    def tg():
        engine.reset()
        engine.prefill(tokens[:1])
        t0 = time.perf_counter()
        for t in tokens[1:]:
            engine.decode(t)
        return DECODE / (time.perf_counter() - t0)

    tg()
    rates = [tg() for _ in range(repeats)]
    return {"tok_s": statistics.median(rates), "runs": rates}


def llama_entries(paths: list[str]) -> dict[tuple[str, int], float]:
    """{(test, n_cpu_moe): median tok/s} from llama-bench's per-repetition samples."""
    rows = {}
    for path in paths:
        if not Path(path).exists():
            continue
        for e in json.loads(Path(path).read_text() or "[]"):
            test = f"pp{e['n_prompt']}" if e.get("n_gen", 0) == 0 else f"tg{e['n_gen']}"
            if (got := llama_median(e)) is not None:
                rows[(test, int(e.get("n_cpu_moe", 0)))] = got.tok_s
    return rows


def report(args: argparse.Namespace) -> int:
    ours = json.loads(Path(args.lucepy).read_text()) if Path(args.lucepy).exists() else {}
    ref = llama_entries(args.llama_bench)
    n = args.n_cpu_moe
    allg, ncm, hot = (ours.get(k, {}) for k in ("all_on_device", "n_cpu_moe", "hotness"))

    def tok_s(d: dict, key: str) -> float | None:
        return d.get(key, {}).get("tok_s")

    def ratio(a, b) -> str:
        return f"{a / b:.2f}×" if a and b else "—"

    def cell(x) -> str:
        return "—" if x is None else f"{x:,.1f}"

    def gib(x) -> str:
        return "—" if x is None else f"{x / 2**30:.2f} GiB"

    llama_ncmoe = ref.get((f"tg{DECODE}", n))
    bare = ours.get("all_on_device_uncounted", {})
    fit = ours.get("split_cost_fit", {})
    extra = [
        ("hotness_read", "lucepy hotness, its cold experts read by the GPU from pinned host RAM "
         f"(--cold-experts device), vs llama.cpp --n-cpu-moe {n}"),
        ("n_cpu_moe_read", f"lucepy --n-cpu-moe {n}, read by the GPU, vs llama.cpp's"),
        ("split_every_layer", "lucepy, every layer split, its k least chosen experts in RAM"),
    ]  # fmt: skip
    lines = [
        f"# MoE GPU benchmark: {ours.get('model', '?')} on {ours.get('device', '?')}, "
        f"{ours.get('threads', '?')} CPU threads",
        "",
        "| test | llama.cpp | lucepy | unit | lucepy / llama.cpp |",
        "|---|---|---|---|---|",
        f"| pp{PROMPT}, all experts on the GPU | {cell(ref.get((f'pp{PROMPT}', 0)))} | "
        f"{cell(tok_s(allg, f'pp{PROMPT}'))} | tok/s | "
        f"{ratio(tok_s(allg, f'pp{PROMPT}'), ref.get((f'pp{PROMPT}', 0)))} |",
        f"| tg{DECODE}, all experts on the GPU | {cell(ref.get((f'tg{DECODE}', 0)))} | "
        f"{cell(tok_s(allg, f'tg{DECODE}'))} | tok/s | "
        f"{ratio(tok_s(allg, f'tg{DECODE}'), ref.get((f'tg{DECODE}', 0)))} |",
        f"| tg{DECODE}, all on the GPU, no routing counted | {cell(ref.get((f'tg{DECODE}', 0)))} "
        f"| {cell(tok_s(bare, f'tg{DECODE}'))} | tok/s | "
        f"{ratio(tok_s(bare, f'tg{DECODE}'), ref.get((f'tg{DECODE}', 0)))} |",
        f"| tg{DECODE}, --n-cpu-moe {n} on both sides | {cell(llama_ncmoe)} | "
        f"{cell(tok_s(ncm, f'tg{DECODE}'))} | tok/s | "
        f"{ratio(tok_s(ncm, f'tg{DECODE}'), llama_ncmoe)} |",
        f"| tg{DECODE}, lucepy hotness vs llama.cpp --n-cpu-moe {n} (same expert bytes on the "
        f"GPU) | {cell(llama_ncmoe)} | {cell(tok_s(hot, f'tg{DECODE}'))} | tok/s | "
        f"**{ratio(tok_s(hot, f'tg{DECODE}'), llama_ncmoe)}** |",
        *(
            f"| tg{DECODE}, {what} | {cell(llama_ncmoe)} | {cell(tok_s(ours[key], f'tg{DECODE}'))}"
            f" | tok/s | {ratio(tok_s(ours[key], f'tg{DECODE}'), llama_ncmoe)} |"
            for key, what in extra
            if key in ours
        ),
        "",
        "| lucepy placement | experts on the GPU | experts in host RAM | weights on the GPU |",
        "|---|---|---|---|",
        *(
            f"| {d.get('policy', '?')} | {gib(d.get('expert_bytes_device'))} | "
            f"{gib(d.get('expert_bytes_host'))} | {gib(d.get('weight_bytes_device'))} |"
            for d in (allg, ncm, hot, ours.get("hotness_read"), ours.get("split_every_layer"))
            if d
        ),
        "",
        f"The hotness profile: routing counts of the all-on-GPU runs, "
        f"{allg.get('profile_tokens', '?')} tokens a layer; the top 10 % of each layer's experts "
        f"took {100 * allg.get('profile_top10pct_share', float('nan')):.1f} % of the choices.",
        "llama.cpp's --n-cpu-moe keeps the same experts in host RAM as lucepy's, so its GPU "
        "holds the same bytes. Medians on both sides (llama-bench's samples_ns).",
    ]
    if tok_s(ours.get("hotness_read", {}), f"pp{PROMPT}"):
        lines += [
            "",
            f"pp{PROMPT} with the hotness placement read by the GPU: "
            f"{tok_s(ours['hotness_read'], f'pp{PROMPT}'):,.1f} tok/s (all on the GPU: "
            f"{cell(tok_s(allg, f'pp{PROMPT}'))}).",
        ]
    if fit.get("split_cost"):
        lines += [
            "",
            f"Fitted per token: a split layer {fit['split_ms']:.3f} ms, one expert read from host "
            f"RAM {fit['read_ms']:.4f} ms: a split costs {fit['split_cost']:.1f} reads "
            f"(lucepy's placement assumes {ours.get('hotness', {}).get('split_cost', '?')}).",
        ]
    text = "\n".join(lines) + "\n"
    if args.md:
        Path(args.md).write_text(text)
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tools/bench_moe.py", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="time lucepy's placements")
    m.add_argument("model")
    m.add_argument("--device", default="cuda:0")
    m.add_argument("--json", required=True, help="results, rewritten after every placement")
    m.add_argument("--n-cpu-moe", type=int, required=True)
    m.add_argument("--threads", type=int, default=8)
    m.add_argument("--repeats", type=int, default=5)
    r = sub.add_parser("report", help="lucepy beside llama-bench, as markdown")
    r.add_argument("lucepy", help="measure's JSON")
    r.add_argument("--llama-bench", nargs="*", default=[], help="llama-bench -o json outputs")
    r.add_argument("--n-cpu-moe", type=int, required=True)
    r.add_argument("--md", help="write the markdown here too")
    args = ap.parse_args(argv)
    return measure(args) if args.cmd == "measure" else report(args)


if __name__ == "__main__":
    sys.exit(main())
