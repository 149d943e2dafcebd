"""KV Flash's pool (runtime/pager.py PagedSlots, runtime/kvpool.py HostPool): full-attention
caches of fewer rows than the context, paged in chunks of 64."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import THREADS
from numpy_llama import NumpyLlama

from lucepy.cache.prefix import PrefixCache
from lucepy.errors import ConfigError
from lucepy.ggml import ffi
from lucepy.runtime.config import RuntimeConfig
from lucepy.runtime.engine import Engine
from lucepy.runtime.pager import CHUNK, PagedSlots
from lucepy.runtime.slots import IdentitySlots

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
LLAMA = FIXTURES / "llama-untied-f32.gguf"


def engine(path, pool: int = 0, max_ctx: int = 1024, **config) -> Engine:
    config = {"threads": THREADS, "max_ctx": max_ctx, "chunk": 64, "kv_pool": pool} | config
    return Engine(path, RuntimeConfig(**config), tokenizer=False)


def tokens(n: int, n_vocab: int, seed: int = 5) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, n_vocab, n).astype(np.int32)


def run(e: Engine, prompt: np.ndarray, n_gen: int, chunk: int = 64):
    """Logits of every prompt position, then ``n_gen`` greedy tokens."""
    logits = e.prefill(prompt, chunk=chunk, all_logits=True)
    out, last = [], int(np.argmax(logits[-1]))
    for _ in range(n_gen):
        out.append(last)
        last = int(np.argmax(e.decode(last)))
    return logits, out


def paged_run(e: Engine, prompt: np.ndarray, n_gen: int = 24, chunk: int = 128):
    """``run``, then the pager's resident chunks, page-outs and page-ins."""
    logits, out = run(e, prompt, n_gen, chunk)
    slots = e.pipeline.slots
    return logits, out, sorted(slots.home), slots.page_outs, slots.page_ins


@pytest.mark.parametrize("which", ["llama", "qwen35", "gemma4"])
def test_a_pool_larger_than_the_sequence_gives_the_full_caches_output(which, tiny_model):
    path = {"llama": LLAMA, "gemma4": FIXTURES / "gemma4-f32.gguf"}.get(which)
    path = path or tiny_model("base", "f32")
    with engine(path) as full, engine(path, pool=512) as pooled:
        assert isinstance(pooled.pipeline.slots, PagedSlots)
        assert isinstance(full.pipeline.slots, IdentitySlots)
        prompt = tokens(300, full.params.n_vocab)
        ref_logits, ref_tokens = run(full, prompt, 40)
        logits, got = run(pooled, prompt, 40)
        assert pooled.pipeline.slots.page_outs == 0
    np.testing.assert_array_equal(logits, ref_logits)
    assert got == ref_tokens


def recording(slots: PagedSlots) -> list[np.ndarray]:
    """Record each step's batch: which positions every token may see."""
    seen, batch = [], slots.batch

    def wrapped(toks, pos0):
        b = batch(toks, pos0)
        seen.append(b)
        return b

    slots.batch = wrapped
    return seen


def visible(b, t: int) -> set[int]:
    """The positions token ``t`` of step batch ``b`` attends to."""
    return {int(p) for p in b.cell_pos[b.mask()[t] == 0]}


def test_paged_attention_is_exact_attention_over_the_resident_rows():
    """Each step of a pool that pages equals exact attention (numpy, f64) over exactly the
    positions resident for each token. Without flash attention, ggml's only roundings (f16
    keys, values, queries and softmax weights) are made by the reference too; what remains is
    f32 against f64 sums, and a rounding to f16 that may land one step apart (relative 5e-4).
    (Flash attention on the CPU also sums V in f16: 1e-2 away from the reference on the full
    cache too, so it is not the test.)"""
    ref = NumpyLlama(LLAMA)
    with engine(LLAMA, pool=384, flash_attn=False, chunk=128) as pooled:
        slots = pooled.pipeline.slots
        seen = recording(slots)
        prompt = tokens(600, pooled.params.n_vocab, seed=9)
        worst = unmasked = 0.0
        for start in range(0, prompt.size, 100):  # steps cross chunk boundaries
            part = prompt[start : start + 100]
            ours = pooled.prefill(part, chunk=100, all_logits=True)
            b = seen[-1]
            want = np.stack(
                [ref.step(part[t : t + 1], start + t, visible(b, t))[0] for t in range(part.size)]
            )
            worst = max(worst, float(np.abs(ours - want).max()))
            seen_all = set(range(start + part.size))
            everything = ref.step(part[-1:], start + part.size - 1, seen_all, keep=False)
            unmasked = max(unmasked, float(np.abs(everything[0] - want[-1]).max()))
        last = int(np.argmax(ours[-1]))
        for _ in range(40):
            ours = pooled.decode(last)
            want = ref.step(np.array([last]), pooled.n_past - 1, visible(seen[-1], 0))[0]
            worst = max(worst, float(np.abs(ours - want).max()))
            last = int(np.argmax(ours))
        assert slots.page_outs >= 4 and slots.resident == 384 // CHUNK
        assert {0, 6, 7, 8, 9} <= set(slots.home)  # the sink and the last 256 positions
    assert worst <= 2e-3
    assert unmasked > 50 * worst  # seeing the paged-out rows would have shown


