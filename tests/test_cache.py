"""Prefix snapshots: restored equals fresh (RAM and cold-restart disk), only the delta is
prefilled, bad files are never restored, and the disk cache keeps to its budget."""

from __future__ import annotations

import logging
import os
import signal
import struct
import subprocess
import sys

import numpy as np
import pytest
from conftest import THREADS

from lucepy.cache.disk import (
    MAGIC,
    SUFFIX,
    DiskCache,
    read_arrays,
    read_header,
    token_hash,
)
from lucepy.cache.prefix import fingerprint
from lucepy.decode.ar import generate
from lucepy.engine import open_engine
from lucepy.runtime.config import RuntimeConfig
from lucepy.testing.tiny import Qwen35Spec, write_qwen35
from lucepy.testing.tiny_draft import write_agreeing_pair

TURN1 = list(range(3, 60))
TURN2 = TURN1 + list(range(100, 140))
N_GEN = 16


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("cache")
    other = write_qwen35(d / "other.gguf", Qwen35Spec(n_layer=4, seed=99))
    target, draft = write_agreeing_pair(d)
    return {"target": target, "other": other, "draft": draft}


def config(device="cpu", draft=None, **cache):
    return RuntimeConfig(
        device=device, threads=THREADS, max_ctx=256, draft=str(draft) if draft else None, **cache
    )


def count_prefilled(engine) -> list[int]:
    """Record how many tokens each prefill call feeds (the engine's own count, not the report)."""
    fed, inner = [], engine.prefill

    def prefill(tokens, **kw):
        fed.append(len(tokens))
        return inner(tokens, **kw)

    engine.prefill = prefill
    return fed


@pytest.fixture(scope="module")
def cold(models):
    """Reference continuations from engines without any cache."""
    out = {}
    for draft in (None, models["draft"]):
        with open_engine(models["target"], config(draft=draft), tokenizer=False) as e:
            out[draft is not None] = [generate(e, p, N_GEN).tokens for p in (TURN1, TURN2)]
    return out


@pytest.mark.parametrize("device", ["cpu", "cpu,cpu", "cpu,cpu@worker"])
@pytest.mark.parametrize("with_draft", [False, True])
def test_restored_equals_fresh(device, with_draft, models, cold, tmp_path):
    draft = models["draft"] if with_draft else None
    cfg = config(
        device, draft, prefix_cache_slots=4, kv_cache_dir=str(tmp_path), disk_prefix_cache="full"
    )
    with open_engine(models["target"], cfg, tokenizer=False) as engine:
        fed = count_prefilled(engine)
        first = generate(engine, TURN1, N_GEN)
        second = generate(engine, TURN2, N_GEN)
        again = generate(engine, TURN2, N_GEN)
    assert first.cache == {"hit": "none", "restored_tokens": 0, "prefilled_tokens": len(TURN1)}
    assert second.cache == {
        "hit": "ram",
        "restored_tokens": len(TURN1),
        "prefilled_tokens": len(TURN2) - len(TURN1),
    }
    assert again.cache["hit"] == "ram" and again.cache["prefilled_tokens"] == 0
    assert fed == [len(TURN1), len(TURN2) - len(TURN1)]  # nothing but the delta was prefilled
    assert [first.tokens, second.tokens, again.tokens] == [*cold[with_draft], cold[with_draft][1]]

    with open_engine(models["target"], cfg, tokenizer=False) as engine:  # a cold restart
        fed = count_prefilled(engine)
        restarted = generate(engine, TURN2 + [7, 8, 9], N_GEN)
        exact = generate(engine, TURN2, N_GEN)
    assert restarted.cache == {"hit": "disk", "restored_tokens": len(TURN2), "prefilled_tokens": 3}
    assert exact.cache["hit"] in ("ram", "disk") and exact.cache["prefilled_tokens"] == 0
    assert fed == [3]
    assert exact.tokens == cold[with_draft][1]


def fingerprint_of(path) -> str:
    with open_engine(path, config(), tokenizer=False) as engine:
        return fingerprint(engine)


def _fill(models, tmp_path, **cache) -> None:
    cfg = config(kv_cache_dir=str(tmp_path), disk_prefix_cache="full", **cache)
    with open_engine(models["target"], cfg, tokenizer=False) as engine:
        generate(engine, TURN1, 4)


def _snapshot_files(tmp_path):
    return sorted(tmp_path.glob(f"*{SUFFIX}"))


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _corrupt(path):
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # inside the last tensor's data: only its CRC notices
    path.write_bytes(bytes(data))


def _old_version(path):
    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, len(MAGIC), 99)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_truncate, _corrupt, _old_version])
def test_bad_files_are_removed_and_never_restored(damage, models, cold, tmp_path, caplog):
    _fill(models, tmp_path)
    files = _snapshot_files(tmp_path)
    assert files
    for path in files:
        damage(path)
    caplog.set_level(logging.WARNING, logger="lucepy.cache")
    cfg = config(kv_cache_dir=str(tmp_path), disk_prefix_cache="full")
    with open_engine(models["target"], cfg, tokenizer=False) as engine:
        gen = generate(engine, TURN1, N_GEN)
    assert gen.cache["hit"] == "none" and gen.tokens == cold[False][0]
    removed = [r.message for r in caplog.records if "removing" in r.message]
    # header damage is found when the directory is scanned, data damage when a file is about to
    # be restored; either way the file the prompt would have used was removed, not restored
    prompt_file = f"-{token_hash(TURN1)[:16]}{SUFFIX}"
    assert any(prompt_file in m for m in removed)
    if damage is not _corrupt:
        assert all(any(p.name in m for m in removed) for p in files)
    # what the directory holds now was written afresh by this run, and reads back whole
    for path in _snapshot_files(tmp_path):
        if path.name.endswith(prompt_file):
            read_arrays(path, read_header(path, fingerprint_of(models["target"])))


