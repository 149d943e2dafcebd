"""The GPU kernels of one decode token, lucepy's against llama.cpp's, on the same model.

Two ways to look:

- ``trace``: lucepy's decode under PyTorch's profiler (CUPTI, which sees the kernels inside
  CUDA graphs): kernels, kernel time and the span from the first kernel's start to the last
  one's end, per token. The span against the kernel time shows the GPU's idle gaps.
- ``path``: two ``trace`` outputs (a decode's and a verify's) side by side, by each kernel's
  share of the span (``critical``): what a verify spends beyond a decode, kernel by kernel.
- ``layers``: two ``--sequence`` files (a decode's and a verify's) side by side, layer by
  layer: the median time from each part's first kernel's start to the next part's, where a
  part starts at a product or at one of ``PART_STARTS``. Overlapped kernels (a product
  launched early, waiting inside) split no time between them, as shares of the span do.
- ``ncu``: Nsight Compute's duration of every kernel, one at a time, for a few decode tokens of
  lucepy (``steps``) and of llama-bench, then ``compare`` the last whole token of each: the
  kernels whose count or time differ.

    python tools/trace_gpu.py trace MODEL [--device cuda:0] [--tokens 20] [--verify K] --json OUT
        [--sequence TXT]
    python tools/trace_gpu.py path DECODE.json VERIFY.json [--md OUT]
    python tools/trace_gpu.py layers DECODE-SEQ.txt VERIFY-SEQ.txt [--md OUT]
    python tools/trace_gpu.py steps MODEL [--device cuda:0] [--tokens 4]
    python tools/trace_gpu.py compare LUCEPY.csv LLAMA.csv      (ncu --csv output)

PyTorch is imported before any ggml library is loaded: PyTorch's CUDA libraries loaded after
ggml-cuda's made the process abort on the H200.
"""

from __future__ import annotations

import argparse
import collections
import csv
import io
import json
import re
import statistics
from pathlib import Path


def short(name: str) -> str:
    """The kernel's name with its template arguments (types, row counts, fusion flags)."""
    name, depth = name.removeprefix("void "), 0
    for i, ch in enumerate(name):
        depth += {"<": 1, ">": -1}.get(ch, 0)
        if ch == "(" and depth == 0:  # the argument list
            return name[:i][:100]
    return name[:100]