def test_which_rows_a_token_sees_depends_on_its_position_not_on_the_steps(tiny_model):
    """Prefill in chunks of 64, of 160 or one token at a time: the same positions are resident
    for every token, so the logits agree up to the order of sums (f32 ones: the CPU's flash
    attention sums V in f16, where the order of the rows shows up to 1e-3)."""
    path = tiny_model("base", "f32")
    prompt = tokens(700, 512, seed=4)
    logits = []
    for chunk in (64, 160):
        with engine(path, pool=384, chunk=160, flash_attn=False) as e:
            logits.append(e.prefill(prompt, chunk=chunk, all_logits=True))
    with engine(path, pool=384, chunk=160, flash_attn=False) as e:
        e.prefill(prompt[:500], chunk=160)
        one = [e.decode(int(t)).copy() for t in prompt[500:]]
        assert e.pipeline.slots.page_outs >= 4
    np.testing.assert_allclose(logits[0], logits[1], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.array(one), logits[0][500:], rtol=1e-4, atol=1e-4)


def test_a_paged_out_chunk_is_copied_to_host_memory_whole(tiny_model):
    """The first chunk paged out was written before any paging: its rows in host memory equal
    the full cache's rows for the same positions, in every full-attention layer."""
    path = tiny_model("base", "f32")
    with engine(path, pool=384) as pooled, engine(path) as full:
        prompt = tokens(520, full.params.n_vocab, seed=3)
        pooled.prefill(prompt, chunk=64)
        full.prefill(prompt, chunk=64)
        slots = pooled.pipeline.slots
        first = min(slots.on_host)
        assert first == 1 and first not in slots.home
        lib, names = full.lib, sorted(full.shard.state.appended())
        assert names
        for name in names:
            t = full.shard.state.t[name]
            row = lib.ggml_row_size(t.type, t.ne[0])
            want = np.empty((CHUNK, row), dtype=np.uint8)
            lib.ggml_backend_tensor_get(t, ffi.from_buffer(want), first * CHUNK * row, want.nbytes)
            np.testing.assert_array_equal(pooled.pipeline.host_pool.rows[(0, name, first)], want)


@pytest.mark.parametrize("device", ["cpu", "cpu,cpu@worker"])
def test_rollback_with_paging_equals_never_seeing_the_rejected_tokens(device, tiny_model):
    """A verify block that crosses a chunk boundary pages a chunk out; rolling it back brings
    the chunk back, so the next steps equal a run that never saw the rejected tokens."""
    path = tiny_model("base", "f32")
    prompt = tokens(444, 512, seed=8)  # 444 + 8 crosses position 448: a chunk pages out
    block = [50, 60, 70, 80, 90, 100, 110, 120]
    with engine(path, pool=384, device=device) as e:
        for keep in (2, 4, 5, 8):  # 4: the block ends at the boundary; 5: one past it
            e.reset()
            e.prefill(prompt, chunk=64)
            before = e.pipeline.slots.page_outs
            e.verify(block, greedy=True)
            assert e.pipeline.slots.page_outs == before + 1
            e.rollback(keep)
            after = [e.decode(t).copy() for t in (7, 9, 11)]
            state = e.pipeline.slots.state()
            e.reset()
            e.prefill(prompt, chunk=64)
            e.prefill(block[:keep], chunk=64)
            fresh = [e.decode(t).copy() for t in (7, 9, 11)]
            for a, b in zip(after, fresh, strict=True):
                np.testing.assert_array_equal(a, b)
            for k in ("home", "on_host", "sealed"):
                np.testing.assert_array_equal(state[k], e.pipeline.slots.state()[k])


