"""The KV cache type is a run-time option (llama.cpp's -ctk/-ctv): q8_0 keys and values give
llama.cpp's logits at every position, and snapshots of a q8_0 cache restore exactly."""

from __future__ import annotations

import contextlib
import os

import llama_cpp
import numpy as np
import pytest
from conftest import THREADS
from test_llama import FIXTURES, PROMPT
from test_parity_sweep import BOUND

from lucepy.decode.ar import generate
from lucepy.engine import open_engine
from lucepy.errors import ConfigError
from lucepy.runtime.config import RuntimeConfig
from lucepy.runtime.engine import Engine

Q8 = {"cache_type_k": "q8_0", "cache_type_v": "q8_0"}


def llama_cpp_logits(path, tokens, **types) -> np.ndarray:
    with open(os.devnull, "w") as null, contextlib.redirect_stderr(null):
        llm = llama_cpp.Llama(
            model_path=str(path),
            n_ctx=256,
            n_batch=len(tokens),
            n_ubatch=len(tokens),
            logits_all=True,
            flash_attn=True,
            n_threads=THREADS,
            verbose=False,
            **types,
        )
    try:
        llm.eval(tokens)
        return np.array(llm.scores[: len(tokens)], dtype=np.float32)
    finally:
        llm.close()


@pytest.mark.parametrize("name", ["llama-untied-q8_0", "qwen35-q8_0"])
@pytest.mark.parametrize("k,v", [("q8_0", "q8_0"), ("q8_0", "f16")])
def test_a_q8_0_cache_matches_llama_cpp(name, k, v):
    path = FIXTURES / f"{name}.gguf"
    cfg = RuntimeConfig(threads=THREADS, max_ctx=256, cache_type_k=k, cache_type_v=v)
    with Engine(path, cfg, tokenizer=False) as engine:
        ours = engine.prefill(PROMPT, chunk=len(PROMPT), all_logits=True).copy()
    types = {"q8_0": llama_cpp.GGML_TYPE_Q8_0, "f16": llama_cpp.GGML_TYPE_F16}
    ref = llama_cpp_logits(path, PROMPT, type_k=types[k], type_v=types[v])
    f16 = llama_cpp_logits(path, PROMPT)
    assert np.abs(ours - ref).max() <= BOUND
    assert np.abs(ref - f16).max() > BOUND  # the cache type does change the logits


def test_snapshots_of_a_q8_0_cache_restore_exactly(tmp_path):
    path = FIXTURES / "llama-untied-q8_0.gguf"
    turn1, turn2 = PROMPT[:30], PROMPT[:30] + list(range(100, 120))
    cache = {"prefix_cache_slots": 4, "kv_cache_dir": str(tmp_path), "disk_prefix_cache": "full"}
    cfg = RuntimeConfig(threads=THREADS, max_ctx=256, **Q8)
    with Engine(path, cfg, tokenizer=False) as engine:
        fresh = generate(engine, turn2, 16, stop_at_end=False).tokens
    cfg = RuntimeConfig(threads=THREADS, max_ctx=256, **Q8, **cache)
    with open_engine(path, cfg, tokenizer=False) as engine:
        generate(engine, turn1, 8, stop_at_end=False)
        ram = generate(engine, turn2, 16, stop_at_end=False)
    with open_engine(path, cfg, tokenizer=False) as engine:
        disk = generate(engine, turn2, 16, stop_at_end=False)
    assert (ram.cache["hit"], disk.cache["hit"]) == ("ram", "disk")
    assert ram.tokens == fresh and disk.tokens == fresh


def test_a_f16_snapshot_is_not_restored_into_a_q8_0_cache(tmp_path):
    path = FIXTURES / "llama-untied-q8_0.gguf"
    cache = {"kv_cache_dir": str(tmp_path), "disk_prefix_cache": "full"}
    with open_engine(path, RuntimeConfig(threads=THREADS, max_ctx=256, **cache)) as engine:
        generate(engine, PROMPT, 4, stop_at_end=False)
    cfg = RuntimeConfig(threads=THREADS, max_ctx=256, **Q8, **cache)
    with open_engine(path, cfg, tokenizer=False) as engine:
        assert generate(engine, PROMPT, 4, stop_at_end=False).cache["hit"] == "none"


def test_bad_cache_types_are_refused():
    with pytest.raises(ConfigError, match="use one of"):
        RuntimeConfig(cache_type_k="q4_0")
    with pytest.raises(ConfigError, match="needs flash attention"):
        RuntimeConfig(cache_type_v="q8_0", flash_attn=False)


def test_a_q8_0_cache_needs_heads_of_whole_blocks():
    """llama-tied has 16-wide heads: a q8_0 row would split blocks, so it is refused up front
    (ggml would abort the process)."""
    cfg = RuntimeConfig(threads=THREADS, max_ctx=256, cache_type_k="q8_0")
    with pytest.raises(ConfigError, match="multiple of 32; this model's is 16"):
        Engine(FIXTURES / "llama-tied-q8_0.gguf", cfg, tokenizer=False)
