"""tools/bench_kernels.py's verify curve, tools/bench_gpu.py's verify and its report, on the CPU
with a tiny model: the 16-token verify timed in turn with a decode step and a greedy one (its
argmax alone read back), each ratio against the steps measured beside it (the curve's too), and
both ratios reported."""

from __future__ import annotations

import json

import pytest
from tool_scripts import load_tool

from lucepy.runtime.config import RuntimeConfig
from lucepy.runtime.engine import Engine

bench_gpu = load_tool("bench_gpu")
bench_kernels = load_tool("bench_kernels")


def test_the_verify_is_timed_in_turn_against_both_kinds_of_decode_step(tiny_model, tmp_path):
    cfg = RuntimeConfig(device="cpu", max_ctx=512, threads=1, chunk=bench_kernels.CHUNK)
    out = tmp_path / "bench.json"
    with Engine(tiny_model(), cfg, tokenizer=False) as engine:
        bench_kernels.verify_curve(bench_gpu.Bench(engine, 1, out))
    got = json.loads(out.read_text())["verify_curve"]
    assert sorted(map(int, got["cost_in_decodes"])) == list(range(1, bench_kernels.MAX_K + 1))
    turn = got["rollback_in_turn"]
    assert turn["calls"] == 20  # four rounds a repeat, at least 5 repeats
    assert got["decode_ms"] > 0 and got["greedy_decode_ms"] > 0
    # each ratio is the same verify time over the step measured beside it, the curve's steps
    for kind in ("left_running", "waited"):
        verify_ms = turn[kind] * got["decode_ms"]
        assert abs(turn[f"{kind}_greedy"] * got["greedy_decode_ms"] - verify_ms) < 1e-9 * verify_ms
    line = bench_kernels._in_turn(turn)
    assert line.count(" / ") == 3 and "—" not in line
    assert bench_kernels._in_turn({}) == "— / — / — / —"


def test_the_gpu_bench_times_its_verify_in_turn_with_both_kinds_of_decode_step(
    tiny_model, tmp_path
):
    cfg = RuntimeConfig(device="cpu", max_ctx=512, threads=1, chunk=bench_gpu.CHUNK)
    out = tmp_path / "bench.json"
    with Engine(tiny_model(), cfg, tokenizer=False) as engine:
        kept = [shard.async_rollback for shard in engine.shards]
        engine.reset()
        bench_gpu.Bench(engine, 1, out).verify(0)
        assert [shard.async_rollback for shard in engine.shards] == kept  # put back
        # 16 tokens from 0, then each of 6 rounds' two verifies and two decodes keeps one token
        assert engine.n_past == 6 * 4
    got = json.loads(out.read_text())["verify16@d0"]
    for key in ("verify_ms", "verify_waited_ms", "decode_ms", "greedy_decode_ms"):
        assert got[key] > 0
    assert abs(got["ratio"] * got["decode_ms"] - got["verify_ms"]) < 1e-9 * got["verify_ms"]
    greedy_ms = got["greedy_ratio"] * got["greedy_decode_ms"]
    assert abs(greedy_ms - got["verify_ms"]) < 1e-9 * got["verify_ms"]


def test_the_gpu_report_gives_the_verify_in_both_kinds_of_decode_step():
    ours = {
        "verify16@d0": {
            "verify_ms": 8.2,
            "decode_ms": 5.5,
            "ratio": 8.2 / 5.5,
            "greedy_decode_ms": 5.4,
            "greedy_ratio": 8.2 / 5.4,
        },
        "verify16@d8192": {"verify_ms": 9.0, "decode_ms": 6.0, "ratio": 1.5},
    }
    lines = bench_gpu.report_lines(ours, {}, 8192)
    assert "| 1-token greedy decode (argmax read) @ d0 | — | 5.4 | ms | — |" in lines
    assert "\nlucepy's 16-token verify at d0: 1.49 decode steps, 1.52 greedy decode steps" in lines
    # a run from before the greedy step was timed says so, not a made-up ratio
    assert "\nlucepy's 16-token verify at d8192: 1.50 decode steps, no greedy step timed" in lines


def test_a_switch_measured_both_ways_sets_each_run_beside_the_others():
    keys = ("left_running", "waited", "left_running_greedy", "waited_greedy")
    turn = dict(zip(keys, (1.46, 1.47, 1.48, 1.49), strict=True))
    run = {"verify_curve": {"decode_ms": 5.4, "greedy_decode_ms": 5.3, "rollback_in_turn": turn}}
    text = bench_kernels.ab_report("LUCEPY_CUDA_F8", {"0": [run, {}], "1": [run]})
    lines = [line for line in text.splitlines() if line.startswith("- ")]
    assert lines[0] == "- LUCEPY_CUDA_F8=0: 5.40 / 5.30 ms; 1.460 / 1.470 / 1.480 / 1.490"
    assert lines[1] == "- LUCEPY_CUDA_F8=0: — / — ms; — / — / — / —"  # a run that failed
    assert lines[2].startswith("- LUCEPY_CUDA_F8=1: 5.40 / 5.30 ms") and len(lines) == 3


def test_a_switch_takes_two_values_of_its_own():
    assert bench_kernels.switch_values("LUCEPY_CUDA_F8") == ("LUCEPY_CUDA_F8", ("0", "1"))
    got = bench_kernels.switch_values("LUCEPY_CUDA_F8_SINGLE=6,7")
    assert got == ("LUCEPY_CUDA_F8_SINGLE", ("6", "7"))
    for bad in ("X=6", "X=6,7,8", "X=6,", "=6,7", "X=6,6"):
        with pytest.raises(SystemExit, match="two values"):
            bench_kernels.switch_values(bad)
    text = bench_kernels.ab_report("X", {"6": [{}], "7": [{}]})
    assert [line.split(":")[0] for line in text.splitlines() if line.startswith("- ")] == [
        "- X=6",
        "- X=7",
    ]


def test_a_switch_is_measured_both_ways_each_run_a_process_of_its_own(tiny_model, tmp_path):
    from argparse import Namespace

    out = tmp_path / "ab.json"
    args = Namespace(
        model=tiny_model(),
        device="cpu",
        json=str(out),
        repeats=1,
        switch="LUCEPY_AB_TEST",
        rounds=1,
        md=str(tmp_path / "ab.md"),
    )
    assert bench_kernels.ab(args) == 0
    got = json.loads(out.read_text())
    assert got["switch"] == "LUCEPY_AB_TEST"
    for value in ("0", "1"):
        (run,) = got["runs"][value]
        assert run["kernels"]["choice"] == "repacked" and run["verify_curve"]["decode_ms"] > 0
    lines = (tmp_path / "ab.md").read_text().splitlines()
    assert [line.split(":")[0] for line in lines if line.startswith("- ")] == [
        "- LUCEPY_AB_TEST=0",
        "- LUCEPY_AB_TEST=1",
    ]
