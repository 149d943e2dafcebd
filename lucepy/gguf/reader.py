"""Read a GGUF file: typed metadata, a tensor index, and zero-copy views of tensor data.

The file is memory-mapped once; tensor data is never read until a loader asks for it.
Format (little-endian): magic "GGUF", version u32, n_tensors u64, n_kv u64, the key/value pairs,
the tensor infos, then the data section at the next multiple of ``general.alignment`` (default 32).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from lucepy.errors import (
    BadMagic,
    MissingMetadata,
    ModelFileError,
    ModelFileNotFound,
    TruncatedFile,
)

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUF value type id -> struct format (scalars only; 8 is string, 9 is array)
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_NUMPY = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "<?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_STRING, _ARRAY = 8, 9
_MISSING = object()


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: shape[0] is the innermost (contiguous) dimension
    type: GGMLQuantizationType
    offset: int  # from the start of the file
    nbytes: int


class _Cursor:
    """Bounds-checked little-endian reads over the mapped header."""

    def __init__(self, buf: memoryview, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            raise TruncatedFile(
                f"{self.path}: file ends at byte {len(self.buf)} inside the header "
                f"(needed {self.pos + n}); the download or copy is incomplete"
            )
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        raw = bytes(self.take(self.unpack("<Q")))
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.unpack("<I"), self.unpack("<Q")
            if etype in _NUMPY:
                size = np.dtype(_NUMPY[etype]).itemsize * count
                return np.frombuffer(self.take(size), dtype=_NUMPY[etype]).tolist()
            return [self.value(etype) for _ in range(count)]
        raise ModelFileError(f"{self.path}: unknown GGUF value type {vtype} at byte {self.pos}")


class GGUFFile:
    """An open GGUF file. ``close()`` is safe to call twice."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelFileNotFound(f"{self.path}: no such model file; check the path")
        self._file = open(self.path, "rb")  # noqa: SIM115 - owned until close()
        size = os.fstat(self._file.fileno()).st_size
        if size < 4:
            self._file.close()
            raise TruncatedFile(f"{self.path}: only {size} bytes; not a GGUF file")
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        self.size = size
        try:
            self._parse(memoryview(self._map))
        except BaseException:
            self.close()
            raise

    def _parse(self, buf: memoryview) -> None:
        cur = _Cursor(buf, self.path)
        magic = bytes(cur.take(4))
        if magic != MAGIC:
            raise BadMagic(f"{self.path}: bad magic {magic!r} (expected b'GGUF'); not a GGUF file")
        self.version = cur.unpack("<I")
        if self.version not in SUPPORTED_VERSIONS:
            raise ModelFileError(
                f"{self.path}: GGUF version {self.version} is not supported (2, 3)"
            )
        n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.unpack("<I"))
        raw = [self._tensor_header(cur) for _ in range(n_tensors)]
        align = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        self.data_offset = -(-cur.pos // align) * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, ttype, rel in raw:
            info = self._tensor_info(name, shape, ttype, self.data_offset + rel)
            self.tensors[name] = info

    def _tensor_header(self, cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
        name = cur.string()
        n_dims = cur.unpack("<I")
        shape = tuple(cur.unpack("<Q") for _ in range(n_dims))
        return name, shape, cur.unpack("<I"), cur.unpack("<Q")

    def _tensor_info(self, name: str, shape: tuple, ttype: int, offset: int) -> TensorInfo:
        try:
            qtype = GGMLQuantizationType(ttype)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ModelFileError(f"{self.path}: tensor {name!r} has unknown type {ttype}") from None
        n = int(np.prod(shape, dtype=np.int64))
        if not shape or shape[0] % block:  # ggml stores each row as whole blocks
            raise ModelFileError(
                f"{self.path}: tensor {name!r} {shape} has rows that are not whole {qtype.name} "
                f"blocks of {block}"
            )
        nbytes = n // block * type_size
        if offset + nbytes > self.size:
            raise TruncatedFile(
                f"{self.path}: tensor {name!r} needs bytes {offset}..{offset + nbytes} but the "
                f"file "
                f"has {self.size}; the download or copy is incomplete"
            )
        return TensorInfo(name, shape, qtype, offset, nbytes)

    # metadata
    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        try:
            return self.metadata[key]
        except KeyError:
            raise MissingMetadata(f"{self.path}: metadata key {key!r} is missing") from None

    def identity(self, samples: int = 64, width: int = 4096) -> str:
        """A digest of the header (metadata, tensor index), the size, and ``samples`` slices of
        the weights spread over the file: fine-tunes share headers, so the data must count too,
        but reading it all would cost seconds per GB."""
        view = memoryview(self._map)
        h = hashlib.sha256(view[: self.data_offset])
        h.update(str(self.size).encode())
        span = max(self.size - self.data_offset - width, 0)
        for i in range(samples):
            at = self.data_offset + span * i // max(samples - 1, 1)
            h.update(view[at : at + width])
        return h.hexdigest()

    # tensor data
    def data(self, name: str) -> memoryview:
        """A read-only view of the tensor's bytes, straight from the mapping."""
        info = self.tensors[name]
        return memoryview(self._map)[info.offset : info.offset + info.nbytes]

    def close(self) -> None:
        if getattr(self, "_map", None) is not None:
            try:
                self._map.close()
            except BufferError:
                pass  # a numpy view still points at it; the mapping goes with the last view
            self._map = None
        if getattr(self, "_file", None) is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
