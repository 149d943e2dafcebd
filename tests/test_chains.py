"""Chained disk snapshots (``--disk-prefix-cache N``): a link stores only what changed since its
parent, a restore follows the chain, a torn chain restores its intact prefix, and a kill -9 during
a chained write loses only the link being written. Also: a speculative step cut short by the
token limit leaves no generation-end snapshot that holds tokens it does not name."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import THREADS

from lucepy.cache.disk import SUFFIX, read_header, token_hash
from lucepy.decode.ar import generate
from lucepy.engine import open_engine
from lucepy.runtime.config import RuntimeConfig
from lucepy.testing.tiny_draft import write_agreeing_pair

LLAMA = Path(__file__).parent / "fixtures" / "hf" / "llama-untied-q8_0.gguf"
PROMPT = [int(t) for t in np.random.default_rng(0).integers(3, 380, 200)]
# The hybrid model's KV grows by 512 bytes a token and its recurrent state is 16,896 bytes, so
# with a chunk of 16 its interval of 16 widens to 48 (the KV of 33 tokens holds the state).
HYBRID_POINTS = [48, 96, 144, 192]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_agreeing_pair(tmp_path_factory.mktemp("chains"))


def config(cache_dir, policy="16", **kw) -> RuntimeConfig:
    base = {"threads": THREADS, "max_ctx": 256, "prefix_cache_slots": 0}
    return RuntimeConfig(
        **{**base, "kv_cache_dir": str(cache_dir), "disk_prefix_cache": policy, **kw}
    )


def fresh(model, tokens, at: int, **kw) -> np.ndarray:
    """The last logits of a cacheless engine fed ``tokens[:at]``, then the rest: the schedule
    of a restore at ``at`` (a flash-attention reduction over another KV length rounds
    differently, and quantized weights magnify that; the KV rows themselves are the same)."""
    with open_engine(model, RuntimeConfig(threads=THREADS, max_ctx=256, **kw)) as engine:
        engine.prefill(tokens[:at])
        return engine.prefill(tokens[at:]).copy()


def headers(engine) -> dict[int, dict]:
    """Every snapshot file's header, by the number of tokens it ends at."""
    disk = engine.prefix_cache.disk
    out = {}
    for path in disk.dir.glob(f"*{SUFFIX}"):
        h = read_header(path, disk.fingerprint)
        out[h["start"] + len(h["tokens"])] = {**h, "size": path.stat().st_size}
    return dict(sorted(out.items()))


def restart(model, cache_dir, tokens, **kw) -> tuple[np.ndarray, dict]:
    """A new engine on the same directory serves ``tokens``: its logits and cache report."""
    with open_engine(model, config(cache_dir, **kw), tokenizer=False) as engine:
        return engine.prefix_cache.start(tokens, None)


def test_hybrid_links_hold_new_rows_and_the_recurrent_state(pair, tmp_path):
    target, _ = pair
    with open_engine(target, config(tmp_path / "full", "full"), tokenizer=False) as engine:
        engine.prefix_cache.start(PROMPT, None)
        (whole,) = headers(engine).values()
    with open_engine(target, config(tmp_path / "c", chunk=16), tokenizer=False) as engine:
        assert engine.state_growth() == (512, 16896)
        engine.prefix_cache.start(PROMPT, None)
        files = headers(engine)
    assert list(files) == [*HYBRID_POINTS, len(PROMPT)]
    starts = [h["start"] for h in files.values()]
    assert starts == [0, *HYBRID_POINTS]  # each a link to the one before
    assert [h["parent"] is None for h in files.values()] == [True, False, False, False, False]
    for end, h in files.items():
        kv = [t for t in h["tensors"] if "first_row" in t]
        assert kv and all(t["first_row"] == h["start"] for t in kv)
        assert all(t["shape"][0] == end - h["start"] for t in kv)
    total = sum(h["size"] for h in files.values())
    assert whole["size"] < total <= 2 * whole["size"]
    for cut in (50, 100, 199, 200):
        edited = PROMPT[:cut] + [9, 9]
        logits, report = restart(target, tmp_path / "c", edited, chunk=16)
        restored = max(p for p in [*HYBRID_POINTS, 200] if p <= cut)
        assert report == {"hit": "disk", "restored_tokens": restored,
                          "prefilled_tokens": len(edited) - restored}  # fmt: skip
        np.testing.assert_array_equal(logits, fresh(target, edited, restored, chunk=16))


