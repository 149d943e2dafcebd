"""Serving an Engine over HTTP with uvicorn: in the foreground (``run``) or in a thread (``start``).

Shutdown (Ctrl-C, SIGTERM, ``stop``) first closes the worker, so running generations end and
waiting requests get a 503, then lets uvicorn close the connections. The Engine is closed last.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import threading

import uvicorn

from lucepy.errors import ConfigError, ServerError
from lucepy.server.app import create_app
from lucepy.server.worker import Worker

log = logging.getLogger(__name__)

GRACE_S = 5  # how long shutdown waits for open connections


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound here so that a taken port is a one-line error."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)  # connections wait in the backlog until uvicorn accepts them
    except OSError as err:
        raise ConfigError(
            f"cannot listen on {host}:{port} ({err.strerror or err}); pick another --port or --host"
        ) from None
    return sock


class _Uvicorn(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, worker: Worker):
        super().__init__(config)
        self.worker = worker

    async def shutdown(self, sockets=None) -> None:
        await asyncio.to_thread(self.worker.close)
        await super().shutdown(sockets)


class Server:
    """One model served on ``host:port`` (port 0: any free port; see ``url``)."""

    def __init__(
        self,
        engine,
        *,
        name: str,
        host: str = "127.0.0.1",
        port: int = 8080,
        api_key: str | None = None,
        log_level: str = "info",
    ):
        if not api_key and not is_loopback(host):
            log.warning(
                "serving on %s without --api-key: anyone who can reach this port can use the "
                "model; pass --api-key KEY or bind 127.0.0.1",
                host,
            )
        self.worker = Worker(engine)
        try:
            self.app = create_app(self.worker, name=name, api_key=api_key)
            self._sock = bind(host, port)
        except BaseException:
            self.worker.close()
            raise
        config = uvicorn.Config(
            self.app,
            log_level=log_level,
            access_log=log_level == "debug",
            lifespan="off",
            timeout_graceful_shutdown=GRACE_S,
        )
        self._uvicorn = _Uvicorn(config, self.worker)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._sock.getsockname()[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def status(self) -> dict:
        return self.app.state.served.status()

    def run(self) -> None:
        """Serve until a signal (main thread) or ``stop()``; the Engine is closed on return."""
        try:
            self._uvicorn.run(sockets=[self._sock])
        finally:
            self.worker.close()
            self._sock.close()

    def start(self, timeout: float = 30.0) -> Server:
        """Serve from a background thread; returns once requests are accepted."""
        self._thread = threading.Thread(target=self.run, name="lucepy-http", daemon=True)
        self._thread.start()
        waited = 0.0
        while not self._uvicorn.started and self._thread.is_alive() and waited < timeout:
            threading.Event().wait(0.02)
            waited += 0.02
        if not self._uvicorn.started:
            self.stop()
            raise ServerError(f"the server did not start within {timeout:.0f} s; see the log")
        return self

    def stop(self) -> None:
        self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join()