def trace(step, n: int) -> list[list[tuple[str, float, float]]]:
    """Kernels (name, start us, end us) of each of ``n`` calls of ``step``."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(n):
            with record_function(f"token{i}"):
                step()
            torch.cuda.synchronize()
    timeline(prof.events(), n)
    marks, kernels = [], set()
    calls = collections.Counter(
        ev.name for ev in prof.events() if ev.name.startswith(("cudaGraphLaunch", "cudaLaunch"))
    )
    print("CUDA runtime calls a token:", {k: v / n for k, v in calls.items()})
    for ev in prof.events():
        cuda = ev.device_type.name == "CUDA"
        if ev.name.startswith("token"):  # the marker, on the CPU (and mirrored on the GPU)
            if not cuda:
                marks.append(ev.time_range.start)
        elif cuda and not ev.name.startswith(("Memcpy", "Memset")):
            kernels.add((ev.name, ev.time_range.start, ev.time_range.end))
    marks.sort()
    out: list[list[tuple[str, float, float]]] = [[] for _ in marks]
    for k in sorted(kernels, key=lambda k: k[1]):  # in the last call started before it
        i = max((j for j, s in enumerate(marks) if s <= k[1]), default=None)
        if i is not None:
            out[i].append(k)
    return out


def timeline(events, n: int) -> None:
    """The CUDA runtime calls and GPU activities of the middle call, in time order: where its
    time goes before the first kernel and after the last one."""
    marks = sorted(
        ev.time_range.start
        for ev in events
        if ev.name.startswith("token") and ev.device_type.name == "CPU"
    )
    lo, hi = marks[n // 2], marks[n // 2 + 1]
    rows = []
    for ev in events:
        if not lo <= ev.time_range.start < hi or ev.name.startswith("token"):
            continue
        gpu = ev.device_type.name == "CUDA"
        if gpu or ev.name.startswith("cuda"):
            rows.append((ev.time_range.start - lo, ev.time_range.end - lo, gpu, ev.name))
    rows.sort()
    kernels = [r for r in rows if r[2]]
    print(f"call {n // 2}: {len(kernels)} GPU activities")
    for i, (s, e, gpu, name) in enumerate(rows):
        if not gpu or i < 12 or i > len(rows) - 8:
            print(f"  {s:9.1f} {e:9.1f} {'GPU' if gpu else 'CPU'} {short(name)[:70]}")


def settled(tokens: list[list[tuple[str, float, float]]]) -> list[list[tuple[str, float, float]]]:
    """The calls after the first two (which may still capture graphs) that ran kernels."""
    return [t for t in tokens[2:] if t]


def summary(tokens: list[list[tuple[str, float, float]]]) -> dict:
    tokens = settled(tokens)
    return {
        "tokens": len(tokens),
        "kernels": statistics.median(len(t) for t in tokens),
        "busy_us": statistics.median(sum(e - s for _, s, e in t) for t in tokens),
        "span_us": statistics.median(max(k[2] for k in t) - min(k[1] for k in t) for t in tokens),
        "gaps_over_5us": statistics.median(
            sum(1 for a, b in zip(t, t[1:], strict=False) if b[1] - a[2] > 5) for t in tokens
        ),
        "top_kernels": by_kernel(tokens, 12),
        "critical_path": critical(tokens),
    }


def critical(tokens: list[list[tuple[str, float, float]]]) -> list[dict]:
    """Each kernel's share of the span, microseconds a call, most first: the time from the
    later of its start and the end of every kernel before it to its own end (none where one
    before outlasts it). Kernels that a programmatic dependent launch starts early, and wait
    inside, so count only what they add to the span; idle gaps count to none ("idle"). The
    shares and the idle time add up to the span, which ``by_kernel``'s busy times do not."""
    share: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    for t in tokens:
        t = sorted(t, key=lambda k: k[1])
        end = t[0][1]  # the latest end so far
        for name, s, e in t:
            if s > end:
                share["idle"] += s - end
            kernel = short(name)[:60]
            share[kernel] += max(0.0, e - max(s, end))
            count[kernel] += 1
            end = max(end, e)
    n = len(tokens)
    return [
        {"kernel": k, "per_call": count[k] / n, "us": round(us / n, 2)}
        for k, us in share.most_common()
    ]


# What a kernel does in a step, by the start of its name (the first role that matches); a
# product kernel launched once a step is the output head's. Kernels of other names: "other".
HEAD = "the output head and its argmax"
PRODUCTS = "products, their parts' sums and the FFN gate"
ROLES = {  # role: the starts of its kernels' names
    "the rollback's recurrences": "lucepy::delta_net_layers",
    "DeltaNet: conv step, recurrence, gated norm": (
        "lucepy::conv_step lucepy::delta_net lucepy::norm_gate lucepy::delta_gates"
    ),
    "residual sums and norms, the products' activations": (
        "lucepy::norm_quantize lucepy::sum_norm_halves lucepy::norm_halves lucepy::quantize "
        "lucepy::to_halves"
    ),
    "attention: flash attention, q/k norms and rope, cache writes, gate": (
        "flash_attn lucepy::norm_rope k_set_rows lucepy::gate_ rope k_cpy"
    ),
    HEAD: "lucepy::argmax",
    PRODUCTS: "lucepy::gemv lucepy::gemm lucepy::glu_halves mul_mat",
}


def role(kernel: str, per_call: float) -> str:
    """What ``kernel`` (a ``critical`` row's name, launched ``per_call`` times a call) does."""
    if kernel == "idle":
        return "idle (between kernels: the host)"
    for name, starts in ROLES.items():
        if kernel.startswith(tuple(starts.split())):
            return HEAD if name == PRODUCTS and per_call == 1 else name
    return "other"


