"""A model split across shards, in-process and in worker processes, computes what the unsplit
model computes, and matches llama.cpp."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import THREADS

from lucepy.errors import ConfigError, DeviceError, WorkerError
from lucepy.runtime.config import RuntimeConfig
from lucepy.runtime.engine import Engine
from lucepy.runtime.workers import free_port

PROMPT = list(range(3, 70))
CHUNK, N_GEN = 16, 24


def run(path, device="cpu", split=None):
    """Prompt logits at every position and a greedy continuation."""
    cfg = RuntimeConfig(device=device, layer_split=split, threads=THREADS, max_ctx=256)
    with Engine(path, cfg, tokenizer=False) as engine:
        logits = engine.prefill(PROMPT, chunk=CHUNK, all_logits=True)
        tokens, last = [], logits[-1]
        for _ in range(N_GEN):
            tokens.append(int(np.argmax(last)))
            last = engine.decode(tokens[-1]).copy()
        layers = [(s.layers.start, s.layers.stop, s.process) for s in engine.shards]
    return logits, tokens, layers


@pytest.fixture(scope="module")
def unsplit(tiny_model):
    return run(tiny_model("odd", "f32"))


@pytest.mark.parametrize(
    "device,split,layers",
    [
        ("cpu,cpu", None, [(0, 2, "local"), (2, 5, "local")]),
        ("cpu,cpu", "4,1", [(0, 4, "local"), (4, 5, "local")]),
        ("cpu,cpu@worker", "2,3", [(0, 2, "local"), (2, 5, "worker")]),
        ("cpu,cpu,cpu@worker", "1,1,1", [(0, 2, "local"), (2, 3, "local"), (3, 5, "worker")]),
        ("cpu@worker,cpu", "1,4", [(0, 1, "worker"), (1, 5, "local")]),
    ],
)
def test_split_equals_unsplit(device, split, layers, tiny_model, unsplit):
    logits, tokens, got = run(tiny_model("odd", "f32"), device, split)
    assert got == layers
    err = np.linalg.norm(logits - unsplit[0], axis=1) / np.linalg.norm(unsplit[0], axis=1)
    assert err.max() <= 1e-4
    assert tokens == unsplit[1]


def test_split_matches_llama_cpp(tiny_model, reference):
    path = tiny_model("odd", "f32")
    logits, _, _ = run(path, "cpu,cpu@worker", "1,1")
    ref = reference(path, CHUNK).prompt_logits(PROMPT)
    err = np.linalg.norm(logits - ref, axis=1) / np.linalg.norm(ref, axis=1)
    assert err.max() <= 5e-3


@pytest.fixture
def running_worker():
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lucepy",
            "worker",
            "--device",
            "cpu",
            "--port",
            str(port),
            "--threads",
            str(THREADS),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 30
    import socket

    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    yield port, proc
    proc.kill()
    proc.wait()


def test_rpc_url_names_a_running_worker(running_worker, tiny_model, unsplit):
    port, _ = running_worker
    logits, tokens, layers = run(tiny_model("odd", "f32"), f"cpu,rpc://127.0.0.1:{port}", "3,2")
    assert layers == [(0, 3, "local"), (3, 5, "worker")]
    assert tokens == unsplit[1]
    assert np.abs(logits - unsplit[0]).max() <= 1e-4 * np.abs(unsplit[0]).max()


def test_killed_worker_fails_the_request_then_restarts(tiny_model):
    cfg = RuntimeConfig(device="cpu,cpu@worker", threads=THREADS, max_ctx=256)
    with Engine(tiny_model("odd", "f32"), cfg, tokenizer=False) as engine:
        logits = engine.prefill(PROMPT)
        victim = engine.pipeline.workers[0]
        with pytest.raises(WorkerError, match=r"worker for cpu .* stopped answering.*restarts"):
            for i in range(500):
                if i == 3:
                    os.kill(victim.proc.pid, signal.SIGKILL)
                    killed = time.monotonic()
                logits = engine.decode(int(np.argmax(logits)))
        assert time.monotonic() - killed < 10  # bounded: no hang
        assert not victim.alive
        engine.reset()  # the next request brings up a new worker
        fresh = engine.pipeline.workers[0]
        assert fresh.alive and fresh.proc.pid != victim.proc.pid
        assert engine.prefill(PROMPT).shape == (engine.params.n_vocab,)
        # a worker that dies between requests is noticed before the next one touches it
        os.kill(fresh.proc.pid, signal.SIGKILL)
        fresh.proc.wait()
        engine.reset()
        assert engine.pipeline.workers[0].alive
        assert engine.prefill(PROMPT).shape == (engine.params.n_vocab,)


def test_a_restarted_worker_never_gets_a_dead_workers_port(tiny_model, monkeypatch):
    """ggml-rpc keeps a dead worker's connection per endpoint, its I/O thread parked by the abort
    hook. When the OS handed the dead worker's port to its replacement, the reload waited on that
    connection forever (seen once in CI); the short setup deadline makes that a failure here."""
    from lucepy.ggml.lib import rpc_failures
    from lucepy.runtime import workers

    cfg = RuntimeConfig(device="cpu,cpu@worker", threads=THREADS, max_ctx=256, setup_deadline_s=5.0)
    with Engine(tiny_model("odd", "f32"), cfg, tokenizer=False) as engine:
        logits = engine.prefill(PROMPT)
        victim = engine.pipeline.workers[0]
        os.kill(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait()
        failures = len(rpc_failures())
        with pytest.raises(WorkerError, match="stopped answering"):
            engine.decode(int(np.argmax(logits)))
        assert len(rpc_failures()) > failures  # its connection's thread is parked
        port = int(victim.endpoint.rsplit(":", 1)[1])
        offers, free_port = [port], workers.free_port
        monkeypatch.setattr(workers, "free_port", lambda: offers.pop() if offers else free_port())
        engine.reset()
        assert not offers and engine.pipeline.workers[0].endpoint != victim.endpoint
        assert engine.prefill(PROMPT).shape == (engine.params.n_vocab,)


@pytest.mark.parametrize(
    "device,split,error,words",
    [
        ("gpu0", None, DeviceError, "unknown device 'gpu0'"),
        ("cpu,rpc://127.0.0.1:1/0,rpc://127.0.0.1:1", None, DeviceError, "listed twice"),
        ("cuda:0,cuda:0", None, DeviceError, "listed twice"),
        ("cpu,cpu", "1", ConfigError, "1 weights for 2 devices"),
        ("cpu,cpu", "1,0", ConfigError, "must be positive"),
        ("cpu,cpu", "1,-2", ConfigError, "must be positive"),
        ("cpu,cpu", "1,x", ConfigError, "comma-separated numbers"),
        (",".join(["cpu"] * 6), None, ConfigError, "6 shards for a model of 5 layers"),
        ("cpu,hip:0", None, DeviceError, "no hip backend.*lucepy backends build hip"),
    ],
)
def test_placement_errors(device, split, error, words, tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("LUCEPY_CACHE_DIR", str(tmp_path))
    with pytest.raises(error, match=words):
        Engine(tiny_model("odd", "f32"), RuntimeConfig(device=device, layer_split=split))


def test_cli_prints_placement_errors_verbatim(tiny_model):
    """Messages with square brackets are text, not rich markup."""
    import subprocess
    import sys

    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "lucepy",
            "generate",
            str(tiny_model("odd", "f32")),
            "--prompt-tokens",
            "1",
            "--target-devices",
            "cpu,gpu:x",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines() == [
        "error: unknown device 'gpu:x'; write cpu, BACKEND:N (cuda:0, hip:1), DEVICE@worker, "
        "or rpc://HOST:PORT[/N]"
    ]
