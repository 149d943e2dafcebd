"""Prefix snapshots on disk: the file format, chains, atomic writes, an index and a byte budget.

File (docs/prefix-cache.md): ``LUCESNP\\0``, u32 version, u32 header length, a JSON header
(fingerprint, token hash, tokens, parent, logits and tensor tables with offsets, sizes and
CRC-32s), then the data at 64-byte-aligned offsets. A file is written to a temp name, fsynced and
renamed, so a crash mid-write leaves only a temp file, which nothing reads and the next start
removes.

A file is a *root*, holding the whole state of its tokens, or a *link* of a chain: it names its
parent (the snapshot of a prefix of its tokens, taken earlier along the same sequence) and holds
only its own new tokens, the rows its appending tensors (attention KV) gained since the parent,
and the tensors kept whole (recurrent state) at its own length. A restore reads the chain from its
root; a link whose parent is gone or bad is gone too, so a torn chain leaves its intact prefix.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import struct
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

MAGIC = b"LUCESNP\0"
VERSION = 2
SUFFIX = ".lsnap"
ALIGN = 64


class BadSnapshot(Exception):
    """A snapshot file that must not be restored (truncated, corrupted, foreign, old)."""


def token_hash(tokens) -> str:
    return hashlib.sha256(np.asarray(tokens, dtype=np.int64).tobytes()).hexdigest()


@dataclass
class Entry:
    key: str  # the token hash of ``tokens``
    path: Path
    tokens: tuple[int, ...]  # the whole prefix, the parents' tokens first
    has_logits: bool
    size: int
    parent: str | None = None  # the parent's token hash; None for a root


@dataclass(frozen=True)
class Link:
    """Where a new snapshot attaches: its parent's token hash and length, and the first cache
    row of each appending tensor's piece (the rows the parent holds)."""

    parent: str
    start: int
    first_row: int


