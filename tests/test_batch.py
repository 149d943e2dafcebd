"""Continuous batching (decode/batch.py) on SmolLM2: requests decoded together, joining and
leaving at any step, give exactly the tokens each gives alone; a cancelled request frees its
sequence for a waiting one; each sequence attends to its own cache rows only."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import THREADS

from lucepy.catalog import smollm2_file
from lucepy.decode.ar import generate
from lucepy.decode.batch import Batcher
from lucepy.engine import Engine, open_engine
from lucepy.errors import ConfigError
from lucepy.runtime.config import RuntimeConfig
from lucepy.runtime.slots import SeqSlots

PROMPTS = Path(__file__).parents[1] / "tools" / "dflash_prompts.json"
CTX = 256


def config(parallel: int, **kw) -> RuntimeConfig:
    base = dict(threads=THREADS, max_ctx=CTX, chunk=32, parallel=parallel, batch_invariant=True)
    return RuntimeConfig(**(base | kw))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    held = json.loads(PROMPTS.read_text())["heldout"]
    # different lengths: whole prompts and their first tokens
    return [p if i % 2 else p[: 12 + 3 * i] for i, p in enumerate(held)]


def alone(prompts, lengths) -> list[list[int]]:
    with Engine(smollm2_file(), config(1), tokenizer=False) as engine:
        return [
            generate(engine, p, n, stop_at_end=False).tokens
            for p, n in zip(prompts, lengths, strict=True)
        ]


def test_seq_slots_keep_each_sequence_to_its_rows():
    slots = SeqSlots(3, 8)
    batch = slots.batch_of(np.array([5, 6, 7]), np.array([0, 0, 2]), np.array([0, 1, 0]))
    assert batch.slots.tolist() == [0, 1, 16]
    mask = batch.mask()
    seen = [np.flatnonzero(row == 0).tolist() for row in mask]
    assert seen == [[0], [0, 1], [16]]
    slots.release(0)
    batch = slots.batch_of(np.array([9]), np.array([2]), np.array([1]))
    assert np.flatnonzero(batch.mask()[0] == 0).tolist() == [16, 17]
    assert batch.cell_pos[:2].tolist() == [-1, -1]  # sequence 0's rows, released
    with pytest.raises(ValueError, match="sequence ids"):
        slots.batch_of(np.array([1]), np.array([3]), np.array([0]))
    # streams: a decode step of sequences 0 and 2 (1 between them stands in at its last row)
    step = slots.decode_batch(np.array([4, 5]), np.array([2, 0]), np.array([3, 1]))
    assert (step.streams, step.stream_first, step.stream_rows) == (3, 0, 8)
    assert step.slots.tolist() == [1, 15, 19] and step.tokens.tolist() == [5, 0, 4]
    assert [np.flatnonzero(row == 0).tolist() for row in step.mask()[[0, 2]]] == [
        [0, 1],
        [0, 1, 2, 3],
    ]
    chunk = slots.chunk_batch(np.array([7, 8, 9]), 1, 2)
    assert (chunk.streams, chunk.stream_first) == (1, 1) and chunk.slots.tolist() == [10, 11, 12]


def seeded(batcher: Batcher, prefixes: list[list[int]]) -> None:
    """Run ``prefixes`` first, so that the prefix cache holds them."""
    for p in prefixes:
        batcher.submit(p, 2, stop_at_end=False)
    batcher.run()


def run_cancelling(batcher: Batcher, req, after: int) -> int:
    """Step until every request has ended, cancelling ``req`` once it has ``after`` tokens; the
    most requests active at once."""
    most = 0
    while not batcher.idle:
        batcher.step()
        most = max(most, len(batcher.active))
        if len(req.tokens) == after and not req.done:
            batcher.cancel(req)
    return most


def test_eight_requests_together_equal_each_alone_with_a_cancel_and_a_queue(prompts):
    """Ten requests on eight sequences: two wait; one is cancelled after 6 tokens and a waiting
    one takes its sequence; two start from a cached prefix; prompts are fed in chunks of 32
    between decode steps."""
    picked = prompts[:10]
    lengths = [24 + 4 * i for i in range(10)]
    want = alone(picked, lengths)
    cfg = config(8, prefix_cache_slots=16)
    with open_engine(smollm2_file(), cfg, tokenizer=False) as engine:
        batcher = Batcher(engine)
        seeded(batcher, [picked[5][:20], picked[7][:33]])
        steps = dict(batcher.steps)
        pairs = zip(picked, lengths, strict=True)
        reqs = [batcher.submit(p, n, stop_at_end=False) for p, n in pairs]
        assert len(batcher.waiting) == 10
        most = run_cancelling(batcher, reqs[3], 6)
        assert most == 8 and batcher.steps["decode"] - steps["decode"] < sum(lengths) / 4
    # at least the seeded prompts (more where a seed's own next token matched); longer prompts
    # restore the chat template's header they share with a seed
    restored = [r.cache["restored_tokens"] for r in reqs]
    assert restored[5] >= 20 and restored[7] >= 33
    for i, (req, tokens) in enumerate(zip(reqs, want, strict=True)):
        if i == 3:
            assert req.finish_reason == "cancelled" and req.tokens == tokens[:6]
        else:
            assert req.finish_reason == "length" and req.tokens == tokens, i


def test_thirty_two_requests_together_equal_each_alone(prompts):
    picked = [prompts[i % len(prompts)][: 10 + i] for i in range(32)]
    lengths = [8 + i % 7 for i in range(32)]
    want = alone(picked, lengths)
    cfg = config(32, prefix_cache_slots=16)
    with open_engine(smollm2_file(), cfg, tokenizer=False) as engine:
        batcher = Batcher(engine)
        seeded(batcher, [picked[3][:12], picked[30][:25]])
        pairs = zip(picked, lengths, strict=True)
        reqs = [batcher.submit(p, n, stop_at_end=False) for p, n in pairs]
        batcher.run()
    assert reqs[3].cache["restored_tokens"] >= 12 and reqs[30].cache["restored_tokens"] >= 25
    assert [r.tokens for r in reqs] == want


def test_batched_requests_use_the_disk_cache_across_a_restart(prompts, tmp_path):
    """Disk snapshots only (no RAM slots): batched requests write their prompts' snapshots;
    after a restart, requests restore them into other sequences than they were written from
    (one goes on from a cached prompt and prefills the rest, one is a cached prompt whole and
    prefills nothing) and equal each request alone; the one-sequence path restores a snapshot
    that a batched sequence wrote."""
    picked = [prompts[3], prompts[5]]
    disk = dict(prefix_cache_slots=0, kv_cache_dir=str(tmp_path), disk_prefix_cache="full")
    with open_engine(smollm2_file(), config(4, **disk), tokenizer=False) as engine:
        batcher = Batcher(engine)
        for p in picked:
            batcher.submit(p, 4, stop_at_end=False)
        batcher.run()
    assert len(list(tmp_path.glob("*"))) >= 2
    later = [prompts[9], picked[0] + prompts[7][-20:], picked[1]]
    want = alone(later, [12, 12, 12])
    with open_engine(smollm2_file(), config(4, **disk), tokenizer=False) as engine:
        batcher = Batcher(engine)
        reqs = [batcher.submit(p, 12, stop_at_end=False) for p in later]  # sequences 0, 1, 2
        batcher.run()
    assert [r.tokens for r in reqs] == want
    assert reqs[1].cache["hit"] == "disk" and reqs[1].cache["restored_tokens"] >= len(picked[0])
    assert reqs[1].cache["prefilled_tokens"] > 0
    assert reqs[2].cache == {"hit": "disk", "restored_tokens": len(picked[1]),
                             "prefilled_tokens": 0}  # fmt: skip
    with open_engine(smollm2_file(), config(1, **disk), tokenizer=False) as engine:
        again = generate(engine, later[1], 12, stop_at_end=False)  # written by sequence 1
    assert again.cache["hit"] == "disk" and again.cache["prefilled_tokens"] == 0
    assert again.tokens == want[1]


def test_requests_restore_cached_prefixes_into_their_own_sequences(prompts):
    """The RAM prefix cache beside batching: a prompt seen before starts from its logits with
    nothing to prefill; one that goes on from where a finished request's sequence stood
    restores that sequence and prefills the rest, in chunks, while others decode; tokens equal
    each request alone."""
    first = prompts[1]
    with open_engine(smollm2_file(), config(4, prefix_cache_slots=8), tokenizer=False) as engine:
        batcher = Batcher(engine)
        seen = batcher.submit(first, 16, stop_at_end=False)
        batcher.run()
        assert seen.cache == {"hit": "none", "restored_tokens": 0, "prefilled_tokens": len(first)}
        # the positions seen's sequence held when it ended: its prompt and 15 tokens fed
        longer = first + seen.tokens[:15] + prompts[3][-40:]
        picked = [first, longer, prompts[5]]
        reqs = [batcher.submit(p, 20, stop_at_end=False) for p in picked]
        steps = dict(batcher.steps)
        batcher.run()
        chunks = -(-len(prompts[5]) // 32) + 2  # prompts[5]'s, and longer's 40 tokens
        assert batcher.steps["prefill"] - steps["prefill"] == chunks
    assert [r.cache["restored_tokens"] for r in reqs] == [len(first), len(first) + 15, 0]
    assert [r.cache["prefilled_tokens"] for r in reqs] == [0, 40, len(prompts[5])]
    assert [r.tokens for r in [seen, *reqs]] == alone([first, *picked], [16, 20, 20, 20])


def test_a_split_with_a_worker_batches_as_the_unsplit_model(prompts):
    """Layers 0-14 here, 15-29 in a worker process: the batch's streams cross the split."""
    picked, lengths = prompts[:6], [12 + 2 * i for i in range(6)]
    want = alone(picked, lengths)
    split = config(4, device="cpu,cpu@worker", layer_split="1,1")
    with Engine(smollm2_file(), split, tokenizer=False) as engine:
        assert [s.process for s in engine.shards] == ["local", "worker"]
        batcher = Batcher(engine)
        pairs = zip(picked, lengths, strict=True)
        reqs = [batcher.submit(p, n, stop_at_end=False) for p, n in pairs]
        batcher.run()
    assert [r.tokens for r in reqs] == want


