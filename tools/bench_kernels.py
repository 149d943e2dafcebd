"""Issue 19's benchmark: lucepy with its own CUDA kernels against lucepy with ggml's, on the same
patched build (LUCEPY_CUDA_KERNELS=1 or =0 forces ours on or off, whatever the default), and with
its own on Q4_0 and Q4_K weights repacked at load (LUCEPY_CUDA_REPACK=1), against llama-bench of the
unpatched build (tools/gpu_run.sh with GPU_RUN_KERNELS), on the same model and GPU, in one run.

    python tools/bench_kernels.py measure MODEL --device cuda:0 --json kernels.json
    python tools/bench_kernels.py report kernels.json --llama-bench llama.json --md kernels.md
    python tools/bench_kernels.py ab MODEL --switch LUCEPY_CUDA_F8 --json ab.json --md ab.md
    python tools/bench_kernels.py ab MODEL --switch LUCEPY_CUDA_F8_SINGLE=6,7 --json ab.json

Each kernel choice runs in a process of its own (ggml-cuda's CUDA graphs replay whichever kernels
they captured). Per choice, as tools/bench_gpu.py measures them: pp512, tg128 at an empty context
(medians of --repeats runs), and the verify cost curve: the k-token forward of a DFlash verify,
k = 1..16, over one decode step at the same position, each a median (and k = 16 with the
rollback left running and waited for, in turn with a decode step that reads the logits and a
greedy one that reads its argmax alone, whose medians are the curve's steps); and how many
products lucepy's kernels computed (0 with ggml's). ``report`` sets medians beside llama-bench's
medians (of its samples_ns, never its mean). ``ab`` measures one switch of lucepy's kernels
both ways on the repacked choice, in turn (NAME=0, NAME=1, or the two values of NAME=A,B,
--rounds times), each run in a process of its own, and sets each run's decode step and k = 16 in
turn beside the other side's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from bench_gpu import CHUNK, DECODE_TOKENS, Bench, in_turn, llama_rows, verify_step

from lucepy.decode.verify_len import median_s

# lucepy's kernels, the same with its Q4_0 and Q4_K weights repacked (LUCEPY_CUDA_REPACK=1), ggml's
CHOICES = ("lucepy", "repacked", "ggml")
MAX_K = 16


def verify_curve(bench: Bench) -> None:
    engine = bench.engine
    engine.reset()
    engine.prefill(bench.tokens(64), chunk=CHUNK)
    block = bench.tokens(MAX_K)
    repeats = max(bench.repeats, 5)
    verify_s = {
        k: median_s(lambda k=k: verify_step(engine, block[:k]), repeats)
        for k in range(1, MAX_K + 1)
    }
    # k = 16 with the rollback left running and waited for, in turn with both kinds of decode
    # step, in the same run: what running it under the next step's host work saves; those
    # decode steps are the curve's too
    rounds = 4 * repeats
    med = in_turn(engine, block, rounds)
    bench.record(
        "verify_curve",
        {
            "decode_ms": 1e3 * med["decode"],
            "greedy_decode_ms": 1e3 * med["greedy"],
            "cost_in_decodes": {k: s / med["decode"] for k, s in verify_s.items()},
            "rollback_in_turn": {
                "left_running": med["left"] / med["decode"],
                "waited": med["waited"] / med["decode"],
                "left_running_greedy": med["left"] / med["greedy"],
                "waited_greedy": med["waited"] / med["greedy"],
                "calls": rounds,
            },
        },
    )


def one(args: argparse.Namespace) -> int:
    """One kernel choice, in this process (LUCEPY_CUDA_KERNELS set by ``measure``)."""
    from lucepy.ggml import load
    from lucepy.ggml.kernels import cuda_kernels
    from lucepy.runtime.config import RuntimeConfig
    from lucepy.runtime.engine import Engine

    cfg = RuntimeConfig(device=args.device, max_ctx=2048, chunk=CHUNK)
    with Engine(args.model, cfg, tokenizer=False) as engine:
        bench = Bench(engine, args.repeats, Path(args.json))
        kernels = cuda_kernels(load())
        cuda = args.device.startswith("cuda")
        on = bool(kernels and cuda and kernels.on(int(args.device.partition(":")[2] or 0)))
        if args.kernels != "ggml" and cuda and not on:
            raise SystemExit(
                "bench_kernels: the loaded ggml (LUCEPY_GGML_LIB) has no lucepy kernels: "
                "build it with `lucepy backends build cuda`"
            )
        bench.record("kernels", {"choice": args.kernels, "on": on})
        bench.prefill(512)
        engine.reset()
        bench.decode(0)
        verify_curve(bench)
        counts = {"calls": 0, "ops": 0, "joined": 0}
        if kernels:
            counts = {"calls": kernels.calls, "ops": kernels.ops, "joined": kernels.joined}
        bench.record("lucepy_kernel_calls", counts)
    return 0


def choice_env(choice: str) -> dict[str, str]:
    """This process's environment with lucepy's kernels set for ``choice`` (one of CHOICES)."""
    return dict(
        os.environ,
        LUCEPY_CUDA_KERNELS="0" if choice == "ggml" else "1",
        LUCEPY_CUDA_REPACK="1" if choice == "repacked" else "0",
    )


def _one_run(args: argparse.Namespace, choice: str, part: Path, env: dict) -> tuple[dict, bool]:
    """tools/bench_kernels.py one of `choice` on args.model in a process of its own, with `env`:
    its JSON ({} where it wrote none), and whether it ended well."""
    part.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "one", str(args.model), "--device", args.device]
    cmd += ["--json", str(part), "--repeats", str(args.repeats), "--kernels", choice]
    done = subprocess.run(cmd, env=env)
    return (json.loads(part.read_text()) if part.exists() else {}), done.returncode == 0


def switch_values(switch: str) -> tuple[str, tuple[str, str]]:
    """``ab``'s --switch: NAME (its values 0 and 1) or NAME=A,B; the name and the two values."""
    name, _, values = switch.partition("=")
    both = tuple(values.split(",")) if values else ("0", "1")
    if not name or len(both) != 2 or not all(both) or both[0] == both[1]:
        raise SystemExit(f"ab: --switch {switch!r}: give NAME, or NAME=A,B with two values")
    return name, (both[0], both[1])


