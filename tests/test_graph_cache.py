"""The graphs a shard or draft keeps built stay within a memory budget (runtime/graphs.py
GraphCache): a long prompt no longer leaves one graph per KV window on the device."""

from __future__ import annotations

import numpy as np
from conftest import THREADS
from test_speculative import PROMPT
from test_speculative import models as models  # noqa: F401  (the fixture)

from lucepy.decode.ar import generate
from lucepy.runtime import graphs
from lucepy.runtime.config import RuntimeConfig
from lucepy.runtime.engine import Engine
from lucepy.runtime.graphs import GraphCache
from lucepy.runtime.slots import kv_bucket


class Fake:
    def __init__(self, nbytes: int):
        self.nbytes, self.closed = nbytes, False

    def close(self) -> None:
        self.closed = True


def test_least_recently_used_graphs_go_first_and_the_newest_always_stays():
    evicted = []
    cache = GraphCache(budget=100, on_evict=evicted.append)
    made = {k: Fake(40) for k in "abcd"}
    for k in "ab":
        cache.get(k, lambda k=k: made[k])
    assert cache.get("a", lambda: Fake(1)) is made["a"]  # a hit builds nothing; "a" is fresh
    cache.get("c", lambda: made["c"])  # 120 bytes: "b", the least recently used, goes
    assert list(cache) == ["a", "c"] and evicted == ["b"] and made["b"].closed
    assert cache.nbytes == 80 and cache.evicted == 1
    big = Fake(500)
    cache.get("d", lambda: big)  # alone over the budget: it stays, the others go
    assert list(cache) == ["d"] and cache.nbytes == 500 and not big.closed
    assert evicted == ["b", "a", "c"]


def test_a_prompts_first_chunk_attends_over_the_rows_it_fills_and_later_ones_share_windows():
    """ggml-cuda's flash attention computes masked rows below 1,024 queries: a first chunk of
    512 over a 1,024-row window cost laguna's pp512 3 % on the H200 (docs/BENCHMARKS.md). After
    the first, two chunks share a window, so a long prompt builds a graph every other chunk."""
    ends = range(512, 4097, 512)
    assert [kv_bucket(end, 8192, 512) for end in ends] == [512, 1024, 2048, 2048] + [3072] * 2 + [
        4096
    ] * 2
    assert kv_bucket(300, 8192, 300) == 512  # a short prompt: the power of two of its tokens
    assert kv_bucket(200, 8192, 100) == 256  # never fewer than 256 rows
    assert kv_bucket(500, 384, 300) == 384  # nor more than the context
    # decode and verify steps: windows of 256 rows, from the first
    assert [kv_bucket(end, 8192) for end in (1, 256, 257, 700)] == [256, 256, 512, 768]
    assert [kv_bucket(end, 8192, 16) for end in (16, 300)] == [256, 512]


def test_a_prompt_longer_than_the_budget_allows_keeps_its_memory_bounded(tiny_model):
    """Prefill in chunks meets a new KV window every 256 rows. Over the budget, the least
    recently used graphs are freed, and a rebuilt graph computes what the first one did."""
    logits = []
    for budget in (None, 1):
        cfg = RuntimeConfig(threads=THREADS, max_ctx=1024, chunk=64)
        with Engine(tiny_model("odd", "f32"), cfg, tokenizer=False) as engine:
            cache = engine.shard.graphs
            if budget is not None:
                cache.budget = budget
            tokens = np.random.default_rng(3).integers(0, engine.params.n_vocab, 1000)
            first = engine.prefill(tokens, chunk=64, all_logits=True).copy()
            engine.reset()  # the same windows again: every graph is rebuilt at budget 1
            again = engine.prefill(tokens, chunk=64, all_logits=True).copy()
            if budget is not None:
                assert len(cache) == 1 and cache.evicted == 9  # 5 graphs built twice
            else:
                assert len(cache) == 5 and cache.evicted == 0  # windows 256..1024, a last T
        np.testing.assert_array_equal(first, again)
        logits.append(first)
    np.testing.assert_array_equal(logits[0], logits[1])


def test_speculation_with_every_graph_rebuilt_equals_greedy(models, monkeypatch):
    """A budget of one graph evicts each verify graph at the next step, and with it the
    rollback graphs that read its snapshots; the draft's graphs go the same way. Speculative
    decoding still equals greedy decoding."""
    cfg = RuntimeConfig(threads=THREADS, max_ctx=256)
    with Engine(models["favoured"], cfg, tokenizer=False) as engine:
        plain = generate(engine, PROMPT, 48).tokens
    monkeypatch.setattr(graphs, "GRAPH_CACHE_BYTES", 1)
    cfg = RuntimeConfig(threads=THREADS, max_ctx=256, draft=str(models["agree"]))
    with Engine(models["favoured"], cfg, tokenizer=False) as engine:
        spec = generate(engine, PROMPT, 48)
        shard = engine.shard
        assert shard.graphs.evicted > 0 and engine.draft.graphs.evicted > 0
        assert {spec for spec, _ in shard._rollbacks} <= set(shard.graphs)
    assert sum(spec.accept.histogram[1:-1]) >= 1  # partial acceptances: rollbacks ran
    assert spec.tokens == plain
