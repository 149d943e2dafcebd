"""DFlash on the held-out prompts (tools/dflash_prompts.json): lucepy plain against lucepy with
the draft, and llama.cpp's own DFlash (tools/llama_dflash.cpp) on the same two GGUFs, in one run.

    python3 tools/bench_dflash.py [--device cpu|cuda:0] [--tokens 256] [--llama-dflash BIN]
        [--draft D.gguf] [--model M.gguf] [--batch-invariant] [--json OUT.json] [--md OUT.md]

Every prompt is answered greedily for exactly ``--tokens`` tokens (end tokens do not stop it), so
lucepy and llama.cpp produce the same lengths. Per configuration: the median over prompts of the
decode tok/s (the tokens after the first, over the time after the prefill), tau (tokens committed
per verify step, the bonus included) and the histogram of accepted drafts, summed over prompts;
``same`` counts the prompts whose tokens equal lucepy's plain greedy ones; ``ms_a_step`` splits
a DFlash step's time (the draft's pass, the verify with its commit and injection, the rest).
lucepy runs DFlash with every step verifying 16 tokens, and with ``auto`` lengths
(decode/verify_len.py; the JSON keeps the measured step costs and the acceptance rates reached;
with no drafting that pays, ``auto`` decodes plainly and reports no tau). ``--temperature`` adds
lucepy's tau when sampling (rejection sampling keeps the target's distribution). lucepy's
configurations are loaded side by side and take turns on each prompt (a machine's drift
reaches them alike); llama.cpp's run after them.
``--batch-invariant`` adds lucepy plain and DFlash 16 with RuntimeConfig.batch_invariant (the
second's ``same`` against the first's tokens).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lucepy.catalog import smollm2_draft_file, smollm2_file
from lucepy.decode.sampling import SamplingParams
from lucepy.engine import Engine
from lucepy.runtime.config import RuntimeConfig

PROMPTS = Path(__file__).with_name("dflash_prompts.json")


def summary(runs: list[dict], plain: list[list[int]] | None) -> dict:
    out = {"median_tok_s": round(statistics.median(r["tok_s"] for r in runs), 2)}
    if plain is not None:
        out["same"] = sum(r["tokens"] == p for r, p in zip(runs, plain, strict=True))
        out["first_diff"] = [_first_diff(r["tokens"], p) for r, p in zip(runs, plain, strict=True)]
    if runs[0].get("histogram") is not None:
        hist = np.sum([r["histogram"] for r in runs], axis=0)
        steps = int(hist.sum())
        out["tau"] = round(float((hist * np.arange(hist.size)).sum() + steps) / steps, 3)
        out["histogram"] = hist.tolist()
        out["mean_k"] = round(1 + sum(r["drafted"] for r in runs) / steps, 2)
    if runs[0].get("step_ms") is not None:  # lucepy's: llama.cpp's runs do not split a step
        # where a step's time goes: the draft's pass; verify, commit and injection; the rest
        draft, verify, wall = np.sum([r["step_ms"] for r in runs], axis=0)
        out["ms_a_step"] = {
            "draft": round(draft / steps, 4),
            "verify": round(verify / steps, 4),
            "other": round((wall - draft - verify) / steps, 4),
        }
    return out


def _first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


@dataclass(frozen=True)
class Side:
    """One lucepy configuration of the rotation."""

    name: str
    draft: bool = False
    verify_len: str = "fixed"
    invariant: bool = False
    sampling: SamplingParams | None = None


def lucepy_runs(args, prompts, sides: list[Side]) -> tuple[dict[str, list[dict]], dict | None]:
    """Every side's runs, the sides loaded side by side and taking turns on each prompt, so
    that a machine's drift over the run (the H200's host ran the same decode 15 % slower for
    seconds at a time) reaches them alike; and auto's measured step costs and the rates it
    reached (None without an auto side)."""
    runs: dict[str, list[dict]] = {side.name: [] for side in sides}
    measured = None
    with contextlib.ExitStack() as stack:
        engines = []
        for side in sides:
            cfg = RuntimeConfig(
                device=args.device,
                draft=str(args.draft) if side.draft else None,
                threads=args.threads,
                verify_len=side.verify_len,
                batch_invariant=side.invariant,
            )
            engine = stack.enter_context(Engine(args.model, cfg, tokenizer=False))
            engine.generate(prompts[0], 8, stop_at_end=False)  # graphs built, lengths timed
            engines.append(engine)
        for p in prompts:
            for side, engine in zip(sides, engines, strict=True):
                runs[side.name].append(_run(engine, p, args.tokens, side.sampling))
        for engine in engines:
            lengths = engine.verify_lengths()
            if lengths is not None:
                measured = {"costs": lengths.costs.to_dict(), **lengths.to_dict()}
    return runs, measured


def _run(engine, prompt, tokens: int, sampling) -> dict:
    t0 = time.perf_counter()
    gen = engine.generate(prompt, tokens, stop_at_end=False, sampling=sampling)
    wall = time.perf_counter() - t0
    decode_s = wall - gen.timings.prefill_ms / 1e3
    run = {"tokens": gen.tokens, "tok_s": (len(gen.tokens) - 1) / decode_s}
    if gen.accept is not None:
        run["histogram"] = gen.accept.histogram
        run["drafted"] = gen.accept.drafted
        run["step_ms"] = (gen.accept.draft_ms, gen.accept.verify_ms, decode_s * 1e3)
    return run


def llama_runs(args, prompts, mode: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        pfile, out = Path(tmp) / "prompts.json", Path(tmp) / "out.json"
        pfile.write_text(json.dumps(prompts))
        cmd = [args.llama_dflash, "-m", str(args.model), "-md", str(args.draft)]
        cmd += ["--prompts", str(pfile), "-n", str(args.tokens), "--mode", mode, "--out", str(out)]
        cmd += ["-ngl", "99" if args.device.startswith("cuda") else "0"]
        if args.threads:
            cmd += ["-t", str(args.threads)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        got = json.loads(out.read_text())
    runs = []
    for r in got["prompts"]:
        run = {"tokens": r["tokens"], "tok_s": r["decode_tok_s"]}
        if mode == "dflash":
            run["histogram"], run["drafted"] = r["histogram"], r["drafted"]
        runs.append(run)
    return runs


def markdown(res: dict) -> str:
    plain = res["lucepy plain"]["median_tok_s"]
    lines = [
        "| configuration | decode tok/s (median) | vs lucepy plain | tau | mean k | = plain |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in res.items():
        if not isinstance(r, dict) or "median_tok_s" not in r:
            continue
        same = f"{r['same']}/{len(r['first_diff'])}" if "same" in r else ""
        lines.append(
            f"| {name} | {r['median_tok_s']:.1f} | {r['median_tok_s'] / plain:.2f}x | "
            f"{r.get('tau', '')} | {r.get('mean_k', '')} | {same} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--draft", type=Path, default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=0, help="the first N held-out prompts (0: all)")
    ap.add_argument("--temperature", type=float, default=0.7, help="0: no sampled run")
    ap.add_argument("--llama-dflash", help="tools/llama_dflash.cpp built (build_llama_dflash.sh)")
    ap.add_argument(
        "--batch-invariant",
        action="store_true",
        help="also lucepy plain and DFlash 16 with batch_invariant (CPU: exactly greedy)",
    )
    ap.add_argument("--json", type=Path)
    ap.add_argument("--md", type=Path)
    args = ap.parse_args()
    args.model = args.model or Path(smollm2_file())
    args.draft = args.draft or smollm2_draft_file()
    prompts = json.loads(PROMPTS.read_text())["heldout"]
    prompts = prompts[: args.prompts or len(prompts)]
    res: dict = {"device": args.device, "tokens": args.tokens, "prompts": len(prompts)}

    def record(name: str, runs: list[dict], plain) -> None:
        res[name] = summary(runs, plain)
        print(name, json.dumps(res[name]), flush=True)
        if args.json:
            args.json.write_text(json.dumps(res, indent=1) + "\n")

    sides = [
        Side("lucepy plain"),
        Side("lucepy DFlash 16", draft=True),
        Side("lucepy DFlash auto", draft=True, verify_len="auto"),
    ]
    if args.batch_invariant:
        sides += [
            Side("lucepy plain, batch-invariant", invariant=True),
            Side("lucepy DFlash 16, batch-invariant", draft=True, invariant=True),
        ]
    if args.temperature > 0:
        sampling = SamplingParams(temperature=args.temperature, seed=0)
        sides.append(Side(f"lucepy DFlash 16 T={args.temperature}", draft=True, sampling=sampling))
    runs, measured = lucepy_runs(args, prompts, sides)
    base = [r["tokens"] for r in runs["lucepy plain"]]
    exact = runs.get("lucepy plain, batch-invariant")
    for side in sides:
        if side.sampling is not None:
            against = None  # sampled: no greedy tokens to equal
        elif side.invariant and side.draft:
            against = [r["tokens"] for r in exact]
        else:
            against = base
        record(side.name, runs[side.name], against)
    res["verify_lengths"] = measured
    if args.llama_dflash:
        record("llama.cpp plain", llama_runs(args, prompts, "ar"), base)
        record("llama.cpp DFlash", llama_runs(args, prompts, "dflash"), base)
    table = markdown(res)
    print(table)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1) + "\n")
    if args.md:
        args.md.write_text(table)


if __name__ == "__main__":
    main()