def ab(args: argparse.Namespace) -> int:
    """The repacked choice with the switch's two values in turn, args.rounds rounds."""
    name, values = switch_values(args.switch)
    out = Path(args.json)
    runs: dict[str, list[dict]] = {value: [] for value in values}
    failed = 0
    for r in range(args.rounds):
        for value in values:
            env = {**choice_env("repacked"), name: value}
            got, ok = _one_run(args, "repacked", out.with_suffix(f".{value}.{r}.json"), env)
            runs[value].append(got)
            failed += not ok
            out.write_text(json.dumps({"switch": name, "runs": runs}, indent=1))
    text = ab_report(name, runs)
    if args.md:
        Path(args.md).write_text(text)
    print(text)
    return 1 if failed else 0


def ab_report(switch: str, runs: dict[str, list[dict]]) -> str:
    """Each run's decode steps and k = 16 in turn (in decode steps and in greedy ones), by side."""
    lines = [
        f"{switch} both ways (lucepy repacked), runs in turn: decode step / greedy step ms; k = "
        f"{MAX_K} in turn with the rollback left running / waited for, in decode steps / in "
        "greedy ones",
        "",
    ]
    for value, side in runs.items():
        for run in side:
            curve = run.get("verify_curve", {})
            steps = (
                f"{_cell(curve.get('decode_ms'), '{:.2f}')} / "
                f"{_cell(curve.get('greedy_decode_ms'), '{:.2f}')}"
            )
            lines.append(
                f"- {switch}={value}: {steps} ms; {_in_turn(curve.get('rollback_in_turn', {}))}"
            )
    return "\n".join(lines) + "\n"


def measure(args: argparse.Namespace) -> int:
    out = Path(args.json)
    results: dict = {"model": str(args.model), "device": args.device}
    failed = 0
    for choice in CHOICES:
        part = out.with_suffix(f".{choice}.json")
        results[choice], ok = _one_run(args, choice, part, choice_env(choice))
        failed += not ok
        out.write_text(json.dumps(results, indent=1))
    return 1 if failed else 0


def _cell(x: float | None, fmt: str = "{:,.1f}") -> str:
    return "—" if x is None else fmt.format(x)


def _in_turn(t: dict) -> str:
    """One side's k = 16 calls in turn, in decode steps and in greedy ones."""
    ratios = ("left_running", "waited", "left_running_greedy", "waited_greedy")
    return " / ".join(_cell(t.get(key), "{:.3f}") for key in ratios)


