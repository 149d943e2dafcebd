"""Every bad model file gives one clear error: an exception from the API, one line from the CLI."""

from __future__ import annotations

import struct
import subprocess
import sys

import gguf
import pytest

from lucepy.errors import (
    BadMagic,
    MissingTensor,
    ModelFileNotFound,
    TensorShapeMismatch,
    TruncatedFile,
    UnsupportedArchitecture,
)
from lucepy.runtime.config import RuntimeConfig
from lucepy.runtime.engine import Engine


def patch(path, old: bytes, new: bytes) -> None:
    data = path.read_bytes()
    assert data.count(old) == 1 and len(old) == len(new)
    path.write_bytes(data.replace(old, new))


def bump_u32(path, key: bytes, delta: int) -> None:
    """Add ``delta`` to the u32 metadata value stored under ``key``."""
    data = bytearray(path.read_bytes())
    at = data.index(key) + len(key)
    vtype, value = struct.unpack_from("<II", data, at)
    assert vtype == gguf.GGUFValueType.UINT32
    struct.pack_into("<I", data, at + 4, value + delta)
    path.write_bytes(bytes(data))


def missing(tmp_path, copy_model):
    return tmp_path / "nope.gguf", "no such model file"


def bad_magic(tmp_path, copy_model):
    path = copy_model()
    data = path.read_bytes()
    path.write_bytes(b"GGML" + data[4:])
    return path, "bad magic"


def truncated_data(tmp_path, copy_model):
    path = copy_model()
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path, "incomplete"


def truncated_header(tmp_path, copy_model):
    path = copy_model()
    path.write_bytes(path.read_bytes()[:300])
    return path, "inside the header"


def unsupported_arch(tmp_path, copy_model):
    path = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return path, "'mamba' is not supported; lucepy runs: gemma4, laguna, llama, qwen35"


def missing_tensor(tmp_path, copy_model):
    path = copy_model()
    patch(path, b"blk.1.ssm_out.weight", b"blk.1.ssm_xyz.weight")
    return path, "'blk.1.ssm_out.weight' is missing"


def shape_mismatch(tmp_path, copy_model):
    path = copy_model()
    bump_u32(path, b"qwen35.feed_forward_length", 32)
    return path, "has shape"


CASES = {
    "missing": (missing, ModelFileNotFound),
    "bad_magic": (bad_magic, BadMagic),
    "truncated_data": (truncated_data, TruncatedFile),
    "truncated_header": (truncated_header, TruncatedFile),
    "unsupported_arch": (unsupported_arch, UnsupportedArchitecture),
    "missing_tensor": (missing_tensor, MissingTensor),
    "shape_mismatch": (shape_mismatch, TensorShapeMismatch),
}


@pytest.mark.parametrize("case", list(CASES))
def test_engine_raises_a_clear_error(case, tmp_path, copy_model):
    make, error = CASES[case]
    path, words = make(tmp_path, copy_model)
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        Engine(path, RuntimeConfig(threads=1))


@pytest.mark.parametrize("case", list(CASES))
def test_cli_prints_one_line_and_exits_nonzero(case, tmp_path, copy_model):
    path, words = CASES[case][0](tmp_path, copy_model)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "lucepy",
            "generate",
            str(path),
            "--prompt",
            "hi",
            "--max-tokens",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 1
    assert "Traceback" not in run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), run.stderr
    assert words in lines[0]
    assert run.stdout == ""
