"""laguna through the same runtime as qwen35moe and gemma4: llama.cpp parity at every prompt
position and decode step on converter-made files, one shaped as XS.2 (sliding layers in the
period-4 pattern llama.cpp assumes when the file has none, YaRN on the full layers, per-head gates,
query heads per layer, a leading dense layer) and one as M.1 (full attention only, per-element
gates, two leading dense layers); the pattern read from the file when it gives one; and the
invariants: split with a worker, snapshots in RAM and on disk, experts split between two
backends, lossless DFlash, greedy and sampled. Prompts are longer than the window (12)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import THREADS
from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata
from test_parity_sweep import BOUND
from test_speculative import assert_target_distribution

from lucepy.decode.ar import generate
from lucepy.decode.sampling import SamplingParams
from lucepy.engine import open_engine
from lucepy.ggml import Sched
from lucepy.gguf import GGUFFile
from lucepy.models import architecture_for
from lucepy.runtime import experts
from lucepy.runtime.config import RuntimeConfig
from lucepy.runtime.engine import Engine
from lucepy.testing.tiny import Qwen35Spec
from lucepy.testing.tiny_draft import write_dflash

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
XS, M = FIXTURES / "laguna-xs-q8_0.gguf", FIXTURES / "laguna-m-f32.gguf"
PROMPT = list(range(5, 60))  # 55 tokens
LONG = [5 + (7 * i) % 370 for i in range(270)]  # past the ring's wrap at 256 (16-token steps)
CHUNK, K = 16, 3  # the prefill step; XS's experts per token


def cfg(tmp_path: Path, **kw) -> RuntimeConfig:
    profile = str(tmp_path / "profile.npz")  # never the user's expert profile
    return RuntimeConfig(**{"threads": THREADS, "max_ctx": 256, "expert_profile": profile, **kw})


def params(path: Path):
    with GGUFFile(path) as f:
        return architecture_for(f).from_gguf(f).p


def test_the_fixtures_have_every_feature():
    xs = params(XS)
    with GGUFFile(XS) as f:
        assert "laguna.attention.sliding_window_pattern" not in f.metadata  # the fallback runs
    assert xs.swa == (False, True, True, True, False) and xs.window == 12
    assert xs.heads == (4, 6, 6, 6, 4) and xs.heads_kv == (2,) * 5 and all(xs.gate_per_head)
    assert (xs.n_dense, xs.n_expert, xs.n_expert_used) == (1, 8, K)
    assert (xs.n_ff, xs.n_ff_exp, xs.n_ff_shexp) == (96, 32, 64)
    assert xs.expert_norm and xs.expert_scale == 2.5
    full, swa = xs.rope_full, xs.rope_swa
    assert (full.dims, full.theta, full.freq_scale, full.ext_factor) == (16, 5e5, 0.25, 1.0)
    assert full.n_ctx_orig == 512 and abs(full.attn_factor - 1.0) < 1e-6
    assert (swa.dims, swa.theta, swa.freq_scale, swa.ext_factor) == (32, 1e4, 1.0, 0.0)
    m = params(M)
    assert m.swa == (False,) * 4 and m.window == 0 and not any(m.gate_per_head)
    assert (m.n_dense, m.n_expert_used, m.rope_full.ext_factor) == (2, 2, 0.0)


def run(path: Path, config: RuntimeConfig, n: int = 8):
    """Prompt logits at every position (16-token steps), then ``n`` greedy decode steps' logits
    and tokens, and the shards' layer ranges."""
    with Engine(path, config, tokenizer=False) as engine:
        prompt = engine.prefill(PROMPT, chunk=CHUNK, all_logits=True).copy()
        steps, tokens = [], [int(np.argmax(prompt[-1]))]
        for _ in range(n):
            steps.append(engine.decode(tokens[-1]).copy())
            tokens.append(int(np.argmax(steps[-1])))
        layers = [(s.layers.start, s.layers.stop, s.process) for s in engine.shards]
    return np.concatenate([prompt, np.array(steps)]), tokens, layers


def _reference(reference, path: Path, tokens: list[int], flash_attn: bool) -> np.ndarray:
    ref = reference(path, CHUNK, flash_attn=flash_attn)
    prompt = ref.prompt_logits(PROMPT)
    return np.concatenate([prompt, np.array([ref.feed(t) for t in tokens[:-1]])])


@pytest.mark.parametrize("flash_attn", [True, False], ids=["fa", "no-fa"])
@pytest.mark.parametrize(
    "name", ["laguna-xs-f32", "laguna-xs-q8_0", "laguna-m-f32", "laguna-m-q8_0"]
)
def test_logits_equal_llama_cpp_at_every_position(name, flash_attn, reference, tmp_path):
    """Bound and its reason: tests/test_parity_sweep.py (measured: 0 on every file)."""
    path = FIXTURES / f"{name}.gguf"
    ours, tokens, _ = run(path, cfg(tmp_path, flash_attn=flash_attn))
    theirs = _reference(reference, path, tokens, flash_attn)
    assert theirs.std(axis=-1).min() > 0.1
    diff = np.abs(ours - theirs).max(axis=-1)
    assert diff.max() <= BOUND, f"position {diff.argmax()}: {diff.max():.2e}"


