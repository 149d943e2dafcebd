"""qwen35moe: experts split between the shard's device and host RAM compute what one backend
computes (here two CPU backend instances under ggml_backend_sched, bit for bit), routing counts
make the hotness profile that the next placement follows, and split, workers, DFlash and prefix
snapshots work as for qwen35. llama.cpp parity at every position is in test_llama.py (it runs
every converted fixture, with and without MTP)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from conftest import THREADS
from test_llama import FIXTURES
from typer.testing import CliRunner

from lucepy.cli import app
from lucepy.decode.ar import generate
from lucepy.engine import open_engine
from lucepy.errors import ConfigError
from lucepy.ggml import Backend, Sched, ffi
from lucepy.gguf import GGUFFile
from lucepy.runtime import experts
from lucepy.runtime.config import RuntimeConfig
from lucepy.runtime.engine import Engine
from lucepy.testing.tiny import Qwen35Spec
from lucepy.testing.tiny_draft import write_dflash

MODEL = FIXTURES / "qwen35moe-q8_0.gguf"
PROMPT = list(range(5, 60))
N_EXPERT, K = 8, 2


def cfg(tmp_path, **kw) -> RuntimeConfig:
    profile = str(tmp_path / "profile.npz")  # never the user's cache
    return RuntimeConfig(threads=THREADS, max_ctx=256, expert_profile=profile, **kw)


def run(path, config):
    """Prompt logits at every position (16-token chunks), 16 greedy tokens, and the engine's
    routing counts."""
    with Engine(path, config, tokenizer=False) as engine:
        logits = engine.prefill(PROMPT, chunk=16, all_logits=True).copy()
        engine.reset()
        tokens = generate(engine, PROMPT, 16, stop_at_end=False).tokens
        counts = engine.pipeline.expert_counts.counts.copy()
        graphs = [g for s in engine.shards for g in s.graphs.values()]
        split = [_split_report(engine, g) for g in graphs if isinstance(g.alloc, Sched)]
        n_split = len(engine.plan.experts.hot) if engine.plan.experts else 0
    return logits, tokens, counts, (split, n_split)


def _split_report(engine, g) -> tuple[int, set[str]]:
    """(number of scheduler splits, backends that run a MUL_MAT_ID on a .cold weight)."""
    lib, sched = engine.lib, g.alloc
    on = set()
    for i in range(lib.ggml_graph_n_nodes(g.gf)):
        node = lib.ggml_graph_node(g.gf, i)
        if node.op == lib.GGML_OP_MUL_MAT_ID:
            name = ffi.string(lib.ggml_get_name(node.src[0])).decode()
            if name.endswith(".cold"):
                backend = lib.ggml_backend_sched_get_tensor_backend(sched.ptr, node)
                host = engine.shard.host
                on.add("host" if host is not None and backend == host.ptr else "device")
    return lib.ggml_backend_sched_get_n_splits(sched.ptr), on


@pytest.fixture(scope="module")
def one_backend(tmp_path_factory):
    return run(MODEL, cfg(tmp_path_factory.mktemp("one")))


def _mb(n_experts: int) -> float:
    """A device budget of exactly ``n_experts`` experts (they are the same size in every layer)."""
    with GGUFFile(MODEL) as f:
        return n_experts * experts.expert_bytes(f, 0) / 2**20


@pytest.mark.parametrize(
    "placement",
    [{"n_cpu_moe": 2}, {"moe_device_mb": 0}, {"moe_device_mb": _mb(3)}, {"moe_device_mb": _mb(20)}],
    ids=["n-cpu-moe-2", "all-in-host-RAM", "3-on-the-device", "20-on-the-device"],
)
def test_hybrid_placement_equals_one_backend(placement, one_backend, tmp_path):
    """Per slot, one part holds the expert's output and the other exactly 0, so the sum is the
    one-backend sum, bit for bit; the cold experts' matmuls run on the host backend, in one trip
    there and back a split layer."""
    logits, tokens, _, (split, n_split) = run(MODEL, cfg(tmp_path, **placement))
    np.testing.assert_array_equal(logits, one_backend[0])
    assert tokens == one_backend[1]
    assert n_split and split and all(n == 2 * n_split + 1 and on == {"host"} for n, on in split)


@pytest.mark.parametrize(
    "placement",
    [{"n_cpu_moe": 2}, {"moe_device_mb": 0}, {"moe_device_mb": _mb(3)}, {"moe_device_mb": _mb(20)}],
    ids=["n-cpu-moe-2", "all-in-host-RAM", "3-on-the-device", "20-on-the-device"],
)
def test_cold_experts_read_by_the_device_equal_one_backend(
    placement, one_backend, tmp_path, monkeypatch
):
    """--cold-experts device: the cold experts' matmuls run on the device (here a CPU standing
    in for a GPU, so that the graph goes through the scheduler as on a GPU), reading the host
    part's weights where they are: each layer one tensor a matrix, its hot experts first, and
    the ids mapped there; no host backend, one split a graph, and the one-backend result, bit
    for bit."""
    monkeypatch.setattr(Backend, "is_local_gpu", property(lambda self: True))
    config = cfg(tmp_path, cold_experts="device", **placement)
    logits, tokens, _, (split, n_split) = run(MODEL, config)
    np.testing.assert_array_equal(logits, one_backend[0])
    assert tokens == one_backend[1]
    assert n_split and split and all(n == 1 for n, _ in split)  # no trip to a host
    with Engine(MODEL, config, tokenizer=False) as engine:
        assert engine.shard.host is None and engine.shard.reads
        engine.prefill(PROMPT[:20])
        lib, shard = engine.lib, engine.shard
        read = {il for il, hot in engine.plan.experts.hot.items()}
        assert all(f"blk.{il}.experts.order" in shard.w for il in read)
        for g in shard.graphs.values():  # every expert matmul on the device, none on a host
            for i in range(lib.ggml_graph_n_nodes(g.gf)):
                node = lib.ggml_graph_node(g.gf, i)
                if node.op == lib.GGML_OP_MUL_MAT_ID:
                    on = lib.ggml_backend_sched_get_tensor_backend(g.alloc.ptr, node)
                    assert on == shard.backend.ptr


def test_on_a_gpu_a_moe_graph_runs_through_the_scheduler(one_backend, tmp_path, monkeypatch):
    """With no expert in host RAM, a MoE graph on a GPU still goes through ggml_backend_sched
    (as one split), so that ggml-cuda can keep what its fused MoE kernels read alive. Here the
    CPU stands in for the GPU: the same logits, bit for bit, every graph one split."""
    monkeypatch.setattr(Backend, "is_local_gpu", property(lambda self: True))
    logits, tokens, _, (split, n_split) = run(MODEL, cfg(tmp_path))
    np.testing.assert_array_equal(logits, one_backend[0])
    assert tokens == one_backend[1]
    assert n_split == 0 and split and all(s == (1, set()) for s in split)


def test_without_counting_the_graphs_output_no_routing(one_backend, tmp_path):
    with Engine(MODEL, cfg(tmp_path, count_experts=False), tokenizer=False) as engine:
        logits = engine.prefill(PROMPT, chunk=16, all_logits=True).copy()
        assert engine.pipeline.expert_counts is None
        assert all("routing" not in g.outputs for g in engine.shard.graphs.values())
    np.testing.assert_array_equal(logits, one_backend[0])


def test_a_layers_options_cost_a_split_plus_its_cold_reads():
    """One expert a token (k=1), chosen 3:1:0:0. With n on the device a step costs the split plus
    the odds of each cold expert, plus one read when it chose none of them."""
    order, cost, units = experts.layer_options(np.array([0, 3, 0, 1]), 1, 1)
    assert list(order) == [1, 3, 0, 2]
    S = experts.SPLIT_COST
    np.testing.assert_allclose(cost, [S + 1 + 0.25 * 0.75, S + 0.25 + 0.75, S + 1, S + 1, 0])
    assert list(units) == [0, 2, 3, 4, 4]  # n experts and 1 padding; all 4 need no padding


def test_the_budget_goes_where_it_saves_the_most_host_work():
    """The dynamic program's placement costs what the best of every combination costs, within
    the budget; without a profile it keeps whole layers on the device (the last ones)."""
    rng = np.random.default_rng(3)
    counts = np.zeros((4, N_EXPERT), dtype=np.int64)
    counts[0] = rng.zipf(1.5, N_EXPERT).clip(max=400)  # skewed
    counts[1] = 50  # even
    counts[2, [2, 7]] = [300, 280]  # two experts take everything
    counts[3] = rng.integers(0, 40, N_EXPERT)
    with GGUFFile(MODEL) as f:
        one = experts.expert_bytes(f, 0)
        for units in (0, 3, 7, 12, 19, 26, 33):
            placed = experts.by_hotness(f, 4, N_EXPERT, counts, units * one + one // 2, K)
            options = [experts.layer_options(counts[il], K, 1) for il in range(4)]
            best = min(
                sum(options[il][1][n] for il, n in enumerate(ns))
                for ns in itertools.product(range(N_EXPERT + 1), repeat=4)
                if sum(options[il][2][n] for il, n in enumerate(ns)) <= units
            )
            ns = [len(placed.hot.get(il, range(N_EXPERT))) for il in range(4)]
            assert sum(options[il][1][n] for il, n in enumerate(ns)) == pytest.approx(best)
            assert placed.bytes()[0] <= units * one
            for il, hot in placed.hot.items():  # a layer's device experts are its most chosen
                assert set(hot) == set(options[il][0][: len(hot)])
        # 8 experts' bytes: a whole layer saves a split; two of layer 2's 8 (and 2 padding)
        # would save one read
        assert len(experts.by_hotness(f, 4, N_EXPERT, counts, 8 * one, K).hot) == 3
        even = experts.by_hotness(f, 4, N_EXPERT, None, 2 * N_EXPERT * one, K)
        assert even.hot == {0: (), 1: ()}
        assert experts.by_layers(f, 4, N_EXPERT, 1).hot == {0: ()}
        # read from host RAM by the device: a token costs one read per cold expert it chooses,
        # no split cost, no padding; the program still finds the cheapest combination
        for units in (3, 12, 19):
            read = experts.by_hotness(f, 4, N_EXPERT, counts, units * one, K, reads=True)
            options = [experts.layer_options(counts[il], K, 1, reads=True) for il in range(4)]
            best = min(
                sum(options[il][1][n] for il, n in enumerate(ns))
                for ns in itertools.product(range(N_EXPERT + 1), repeat=4)
                if sum(ns) <= units
            )
            ns = [len(read.hot.get(il, range(N_EXPERT))) for il in range(4)]
            assert sum(options[il][1][n] for il, n in enumerate(ns)) == pytest.approx(best)
            assert read.reads and read.padding == 0 and read.bytes()[0] <= units * one
        # a granule a matrix set aside: 12 experts' bytes less 4 layers x 3 matrices x one
        spare = experts.by_hotness(f, 4, N_EXPERT, counts, 24 * one, K, reads=True, granule=one)
        assert spare.bytes()[0] <= 12 * one


def test_routing_counts_every_choice_and_the_profile_drives_the_next_placement(tmp_path):
    """k choices per token and layer, the same whether prefilled in one chunk or in chunks of
    5 (the last of 55 is 5 tokens too); decode steps count nothing. Saved on close, added to
    what the file had, and shown by lucepy plan and experts."""
    config = cfg(tmp_path, save_expert_profile=True)
    with Engine(MODEL, config, tokenizer=False) as engine:
        engine.prefill(PROMPT, chunk=len(PROMPT))
        whole = engine.pipeline.expert_counts.counts.copy()
        engine.reset()
        engine.pipeline.expert_counts.counts[:] = 0
        engine.prefill(PROMPT, chunk=5)
        for t in (7, 8, 9):
            engine.decode(t)
        chunked = engine.pipeline.expert_counts.counts.copy()
    assert (whole.sum(axis=1) == K * len(PROMPT)).all()
    np.testing.assert_array_equal(whole, chunked)
    saved = np.load(tmp_path / "profile.npz")["counts"]
    np.testing.assert_array_equal(saved, chunked)  # the first save: what the run counted

    # 5 experts' bytes: no whole layer fits, so the budget buys a split layer's most chosen
    # experts (and its K padding experts), the layer where they save the most host reads
    budget = _mb(5)
    with Engine(MODEL, cfg(tmp_path, moe_device_mb=budget), tokenizer=False) as engine:
        placed = engine.plan.experts
    assert "profile" in placed.policy
    with GGUFFile(MODEL) as f:
        want = experts.by_hotness(f, 4, N_EXPERT, saved, int(budget * 2**20), K)
        blind = experts.by_hotness(f, 4, N_EXPERT, None, int(budget * 2**20), K)
    assert placed.hot == want.hot != blind.hot
    [(il, hot)] = [(il, hot) for il, hot in placed.hot.items() if hot]
    assert sorted(saved[il, list(hot)]) == sorted(saved[il])[-len(hot) :]

    profile = ["--expert-profile", str(tmp_path / "profile.npz")]
    result = CliRunner().invoke(app, ["plan", str(MODEL), "--moe-gpu-mb", "0", *profile, "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)["experts"]
    assert plan["device_bytes"] == 0 and plan["hot"] == {str(il): 0 for il in range(4)}
    result = CliRunner().invoke(app, ["experts", str(MODEL), *profile, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert [row["tokens"] for row in report["layers"]] == [len(PROMPT)] * 4
    top = report["layers"][0]["top"][0]
    assert top == [int(np.argmax(saved[0])), round(saved[0].max() / saved[0].sum(), 4)]


@pytest.mark.parametrize(
    "placement",
    [{}, {"n_cpu_moe": 3}, {"moe_device_mb": _mb(12), "cold_experts": "device"}],
    ids=["one-backend", "hybrid", "read-by-the-device"],
)
def test_restored_equals_fresh_and_the_delta_is_prefilled_in_chunks(placement, tmp_path):
    """A RAM hit (turn 2 after turn 1), then after a restart a disk hit (turn 3 after the
    snapshot of turn 2): each delta of 50 tokens takes 4 steps of 16, not 50 of 1."""
    turn1 = PROMPT[:40]
    turn2 = PROMPT + list(range(100, 135))
    turn3 = turn2 + list(range(200, 250))
    kw = {"chunk": 16, **placement}
    with Engine(MODEL, cfg(tmp_path, **kw), tokenizer=False) as engine:
        fresh2 = generate(engine, turn2, 16, stop_at_end=False).tokens
        fresh3 = generate(engine, turn3, 16, stop_at_end=False).tokens
    cache = {"prefix_cache_slots": 4, "kv_cache_dir": str(tmp_path / "kv")}
    cache["disk_prefix_cache"] = "full"
    hits = []
    with open_engine(MODEL, cfg(tmp_path, **kw, **cache), tokenizer=False) as engine:
        generate(engine, turn1, 4, stop_at_end=False)
        steps = engine.pipeline.steps
        hits.append((generate(engine, turn2, 16, stop_at_end=False), fresh2))
        hits[-1] += (engine.pipeline.steps - steps,)
    with open_engine(MODEL, cfg(tmp_path, **kw, **cache), tokenizer=False) as engine:
        hits.append((generate(engine, turn3, 16, stop_at_end=False), fresh3))
        hits[-1] += (engine.pipeline.steps,)
    assert [gen.cache["hit"] for gen, _, _ in hits] == ["ram", "disk"]
    for gen, fresh, n_steps in hits:
        assert gen.tokens == fresh
        delta = gen.cache["prefilled_tokens"]
        assert delta == 50
        assert n_steps - 15 == 4  # the delta in 4 steps of up to 16; then 15 decode steps


@pytest.mark.parametrize(
    "device,split", [("cpu,cpu", None), ("cpu,cpu@worker", "1,3"), ("cpu@worker,cpu", "3,1")]
)
def test_sharded_equals_unsharded(device, split, one_backend, tmp_path):
    logits, tokens, _, _ = run(MODEL, cfg(tmp_path, device=device, layer_split=split))
    err = np.linalg.norm(logits - one_backend[0], axis=1)
    assert (err / np.linalg.norm(one_backend[0], axis=1)).max() <= 1e-4
    assert tokens == one_backend[1]


@pytest.mark.parametrize("name", ["qwen35moe-q8_0", "qwen35moe-mtp-q8_0"])
def test_speculative_equals_greedy(name, tmp_path):
    path = FIXTURES / f"{name}.gguf"
    shape = Qwen35Spec(n_vocab=384, n_embd=64, n_layer=4, context_length=2048)
    draft = write_dflash(tmp_path / "draft.gguf", shape, target_layers=(1, 3), block_size=4)
    with Engine(path, cfg(tmp_path), tokenizer=False) as engine:
        plain = generate(engine, PROMPT, 32, stop_at_end=False).tokens
    with Engine(path, cfg(tmp_path, draft=str(draft), n_cpu_moe=2), tokenizer=False) as engine:
        gen = generate(engine, PROMPT, 32, stop_at_end=False)
    assert gen.accept is not None and gen.accept.steps > 0
    assert gen.tokens == plain


def test_placement_flags_are_refused_where_they_mean_nothing(tmp_path):
    dense = FIXTURES / "qwen35-q8_0.gguf"
    result = CliRunner().invoke(app, ["plan", str(dense), "--n-cpu-moe", "2"])
    assert result.exit_code != 0 and "need a model with experts" in result.output
    result = CliRunner().invoke(app, ["experts", str(dense)])
    assert result.exit_code != 0 and "no routed experts" in result.output
    missing = ["experts", str(MODEL), "--expert-profile", str(tmp_path / "none.npz")]
    result = CliRunner().invoke(app, missing)
    assert result.exit_code != 0 and "no expert profile" in result.output
    with pytest.raises(ConfigError, match="not both"):
        RuntimeConfig(n_cpu_moe=2, moe_device_mb=100)
    result = CliRunner().invoke(
        app, ["plan", str(MODEL), "--n-cpu-moe", "2", "--cold-experts", "gpu"]
    )
    assert result.exit_code != 0 and "use cpu or device" in result.output
    plan = ["plan", str(MODEL), "--n-cpu-moe", "2", "--cold-experts", "device", "--json"]
    result = CliRunner().invoke(app, plan)
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["experts"]["cold_experts"] == "device"
    with pytest.raises(ConfigError, match="local devices only"):
        Engine(MODEL, cfg(tmp_path, device="cpu@worker", n_cpu_moe=2), tokenizer=False)
