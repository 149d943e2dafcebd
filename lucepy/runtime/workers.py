"""Workers (decision 3): processes that serve a device of their own ggml build over ggml-rpc.

``serve`` is the body of ``lucepy worker``. ``spawn`` starts one on 127.0.0.1 at a free port for a
device whose backend this process lacks (or that the user put ``@worker``), and ``connect`` opens a
backend on a running worker. ggml-rpc has no authentication: we warn when binding beyond loopback.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from lucepy.errors import DeviceError, WorkerError
from lucepy.ggml import Backend, Lib, ffi

log = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0
KEEP_LOGS = "LUCEPY_KEEP_WORKER_LOGS"  # set to 1 to keep a spawned worker's log after it ends


def keep_logs() -> bool:
    return os.environ.get(KEEP_LOGS, "") not in ("", "0")


def exit_with_parent(fd: int, log_path: Path | None) -> None:
    """In a spawned worker: exit as soon as the process that spawned it is gone, however it
    died. It holds the write end of a pipe whose read end is ``fd``; its death closes that end,
    and the read returns. The worker's log goes too, unless logs are kept."""

    def watch() -> None:
        while os.read(fd, 1):
            pass
        if log_path is not None and not keep_logs():
            log_path.unlink(missing_ok=True)
        os._exit(0)

    threading.Thread(target=watch, name="lucepy-parent-watch", daemon=True).start()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def serve(lib: Lib, device: str, host: str, port: int, threads: int) -> None:
    """Serve ``device`` over ggml-rpc until the process is stopped. Never returns."""
    from lucepy.runtime.devices import find_device

    if not is_loopback(host):
        log.warning(
            "worker listening on %s:%d: ggml-rpc has no authentication, so anyone who can "
            "reach this port can run code on this device",
            host,
            port,
        )
    dev = find_device(lib, device)
    devices = ffi.new("ggml_backend_dev_t[1]", [dev])
    endpoint = f"{host}:{port}".encode()
    log.info("worker serving %s on %s", device, endpoint.decode())
    lib.ggml_backend_rpc_start_server(endpoint, ffi.NULL, threads, 1, devices)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ggml-rpc keeps one connection (and its I/O thread) per endpoint string for the life of the
# process. When a worker dies mid-call that thread is parked by our abort hook, and the shards
# abandoned on it keep the connection cached: a new worker on the same port would be handed that
# dead connection, and its first call would wait forever. So no port is given out twice.
_ports_given: set[int] = set()


def _new_port() -> int:
    """A free port that no worker of this process has had (the OS may hand one out again)."""
    port = free_port()
    while port in _ports_given:
        port = free_port()
    _ports_given.add(port)
    return port


@dataclass
class Worker:
    """A worker process this process started; stopped on ``close()``."""

    device: str
    endpoint: str
    proc: subprocess.Popen
    log_path: Path
    lifeline: int = -1  # write end of the pipe the worker watches; closed, it exits
    closed: bool = field(default=False)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def describe(self) -> str:
        return f"worker for {self.device} (pid {self.proc.pid}, {self.endpoint})"

    def log_tail(self, n: int = 5) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(lines[-n:])

    def kill(self) -> None:
        """Stop it now, frozen (SIGSTOP) or not; ``close`` then only reaps and cleans up."""
        if self.alive:
            self.proc.kill()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.alive:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.lifeline >= 0:
            os.close(self.lifeline)
            self.lifeline = -1
        if not keep_logs():
            self.log_path.unlink(missing_ok=True)


def spawn(
    device: str, ggml_dir: Path | None, threads: int | None = None, log_dir: Path | None = None
) -> Worker:
    """Start ``lucepy worker`` for ``device`` on 127.0.0.1 and wait until it accepts connections."""
    port = _new_port()
    env = dict(os.environ)
    if ggml_dir is not None:
        env["LUCEPY_GGML_LIB"] = str(ggml_dir)
    cmd = [
        sys.executable,
        "-m",
        "lucepy",
        "worker",
        "--device",
        device,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    if threads:
        cmd += ["--threads", str(threads)]
    log_dir = log_dir or Path(os.environ.get("TMPDIR", "/tmp"))
    log_path = log_dir / f"lucepy-worker-{os.getpid()}-{port}.log"
    watched, lifeline = os.pipe()  # the worker exits when this process, holding lifeline, dies
    cmd += ["--parent-fd", str(watched), "--log-file", str(log_path)]
    try:
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(
                cmd,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                pass_fds=(watched,),
            )
    except BaseException:
        os.close(lifeline)
        raise
    finally:
        os.close(watched)
    os.set_inheritable(lifeline, False)
    worker = Worker(device, f"127.0.0.1:{port}", proc, log_path, lifeline)
    _wait_ready(worker)
    return worker


def _wait_ready(worker: Worker) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    host, port = worker.endpoint.rsplit(":", 1)
    while time.monotonic() < deadline:
        if not worker.alive:
            tail = worker.log_tail()
            worker.close()
            raise WorkerError(f"{worker.describe()} exited at start: {tail or 'no output'}")
        try:
            with socket.create_connection((host, int(port)), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    worker.close()
    raise WorkerError(f"{worker.describe()} did not accept connections within {START_TIMEOUT_S}s")


def connect(lib: Lib, endpoint: str, index: int, name: str) -> Backend:
    """A backend on device ``index`` of the worker at ``endpoint``."""
    host, port = endpoint.rsplit(":", 1)
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except OSError as err:
        raise DeviceError(
            f"cannot reach worker {endpoint} for {name}: {err}; start it with "
            f"`lucepy worker --device DEV --port {port}`"
        ) from None
    try:
        add_server = lib.ggml_backend_rpc_add_server
    except AttributeError:
        raise DeviceError(
            f"{name} needs ggml's RPC backend, which this build lacks; reinstall "
            f'with CMAKE_ARGS="-DGGML_RPC=ON" pip install llama-cpp-python'
        ) from None
    reg = add_server(endpoint.encode())
    if reg == ffi.NULL:
        raise DeviceError(f"ggml-rpc could not register worker {endpoint}")
    count = lib.ggml_backend_reg_dev_count(reg)
    if index >= count:
        raise DeviceError(f"worker {endpoint} serves {count} device(s); {name} asks for #{index}")
    return Backend(lib, lib.ggml_backend_reg_dev_get(reg, index), name)