def _with_pattern(src: Path, dst: Path, pattern: list[bool] | int) -> Path:
    """A copy of ``src`` that gives ``attention.sliding_window_pattern``."""
    kind = gguf.GGUFValueType
    value = MetadataDetails(kind.ARRAY, pattern, sub_type=kind.BOOL)
    if isinstance(pattern, int):
        value = MetadataDetails(kind.UINT32, pattern)
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, "laguna", endianess=reader.endianess)
    copy_with_new_metadata(reader, writer, {"laguna.attention.sliding_window_pattern": value}, [])
    return dst


@pytest.mark.parametrize(
    "pattern,swa",
    [
        ([False, True, False, True, True], (False, True, False, True, True)),
        (2, (False, True) * 2 + (False,)),
    ],
    ids=["flags", "period-2"],
)
def test_a_pattern_in_the_file_decides_which_layers_slide(pattern, swa, reference, tmp_path):
    src = FIXTURES / "laguna-xs-f32.gguf"
    path = _with_pattern(src, tmp_path / "x.gguf", pattern)
    assert params(path).swa == swa
    ours, tokens, _ = run(path, cfg(tmp_path))
    diff = np.abs(ours - _reference(reference, path, tokens, True)).max(axis=-1)
    assert diff.max() <= BOUND, f"position {diff.argmax()}: {diff.max():.2e}"
    assert np.abs(ours - run(src, cfg(tmp_path))[0]).max() > 100 * BOUND  # another model


@pytest.mark.parametrize("name", ["laguna-xs-f32", "laguna-xs-q8_0"])
def test_sliding_layers_equal_llama_cpp_past_the_rings_wrap(name, reference, tmp_path):
    """300 tokens in 16-token steps: the ring (window 12 + step 16, padded to 256 rows) wraps at
    256, and the sliding layers still attend to what llama.cpp's do (measured: 0 difference).
    Non-flash: past the wrap ggml's CPU flash attention sums the ring's rows in another order
    than llama.cpp's full-size cache, as for gemma4 (docs/architecture.md, decision 7; measured
    4.3e-3 on the f32 file, 0.6 on q8_0 where that flips roundings; 0 before the wrap)."""
    path, tokens = FIXTURES / f"{name}.gguf", LONG + list(range(100, 130))
    config = cfg(tmp_path, flash_attn=False, max_ctx=512, chunk=CHUNK)
    with Engine(path, config, tokenizer=False) as engine:
        assert engine.plan.memory and "ring of 256 rows" in engine.plan.memory
        ours = engine.prefill(tokens, chunk=CHUNK, all_logits=True).copy()
    theirs = reference(path, CHUNK, n_ctx=512, flash_attn=False).prompt_logits(tokens)
    diff = np.abs(ours - theirs).max(axis=-1)
    assert diff.max() <= BOUND, f"position {diff.argmax()}: {diff.max():.2e}"


@pytest.mark.parametrize(
    "path,device,split,layers",
    [
        (XS, "cpu,cpu", None, None),
        (XS, "cpu,cpu@worker", "1,4", [(0, 1, "local"), (1, 5, "worker")]),
        (M, "cpu@worker,cpu", "3,1", [(0, 3, "worker"), (3, 4, "local")]),
    ],
)
def test_sharded_equals_unsharded(path, device, split, layers, tmp_path):
    whole = run(path, cfg(tmp_path), n=16)
    logits, tokens, got = run(path, cfg(tmp_path, device=device, layer_split=split), n=16)
    assert layers is None or got == layers
    assert len(got) == 2
    err = np.linalg.norm(logits - whole[0], axis=1) / np.linalg.norm(whole[0], axis=1)
    assert err.max() <= 1e-4
    assert tokens == whole[1]


@pytest.mark.parametrize("device,split", [("cpu", None), ("cpu,cpu@worker", "2,3")])
def test_restored_equals_fresh_in_ram_and_on_disk(device, split, tmp_path):
    """Turns long enough to wrap the sliding layers' ring."""
    turn1, turn2 = LONG[:200], LONG + list(range(100, 120))
    kw = {"device": device, "layer_split": split, "chunk": CHUNK, "max_ctx": 512}
    with Engine(XS, cfg(tmp_path, **kw), tokenizer=False) as engine:
        fresh = generate(engine, turn2, 16, stop_at_end=False).tokens
    cache = {"prefix_cache_slots": 4, "kv_cache_dir": str(tmp_path / "kv")}
    cache["disk_prefix_cache"] = "full"
    with open_engine(XS, cfg(tmp_path, **kw, **cache), tokenizer=False) as engine:
        generate(engine, turn1, 8, stop_at_end=False)
        ram = generate(engine, turn2, 16, stop_at_end=False)
    with open_engine(XS, cfg(tmp_path, **kw, **cache), tokenizer=False) as engine:
        disk = generate(engine, turn2, 16, stop_at_end=False)
    assert ram.cache["hit"] == "ram" and ram.cache["restored_tokens"] == len(turn1)
    assert disk.cache["hit"] == "disk" and disk.cache["restored_tokens"] > len(turn1)
    assert ram.tokens == fresh and disk.tokens == fresh


