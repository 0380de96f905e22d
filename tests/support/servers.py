"""Loopback servers for tests: a free port for a child to listen on, a port already taken, and an ASGI app served
on a thread.

Every in-process test server (the inference server, the fake OpenAI server) is an `AppThread`, so they all
bind, start and stop the same way: a socket bound to port 0 before the thread starts (no race for the port),
a wait bounded by progress rather than a clock, and a stop that lets in-flight requests finish for a second.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Self

import uvicorn
from starlette.types import ASGIApp

from support.polling import wait_until


def free_port() -> int:
    """A loopback port free now, for a child process that must be told its port before it binds it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def taken_port() -> Iterator[int]:
    """A loopback port another server is listening on for the duration of the `with` block."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


class AppThread:
    """`app` under uvicorn on a daemon thread, listening on a free loopback port (`url`) from construction until
    `stop()` (or the end of a `with` block)."""

    def __init__(self, app: ASGIApp) -> None:
        config = uvicorn.Config(app, log_config=None, lifespan="off", timeout_graceful_shutdown=1, access_log=False)
        self._server = uvicorn.Server(config)
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True)
        self._thread.start()
        # A server that failed to start has ended its thread: stop waiting then, and say so.
        wait_until(lambda: self._server.started or not self._thread.is_alive(), message="the test server to start")
        assert self._server.started, "the test server's thread ended before it started"

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._socket.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
