"""Unit tier: the ggml binding, its pin check and owner classes, and device listing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lucepy.errors import DeviceError, GGMLCommitMismatch
from lucepy.ggml import GGML_TYPE_F32, Buffer, Context, _decls, ffi, lib, load
from lucepy.runtime.devices import list_devices, open_backend


class FakeLib:
    directory = "/fake"

    def __init__(self, commit: str, version: str):
        self._c, self._v = ffi.new("char[]", commit.encode()), ffi.new("char[]", version.encode())

    def ggml_commit(self):
        return self._c

    def ggml_version(self):
        return self._v


def test_loaded_ggml_is_the_pinned_one():
    g = load()
    assert ffi.string(g.ggml_version()).decode() == _decls.GGML_VERSION
    assert ffi.string(g.ggml_commit()).decode()[:7] == _decls.GGML_COMMIT[:7]


@pytest.mark.parametrize(
    "commit,version",
    [("deadbee", _decls.GGML_VERSION), (_decls.GGML_COMMIT, "0.9.0"), ("unknown", "0.9.0")],
)
def test_pin_mismatch_is_refused(commit, version):
    with pytest.raises(GGMLCommitMismatch, match="rebuild|reinstall"):
        lib.check_pin(FakeLib(commit, version))


@pytest.mark.parametrize(
    "commit", [_decls.GGML_COMMIT, _decls.GGML_COMMIT[:7] + "-dirty", "unknown"]
)
def test_pinned_builds_are_accepted(commit):
    lib.check_pin(FakeLib(commit, _decls.GGML_VERSION))


def test_owners_free_once_and_close_twice_safely():
    g = load()
    backend = open_backend(g, "cpu", threads=1)
    ctx = Context(g, 2)
    ne = ffi.new("int64_t[4]", [8, 1, 1, 1])
    t = g.ggml_new_tensor(ctx.ptr, GGML_TYPE_F32, 1, ne)
    buf = Buffer(g, ctx, backend, "test")
    assert buf.nbytes >= 32 and t.buffer == buf.ptr
    for owner in (buf, ctx, backend):
        owner.close()
        owner.close()
        assert owner.closed


def test_backend_of_unknown_device_names_the_devices():
    with pytest.raises(DeviceError, match="unknown device 'cuda:7'.*cpu"):
        open_backend(load(), "cuda:7")


def test_devices_cli_json_lists_the_cpu():
    run = subprocess.run(
        [sys.executable, "-m", "lucepy", "devices", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    devices = json.loads(run.stdout)["devices"]
    assert devices == [d.to_dict() for d in list_devices(load())]
    cpu = next(d for d in devices if d["name"] == "cpu")
    assert cpu["memory_total"] > 0 and cpu["backend"] == "cpu"