@pytest.fixture(scope="module")
def one_backend(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one")
    with Engine(XS, cfg(tmp), tokenizer=False) as engine:
        logits = engine.prefill(PROMPT, chunk=CHUNK, all_logits=True).copy()
        counts = engine.pipeline.expert_counts.counts.copy()
    return logits, counts


def _expert_mb(n: int) -> float:
    """A device budget of ``n`` experts (they are the same size in every layer)."""
    with GGUFFile(XS) as f:
        return n * experts.expert_bytes(f, 1) / 2**20


@pytest.mark.parametrize(
    "placement",
    [{"n_cpu_moe": 3}, {"moe_device_mb": 0}, {"moe_device_mb": _expert_mb(12)}],
    ids=["n-cpu-moe-3", "all-in-host-RAM", "12-on-the-device"],
)
def test_hybrid_experts_equal_one_backend(placement, one_backend, tmp_path):
    """Experts split between two CPU backends (ggml_backend_sched) compute what one backend
    computes, bit for bit; --n-cpu-moe counts the dense layer 0 among its N, as llama.cpp's.
    Routing counts k choices per token in every MoE layer and none in the dense one."""
    with Engine(XS, cfg(tmp_path, **placement), tokenizer=False) as engine:
        logits = engine.prefill(PROMPT, chunk=CHUNK, all_logits=True).copy()
        counts = engine.pipeline.expert_counts.counts
        split = [g for g in engine.shard.graphs.values() if isinstance(g.alloc, Sched)]
        cold = {il for il in range(5) if f"blk.{il}.ffn_down_exps.weight.cold" in engine.shard.w}
    np.testing.assert_array_equal(logits, one_backend[0])
    np.testing.assert_array_equal(counts, one_backend[1])
    assert split and cold
    if "n_cpu_moe" in placement:
        assert cold == {1, 2}
    assert counts[0].sum() == 0 and (counts[1:].sum(axis=1) == K * len(PROMPT)).all()


def _draft(tmp_path: Path, layers: tuple[int, ...], block: int = 4) -> Path:
    """A random DFlash draft reading the residual entering ``layers``."""
    shape = Qwen35Spec(n_vocab=384, n_embd=64, n_layer=5, context_length=2048, rms_eps=1e-6)
    return write_dflash(tmp_path / "draft.gguf", shape, target_layers=layers, block_size=block)


# Past the ring's wrap a block step and single-token steps give bit-equal logits only on the
# non-flash path (docs/architecture.md, decision 7), as for gemma4: with flash attention the
# q8_0 file's greedy tokens part there. The router's f32 products are not bit-equal between a
# verify's rows and a step's on every CPU (ggml-cpu: llamafile's sgemm for 2 rows and more, its
# vec_dot for one), so a window whose experts' choice has a near-tie parts there: on an AVX2-only
# EPYC LONG[:240] parted at its 29th token, LONG[8:248] at its 21st; LONG[1:241] did not
@pytest.mark.parametrize(
    "path,prompt,layers,extra",
    [
        (XS, PROMPT, (1, 3), {}),
        (XS, LONG[1:241], (1, 5), {"flash_attn": False, "chunk": CHUNK, "max_ctx": 512}),
        (M, PROMPT, (1, 4), {"n_cpu_moe": 3}),
    ],
    ids=["xs", "xs-across-the-wrap", "m-hybrid"],
)
def test_speculative_equals_greedy(path, prompt, layers, extra, tmp_path):
    draft = _draft(tmp_path, layers, block=6)
    plain_kw = {k: v for k, v in extra.items() if k != "n_cpu_moe"}
    with Engine(path, cfg(tmp_path, **plain_kw), tokenizer=False) as engine:
        plain = generate(engine, prompt, 40, stop_at_end=False).tokens
    with Engine(path, cfg(tmp_path, draft=str(draft), **extra), tokenizer=False) as engine:
        gen = generate(engine, prompt, 40, stop_at_end=False)
    assert gen.accept is not None and gen.accept.steps > 0
    assert gen.tokens == plain


def test_sampling_with_a_draft_matches_the_target_distribution(tmp_path):
    """As test_speculative's: each sampled token's rank under the target's own distribution,
    chi-square over 4 ranks, 3 degrees of freedom, rejected at p < 0.001 (16.3); q8_0 and the
    non-flash path, so the teacher-forced pass sees the logits the sampler saw."""
    draft = _draft(tmp_path, (1, 3))
    sampling = SamplingParams(temperature=1.0, top_k=4)
    seqs = []
    with Engine(XS, cfg(tmp_path, draft=str(draft), flash_attn=False), tokenizer=False) as engine:
        for seed in range(10):
            gen = generate(engine, PROMPT, 48, sampling=SamplingParams(1.0, 4, 1.0, seed))
            assert gen.accept is not None and gen.accept.steps > 0
            seqs.append(gen.tokens)
    assert_target_distribution(XS, seqs, sampling, PROMPT, flash_attn=False)