def test_recurrent_sequences_batch_as_each_alone(tiny_model):
    """qwen35 (Gated DeltaNet layers beside attention): each sequence has its own slice of the
    recurrent state; six requests on four sequences, one cancelled, equal each alone."""
    path = tiny_model()
    cfg = dict(threads=THREADS, max_ctx=96, chunk=8, batch_invariant=True)
    rng = np.random.default_rng(7)
    with Engine(path, RuntimeConfig(**cfg), tokenizer=False) as engine:
        picked = [rng.integers(3, engine.params.n_vocab, 5 + 4 * i).tolist() for i in range(6)]
        lengths = [10 + 3 * i for i in range(6)]
        want = [
            generate(engine, p, n, stop_at_end=False).tokens
            for p, n in zip(picked, lengths, strict=True)
        ]
    with Engine(path, RuntimeConfig(**cfg, parallel=4), tokenizer=False) as engine:
        batcher = Batcher(engine)
        assert batcher.recurrent and batcher.cache is None
        pairs = zip(picked, lengths, strict=True)
        reqs = [batcher.submit(p, n, stop_at_end=False) for p, n in pairs]
        while not batcher.idle:
            batcher.step()
            if len(reqs[1].tokens) == 4:
                batcher.cancel(reqs[1])
    assert reqs[1].tokens == want[1][:4]
    assert [r.tokens for i, r in enumerate(reqs) if i != 1] == want[:1] + want[2:]


