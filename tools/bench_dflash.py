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
lucepy's tau when sampling (rejection sampling keeps the target's distribution).
``--batch-invariant`` adds lucepy plain and DFlash 16 with RuntimeConfig.batch_invariant (the
second's ``same`` against the first's tokens).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
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
    steps = int(np.sum([r.get("histogram", 0) for r in runs]))
    if runs[0].get("step_ms") is not None and steps:  # where a step's time goes, over prompts
        draft, verify, wall = np.sum([r["step_ms"] for r in runs], axis=0)
        out["ms_a_step"] = {  # the draft's pass; verify, commit and injection; the rest
            "draft": round(draft / steps, 4),
            "verify": round(verify / steps, 4),
            "other": round((wall - draft - verify) / steps, 4),
        }
    return out


def _first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def lucepy_runs(
    args, prompts, draft: Path | None, sampling=None, verify_len="fixed", invariant=False
) -> list:
    cfg = RuntimeConfig(
        device=args.device,
        draft=str(draft) if draft else None,
        threads=args.threads,
        verify_len=verify_len,
        batch_invariant=invariant,
    )
    with Engine(args.model, cfg, tokenizer=False) as engine:
        engine.generate(prompts[0], 8, stop_at_end=False)  # warm-up: graphs built once
        runs = []
        for p in prompts:
            t0 = time.perf_counter()
            gen = engine.generate(p, args.tokens, stop_at_end=False, sampling=sampling)
            wall = time.perf_counter() - t0
            decode_s = wall - gen.timings.prefill_ms / 1e3
            run = {"tokens": gen.tokens, "tok_s": (len(gen.tokens) - 1) / decode_s}
            if gen.accept is not None:
                run["histogram"] = gen.accept.histogram
                run["drafted"] = gen.accept.drafted
                run["step_ms"] = (gen.accept.draft_ms, gen.accept.verify_ms, decode_s * 1e3)
            runs.append(run)
        lengths = engine.verify_lengths()
        if lengths is not None:  # the measured step costs and the rates reached
            args.lengths = {"costs": lengths.costs.to_dict(), **lengths.to_dict()}
    return runs


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

    plain = lucepy_runs(args, prompts, None)
    base = [r["tokens"] for r in plain]
    record("lucepy plain", plain, base)
    record("lucepy DFlash 16", lucepy_runs(args, prompts, args.draft), base)
    args.lengths = None
    record("lucepy DFlash auto", lucepy_runs(args, prompts, args.draft, None, "auto"), base)
    res["verify_lengths"] = args.lengths
    if args.llama_dflash:
        record("llama.cpp plain", llama_runs(args, prompts, "ar"), base)
        record("llama.cpp DFlash", llama_runs(args, prompts, "dflash"), base)
    if args.batch_invariant:
        exact = lucepy_runs(args, prompts, None, invariant=True)
        record("lucepy plain, batch-invariant", exact, base)
        runs = lucepy_runs(args, prompts, args.draft, invariant=True)
        record("lucepy DFlash 16, batch-invariant", runs, [r["tokens"] for r in exact])
    if args.temperature > 0:
        sampling = SamplingParams(temperature=args.temperature, seed=0)
        record(
            f"lucepy DFlash 16 T={args.temperature}",
            lucepy_runs(args, prompts, args.draft, sampling),
            None,
        )
    table = markdown(res)
    print(table)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1) + "\n")
    if args.md:
        args.md.write_text(table)


if __name__ == "__main__":
    main()
