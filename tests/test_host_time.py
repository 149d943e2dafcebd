"""tools/host_time.py's split of a call's wall time by phase, on the CPU with a tiny model: each
phase timed where the shard calls it, and the shard's own functions back afterwards."""

from __future__ import annotations

from tool_scripts import load_tool

from lucepy.runtime import graphs, shard
from lucepy.runtime.config import RuntimeConfig
from lucepy.runtime.engine import Engine

host_time = load_tool("host_time")


def test_each_call_is_split_into_its_phases_and_the_shard_is_left_as_it_was(tiny_model):
    before = (shard.compute, shard.get, graphs.CompiledGraph.write_inputs)
    cfg = RuntimeConfig(device="cpu", max_ctx=256, threads=1)
    with Engine(tiny_model(), cfg, tokenizer=False) as engine:
        out = host_time.measure(engine, calls=3)
    assert (shard.compute, shard.get, graphs.CompiledGraph.write_inputs) == before
    assert set(out) == {"decode", "greedy decode", "verify"}
    for kind in out:
        times = out[kind]
        assert set(times) == {"inputs", "compute", "launch", "read", "python", "wall"}
        # every call writes inputs, computes and reads; on a CPU a rollback is waited for
        assert min(times["inputs"], times["compute"], times["read"], times["python"]) > 0
        assert times["launch"] == 0
        assert times["compute"] < times["wall"]
