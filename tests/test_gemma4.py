"""gemma4 through the same runtime as qwen35: llama.cpp parity on converter-made files (sliding
and full layers, shared KV, per-layer inputs, V = K, double-wide MLP, MoE, softcap), the ring that
bounds sliding-window KV, splits that keep KV sharers with their source, snapshots and lossless
DFlash across the ring's wrap. Logits at every prompt position are compared in test_llama.py
(``test_converted_files_match_llama_cpp_at_every_position`` runs every fixture)."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from conftest import THREADS
from test_speculative import assert_target_distribution

from lucepy.decode.ar import generate
from lucepy.decode.sampling import SamplingParams
from lucepy.engine import open_engine
from lucepy.ggml import load
from lucepy.gguf import GGUFFile
from lucepy.models import ModelOptions, architecture_for
from lucepy.models.batch import StepBatch
from lucepy.runtime.config import RuntimeConfig
from lucepy.runtime.engine import Engine
from lucepy.runtime.placement import honour_split_points, layer_ranges
from lucepy.runtime.plan import make_plan
from lucepy.testing.tiny import Qwen35Spec
from lucepy.testing.tiny_draft import write_dflash

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
MODELS = ["gemma4-f32", "gemma4-q8_0", "gemma4-q4_0", "gemma4-moe-f32", "gemma4-moe-q8_0"]
SHARED = FIXTURES / "gemma4-f32.gguf"  # the file with shared KV and per-layer inputs
WINDOW = 12
PROMPT = list(range(5, 60))  # 55 tokens: longer than the window
# Past the ring: with a 16-token step the ring is 256 rows (window + step, padded to 256), so a
# sequence of 300 tokens wraps it
LONG = [5 + (7 * i) % 450 for i in range(270)]


def cfg(**kw) -> RuntimeConfig:
    return RuntimeConfig(**{"threads": THREADS, "max_ctx": 256, **kw})


@pytest.mark.parametrize("name", MODELS)
def test_greedy_32_tokens_equal_llama_cpp(name, reference):
    path = FIXTURES / f"{name}.gguf"
    with Engine(path, cfg(), tokenizer=False) as engine:
        ours = generate(engine, PROMPT, 32, stop_at_end=False).tokens
    ref = reference(path, 512)
    theirs = ref.greedy(PROMPT, 32)
    assert ours == theirs
    assert len(set(ours)) > 4


def test_the_fixtures_have_every_feature():
    with GGUFFile(SHARED) as f:
        p = architecture_for(f).from_gguf(f).p
        assert "blk.3.attn_v.weight" not in f.tensors  # a full layer without v_proj: V = K
        assert "blk.0.attn_v.weight" in f.tensors
    assert p.swa == (True, True, True, False, True, False) and p.window == WINDOW
    assert (p.head_dim_swa, p.head_dim) == (16, 32) and p.rope_theta_swa != p.rope_theta
    assert p.n_kv_shared == 2 and [p.kv_source(il) for il in (4, 5)] == [2, 3]
    assert p.n_embd_per_layer == 8 and p.ffs == (96, 96, 96, 96, 192, 192)
    assert p.softcap == 30.0
    with GGUFFile(FIXTURES / "gemma4-moe-f32.gguf") as f:
        moe = architecture_for(f).from_gguf(f).p
    assert (moe.n_expert, moe.n_expert_used, moe.n_ff_exp) == (4, 2, 32)


def test_sliding_state_is_a_ring_not_the_context():
    """State bytes: 3 sliding layers own KV (layer 4 reads layer 2's), each a ring of the window
    plus the step padded to 256 rows; only layer 3 (full; layer 5 reads it) grows with context."""
    f16, width = 2, 16 * 2  # sliding: 2 KV heads of 16; full: 1 KV head of 32
    got = {}
    for ctx in (1024, 2048):
        with Engine(SHARED, cfg(max_ctx=ctx, chunk=16), tokenizer=False) as engine:
            got[ctx] = engine.shard.state_bytes
            assert engine.plan.shards[0].state_bytes == got[ctx]
            assert "ring of 256 rows" in engine.plan.memory
    ring = 3 * 2 * width * 256 * f16
    for ctx, n in got.items():
        assert n == ring + 2 * 32 * ctx * f16
    with Engine(SHARED, cfg(max_ctx=2048), tokenizer=False) as engine:  # step 512: 768 rows
        assert engine.shard.state_bytes == 3 * 2 * width * 768 * f16 + 2 * 32 * 2048 * f16


def test_the_ring_always_holds_the_window():
    """Steps of every size up to the ring's margin, with verify-like rollbacks: after each step
    every token attends to exactly the positions of its window, and each row it attends to holds
    the position the mask says (what the cache would hold, simulated row by row)."""
    window, margin = 5, 4
    ring = window + margin
    rng = np.random.default_rng(0)
    rows = np.full(ring, -1)  # the position each ring row holds
    end = 0
    while end < 60:
        t = int(rng.integers(1, margin + 1))
        pos = np.arange(end, end + t, dtype=np.int32)
        batch = StepBatch(
            tokens=np.zeros(t, np.int32),
            pos=pos,
            seq=np.zeros(t, np.int32),
            slots=pos.astype(np.int64),
            cell_pos=np.arange(256, dtype=np.int32),
            cell_seq=np.zeros(256, np.int32),
        ).ring(ring, ring)
        rows[batch.slots] = pos
        ok = batch.mask(window) == 0
        for i, p in enumerate(pos):
            seen = sorted(rows[ok[i]])
            assert seen == list(range(max(0, p - window + 1), p + 1)), (p, seen)
        keep = int(rng.integers(1, t + 1))  # a verify keeps a prefix of its block
        end = int(pos[0]) + keep


def test_every_split_keeps_kv_sharers_with_their_source():
    with GGUFFile(SHARED) as f:
        model = architecture_for(f).from_gguf(f)
    p, points = model.p, model.split_points()
    assert points == [1, 2]
    sharers = {s: p.kv_source(s) for s in range(p.first_shared, p.n_layer)}
    for n in (2, 3):
        for bounds in itertools.combinations(range(1, p.n_layer), n - 1):
            edges = [0, *bounds, p.n_layer]
            asked = [range(a, b) for a, b in itertools.pairwise(edges)]
            try:
                ranges, notes = honour_split_points(asked, points, model.split_reason())
            except Exception as e:  # only when no allowed boundary fits between two others
                assert "allows a split" in str(e)
                continue
            for r in ranges:
                for s, src in sharers.items():
                    assert (s in r) == (src in r), (bounds, ranges)
            assert bool(notes) == (ranges != asked)


def test_an_explicit_split_is_aligned_and_explained():
    config = cfg(device="cpu,cpu", layer_split="1,1")
    with GGUFFile(SHARED) as f:
        model = architecture_for(f).from_gguf(f, ModelOptions())
        plan = make_plan(f, model, config, load())
    assert plan.requested == ((0, 3), (3, 6))
    assert [s.layers for s in plan.shards] == [(0, 2), (2, 6)]
    assert plan.notes == (
        "split at layer 3 moved to 2: shared-KV layers stay with the layer whose KV they read "
        "(4<-2, 5<-3)",
    )
    assert layer_ranges([1, 1], 6) == [range(0, 3), range(3, 6)]


def run(path, **kw):
    """Prompt logits at every position and a greedy continuation."""
    with Engine(path, cfg(**kw), tokenizer=False) as engine:
        logits = engine.prefill(PROMPT, chunk=16, all_logits=True).copy()
        out = [int(np.argmax(logits[-1]))]
        for _ in range(16):
            out.append(int(np.argmax(engine.decode(out[-1]))))
        layers = [(s.layers.start, s.layers.stop, s.process) for s in engine.shards]
    return logits, out, layers


@pytest.mark.parametrize(
    "name,device,split,layers",
    [
        ("gemma4-f32", "cpu,cpu", None, [(0, 2, "local"), (2, 6, "local")]),
        ("gemma4-f32", "cpu,cpu@worker", "1,5", [(0, 1, "local"), (1, 6, "worker")]),
        (
            "gemma4-f32",
            "cpu,cpu,cpu@worker",
            "1,1,4",
            [(0, 1, "local"), (1, 2, "local"), (2, 6, "worker")],
        ),
        ("gemma4-moe-f32", "cpu,cpu@worker,cpu", "1,1,2", None),
    ],
)
def test_sharded_equals_unsharded(name, device, split, layers):
    path = FIXTURES / f"{name}.gguf"
    whole = run(path)
    logits, out, got = run(path, device=device, layer_split=split)
    if layers is not None:
        assert got == layers
    err = np.linalg.norm(logits - whole[0], axis=1) / np.linalg.norm(whole[0], axis=1)
    assert err.max() <= 1e-4
    assert out == whole[1]


@pytest.mark.parametrize("device,split", [("cpu", None), ("cpu,cpu@worker", "1,2")])
def test_restored_equals_fresh_in_ram_on_disk_and_after_a_cold_restart(device, split, tmp_path):
    """Turns long enough to wrap the ring (16-token steps: 256 rows)."""
    path = FIXTURES / "gemma4-q8_0.gguf"
    turn1, turn2 = LONG[:200], LONG + list(range(100, 120))
    kw = {"device": device, "layer_split": split, "max_ctx": 512, "chunk": 16}
    with Engine(path, cfg(**kw), tokenizer=False) as engine:
        fresh = generate(engine, turn2, 24, stop_at_end=False).tokens
    cache = {"prefix_cache_slots": 4, "kv_cache_dir": str(tmp_path), "disk_prefix_cache": "full"}
    with open_engine(path, cfg(**kw, **cache), tokenizer=False) as engine:
        generate(engine, turn1, 8, stop_at_end=False)
        ram = generate(engine, turn2, 24, stop_at_end=False)
    with open_engine(path, cfg(**kw, **cache), tokenizer=False) as engine:
        disk = generate(engine, turn2, 24, stop_at_end=False)
    assert ram.cache["hit"] == "ram" and ram.cache["restored_tokens"] == len(turn1)
    assert disk.cache["hit"] == "disk" and disk.cache["restored_tokens"] > len(turn1)
    assert ram.tokens == fresh and disk.tokens == fresh


def _draft(tmp_path, block: int, layers=(1, 3, 6)) -> Path:
    """A random draft reading the residual entering ``layers`` (n_layer: the final one)."""
    shape = Qwen35Spec(n_vocab=469, n_embd=64, n_layer=6, context_length=2048, rms_eps=1e-6)
    return write_dflash(tmp_path / "draft.gguf", shape, target_layers=layers, block_size=block)


# Where a test needs a block step and single-token steps to give bit-equal logits, it runs q8_0
# weights (whose matmuls are per row at any batch size) and the non-flash attention path. Once the
# ring wraps, a window's rows sit at both ends of the ring, and ggml's CPU flash attention sums a
# single token's rows in a different order from a block's: logits then move by up to 0.1 on these
# random models, which have near-ties (gemma4-moe-q8_0: flash, step 16 against step 1, 0 before
# position 256 and 0.05-0.1 after; non-flash 0 everywhere).
@pytest.mark.parametrize(
    "name,layers,flash",
    [
        ("gemma4-f32", (1, 3, 6), True),
        ("gemma4-q8_0", (1, 3, 6), False),
        ("gemma4-moe-q8_0", (1, 4), False),
    ],
)
def test_speculative_equals_greedy_across_the_ring_wrap(name, layers, flash, tmp_path):
    """Verify blocks of 6 from position 240 on cross the ring's wrap at 256 and the window."""
    path, draft = FIXTURES / f"{name}.gguf", _draft(tmp_path, 6, layers)
    prompt = LONG[:240]
    kw = {"max_ctx": 512, "chunk": 16, "flash_attn": flash}
    with Engine(path, cfg(**kw), tokenizer=False) as engine:
        plain = generate(engine, prompt, 40, stop_at_end=False).tokens
    with Engine(path, cfg(draft=str(draft), **kw), tokenizer=False) as engine:
        gen = generate(engine, prompt, 40, stop_at_end=False)
    assert gen.accept is not None and gen.accept.steps > 0
    assert gen.tokens == plain


def test_sampling_with_a_draft_matches_the_target_distribution(tmp_path):
    """As test_speculative's: each sampled token's rank under the target's own distribution,
    chi-square over 4 ranks, 3 degrees of freedom, rejected at p < 0.001 (16.3). The teacher-
    forced pass must see the logits the sampler saw, so: q8_0, non-flash (see above)."""
    path, draft = FIXTURES / "gemma4-q8_0.gguf", _draft(tmp_path, 4)
    sampling = SamplingParams(temperature=1.0, top_k=4)
    seqs = []
    for seed in range(10):
        with Engine(path, cfg(draft=str(draft), flash_attn=False), tokenizer=False) as engine:
            gen = generate(engine, PROMPT, 48, sampling=SamplingParams(1.0, 4, 1.0, seed))
        assert gen.accept is not None and gen.accept.steps > 0
        seqs.append(gen.tokens)
    assert_target_distribution(path, seqs, sampling, PROMPT, flash_attn=False)