def path(decode: dict, verify: dict) -> str:
    """Markdown tables of the kernels' shares of a decode's span and of a verify's (``critical``
    in each ``trace`` output): by what they do (``ROLES``), then kernel by kernel, by what the
    verify adds, most first."""
    rows: dict[str, list[float]] = {}
    roles: dict[str, list[float]] = {}
    for side, out in enumerate((decode, verify)):
        for r in out["critical_path"]:
            row = rows.setdefault(r["kernel"], [0.0, 0.0, 0.0, 0.0])
            row[side], row[2 + side] = r["us"], r["per_call"]
            roles.setdefault(role(r["kernel"], r["per_call"]), [0.0, 0.0])[side] += r["us"]
    total = [sum(r[0] for r in rows.values()), sum(r[1] for r in rows.values())]
    lines = [
        f"Share of the span, us a call: a decode {total[0]:,.1f}, a verify {total[1]:,.1f} "
        f"(the verify adds {total[1] - total[0]:,.1f}).",
        "",
        "| what | decode us | verify us | verify - decode |",
        "|---|---|---|---|",
    ]
    for name, (d, v) in sorted(roles.items(), key=lambda kv: kv[1][0] - kv[1][1]):
        lines.append(f"| {name} | {d:,.1f} | {v:,.1f} | {v - d:+,.1f} |")
    lines += [
        "",
        "| kernel | decode us (calls) | verify us (calls) | verify - decode |",
        "|---|---|---|---|",
    ]
    for name, (d, v, dn, vn) in sorted(rows.items(), key=lambda kv: kv[1][0] - kv[1][1]):
        lines.append(f"| `{name}` | {d:,.1f} ({dn:g}) | {v:,.1f} ({vn:g}) | {v - d:+,.1f} |")
    return "\n".join(lines) + "\n"


