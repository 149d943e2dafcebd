"""The load plan: pure, printable, and what a load actually does."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from rich.console import Console

from lucepy import tui
from lucepy.errors import ConfigError
from lucepy.runtime import backends
from lucepy.runtime.config import RuntimeConfig
from lucepy.runtime.engine import Engine
from lucepy.runtime.placement import layer_ranges
from lucepy.runtime.workers import is_loopback


def lucepy(*args):
    return subprocess.run(
        [sys.executable, "-m", "lucepy", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_plan_json_matches_what_is_loaded(tiny_model):
    path = tiny_model("odd", "q8_0")
    run = lucepy(
        "plan",
        path,
        "--target-devices",
        "cpu,cpu@worker",
        "--target-layer-split",
        "0.3,0.7",
        "--max-ctx",
        "512",
        "--json",
    )
    assert run.returncode == 0, run.stderr
    plan = json.loads(run.stdout)
    assert [s["layers"] for s in plan["shards"]] == [[0, 2], [2, 5]]
    assert [s["process"] for s in plan["shards"]] == ["local", "worker"]
    assert set(plan["shards"][0]) == {
        "device",
        "backend",
        "layers",
        "weight_bytes",
        "state_bytes",
        "process",
    }
    cfg = RuntimeConfig(device="cpu,cpu@worker", layer_split="0.3,0.7", max_ctx=512, threads=2)
    with Engine(path, cfg, tokenizer=False) as engine:
        assert engine.plan.to_dict()["shards"] == plan["shards"]
        for shard, planned in zip(engine.shards, plan["shards"], strict=True):
            assert [shard.layers.start, shard.layers.stop] == planned["layers"]
            assert planned["weight_bytes"] <= shard.weight_bytes < planned["weight_bytes"] + 65536
            assert planned["state_bytes"] <= shard.state_bytes < planned["state_bytes"] + 65536


def test_plan_table_shows_the_placement(tiny_model):
    from lucepy.ggml import load
    from lucepy.gguf import GGUFFile
    from lucepy.models import architecture_for
    from lucepy.runtime.plan import make_plan

    with GGUFFile(tiny_model("odd", "f32")) as f:
        plan = make_plan(
            f,
            architecture_for(f).from_gguf(f),
            RuntimeConfig(device="cpu,cpu", layer_split="1,4"),
            load(),
        )
    console = Console(record=True, width=120)
    console.print(tui.plan_table(plan))
    text = console.export_text()
    assert "0–0 (1)" in text and "1–4 (4)" in text and text.count("local") == 2


@pytest.mark.parametrize(
    "weights,n,expected",
    [
        ([1, 1], 4, [(0, 2), (2, 4)]),
        ([0.08, 0.46, 0.46], 64, [(0, 5), (5, 35), (35, 64)]),
        ([100, 1, 1], 3, [(0, 1), (1, 2), (2, 3)]),
        ([1, 100], 3, [(0, 1), (1, 3)]),
    ],
)
def test_layer_ranges_are_contiguous_and_nonempty(weights, n, expected):
    assert [(r.start, r.stop) for r in layer_ranges(weights, n)] == expected


def test_build_recipes():
    cuda = backends.plan_build("cuda", arch="90")
    assert (
        "-DGGML_CUDA=ON" in cuda.cmake_args and "-DCMAKE_CUDA_ARCHITECTURES=90" in cuda.cmake_args
    )
    hip = backends.plan_build("hip", arch="gfx942", with_bench=True)
    assert {"-DGGML_HIP=ON", "-DGGML_RPC=ON", "-DGPU_TARGETS=gfx942"} <= set(hip.cmake_args)
    assert "llama-bench" in hip.targets
    assert "-DGGML_RPC=ON" in backends.plan_build("cpu").cmake_args
    with pytest.raises(ConfigError, match="lucepy can build: cpu, cuda, hip, vulkan"):
        backends.plan_build("metal")
    with pytest.raises(ConfigError, match="--arch does not apply"):
        backends.plan_build("cpu", arch="90")


def test_backends_list_finds_builds(tmp_path, monkeypatch):
    monkeypatch.setenv("LUCEPY_CACHE_DIR", str(tmp_path))
    assert backends.list_builds() == []
    (tmp_path / "ggml" / "vulkan").mkdir(parents=True)
    (tmp_path / "ggml" / "vulkan" / "libggml-base.so").write_bytes(b"")
    assert backends.list_builds() == [("vulkan", tmp_path / "ggml" / "vulkan")]
    assert backends.find_build("vulkan") == tmp_path / "ggml" / "vulkan"
    run = subprocess.run(
        [sys.executable, "-m", "lucepy", "backends", "list", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert json.loads(run.stdout)["builds"][0]["backend"] == "vulkan"


def test_worker_warns_beyond_loopback():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.2")
    from lucepy.runtime.workers import free_port

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "lucepy", "worker", "--host", "0.0.0.0", "--port", str(port)],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stderr.readline()
    finally:
        proc.kill()
        proc.wait()
    assert "no authentication" in line


def test_split_points_move_a_boundary_and_say_so():
    from lucepy.runtime.placement import honour_split_points

    ranges = layer_ranges([1, 1], 8)  # 0-4, 4-8
    moved, notes = honour_split_points(ranges, [3, 6])
    assert [(r.start, r.stop) for r in moved] == [(0, 3), (3, 8)]
    assert notes == ["split at layer 4 moved to 3: the model's split points"]
    same, none = honour_split_points(ranges, list(range(1, 8)))
    assert same == ranges and none == []
    with pytest.raises(ConfigError, match="no layer boundary"):
        honour_split_points(layer_ranges([1, 1, 1], 6), [3])