def test_more_sequences_at_once_than_rows_in_a_window(prompts):
    """Twenty requests whose prompt is cached with its logits join in one round and decode
    together in sequences of 16 positions: a step of more tokens than a sequence's window has
    rows (each token reads its own window)."""
    prompt = prompts[0][:6]
    want = alone([prompt], [8])[0]
    cfg = config(20, max_ctx=16, prefix_cache_slots=4)
    with open_engine(smollm2_file(), cfg, tokenizer=False) as engine:
        batcher = Batcher(engine)
        batcher.submit(prompt, 1, stop_at_end=False)
        batcher.run()  # the prompt, with its logits, in the cache
        reqs = [batcher.submit(prompt, 8, stop_at_end=False) for _ in range(20)]
        batcher.run()
        assert all(r.cache["prefilled_tokens"] == 0 for r in reqs)
        assert batcher.steps["decoded"] == 20 * 7  # 20 rows a step, after each first token
    assert all(r.tokens == want for r in reqs)


def test_parallel_is_refused_where_it_cannot_run():
    with pytest.raises(ConfigError, match="parallel"):
        RuntimeConfig(parallel=0)
    with pytest.raises(ConfigError, match="kv-pool"):
        RuntimeConfig(parallel=2, kv_pool=1024)
    with Engine(smollm2_file(), config(1), tokenizer=False) as engine:
        with pytest.raises(ConfigError, match="parallel"):
            Batcher(engine)
    with pytest.raises(ConfigError, match="needs .* MiB on cpu"):
        Engine(smollm2_file(), RuntimeConfig(max_ctx=8192, parallel=100_000), tokenizer=False)


def test_prompts_that_arrive_together_are_read_in_one_round(prompts):
    """With no request decoding, a round feeds the chunks of every waiting prompt (32 tokens in
    all here), so that they decode together; while requests decode, one chunk a round."""
    with open_engine(smollm2_file(), config(8), tokenizer=False) as engine:
        batcher = Batcher(engine)
        first = [batcher.submit(p[:8], 20, stop_at_end=False) for p in prompts[:5]]
        batcher.step()  # 4 prompts of 8 tokens fill the round's 32; the fifth waits for the next
        assert [len(r.tokens) for r in first] == [2, 2, 2, 2, 0]
        batcher.step()  # now others decode: the fifth prompt's chunk alone
        later = [batcher.submit(p[:8], 4, stop_at_end=False) for p in prompts[5:7]]
        batcher.step()
        assert [len(r.tokens) for r in later] == [2, 0]  # its first token, then decoded
        batcher.run()
    assert all(r.finish_reason == "length" for r in first + later)