def test_attention_only_links_every_interval_without_stopping_the_prefill(tmp_path):
    with open_engine(LLAMA, config(tmp_path / "full", "full"), tokenizer=False) as engine:
        engine.prefix_cache.start(PROMPT, None)
        (whole,) = headers(engine).values()
    with open_engine(LLAMA, config(tmp_path / "c"), tokenizer=False) as engine:
        assert engine.state_growth()[1] == 0
        fed, inner = [], engine.prefill
        engine.prefill = lambda tokens, **kw: fed.append(len(tokens)) or inner(tokens, **kw)
        engine.prefix_cache.start(PROMPT, None)
        files = headers(engine)
    assert fed == [len(PROMPT)]  # one prefill; the links are read from the KV rows after it
    assert list(files) == [*range(16, 200, 16), 200]
    assert [h["start"] for h in files.values()] == [0, *range(16, 200, 16)]
    total = sum(h["size"] for h in files.values())
    assert total <= 2 * whole["size"]
    edited = PROMPT[:100] + [9, 9]
    logits, report = restart(LLAMA, tmp_path / "c", edited)
    assert report == {"hit": "disk", "restored_tokens": 96, "prefilled_tokens": 6}
    np.testing.assert_array_equal(logits, fresh(LLAMA, edited, 96))


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # the link's own data: only its CRC notices
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_flip_last_byte, Path.unlink])
def test_a_torn_chain_restores_its_intact_prefix(damage, pair, tmp_path, caplog):
    target, _ = pair
    caplog.set_level(logging.WARNING, logger="lucepy.cache")
    with open_engine(target, config(tmp_path, chunk=16), tokenizer=False) as engine:
        engine.prefix_cache.start(PROMPT, None)
        names = {n: engine.prefix_cache.disk.entries[token_hash(PROMPT[:n])].path for n in
                 [*HYBRID_POINTS, 200]}  # fmt: skip
    damage(names[96])
    longer = PROMPT + [7, 8]
    logits, report = restart(target, tmp_path, longer, chunk=16)
    assert report["hit"] == "disk" and report["restored_tokens"] == 48
    np.testing.assert_array_equal(logits, fresh(target, longer, 48, chunk=16))
    # the bad link went, and every link that hung from it, before the restart wrote its own
    removed = " ".join(r.message for r in caplog.records if "removing" in r.message)
    hung = (144, 192, 200) if damage is Path.unlink else (96, 144, 192, 200)
    assert all(names[n].name in removed for n in hung)
    assert names[48].name not in removed


KILLER = """
import os, signal, sys
from lucepy.cache import disk
from lucepy.engine import open_engine
from lucepy.runtime.config import RuntimeConfig
model, folder, tokens = sys.argv[1], sys.argv[2], [int(t) for t in sys.argv[3].split(",")]
renames, replace = [], os.replace
def dying_replace(a, b):
    renames.append(b)
    if len(renames) == 3:  # the third link is written and synced, not yet renamed into place
        os.kill(os.getpid(), signal.SIGKILL)
    replace(a, b)
disk.os.replace = dying_replace
cfg = RuntimeConfig(threads=2, max_ctx=256, kv_cache_dir=folder, disk_prefix_cache="16",
                    prefix_cache_slots=0, chunk=16)
with open_engine(model, cfg, tokenizer=False) as engine:
    engine.prefix_cache.start(tokens, None)
"""


def test_kill_during_a_chained_write_restores_the_longest_intact_prefix(pair, tmp_path, caplog):
    target, _ = pair
    done = subprocess.run(
        [sys.executable, "-c", KILLER, str(target), str(tmp_path), ",".join(map(str, PROMPT))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert len(list(tmp_path.glob(f"*{SUFFIX}"))) == 2  # links at 48 and 96
    assert len(list(tmp_path.glob(f".*{SUFFIX}.tmp-*"))) == 1  # the one cut short
    longer = PROMPT + [7, 8]
    logits, report = restart(target, tmp_path, longer, chunk=16)
    assert report == {"hit": "disk", "restored_tokens": 96, "prefilled_tokens": 106}
    np.testing.assert_array_equal(logits, fresh(target, longer, 96, chunk=16))
    assert not list(tmp_path.glob(f".*{SUFFIX}.tmp-*"))


def test_a_cut_speculative_step_keeps_no_snapshot_past_its_tokens(pair, tmp_path):
    """The last verify step can take in accepted tokens past the token limit. The recurrent
    state then holds tokens the generation does not return, so no generation-end snapshot is
    kept for a hybrid model; the next turn restores the prompt's and prefills the rest."""
    target, draft = pair
    prompt = PROMPT[:40]
    plain = RuntimeConfig(threads=THREADS, max_ctx=256, draft=str(draft))
    cached = config(tmp_path, "full", draft=str(draft), prefix_cache_slots=2)
    cuts = 0
    with open_engine(target, cached, tokenizer=False) as engine:
        for limit in range(2, 10):
            gen = generate(engine, prompt, limit)
            cuts += engine.n_past > len(prompt) + len(gen.tokens)
            follow = prompt + gen.tokens + [11, 12]
            again = generate(engine, follow, 6)
            with open_engine(target, plain, tokenizer=False) as ref:
                assert again.tokens == generate(ref, follow, 6).tokens
    assert cuts >= 2  # limits that cut a verify step short (the agreeing draft accepts much)
