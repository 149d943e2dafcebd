"""Generate lucepy/ggml/_decls.py from the pinned ggml headers.

The headers come from the pinned llama-cpp-python sdist (vendor/ggml/pin.toml). We run the C
preprocessor over them with empty stand-ins for the system headers, so the output holds only ggml's
own declarations, then append the integer ``#define`` constants that cffi can take as they are.

    python tools/gen_ggml_decls.py [--sdist PATH.tar.gz|DIR]

Without --sdist the sdist is fetched with ``pip download``. The result is committed.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "lucepy" / "ggml" / "_decls.py"
HEADERS = ["ggml.h", "ggml-alloc.h", "ggml-backend.h", "ggml-cpu.h", "ggml-rpc.h"]
SYSTEM_STUBS = ["stdbool.h", "stddef.h", "stdint.h", "stdio.h", "stdlib.h", "string.h"]
DEFINE = re.compile(r"^\s*#\s*define\s+(GGML_[A-Z0-9_]+)\s+(\(?-?\d+\)?|0x[0-9a-fA-F]+)\s*(//.*)?$")
# cffi has no use for these: parameter qualifiers and compiler keywords
STRIP = [
    (re.compile(r"\b__restrict__\b|\b__restrict\b|\brestrict\b"), ""),
    (re.compile(r"\bextern\b\s*"), ""),
    (re.compile(r"\b__declspec\s*\([^)]*\)"), ""),
    (re.compile(r"sizeof\((u?int32_t|float)\)"), "4"),
    (re.compile(r"^.*\bstatic const\b.*$", re.M), ""),  # computed constants cffi cannot evaluate
]


def pin() -> dict:
    return tomllib.loads((ROOT / "vendor" / "ggml" / "pin.toml").read_text())


def include_dir(sdist: Path | None, work: Path) -> Path:
    version = pin()["llama_cpp_python"]["version"]
    if sdist is None:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                f"llama-cpp-python=={version}",
                "-d",
                str(work),
            ],
            check=True,
        )
        sdist = next(work.glob("llama_cpp_python-*.tar.gz"))
    if sdist.is_file():
        with tarfile.open(sdist) as tar:
            members = [
                m
                for m in tar.getmembers()
                if "/ggml/include/" in m.name or m.name.endswith("/ggml/src/ggml-impl.h")
            ]
            tar.extractall(work, members=members, filter="data")
        sdist = work
    found = sorted(sdist.glob("**/vendor/llama.cpp/ggml/include/ggml.h"))
    if not found:
        raise SystemExit(f"no vendor/llama.cpp/ggml/include/ggml.h under {sdist}")
    return found[0].parent


def preprocess(inc: Path, work: Path) -> str:
    stubs = work / "stubs"
    stubs.mkdir(exist_ok=True)
    for name in SYSTEM_STUBS:
        (stubs / name).write_text("")
    wrapper = work / "all.h"
    wrapper.write_text("".join(f'#include "{h}"\n' for h in HEADERS))
    cmd = [
        "cc",
        "-E",
        "-P",
        "-nostdinc",
        "-I",
        str(stubs),
        "-I",
        str(inc),
        "-D__attribute__(x)=",
        "-DGGML_BACKEND_SHARED=0",
        str(wrapper),
    ]
    text = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    for pattern, repl in STRIP:
        text = pattern.sub(repl, text)
    lines, seen = [], set()
    for line in text.splitlines():
        key = " ".join(line.split())
        if not key or (key.startswith("typedef") and key.endswith(";") and key in seen):
            continue  # ggml-alloc.h and ggml-backend.h repeat some one-line typedefs
        seen.add(key)
        lines.append(line.rstrip())
    return "\n".join(lines)


# ggml_cgraph is opaque in the public headers. We need its ``uid``: ggml-rpc re-sends a whole graph
# unless the uid matches the last one it ran, so a reused graph gets a uid (ggml_graph_next_uid).
INTERNAL = [
    "typedef uint32_t ggml_bitset_t;",
    "enum ggml_cgraph_eval_order {",
    "struct ggml_hash_set {",
    "struct ggml_cgraph {",
]


def internal_decls(inc: Path) -> str:
    text = (inc.parent / "src" / "ggml-impl.h").read_text()
    out = ["// from ggml/src/ggml-impl.h (internal, pinned)"]
    for start in INTERNAL:
        at = text.index(start)
        end = text.index("};", at) + 2 if start.endswith("{") else at + len(start)
        out.append(re.sub(r"//.*", "", text[at:end]))
    out.append("uint64_t ggml_graph_next_uid(void);")
    return "\n".join(out)


def defines(inc: Path) -> list[str]:
    seen: dict[str, str] = {}
    for name in HEADERS:
        for line in (inc / name).read_text().splitlines():
            m = DEFINE.match(line)
            if m and m.group(1) not in seen:
                seen[m.group(1)] = m.group(2).strip("()")
    return [f"#define {k} {v}" for k, v in seen.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--sdist", type=Path, help="the llama-cpp-python sdist (.tar.gz or extracted dir)"
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        inc = include_dir(args.sdist, work)
        body = preprocess(inc, work) + "\n" + internal_decls(inc)
        consts = defines(inc)
    p = pin()
    OUT.write_text(
        '"""Generated by tools/gen_ggml_decls.py from the pinned ggml headers. Do not edit."""\n\n'
        f"LLAMA_CPP_PYTHON_VERSION = {p['llama_cpp_python']['version']!r}\n"
        f"GGML_COMMIT = {p['ggml']['commit']!r}\n"
        f"GGML_VERSION = {p['ggml']['version']!r}\n"
        f"HEADERS = {HEADERS!r}\n\n"
        'CDEF = r"""\n' + body + "\n" + "\n".join(consts) + '\n"""\n'
    )
    print(f"wrote {OUT.relative_to(ROOT)}: {len(body.splitlines())} lines, {len(consts)} constants")


if __name__ == "__main__":
    main()
