"""Faults: a spawned worker ends with the process that spawned it, however that one dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

PARENT = textwrap.dedent(
    """
    import sys, time
    from lucepy.runtime.config import RuntimeConfig
    from lucepy.runtime.engine import Engine
    engine = Engine(sys.argv[1], RuntimeConfig(device="cpu,cpu@worker", threads=1), tokenizer=False)
    worker = engine.pipeline.workers[0]
    print(worker.proc.pid, worker.log_path, flush=True)
    time.sleep(600)
    """
)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has exited; only its parent (init) reaps it
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.parametrize("keep", [False, True])
def test_workers_exit_within_2_s_of_a_kill_9_of_their_parent(keep, tiny_model, monkeypatch):
    if keep:
        monkeypatch.setenv("LUCEPY_KEEP_WORKER_LOGS", "1")
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tiny_model("odd", "f32"))],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        pid, log = parent.stdout.readline().split()
        pid, log = int(pid), Path(log)
        assert alive(pid) and log.exists()
        parent.send_signal(signal.SIGKILL)
        parent.wait(5)
        t0 = time.monotonic()
        while alive(pid) and time.monotonic() - t0 < 2.0:
            time.sleep(0.05)
        assert not alive(pid), "the worker outlived its parent by 2 s"
        assert log.exists() == keep
    finally:
        parent.kill()
        if keep:
            log.unlink(missing_ok=True)


@pytest.mark.parametrize(
    "source, seed",
    [("tiny q8_0", 1), ("fixtures/hf/llama-untied-q4_k_m.gguf", 2)],
)
def test_mutated_gguf_files_give_one_line_errors(source, seed, tiny_model, tmp_path):
    """600 seeded mutants (header field edits, byte flips, truncations) each load or fail with
    one line: no signal, no traceback, no hang. docs/BENCHMARKS.md has the 5,000-mutant runs."""
    from lucepy.testing.fuzz import fuzz

    model = tiny_model("base", "q8_0") if source == "tiny q8_0" else Path(__file__).parent / source
    outcomes = fuzz(Path(model), 600, seed, tmp_path)
    bad = [o for o in outcomes if o.result not in ("ok", "error")]
    assert len(outcomes) == 600 and not bad, bad[:3]
    assert sum(o.result == "error" for o in outcomes) > 300  # the mutations do break files


def _with_tensor_type(src: Path, dst: Path, name: str, gtype: int) -> Path:
    from lucepy.gguf import GGUFFile
    from lucepy.testing.fuzz import fields

    data = bytearray(src.read_bytes())
    with GGUFFile(src) as f:
        index = list(f.tensors).index(name)
    pos = [p for kind, p, _ in fields(bytes(data)) if kind == "type"][index]
    data[pos : pos + 4] = gtype.to_bytes(4, "little")
    dst.write_bytes(bytes(data))
    return dst


def test_a_tensor_whose_rows_are_not_whole_blocks_is_refused(tiny_model, tmp_path):
    """ssm_conv1d [4, 128] retyped q4_0 holds 512 values, whole 32-blocks in all, but rows of 4:
    ggml would abort writing it."""
    from lucepy.errors import ModelFileError
    from lucepy.gguf import GGUFFile

    bad = _with_tensor_type(
        tiny_model("base", "f32"), tmp_path / "bad.gguf", "blk.0.ssm_conv1d.weight", 2
    )
    with pytest.raises(ModelFileError, match="rows that are not whole Q4_0 blocks of 32"):
        GGUFFile(bad)


def test_a_vocabulary_with_a_repeated_token_is_refused():
    from lucepy.errors import ModelFileError
    from lucepy.runtime.tokenizer import check_vocabulary

    check_vocabulary("m.gguf", ["a", "b", "c"])
    with pytest.raises(ModelFileError, match="tokens 0 and 2 of the vocabulary are the same"):
        check_vocabulary("m.gguf", ["a", "b", "a"])


def snapshot_fuzz(model: Path, folder: Path, n: int, seed: int, chain: bool = False) -> dict:
    """Mutants of a prompt's snapshot, or of one file of its chain (``chain``: links at 48 and
    96 and the prompt's end at 112), in an otherwise intact disk cache: a resent longer prompt
    must give exactly the fresh logits, whether the mutant was restored or refused, and nothing
    may raise. Returns how often each restore point was used."""
    import numpy as np

    from lucepy.cache.disk import DiskCache
    from lucepy.engine import open_engine
    from lucepy.runtime.config import RuntimeConfig
    from lucepy.testing.fuzz import mutate_snapshot

    prompt = [3 + i % 300 for i in range(112 if chain else 37)]
    longer = prompt + [7, 8, 9]
    cache_dir = folder / "cache"
    # a chunk of 16 keeps every restore point on the fresh prefill's schedule
    cfg = RuntimeConfig(
        threads=2,
        max_ctx=128,
        chunk=16,
        kv_cache_dir=str(cache_dir),
        disk_prefix_cache="16" if chain else "full",
    )
    counts: dict[int, int] = {}
    with open_engine(model, cfg, tokenizer=False) as engine:
        engine.reset()
        fresh = engine.prefill(longer).copy()
        engine.prefix_cache.start(prompt, None)  # writes the prompt's snapshot (or chain)
        files = {p.name: p.read_bytes() for p in cache_dir.glob("*.lsnap")}
        assert len(files) == (3 if chain else 1)
        rng = np.random.default_rng(seed)
        for _ in range(n):
            for old in cache_dir.iterdir():
                old.unlink()
            victim = sorted(files)[rng.integers(len(files))]
            for name, data in files.items():
                damaged = mutate_snapshot(data, rng) if name == victim else data
                (cache_dir / name).write_bytes(damaged)
            engine.prefix_cache.disk = DiskCache(
                cache_dir, engine.prefix_cache.disk.fingerprint, 2**30
            )
            logits, report = engine.prefix_cache.start(longer, None)
            np.testing.assert_array_equal(logits, fresh)
            counts[report["restored_tokens"]] = counts.get(report["restored_tokens"], 0) + 1
    return counts


def test_mutated_snapshot_files_are_refused_or_restore_exactly(tiny_model, tmp_path):
    """400 mutants (header field types and values, byte flips, truncations); docs/faults.md has
    the 5,000-mutant run."""
    counts = snapshot_fuzz(tiny_model("base", "q8_0"), tmp_path, 400, seed=3)
    assert counts[0] > 200 and sum(counts.values()) == 400


def test_a_mutated_link_leaves_its_intact_prefix(tiny_model, tmp_path):
    """300 mutants of one file of a three-file chain: the restore uses the longest prefix whose
    files all pass, and each of the three restore points below the prompt's end is seen."""
    counts = snapshot_fuzz(tiny_model("base", "q8_0"), tmp_path, 300, seed=4, chain=True)
    assert sum(counts.values()) == 300
    assert {0, 48, 96} <= set(counts) <= {0, 48, 96, 112}


