"""Compare two builds of a CUDA object function by function: which kernels' SASS stayed byte for
byte the same, which changed (and by how many instructions), which are new or gone. For a
refactor of lucepy's kernels that should leave their code as it was (docs/BENCHMARKS.md,
session 44), without a GPU:

    nvcc -c -std=c++17 -O3 -arch=sm_90 ... lucepy-mm.cu -o old.o   (and new.o from the change)
    cuobjdump -sass old.o > old.sass; cuobjdump -sass new.o > new.sass
    python tools/sass_diff.py old.sass new.sass [--rename 'REGEX=>REPLACEMENT' ...] [--show NAME]

Names are demangled (c++filt) and compared after the renames (Python regular expressions, applied
to both sides: a template argument that changed its spelling, e.g. 'gemm_rq6<(\\d+)>=>gemm_rq<\\1,
RpQ6_K>'). --show prints one function's instruction diff with registers and branch targets
blanked (what moved, not how it was allocated). --loops prints each loop of a function in both
listings (a backward branch and its target; --min instructions or more, to leave out the
one-instruction retry loops of waits and bulk copies): its span, its instruction count and its
commonest opcodes, the count an instruction diet is measured by where a kernel is near its issue
rate (docs/BENCHMARKS.md, session 53: `gemm_f8`'s descriptors)."""

from __future__ import annotations

import argparse
import collections
import difflib
import re
import subprocess
import sys
from pathlib import Path


def functions(path: Path) -> dict[str, list[str]]:
    """Each function of a `cuobjdump -sass` listing: its demangled name -> its instructions."""
    parts = re.split(r"\n\s*Function : (\S+)\n", path.read_text())
    bodies = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        code = re.findall(r"^\s*/\*[0-9a-f]{4,}\*/\s*(.*?)\s*;", body, re.MULTILINE)
        bodies[name] = [re.sub(r"\s+", " ", line) for line in code]
    names = list(bodies)
    plain = subprocess.run(
        ["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True
    ).stdout.splitlines()
    return {readable: bodies[name] for name, readable in zip(names, plain, strict=True)}


def loops(code: list[str], least: int) -> list[tuple[int, int, collections.Counter]]:
    """The loops of a function's instructions (16 bytes each from address 0): each predicated
    backward branch's (first, last) instruction index, with the opcodes between (predicates and
    modifiers dropped), where there are at least ``least``. (An unpredicated one is a slow
    path's jump back into the code, such as a wait's after its retry loop, not a loop's end.)"""
    out = []
    for i, line in enumerate(code):
        target = re.search(r"^@!?U?P[T\d]\s+BRA\b.*?(0x[0-9a-f]+)$", line)
        if target is None or int(target.group(1), 16) // 16 > i:
            continue
        first = int(target.group(1), 16) // 16
        if i - first + 1 >= least:
            ops = collections.Counter(
                re.sub(r"^@!?U?P[T\d]\s+", "", ins).split()[0].split(".")[0]
                for ins in code[first : i + 1]
            )
            out.append((first, i, ops))
    return out


def renamed(fns: dict[str, list[str]], renames: list[tuple[str, str]]) -> dict[str, list[str]]:
    out = {}
    for name, code in fns.items():
        for pattern, replacement in renames:
            name = re.sub(pattern, replacement, name)
        out[name] = code
    return out


def blanked(code: list[str]) -> list[str]:
    """Instructions with registers, predicates and branch targets blanked."""
    out = []
    for line in code:
        line = re.sub(r"\bU?P\d\b", "P", line)
        line = re.sub(r"\bU?R\d+\b", "R", line)
        out.append(re.sub(r"0x[0-9a-f]+$", "ADDR", line))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--rename", action="append", default=[], help="REGEX=>REPLACEMENT")
    ap.add_argument("--show", help="a function's (renamed) name: its instruction diff")
    ap.add_argument("--loops", help="a function's (renamed) name: its loops in each listing")
    ap.add_argument("--min", type=int, default=16, help="--loops' least instructions a loop")
    args = ap.parse_args()
    renames = [tuple(r.split("=>", 1)) for r in args.rename]
    if any(len(r) != 2 for r in renames):
        ap.error("--rename takes REGEX=>REPLACEMENT")
    old = renamed(functions(args.old), renames)
    new = renamed(functions(args.new), renames)
    if args.loops:
        if args.loops not in old or args.loops not in new:
            ap.error(f"{args.loops!r} is not in both listings")
        for side, fns in (("old", old), ("new", new)):
            for first, last, ops in loops(fns[args.loops], args.min):
                mix = ", ".join(f"{op} {n}" for op, n in ops.most_common(10))
                print(
                    f"{side} loop 0x{16 * first:04x}-0x{16 * last:04x}: "
                    f"{last - first + 1} instructions ({mix})"
                )
        return 0
    if args.show:
        if args.show not in old or args.show not in new:
            ap.error(f"{args.show!r} is not in both listings")
        diff = difflib.unified_diff(blanked(old[args.show]), blanked(new[args.show]), lineterm="")
        print("\n".join(diff) or "the same once registers and branch targets are blanked")
        return 0
    same = 0
    for name in sorted(old.keys() | new.keys()):
        if name not in old:
            print(f"new      {name} ({len(new[name])} instructions)")
        elif name not in new:
            print(f"gone     {name}")
        elif old[name] == new[name]:
            same += 1
        else:
            moved = "instructions" if blanked(old[name]) != blanked(new[name]) else "registers only"
            print(f"changed  {name}: {len(old[name])} -> {len(new[name])} ({moved})")
    print(f"{same} of {len(old.keys() & new.keys())} functions in both byte for byte the same")
    return 0


if __name__ == "__main__":
    sys.exit(main())