def test_files_of_another_model_are_removed(models, cold, tmp_path, caplog):
    _fill(models, tmp_path)
    files = _snapshot_files(tmp_path)
    caplog.set_level(logging.WARNING, logger="lucepy.cache")
    cfg = config(kv_cache_dir=str(tmp_path), disk_prefix_cache="full")
    with open_engine(models["other"], cfg, tokenizer=False) as engine:
        gen = generate(engine, TURN1, 4)
    assert gen.cache["hit"] == "none"
    assert all(not p.exists() for p in files)  # the other model's tokens differ: new names
    assert any("another model" in r.message for r in caplog.records)
    # and another layout of the same model is foreign too
    _fill(models, tmp_path)
    layout = config("cpu,cpu", kv_cache_dir=str(tmp_path), disk_prefix_cache="full")
    with open_engine(models["target"], layout, tokenizer=False) as engine:
        assert generate(engine, TURN1, 4).cache["hit"] == "none"


WRITER = """
import os, sys, time, numpy as np
from lucepy.cache import disk
os.fsync = lambda fd: (print("writing", flush=True), time.sleep(60))
disk.write(disk.Path(sys.argv[1]), "f" * 64, [1, 2, 3], {"a": np.ones(1 << 22, np.float32)}, set())
"""


def test_kill_mid_write_leaves_nothing_trusted(tmp_path, caplog):
    target = tmp_path / f"{'f' * 16}-x{SUFFIX}"
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(target)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "writing"  # the data is written, not yet renamed
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not target.exists() and list(tmp_path.glob(".*.tmp-*"))
    caplog.set_level(logging.WARNING, logger="lucepy.cache")
    cache = DiskCache(tmp_path, "f" * 64, 1 << 30)
    assert cache.entries == {} and not list(tmp_path.iterdir())
    assert any("unfinished write" in r.message for r in caplog.records)


def test_disk_budget_is_kept(models, tmp_path):
    budget_mb = 1
    cfg = config(kv_cache_dir=str(tmp_path), disk_prefix_cache="full", kv_cache_budget_mb=budget_mb)
    with open_engine(models["target"], cfg, tokenizer=False) as engine:
        sizes = []
        for i in range(24):
            generate(engine, [5 + i] + TURN1 + TURN1, 2)
            sizes.append(sum(p.stat().st_size for p in _snapshot_files(tmp_path)))
            assert sizes[-1] <= budget_mb << 20
    kept = len(_snapshot_files(tmp_path))
    assert 2 <= kept < 2 * 24  # it kept what fits and evicted the rest
    assert max(sizes) > (budget_mb << 20) // 2


def test_interval_snapshots_serve_an_edited_prompt(models, tmp_path):
    """On this hybrid model the interval of 16 widens to 48 tokens, over which the KV (512 bytes
    a token) grows by at least the recurrent state's 16,896 (with a chunk of 16; see
    tests/test_chains.py)."""
    cfg = config(kv_cache_dir=str(tmp_path), disk_prefix_cache="16", prefix_cache_slots=0, chunk=16)
    with open_engine(models["target"], cfg, tokenizer=False) as engine:
        assert engine.state_growth() == (512, 16896)
        generate(engine, TURN2, 2)
        edited = TURN2[:60] + [9, 9, 9]  # the head up to token 60 is unchanged
        gen = generate(engine, edited, 2)
    assert gen.cache == {"hit": "disk", "restored_tokens": 48, "prefilled_tokens": 15}


def test_generation_end_snapshot_is_reused(models, cold, tmp_path):
    cfg = config(prefix_cache_slots=2)
    with open_engine(models["target"], cfg, tokenizer=False) as engine:
        first = generate(engine, TURN1, N_GEN)
        follow = TURN1 + first.tokens + [11, 12]
        gen = generate(engine, follow, 4)
    # every generated token but the last was fed to the model, so all but that is restored
    assert gen.cache["restored_tokens"] == len(TURN1) + N_GEN - 1
    with open_engine(models["target"], config(), tokenizer=False) as engine:
        assert gen.tokens == generate(engine, follow, 4).tokens
    assert np.all(np.asarray(first.tokens) == np.asarray(cold[False][0]))


def test_restored_equals_fresh_with_the_draft_in_a_worker(models, cold, tmp_path):
    """The draft's KV is snapshotted inside its worker (RAM) and read over RPC (disk)."""
    cfg = config(
        draft=models["draft"],
        prefix_cache_slots=2,
        kv_cache_dir=str(tmp_path),
        disk_prefix_cache="full",
        draft_device="cpu@worker",
    )
    with open_engine(models["target"], cfg, tokenizer=False) as engine:
        assert engine.draft.remote
        first, second = generate(engine, TURN1, N_GEN), generate(engine, TURN2, N_GEN)
    with open_engine(models["target"], cfg, tokenizer=False) as engine:
        restarted = generate(engine, TURN2, N_GEN)
    assert [first.cache["hit"], second.cache["hit"], restarted.cache["hit"]] == [
        "none",
        "ram",
        "disk",
    ]
    assert [first.tokens, second.tokens, restarted.tokens] == [*cold[True], cold[True][1]]