def test_a_frozen_worker_fails_its_request_within_the_deadline_then_is_replaced(tiny_model):
    """SIGSTOP of a worker mid-generation: the stream fails within its deadline (a 2 s floor
    here), /health is 503 while the worker is replaced and 200 after, the next request is
    served, and the frozen worker is gone."""
    import httpx
    import openai

    from lucepy.engine import Engine
    from lucepy.runtime.config import RuntimeConfig
    from lucepy.server.run import Server

    cfg = RuntimeConfig(device="cpu,cpu@worker", threads=1, max_ctx=512, step_deadline_s=2.0)
    srv = Server(Engine(tiny_model("odd", "f32"), cfg), name="tiny", port=0, log_level="warning")
    srv.start()
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        frozen = srv.worker.engine.pipeline.workers[0].proc
        messages = [{"role": "user", "content": "hello"}]
        stream = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=400, stream=True, temperature=0
        )
        t0 = None
        with pytest.raises(openai.APIError):
            for i, _ in enumerate(stream):
                if i == 3:
                    os.kill(frozen.pid, signal.SIGSTOP)
                    t0 = time.monotonic()
        assert t0 is not None and time.monotonic() - t0 < 6.0
        seen = set()
        while time.monotonic() - t0 < 60:
            code = httpx.get(srv.url + "/health").status_code
            seen.add(code)
            if code == 200 and 503 in seen:
                break
            time.sleep(0.02)
        assert seen == {200, 503}
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
        assert reply.choices[0].finish_reason in ("length", "stop")
        assert frozen.poll() is not None  # killed, not left stopped
    finally:
        srv.stop()


def test_a_worker_frozen_while_loading_fails_the_load_within_the_setup_deadline(
    tiny_model, monkeypatch
):
    """A call that is not a step (a load here) has a deadline too: a worker that accepts
    connections but never answers fails the load, is killed, and the next load gets a new one.
    Without the deadline the load waited; the timer thaws the worker after 20 s, so that fails
    instead of hanging."""
    from lucepy.errors import WorkerError
    from lucepy.runtime import workers
    from lucepy.runtime.config import RuntimeConfig
    from lucepy.runtime.engine import Engine

    spawned, spawn, connect = [], workers.spawn, workers.connect

    def connect_then_freeze(*args):
        backend = connect(*args)  # the handshake and device count are answered
        # and so is the buffer type: ggml-rpc asks for it under a process-wide lock, which a
        # worker frozen then would hold for good (docs/faults.md)
        assert backend.buffer_type is not None
        os.kill(spawned[-1].proc.pid, signal.SIGSTOP)
        return backend

    monkeypatch.setattr(workers, "spawn", lambda *a: spawned.append(spawn(*a)) or spawned[-1])
    monkeypatch.setattr(workers, "connect", connect_then_freeze)
    cfg = RuntimeConfig(device="cpu,cpu@worker", threads=1, max_ctx=256, setup_deadline_s=3.0)
    thaw = threading.Timer(20.0, lambda: os.kill(spawned[0].proc.pid, signal.SIGCONT))
    thaw.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match=r"worker for cpu .* did not answer within 3.0 s"):
            Engine(tiny_model("odd", "f32"), cfg, tokenizer=False)
        assert time.monotonic() - t0 < 12.0
        assert spawned[0].proc.wait(5) == -signal.SIGKILL  # killed, not left stopped
    finally:
        thaw.cancel()
    monkeypatch.undo()
    with Engine(tiny_model("odd", "f32"), cfg, tokenizer=False) as engine:
        assert engine.prefill(list(range(3, 40))).shape == (engine.params.n_vocab,)