def sequence(tokens: list[list[tuple[str, float, float]]]) -> str:
    """The middle call's kernels in order: start (us from its first), duration, the idle gap
    before it, and the kernel; runs of one kernel back to back folded into one line."""
    calls = settled(tokens)
    t = calls[len(calls) // 2]
    t0, rows, prev_end = t[0][1], [], None
    for name, s, e in t:
        gap = 0.0 if prev_end is None else max(0.0, s - prev_end)
        rows.append((s - t0, e - s, gap, short(name)[:90]))
        prev_end = e
    out = [f"{len(t)} kernels over {t[-1][2] - t0:.1f} us (start, us, gap before, kernel)"]
    i = 0
    while i < len(rows):
        j = i
        while j + 1 < len(rows) and rows[j + 1][3] == rows[i][3]:
            j += 1
        n, us = j - i + 1, sum(r[1] for r in rows[i : j + 1])
        gap = sum(r[2] for r in rows[i : j + 1])
        times = f" x{n}" if n > 1 else ""
        out.append(f"{rows[i][0]:9.1f} {us:8.1f} {gap:6.1f}  {rows[i][3]}{times}")
        i = j + 1
    return "\n".join(out) + "\n"


# a product's kernels (its parts' sums and a verify's gates run inside its part), and the
# other kernels where a part of a layer starts, with the kind of layer a part after the first
# product marks: qwen35's conv step and recurrence (a DeltaNet layer; not a rollback's
# `delta_net_layers`), its q and k norms (an attention layer)
PRODUCT_KERNELS = ("lucepy::gemv", "lucepy::gemm_r", "lucepy::gemm_f8", "lucepy::gemm<", "mul_mat")
PART_STARTS = {
    "lucepy::conv_step": "DeltaNet",
    "lucepy::delta_net": "",
    "lucepy::norm_rope": "attention",
}


def read_sequence(text: str) -> tuple[float, list[tuple[float, float, str]]]:
    """A ``sequence`` file's span and its (start, us, kernel) rows."""
    lines = text.splitlines()
    span = float(lines[0].split(" over ")[1].split()[0])
    rows = []
    for line in lines[1:]:
        start, us, _gap, name = line.split(maxsplit=3)
        rows.append((float(start), float(us), re.sub(r" x\d+$", "", name)))
    return span, rows


def part_start(name: str) -> str | None:
    """Where ``name`` starts a part: "product", or the kind of layer it marks ("" for none);
    None where it does not."""
    if name.startswith(PRODUCT_KERNELS):
        return "product"
    base = name.split("<")[0]
    return PART_STARTS.get(base)


def layer_parts(text: str) -> tuple[dict[str, list[list[tuple[str, float]]]], float, float]:
    """A call's layers by kind (each its parts: the first kernel's name without its template
    arguments, and the us from the part's start to the next's), the output head's own time (the
    last product's) and the span after it."""
    span, rows = read_sequence(text)
    starts = [i for i, (_, _, name) in enumerate(rows) if part_start(name) is not None]
    head = max(i for i in starts if part_start(rows[i][2]) == "product")
    starts = [i for i in starts if i <= head]
    layers: dict[str, list[list[tuple[str, float]]]] = {}
    current: list[tuple[str, float]] | None = None
    for i, nxt in zip(starts, starts[1:], strict=False):
        kind = part_start(rows[nxt][2])
        if part_start(rows[i][2]) == "product" and kind not in ("product", ""):
            current = []  # a layer's first product: the part after it names the layer
            layers.setdefault(kind, []).append(current)
        if current is not None:
            name = rows[i][2].split("<")[0].removeprefix("lucepy::")
            current.append((name, rows[nxt][0] - rows[i][0]))
    head_start, head_us, _ = rows[head]
    return layers, head_us, span - (head_start + head_us)


def layers(decode: str, verify: str) -> str:
    """A markdown table of the median time of each part of a layer, by kind of layer, in a
    decode's ``sequence`` and a verify's, then the head and what follows it."""
    sides = [layer_parts(decode), layer_parts(verify)]
    lines = [
        "Parts of a layer, us from a part's start to the next's (medians over the layers):",
        "",
        "| layer | part | decode | verify | verify - decode |",
        "|---|---|---|---|---|",
    ]
    for kind in sides[0][0]:
        runs = [side[0].get(kind, []) for side in sides]
        shape = {len(layer) for run in runs for layer in run}
        if len(shape) != 1:
            raise SystemExit(f"layers: {kind} layers of different part counts: {sorted(shape)}")
        medians = [
            [statistics.median(us for _, us in col) for col in zip(*run, strict=True)]
            for run in runs
        ]
        medians = [m + [sum(m)] for m in medians]
        first = [[name for name, _ in run[0]] for run in runs]  # each side's kernels
        names = [a if a == b else f"{a} / {b}" for a, b in zip(*first, strict=True)]
        names.append("the whole layer")
        for name, d, v in zip(names, *medians, strict=True):
            row = f"| {kind} ({len(runs[0])}) | {name} | {d:,.1f} | {v:,.1f} | {v - d:+,.1f} |"
            lines.append(row)
    for name, i in (("the output head", 1), ("after the head (argmax, host gap, rollback)", 2)):
        d, v = sides[0][i], sides[1][i]
        lines.append(f"| | {name} | {d:,.1f} | {v:,.1f} | {v - d:+,.1f} |")
    return "\n".join(lines) + "\n"


def by_kernel(tokens: list[list[tuple[str, float, float]]], top: int) -> list[dict]:
    """The kernels that take the most time a token: launches and microseconds a token."""
    n, busy, count = len(tokens), collections.Counter(), collections.Counter()
    for t in tokens:
        for name, s, e in t:
            busy[short(name)[:60]] += e - s
            count[short(name)[:60]] += 1
    return [
        {"kernel": k, "per_token": count[k] / n, "us": round(us / n, 1)}
        for k, us in busy.most_common(top)
    ]


def lucepy_engine(model: str, device: str, warm: int):
    from lucepy.runtime.config import RuntimeConfig
    from lucepy.runtime.engine import Engine

    engine = Engine(model, RuntimeConfig(device=device, max_ctx=1024), tokenizer=False)
    engine.prefill(list(range(1, 17)))
    for _ in range(warm):
        engine.decode(5)
    return engine


_NS = {"nsecond": 1, "usecond": 1e3, "msecond": 1e6, "ns": 1, "us": 1e3, "ms": 1e6}


def ncu_kernels(path: str) -> list[tuple[str, float]]:
    """(kernel, ns) in launch order from ``ncu --csv --metrics gpu__time_duration.sum``."""
    text = Path(path).read_text()
    out = []
    for r in csv.DictReader(io.StringIO(text[text.find('"ID"') :])):
        if r.get("Metric Name") == "gpu__time_duration.sum":
            value = float(r["Metric Value"].replace(",", ""))
            out.append((short(r["Kernel Name"]), value * _NS.get(r["Metric Unit"], 1)))
    return out


def last_token(kernels: list[tuple[str, float]]) -> list[tuple[str, float]]:
    """The last period of the launch sequence: decode tokens repeat the same kernels."""
    names = [k for k, _ in kernels]
    for p in range(50, len(names) // 2 + 1):
        if names[-p:] == names[-2 * p : -p]:
            return kernels[-p:]
    raise SystemExit(f"no repeating token in {len(names)} kernels")


def compare(ours: list[tuple[str, float]], theirs: list[tuple[str, float]]) -> None:
    a, b = last_token(ours), last_token(theirs)
    print(
        f"one token: lucepy {len(a)} kernels, {sum(t for _, t in a) / 1e3:.1f} us; "
        f"llama.cpp {len(b)} kernels, {sum(t for _, t in b) / 1e3:.1f} us"
    )
    per = {}
    for side, ks in (("l", a), ("r", b)):
        for name, t in ks:
            row = per.setdefault(name, {"l": [0, 0.0], "r": [0, 0.0]})
            row[side][0] += 1
            row[side][1] += t / 1e3
    rows = sorted(per.items(), key=lambda kv: -abs(kv[1]["l"][1] - kv[1]["r"][1]))
    print(f"{'kernel':100s} {'lucepy n':>8s} {'us':>8s} {'llama n':>8s} {'us':>8s}")
    for name, r in rows:
        if r["l"][0] != r["r"][0] or abs(r["l"][1] - r["r"][1]) >= 1.0:
            print(f"{name:100s} {r['l'][0]:8d} {r['l'][1]:8.1f} {r['r'][0]:8d} {r['r'][1]:8.1f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("trace", "steps"):
        r = sub.add_parser(name)
        r.add_argument("model")
        r.add_argument("--device", default="cuda:0")
        r.add_argument("--tokens", type=int, default=20 if name == "trace" else 3)
        if name == "trace":
            r.add_argument("--json", required=True)
            r.add_argument(
                "--verify", type=int, default=0, help="trace a K-token verify, not a decode token"
            )
            r.add_argument("--sequence", help="also write one call's kernels in order here")
    c = sub.add_parser("compare")
    c.add_argument("ours")
    c.add_argument("theirs")
    for name in ("path", "layers"):
        p = sub.add_parser(name)
        p.add_argument("decode")
        p.add_argument("verify")
        p.add_argument("--md", help="write the table here too")
    args = ap.parse_args()
    if args.cmd in ("path", "layers"):
        texts = [Path(f).read_text() for f in (args.decode, args.verify)]
        table = path(*map(json.loads, texts)) if args.cmd == "path" else layers(*texts)
        print(table, end="")
        if args.md:
            Path(args.md).write_text(table)
        return
    if args.cmd == "compare":
        compare(ncu_kernels(args.ours), ncu_kernels(args.theirs))
        return
    if args.cmd == "steps":
        engine = lucepy_engine(args.model, args.device, 2)
        for _ in range(args.tokens):
            engine.decode(5)
        return
    import torch  # noqa: F401  (before ggml: see the module's note)

    engine = lucepy_engine(args.model, args.device, 8)

    def step() -> None:
        if args.verify:  # one of its tokens kept: the position creeps by one a call
            engine.verify([5] * args.verify, greedy=True)
            engine.rollback(1)
        else:
            engine.decode(5)

    calls = trace(step, args.tokens)
    out = summary(calls)
    if args.sequence:
        Path(args.sequence).write_text(sequence(calls))
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