def _table(
    arrays: dict[str, np.ndarray], start: int, appended: set[str], first_row: int
) -> tuple[list, int]:
    table, offset = [], start
    for name, arr in arrays.items():
        offset = -(-offset // ALIGN) * ALIGN
        entry = {
            "name": name,
            "dtype": arr.dtype.str,
            "shape": list(arr.shape),
            "offset": offset,
            "nbytes": arr.nbytes,
            "crc32": zlib.crc32(arr),
        }
        if name in appended:
            entry["first_row"] = first_row
        table.append(entry)
        offset += arr.nbytes
    return table, offset


def write(
    path: Path,
    fingerprint: str,
    tokens,
    arrays: dict[str, np.ndarray],
    appended: set[str],
    link: Link | None = None,
) -> int:
    """Write atomically; ``arrays`` may hold ``logits``, and those named in ``appended`` are rows
    of appending tensors. With ``link``, ``tokens`` is still the whole prefix; the file keeps
    those after ``link.start``, and the appending arrays are the pieces from ``link.first_row``.
    Returns the file size."""
    arrays = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
    start, first_row = (link.start, link.first_row) if link else (0, 0)
    header = {
        "fingerprint": fingerprint,
        "token_hash": token_hash(tokens),
        "parent": link.parent if link else None,
        "start": start,
        "tokens": [int(t) for t in tokens[start:]],
        "created": time.time(),
    }
    # offsets depend on the header's length, which depends on the offsets: size the header with
    # the widest possible numbers, then fill in the real ones (never longer)
    widest, _ = _table(arrays, 10**15, appended, first_row)
    widest = [{**t, "crc32": 2**32 - 1} for t in widest]
    room = len(MAGIC) + 8 + len(json.dumps({**header, "tensors": widest}).encode())
    table, end = _table(arrays, -(-room // ALIGN) * ALIGN, appended, first_row)
    body = json.dumps({**header, "tensors": table}).encode()
    assert len(MAGIC) + 8 + len(body) <= room
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(MAGIC + struct.pack("<II", VERSION, len(body)) + body)
        for entry, arr in zip(table, arrays.values(), strict=True):
            f.write(b"\0" * (entry["offset"] - f.tell()))
            f.write(memoryview(arr.reshape(-1)).cast("B"))  # flat: an empty array casts too
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
    root = header["parent"] is None
    if root and (header["start"] != 0 or token_hash(header["tokens"]) != header["token_hash"]):
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
        and (header.get("parent") is None or isinstance(header["parent"], str))
        and _is_int(header.get("start"), 0, 2**31)
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
    if "first_row" in t and not (_is_int(t["first_row"], 0, 2**31) and shape):
        return False
    n = math.prod(shape)
    return t["nbytes"] == n * np.dtype(t["dtype"]).itemsize


_DTYPES = {"<f4", "<f2", "|u1", "<i4", "<i8"}  # what export writes: f32/f16 state, quantized rows


def read_arrays(
    path: Path, header: dict, pieces_only: bool = False, into: dict[str, np.ndarray] | None = None
) -> dict[str, np.ndarray]:
    """Every array (only the appending pieces with ``pieces_only``), each checked against its
    CRC before any is returned. A tensor named in ``into`` is read into that (contiguous) array
    of its shape and dtype instead."""
    wanted = [t for t in header["tensors"] if not pieces_only or "first_row" in t]
    if not wanted:
        return {}
    start = min(t["offset"] for t in wanted)
    with open(path, "rb") as f:  # one read: a link's pieces are many and small
        f.seek(start)
        data = memoryview(f.read(max(t["offset"] + t["nbytes"] for t in wanted) - start))
    out = {}
    for t in wanted:
        raw = data[t["offset"] - start : t["offset"] - start + t["nbytes"]]
        if len(raw) != t["nbytes"]:
            raise BadSnapshot(f"truncated in {t['name']}")
        if zlib.crc32(raw) != t["crc32"]:
            raise BadSnapshot(f"{t['name']} fails its checksum (corrupted)")
        arr = np.frombuffer(raw, dtype=np.dtype(t["dtype"])).reshape(t["shape"])
        dest = (into or {}).get(t["name"])
        if dest is not None:
            if dest.shape != arr.shape or dest.dtype != arr.dtype:
                raise BadSnapshot(f"{t['name']} does not fit its parent's pieces")
            dest[...] = arr
            arr = dest
        out[t["name"]] = arr
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
        headers = []
        for path in sorted(self.dir.glob(f"*{SUFFIX}")):
            try:
                headers.append((path, read_header(path, self.fingerprint)))
            except (BadSnapshot, OSError, KeyError, TypeError) as err:
                self._drop(path, err)
        # parents before their links: a link starts where its parent ends
        for path, header in sorted(headers, key=lambda ph: ph[1]["start"]):
            parent = self.entries.get(header["parent"]) if header["parent"] else None
            if header["parent"] and (parent is None or len(parent.tokens) != header["start"]):
                self._drop(path, "its parent snapshot is missing (a torn chain)")
                continue
            tokens = (parent.tokens if parent else ()) + tuple(header["tokens"])
            if parent and token_hash(tokens) != header["token_hash"]:
                self._drop(path, "token hash mismatch (corrupted)")
                continue
            if not header["tokens"] or header["token_hash"] in self.entries:
                self._drop(path, "no tokens of its own, or another file's tokens")
                continue
            has_logits = any(t["name"] == "logits" for t in header["tensors"])
            size = path.stat().st_size
            key = header["token_hash"]
            self.entries[key] = Entry(key, path, tokens, has_logits, size, header["parent"])

    def _drop(self, path: Path, why: object) -> None:
        """Remove a file, and every link that hangs from it."""
        log.warning("prefix cache: removing %s: %s", path.name, why)
        path.unlink(missing_ok=True)
        gone = [k for k, e in self.entries.items() if e.path == path]
        for key in gone:
            del self.entries[key]
        for key in gone:
            for child in [e for e in self.entries.values() if e.parent == key]:
                self._drop(child.path, "its parent snapshot was removed")

    def chain(self, entry: Entry) -> list[Entry]:
        """``entry`` and its ancestors, root first."""
        out = [entry]
        while out[-1].parent is not None:
            out.append(self.entries[out[-1].parent])
        return out[::-1]

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
        """The state of ``entry``, its chain's pieces read into whole arrays; None (and the bad
        link and what hangs from it removed) if a file of the chain fails a check."""
        links, headers = self.chain(entry), []
        rows: dict[str, int] = {}  # per appending tensor, the rows its pieces so far cover
        inner: dict[str, tuple] = {}  # and its (dtype, row shape)
        for i, link in enumerate(links):
            try:
                header = read_header(link.path, self.fingerprint)
                got = {t["name"]: t for t in header["tensors"] if "first_row" in t}
                if i and set(got) != set(rows):
                    raise BadSnapshot("its appending tensors are not its parent's")
                for name, t in got.items():
                    if t["first_row"] != rows.get(name, 0):
                        raise BadSnapshot(f"{name} does not continue its parent's rows")
                    if inner.setdefault(name, (t["dtype"], t["shape"][1:])) != (
                        t["dtype"],
                        t["shape"][1:],
                    ):
                        raise BadSnapshot(f"{name} has another row shape than its parent's")
                    rows[name] = t["first_row"] + t["shape"][0]
                if len(set(rows.values())) > 1:
                    raise BadSnapshot("its pieces do not cover the same rows")
            except (BadSnapshot, OSError, KeyError, ValueError, IndexError) as err:
                self._drop(link.path, err)
                return None
            headers.append(header)
        joined = {n: np.empty((rows[n], *inner[n][1]), np.dtype(inner[n][0])) for n in rows}
        for link, header in zip(links, headers, strict=True):
            into = {
                t["name"]: joined[t["name"]][t["first_row"] : t["first_row"] + t["shape"][0]]
                for t in header["tensors"]
                if "first_row" in t
            }
            try:
                arrays = read_arrays(link.path, header, link is not entry, into)
            except (BadSnapshot, OSError, ValueError) as err:
                self._drop(link.path, err)
                return None
        now = time.time()
        for link in links:  # recently used, the chain with it: last to be evicted
            os.utime(link.path, (now, now))
        return {**arrays, **joined}  # the entry's own whole tensors and logits, and the pieces

    def save(
        self, tokens, arrays: dict[str, np.ndarray], appended: set[str], link: Link | None = None
    ) -> Path | None:
        """Write a snapshot of ``tokens``: a root, or with ``link`` a link to a kept parent
        (``appended``: which arrays are rows of appending tensors). None if it does not fit the
        budget (a link, also when keeping its chain leaves no room: the caller may then write a
        root)."""
        h = token_hash(tokens)
        if h in self.entries:
            os.utime(self.entries[h].path)
            return self.entries[h].path
        keep = set()
        if link is not None:
            parent = self.entries.get(link.parent)
            if parent is None or len(parent.tokens) != link.start:
                return None
            keep = {e.path for e in self.chain(parent)}
        path = self.dir / f"{self.fingerprint[:16]}-{h[:16]}{SUFFIX}"
        size = sum(a.nbytes for a in arrays.values())
        if not self._evict(self.budget - size, keep):
            log.info("prefix cache: a %d-byte snapshot does not fit the disk budget", size)
            return None
        size = write(path, self.fingerprint, tokens, arrays, appended, link)
        parent = link.parent if link else None
        tokens = tuple(int(t) for t in tokens)
        self.entries[h] = Entry(h, path, tokens, "logits" in arrays, size, parent)
        return path

    def _evict(self, room: int, keep: set[Path]) -> bool:
        """Remove the least recently used snapshots that no link hangs from, never those in
        ``keep``, until the rest fit in ``room`` bytes. Whether they do."""
        if room < 0:
            return False
        while True:
            total = sum(e.size for e in self.entries.values())
            if total <= room:
                return True
            parents = {e.parent for e in self.entries.values()}
            leaves = [e for e in self.entries.values() if e.key not in parents]
            live = [e for e in leaves if e.path not in keep]
            if not live:
                return False
            oldest = min(live, key=lambda e: e.path.stat().st_mtime)
            log.info("prefix cache: evicting %s (budget)", oldest.path.name)
            self._drop(oldest.path, "evicted to stay within the budget")

    @property
    def nbytes(self) -> int:
        return sum(p.stat().st_size for p in self.dir.glob(f"*{SUFFIX}"))
