"""Faults: a spawned worker ends with the process that spawned it, however that one dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
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
