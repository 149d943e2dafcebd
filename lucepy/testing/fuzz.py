"""A seeded GGUF mutator and a loader that runs each mutant in a child process, for the fault
tests: every malformed file must give one line (a LucepyError), never a signal, a traceback or a
hang.

Mutations: byte flips, truncations, and edits of the header's fields (tensor and key counts,
string and array lengths, value types, dimension counts, dims, tensor type ids and offsets), whose
positions ``fields`` finds by walking the header as the reader does.

    python -m lucepy.testing.fuzz MODEL.gguf N [--seed S]   # the long run; prints a summary
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # value type: bytes
_STRING, _ARRAY = 8, 9


def fields(data: bytes) -> list[tuple[str, int, int]]:
    """(kind, position, width) of the header's integer fields, walking as a GGUF reader does."""
    out, pos = [("n_tensors", 8, 8), ("n_kv", 16, 8)], 24
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)

    def string(kind: str) -> None:
        nonlocal pos
        out.append((kind, pos, 8))
        pos += 8 + struct.unpack_from("<Q", data, pos)[0]

    def value(vtype: int) -> None:
        nonlocal pos
        if vtype == _STRING:
            string("string_len")
        elif vtype == _ARRAY:
            etype, n = struct.unpack_from("<IQ", data, pos)
            out.extend([("value_type", pos, 4), ("array_len", pos + 4, 8)])
            pos += 12
            for _ in range(n):
                value(etype)
        else:
            pos += _SCALAR[vtype]

    for _ in range(n_kv):
        string("key_len")
        out.append(("value_type", pos, 4))
        pos += 4
        value(struct.unpack_from("<I", data, pos - 4)[0])
    for _ in range(n_tensors):
        string("name_len")
        n_dims = struct.unpack_from("<I", data, pos)[0]
        out.append(("n_dims", pos, 4))
        out.extend(("dim", pos + 4 + 8 * i, 8) for i in range(n_dims))
        pos += 4 + 8 * n_dims
        out.extend([("type", pos, 4), ("offset", pos + 4, 8)])
        pos += 12
    return out


def mutate(data: bytes, rng: np.random.Generator, where: list[tuple[str, int, int]]) -> bytes:
    """One mutant: a header field set to an edge or random value, bytes flipped, or a cut."""
    buf = bytearray(data)
    kind = rng.integers(3)
    if kind == 0:
        _, pos, width = where[rng.integers(len(where))]
        top = 2 ** (8 * width) - 1
        choice = [0, 1, 2, 3, 41, 42, 255, top, top // 2, int(rng.integers(0, 2**31))]
        value = choice[rng.integers(len(choice))] & top
        buf[pos : pos + width] = value.to_bytes(width, "little")
    elif kind == 1:
        for _ in range(int(rng.integers(1, 9))):
            at = int(rng.integers(len(buf)))
            buf[at] ^= 1 << int(rng.integers(8))
    else:
        buf = buf[: int(rng.integers(len(buf)))]
    return bytes(buf)


_BAD_VALUES = [None, "x", -1, 0, 1, 2**70, 1.5, [], {}, [1, "a"], True]


def mutate_snapshot(data: bytes, rng: np.random.Generator) -> bytes:
    """One mutant of a ``.lsnap`` file: a header field set to a wrong type or value (the header
    re-padded to its length when it fits, so the data offsets may still hold), bytes flipped, or
    a cut."""
    kind = rng.integers(3)
    if kind == 1:
        buf = bytearray(data)
        for _ in range(int(rng.integers(1, 9))):
            buf[int(rng.integers(len(buf)))] ^= 1 << int(rng.integers(8))
        return bytes(buf)
    if kind == 2:
        return data[: int(rng.integers(len(data)))]
    start = 16  # magic, version, header length
    n = struct.unpack_from("<I", data, 12)[0]
    header = json.loads(data[start : start + n])
    spots = [(header, k) for k in header]
    spots += [(t, k) for t in header["tensors"] for k in t]
    spots += [(header["tokens"], i) for i in range(len(header["tokens"]))]
    box, key = spots[rng.integers(len(spots))]
    box[key] = _BAD_VALUES[rng.integers(len(_BAD_VALUES))]
    body = json.dumps(header).encode()
    body += b" " * max(n - len(body), 0)
    return data[:12] + struct.pack("<I", len(body)) + body + data[start + n :]


@dataclass
class Outcome:
    index: int
    result: str  # "ok", "error" (one clean line), "traceback", "signal N", "hang"
    line: str


_CHILD = """
import sys
from lucepy.errors import LucepyError
from lucepy.runtime.config import RuntimeConfig
from lucepy.runtime.engine import Engine
for path in sys.argv[1:]:
    print("start", path, flush=True)
    try:
        Engine(path, RuntimeConfig(threads=1, max_ctx=64)).close()
        print("ok", flush=True)
    except LucepyError as err:
        text = str(err)
        print("error" if "\\n" not in text else "multiline", text.replace("\\n", " | "), flush=True)
"""


def run(paths: list[Path], timeout_s: float = 10.0) -> list[Outcome]:
    """Load every file in a child; a child that dies or hangs is restarted after that file."""
    out: list[Outcome] = []
    while len(out) < len(paths):
        got = _batch(paths[len(out) :], timeout_s, len(out))
        out.extend(got or [Outcome(len(out), "signal ?", "the child died before loading")])
    return out


def _batch(paths: list[Path], timeout_s: float, start: int) -> list[Outcome]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, *map(str, paths)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s * len(paths))
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
    out, pending = [], False
    for line in stdout.splitlines():
        if line.startswith("start "):
            pending = True
            continue
        result, _, text = line.partition(" ")
        out.append(Outcome(start + len(out), result, text))
        pending = False
    code, tail = proc.returncode, stderr.strip()[-300:]
    if pending:  # the child died or hung on this file
        result = "hang" if code == -9 else f"signal {-code}" if code < 0 else "traceback"
        out.append(Outcome(start + len(out), result, tail))
    elif code != 0:
        out.append(Outcome(start + len(out), "traceback", tail))
    return out


def fuzz(model: Path, n: int, seed: int, folder: Path) -> list[Outcome]:
    data = model.read_bytes()
    where, rng = fields(data), np.random.default_rng(seed)
    paths = []
    for i in range(n):
        path = folder / f"m{i}.gguf"
        path.write_bytes(mutate(data, rng, where))
        paths.append(path)
    return run(paths)


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    model, n = Path(args[0]), int(args[1])
    seed = int(args[args.index("--seed") + 1]) if "--seed" in args else 0
    with tempfile.TemporaryDirectory() as tmp:
        outcomes = fuzz(model, n, seed, Path(tmp))
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o.result] = counts.get(o.result, 0) + 1
    print(json.dumps({"mutants": n, "seed": seed, "results": counts}))
    for o in outcomes:
        if o.result not in ("ok", "error"):
            print(o.index, o.result, o.line, file=sys.stderr)
    return 0 if set(counts) <= {"ok", "error"} else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