@pytest.mark.parametrize("rank", ["lru", "qk"])
def test_a_split_with_a_worker_pages_as_the_unsplit_model(rank, tiny_model):
    """One pool per shard, one of them in a worker: the same chunks page out and in as in one
    shard (qk's scores read the queries of both shards), with the same logits and tokens."""
    path = tiny_model("base", "f32")
    prompt = tokens(1000, 512, seed=4)
    runs = []
    for device, split in (("cpu", None), ("cpu,cpu@worker", "1,1")):
        with engine(
            path, pool=640, max_ctx=2048, kv_pool_rank=rank, device=device, layer_split=split
        ) as e:
            if split:
                assert [s.process for s in e.shards] == ["local", "worker"]
            runs.append(paged_run(e, prompt))
    (one, one_tokens, *one_pager), (split, split_tokens, *split_pager) = runs
    assert one_pager == split_pager and one_pager[1] >= 6
    assert one_pager[2] >= (rank == "qk")
    err = np.linalg.norm(split - one, axis=1) / np.linalg.norm(one, axis=1)
    assert err.max() <= 1e-4
    assert split_tokens == one_tokens


@pytest.mark.parametrize("rank", ["lru", "qk"])
def test_a_snapshot_after_paging_restores_the_same_pool(rank, tiny_model, tmp_path):
    """RAM and disk snapshots taken after paging hold the pool, the mapping and the host rows;
    restored, the next steps equal those of the run that went on (and page the same way)."""
    path = tiny_model("base", "f32")
    prompt = tokens(900, 512, seed=6)
    cfg = {"pool": 512, "kv_pool_rank": rank, "kv_cache_dir": str(tmp_path)}
    with engine(path, **cfg) as e:
        e.prefill(prompt, chunk=64)
        slots = e.pipeline.slots
        assert slots.page_outs and not slots.readable(e.n_past)
        if rank == "qk":
            assert slots.page_ins  # ranking has brought chunks back
        copies, arrays = e.snapshot(), e.export_state()
        cont = [e.decode(t).copy() for t in range(3, 83)]  # pages further, ranks again
        assert e.pipeline.slots.page_outs > 0
        counts = (slots.page_outs, slots.page_ins)
        for restore in (lambda: e.restore(copies, 900), lambda: e.load_state(arrays, 900)):
            e.reset()
            restore()
            again = [e.decode(t).copy() for t in range(3, 83)]
            for a, b in zip(cont, again, strict=True):
                np.testing.assert_array_equal(a, b)
        assert slots.page_outs > counts[0]
        e.drop_snapshot(copies)


def test_the_prefix_cache_keeps_and_restores_a_paged_prompt(tiny_model, tmp_path):
    """Through the prefix cache, RAM and disk: a resent prompt longer than the pool restores
    after paging and gives the fresh run's logits; a cold restart reads the disk snapshot."""
    path = tiny_model("base", "f32")
    prompt = [int(t) for t in tokens(800, 512, seed=2)]
    cfg = {"pool": 384, "prefix_cache_slots": 2, "kv_cache_dir": str(tmp_path)}
    with engine(path, pool=384) as plain:
        want = plain.prefill(prompt, chunk=64).copy()
        want_next = plain.decode(5).copy()
    for _ in range(2):  # the second engine starts cold: only the disk holds the snapshot
        with engine(path, **cfg) as e:
            cache = PrefixCache.for_engine(e)
            first, report = cache.start(prompt, 64)
            np.testing.assert_array_equal(first, want)
            logits, report = cache.start(prompt + [5], 64)
            assert report["restored_tokens"] == 800 and report["prefilled_tokens"] == 1
            np.testing.assert_array_equal(logits, want_next)


def test_gemma4_pools_its_full_layers_and_keeps_its_rings(tmp_path):
    """gemma4's sliding layers keep their rings (indexed by position); only the full layers
    page. Pooled equals the full cache until the first page-out, and runs on after it."""
    path = FIXTURES / "gemma4-f32.gguf"
    with engine(path, pool=384, max_ctx=2048) as pooled, engine(path, max_ctx=2048) as full:
        prompt = tokens(900, full.params.n_vocab, seed=1)
        a = pooled.prefill(prompt, chunk=64, all_logits=True)
        b = full.prefill(prompt, chunk=64, all_logits=True)
        np.testing.assert_array_equal(a[:384], b[:384])
        assert pooled.pipeline.slots.page_outs > 0
        assert np.abs(a[448:] - b[448:]).max() > 1e-3  # the pool forgets: not the full cache
        full_rows = {s.layer: s.n_ctx for s in pooled.shard.state.states}
        assert sorted(set(full_rows.values()))[-1] < 2048


