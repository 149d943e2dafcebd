"""Prefix snapshots on disk: the file format, atomic writes, an index and a byte budget.

File (docs/prefix-cache.md): ``LUCESNP\\0``, u32 version, u32 header length, a JSON header
(fingerprint, token hash, tokens, logits and tensor tables with offsets, sizes and CRC-32s), then
the data at 64-byte-aligned offsets. A file is written to a temp name, fsynced and renamed, so a
crash mid-write leaves only a temp file, which nothing reads and the next start removes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

MAGIC = b"LUCESNP\0"
VERSION = 1
SUFFIX = ".lsnap"
ALIGN = 64


class BadSnapshot(Exception):
    """A snapshot file that must not be restored (truncated, corrupted, foreign, old)."""


def token_hash(tokens) -> str:
    return hashlib.sha256(np.asarray(tokens, dtype=np.int64).tobytes()).hexdigest()


@dataclass
class Entry:
    path: Path
    tokens: tuple[int, ...]
    has_logits: bool
    size: int


def _table(arrays: dict[str, np.ndarray], start: int) -> tuple[list[dict], int]:
    table, offset = [], start
    for name, arr in arrays.items():
        offset = -(-offset // ALIGN) * ALIGN
        table.append(
            {
                "name": name,
                "dtype": arr.dtype.str,
                "shape": list(arr.shape),
                "offset": offset,
                "nbytes": arr.nbytes,
                "crc32": zlib.crc32(arr),
            }
        )
        offset += arr.nbytes
    return table, offset


def write(path: Path, fingerprint: str, tokens, arrays: dict[str, np.ndarray]) -> int:
    """Write atomically; ``arrays`` may hold ``logits``. Returns the file size."""
    arrays = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
    header = {
        "fingerprint": fingerprint,
        "token_hash": token_hash(tokens),
        "tokens": [int(t) for t in tokens],
        "created": time.time(),
    }
    # offsets depend on the header's length, which depends on the offsets: size the header with
    # the widest possible numbers, then fill in the real ones (never longer)
    widest, _ = _table(arrays, 10**15)
    widest = [{**t, "crc32": 2**32 - 1} for t in widest]
    room = len(MAGIC) + 8 + len(json.dumps({**header, "tensors": widest}).encode())
    table, end = _table(arrays, -(-room // ALIGN) * ALIGN)
    body = json.dumps({**header, "tensors": table}).encode()
    assert len(MAGIC) + 8 + len(body) <= room
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(MAGIC + struct.pack("<II", VERSION, len(body)) + body)
        for entry, arr in zip(table, arrays.values(), strict=True):
            f.write(b"\0" * (entry["offset"] - f.tell()))
            f.write(memoryview(arr).cast("B"))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    return end


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_header(path: Path, fingerprint: str) -> dict:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(len(MAGIC) + 8)
        if len(head) < len(MAGIC) + 8 or head[: len(MAGIC)] != MAGIC:
            raise BadSnapshot("not a lucepy snapshot (bad magic or truncated)")
        version, n = struct.unpack("<II", head[len(MAGIC) :])
        if version != VERSION:
            raise BadSnapshot(f"format version {version}, this lucepy writes {VERSION}")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise BadSnapshot("unreadable header (truncated or corrupted)") from None
    _check_types(header)
    if header["fingerprint"] != fingerprint:
        raise BadSnapshot("made for another model, layout or context")
    if token_hash(header["tokens"]) != header["token_hash"]:
        raise BadSnapshot("token hash mismatch (corrupted)")
    end = max((t["offset"] + t["nbytes"] for t in header["tensors"]), default=0)
    if end > size:
        raise BadSnapshot(f"truncated: {size} bytes of {end}")
    return header


def _is_int(x: object, low: int = 0, high: int = 2**62) -> bool:
    return type(x) is int and low <= x < high


def _check_types(header: object) -> None:
    """Every field this reader uses has its type and range, or the file is refused."""
    ok = (
        isinstance(header, dict)
        and isinstance(header.get("fingerprint"), str)
        and isinstance(header.get("token_hash"), str)
        and isinstance(header.get("tokens"), list)
        and all(_is_int(t, 0, 2**31) for t in header["tokens"])
        and isinstance(header.get("tensors"), list)
    )
    if not ok or not all(_tensor_entry_ok(t) for t in header["tensors"]):
        raise BadSnapshot("malformed header (a field has the wrong type or range)")


def _tensor_entry_ok(t: object) -> bool:
    if not isinstance(t, dict) or not isinstance(t.get("name"), str):
        return False
    if not isinstance(t.get("dtype"), str) or t["dtype"] not in _DTYPES:
        return False
    shape = t.get("shape")
    if not isinstance(shape, list) or not all(_is_int(d, 0, 2**40) for d in shape):
        return False
    fields = (t.get("offset"), t.get("nbytes"), t.get("crc32"))
    if not all(_is_int(v) for v in fields):
        return False
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    return t["nbytes"] == n * np.dtype(t["dtype"]).itemsize


_DTYPES = {"<f4", "<f2", "|u1", "<i4", "<i8"}  # what export writes: f32/f16 state, quantized rows


def read_arrays(path: Path, header: dict) -> dict[str, np.ndarray]:
    """Every array, each checked against its CRC before any is returned."""
    out = {}
    with open(path, "rb") as f:
        for t in header["tensors"]:
            f.seek(t["offset"])
            raw = f.read(t["nbytes"])
            if len(raw) != t["nbytes"]:
                raise BadSnapshot(f"truncated in {t['name']}")
            if zlib.crc32(raw) != t["crc32"]:
                raise BadSnapshot(f"{t['name']} fails its checksum (corrupted)")
            out[t["name"]] = np.frombuffer(raw, dtype=np.dtype(t["dtype"])).reshape(t["shape"])
    return out


class DiskCache:
    """The snapshots of one model and layout in one directory, kept under a byte budget."""

    def __init__(self, directory: str | os.PathLike, fingerprint: str, budget_bytes: int):
        self.dir = Path(directory).expanduser()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fingerprint, self.budget = fingerprint, budget_bytes
        self.entries: dict[str, Entry] = {}
        self._scan()

    def _scan(self) -> None:
        for tmp in self.dir.glob(f".*{SUFFIX}.tmp-*"):
            log.warning("prefix cache: removing %s, an unfinished write", tmp.name)
            tmp.unlink(missing_ok=True)
        for path in sorted(self.dir.glob(f"*{SUFFIX}")):
            try:
                header = read_header(path, self.fingerprint)
            except (BadSnapshot, OSError, KeyError, TypeError) as err:
                self._drop(path, err)
                continue
            has_logits = any(t["name"] == "logits" for t in header["tensors"])
            self.entries[header["token_hash"]] = Entry(
                path, tuple(header["tokens"]), has_logits, path.stat().st_size
            )

    def _drop(self, path: Path, why: object) -> None:
        log.warning("prefix cache: removing %s: %s", path.name, why)
        path.unlink(missing_ok=True)
        self.entries = {k: e for k, e in self.entries.items() if e.path != path}

    def find(self, prompt: list[int]) -> Entry | None:
        """The entry with the longest usable prefix of ``prompt``."""
        best = None
        for e in self.entries.values():
            n = len(e.tokens)
            usable = n < len(prompt) or (n == len(prompt) and e.has_logits)
            if usable and (best is None or n > len(best.tokens)) and tuple(prompt[:n]) == e.tokens:
                best = e
        return best

    def load(self, entry: Entry) -> dict[str, np.ndarray] | None:
        try:
            arrays = read_arrays(entry.path, read_header(entry.path, self.fingerprint))
        except (BadSnapshot, OSError, KeyError, ValueError) as err:
            self._drop(entry.path, err)
            return None
        os.utime(entry.path)  # recently used: last to be evicted
        return arrays

    def save(self, tokens, arrays: dict[str, np.ndarray]) -> Path | None:
        h = token_hash(tokens)
        if h in self.entries:
            os.utime(self.entries[h].path)
            return self.entries[h].path
        path = self.dir / f"{self.fingerprint[:16]}-{h[:16]}{SUFFIX}"
        size = sum(a.nbytes for a in arrays.values())
        if size > self.budget:
            log.info("prefix cache: a %d-byte snapshot exceeds the disk budget; not written", size)
            return None
        self._evict(self.budget - size)
        size = write(path, self.fingerprint, tokens, arrays)
        self.entries[h] = Entry(path, tuple(int(t) for t in tokens), "logits" in arrays, size)
        return path

    def _evict(self, room: int) -> None:
        """Remove least recently used files until the rest fit in ``room`` bytes."""
        live = sorted(self.entries.values(), key=lambda e: e.path.stat().st_mtime)
        total = sum(e.size for e in live)
        while live and total > room:
            e = live.pop(0)
            total -= e.size
            log.info("prefix cache: evicting %s (budget)", e.path.name)
            self._drop(e.path, "evicted to stay within the budget")

    @property
    def nbytes(self) -> int:
        return sum(p.stat().st_size for p in self.dir.glob(f"*{SUFFIX}"))