def report(args: argparse.Namespace) -> int:
    got = json.loads(Path(args.results).read_text())
    ref, missing = llama_rows([p for p in args.llama_bench if Path(p).exists()])
    ours, theirs, rp = got.get("lucepy", {}), got.get("ggml", {}), got.get("repacked", {})

    def rate(side: dict, key: str) -> float | None:
        return side.get(key, {}).get("tok_s")

    rows = [
        ("decode tg128", f"tg{DECODE_TOKENS}@d0", (f"tg{DECODE_TOKENS}", 0)),
        ("prefill pp512", "pp512", ("pp512", 0)),
    ]
    lines = [
        f"# lucepy's CUDA kernels: {got.get('model', '?')} on {got.get('device', '?')}",
        "",
        f"| test | llama.cpp ({args.llama_build}) | lucepy, ggml's kernels | lucepy, own kernels "
        "| own, repacked | own / llama.cpp | repacked / llama.cpp | own / ggml's |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, key, llama_key in rows:
        a, b, r = rate(theirs, key), rate(ours, key), rate(rp, key)
        c = ref[llama_key].tok_s if llama_key in ref else None
        lines.append(
            f"| {name} (tok/s) | {_cell(c)} | {_cell(a)} | {_cell(b)} | {_cell(r)} "
            f"| {_cell(b / c if b and c else None, '{:.2f}×')} "
            f"| {_cell(r / c if r and c else None, '{:.2f}×')} "
            f"| {_cell(b / a if b and a else None, '{:.2f}×')} |"
        )
    sides = (theirs, ours, rp)
    curves = [s.get("verify_curve", {}).get("cost_in_decodes", {}) for s in sides]
    lines += [
        "",
        "Verify cost: a k-token forward, in decode steps at the same position (medians).",
        "",
        "| k | " + " | ".join(str(k) for k in range(1, MAX_K + 1)) + " |",
        "|---|" + "---|" * MAX_K,
    ]
    labels = ("ggml's kernels", "own kernels", "own, repacked")
    for label, curve in zip(labels, curves, strict=True):
        cells = [_cell(curve.get(str(k)), "{:.2f}") for k in range(1, MAX_K + 1)]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    steps = [s.get("verify_curve", {}) for s in sides]
    lines.append(
        "\nDecode step, and a greedy one (its argmax alone read back), ms: "
        + ", ".join(
            f"{lab} {_cell(c.get('decode_ms'), '{:.2f}')} and "
            f"{_cell(c.get('greedy_decode_ms'), '{:.2f}')}"
            for lab, c in zip(labels, steps, strict=True)
        )
    )
    turns = [s.get("verify_curve", {}).get("rollback_in_turn", {}) for s in sides]
    lines.append(
        f"\nk = {MAX_K}, calls in turn with the rollback left running / waited for, a decode step "
        f"and a greedy one (medians of {turns[-1].get('calls', '?')} each), in those decode steps "
        "/ in greedy ones: "
        + ", ".join(f"{lab} {_in_turn(t)}" for lab, t in zip(labels, turns, strict=True))
    )
    counts = [s.get("lucepy_kernel_calls", {}) for s in sides]
    calls, ops, joined = ([c.get(key) for c in counts] for key in ("calls", "ops", "joined"))
    lines += [
        "",
        f"Products computed by lucepy's kernels: {calls[1]} with them on, {calls[2]} repacked, "
        f"{calls[0]} off; other ops {ops[1]} with them on ({joined[1]} of them in another op's "
        "kernel).",
        *(f"- llama.cpp {m}: no samples, left out" for m in missing),
    ]
    text = "\n".join(lines) + "\n"
    if args.md:
        Path(args.md).write_text(text)
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tools/bench_kernels.py", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="lucepy with its kernels and with ggml's")
    o = sub.add_parser("one", help="(internal) one kernel choice in this process")
    a = sub.add_parser("ab", help="one switch of lucepy's kernels both ways, in turn")
    for p in (m, o, a):
        p.add_argument("model")
        p.add_argument("--device", default="cuda:0")
        p.add_argument("--json", required=True)
        p.add_argument("--repeats", type=int, default=5)
    o.add_argument("--kernels", choices=CHOICES, required=True)
    a.add_argument(
        "--switch",
        required=True,
        help="an environment variable, e.g. LUCEPY_CUDA_F8 (0 and 1), or NAME=A,B (A and B)",
    )
    a.add_argument("--rounds", type=int, default=2)
    a.add_argument("--md")
    r = sub.add_parser("report", help="beside llama-bench, as markdown")
    r.add_argument("results", help="measure's JSON")
    r.add_argument("--llama-bench", nargs="*", default=[], help="llama-bench -o json outputs")
    r.add_argument(
        "--llama-build", default="unpatched", help="which build's llama-bench, for the header"
    )
    r.add_argument("--md")
    args = ap.parse_args(argv)
    return {"measure": measure, "one": one, "report": report, "ab": ab}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