def test_plan_and_generate_report_the_pool(tiny_model):
    """``plan --json`` sizes the pool as the engine allocates it; ``generate --json`` says where
    its chunks went."""
    path, flags = tiny_model("base", "f32"), ["--kv-pool", "384", "--max-ctx", "1024"]
    run = subprocess.run(
        [sys.executable, "-m", "lucepy", "plan", path, *flags, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    plan = json.loads(run.stdout)
    pool = plan["kv_pool"]
    assert pool["pool_tokens"] == 384 and pool["cache_rows"] == 384 + 512 + 64
    assert pool["full_cache_bytes"] == pool["pool_bytes"] // pool["cache_rows"] * 1024
    prompt = ",".join(str(t) for t in tokens(500, 512))
    run = subprocess.run(
        [sys.executable, "-m", "lucepy", "generate", path, *flags, "--kv-pool-rank", "qk"]
        + ["--prompt-tokens", prompt, "--max-tokens", "70", "--threads", "2", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)["kv_pool"]
    assert out["policy"] == "qk" and out["resident_chunks"] == 6
    assert out["page_outs"] >= 3 and out["paged_chunks"] >= 3 and out["host_bytes"] > 0
    with engine(path, pool=384, chunk=512) as e:
        assert e.shard.state_bytes == plan["shards"][0]["state_bytes"]


def test_pool_flags_are_checked(tiny_model):
    with pytest.raises(ConfigError, match="multiple of 64"):
        PagedSlots(1024, 400, 64)
    with pytest.raises(ConfigError, match="negative"):
        RuntimeConfig(kv_pool=-1)
    with pytest.raises(ConfigError, match="lru or qk"):
        RuntimeConfig(kv_pool_rank="random")
    with engine(tiny_model("base", "f32"), pool=2048, max_ctx=1024) as e:  # pool >= context
        assert isinstance(e.pipeline.slots, IdentitySlots)
    with engine(LLAMA, pool=384) as e:
        e.prefill(tokens(300, e.params.n_vocab), chunk=64)
        e.drop_snapshot(e.snapshot(200))  # fewer tokens than held, before paging
        e.prefill(tokens(300, e.params.n_vocab), chunk=64)
        with pytest.raises(ValueError, match="paged: a snapshot holds all 600 tokens"):
            e.snapshot(500)


class FakeMover:
    """Records the pager's copies; scores chunks by a fixed table."""

    def __init__(self, table: dict[int, float]):
        self.table, self.calls = table, []

    def seal(self, pc, c):
        self.calls.append(("seal", c))

    def page_out(self, pc, c):
        self.calls.append(("out", c))

    def page_in(self, pc, c):
        self.calls.append(("in", c))

    def scores(self, chunks):
        return np.array([self.table.get(c, 0.0) for c in chunks])


def test_qk_ranking_fills_the_pool_with_the_best_chunks_and_keeps_sink_and_tail():
    mover = FakeMover({})
    slots = PagedSlots(4096, 512, 64, mover, "qk")  # 8 chunks resident at most
    for pos0 in range(0, 1024, 64):  # equal scores: the least recently used go
        slots.batch(np.zeros(64, np.int32), pos0)
    assert ("out", 2) in mover.calls and set(slots.home) == {0, *range(9, 16)}
    mover.table = {2: 5.0, 3: 4.0, 9: -1.0}
    slots.rank_next = True
    slots.batch(np.zeros(1, np.int32), 1024)
    # the sink, the chunks of positions 768..1023 and the step's new one stay; the two best
    # of the others come back in
    assert set(slots.home) == {0, 12, 13, 14, 15, 16, 2, 3}
    assert mover.calls[-2:] == [("in", 2), ("in", 3)]
    assert slots.report()["page_ins"] == 2 and slots.report()["paged_chunks"] == 9
    slots.batch(np.zeros(64, np.int32), 1025)  # chunk 17: the lowest score (chunk 3) goes
    assert 3 in slots.retired and 2 in slots.home


def test_a_chunk_paged_out_inside_a_step_stays_visible_to_the_tokens_before():
    slots = PagedSlots(4096, 384, 128, None, "lru")
    for pos0 in range(0, 384, 64):
        slots.batch(np.zeros(64, np.int32), pos0)
    b = slots.batch(np.zeros(128, np.int32), 352)  # position 384 starts chunk 6: chunk 1 goes
    assert 1 in slots.retired and slots.retired[1][1] == 384
    before, after = visible(b, 384 - 352 - 1), visible(b, 384 - 352)
    assert set(range(64, 128)) <= before and not set(range(64, 128)) & after
    assert set(range(0, 64)) <= after and set(range(128, 385)) <= after
