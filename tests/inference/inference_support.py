"""Helpers the inference tests import: constants, configs, an in-process server thread, polling."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import uvicorn

from tandem.config.inference import InferenceConfig
from tandem.inference.engine import Engine
from tandem.inference.server import InferenceServer
from tandem.testing.progress import Stalled, wait_for

# As in tests/models: weights with std 0.1 give O(1) logits, so greedy choices are not near-ties.
INIT_STD = 0.1
SEQ_LEN = 256


def engine_config(path: Path, **overrides) -> InferenceConfig:
    return InferenceConfig(**{"model": {"name": str(path), "dtype": "float32"}, "seq_len": SEQ_LEN, **overrides})


class ServerThread:
    """`InferenceServer` under uvicorn on a thread, bound to a free loopback port."""

    def __init__(self, engine: Engine, tokenizer, weights_dir: Path, admin_token: str | None = None, **options) -> None:
        self.engine = engine
        server = InferenceServer(engine, tokenizer, "tiny", admin_token=admin_token, weights_dir=weights_dir, **options)
        app = server.app()
        config = uvicorn.Config(app, log_config=None, lifespan="off", timeout_graceful_shutdown=1, access_log=False)
        self._server = uvicorn.Server(config)
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True)
        self._thread.start()
        wait_until(lambda: self._server.started or not self._thread.is_alive(), message="the test server to start")
        assert self._server.started, "the test server's thread ended before it started"

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._socket.close()


def wait_until(condition, message: str = "condition") -> None:
    """Poll `condition` until it holds; fail only after the stall limit (a loaded machine is slow, not stuck)."""
    try:
        wait_for(condition, poll_s=0.01)
    except Stalled as error:
        raise AssertionError(f"waiting for {message}: {error}") from None


@contextmanager
def skip_without_inductor_toolchain() -> Iterator[None]:
    """Skip (rather than fail) where inductor cannot build CPU kernels: no usable C++ compiler."""
    try:
        yield
    except Exception as error:
        text = f"{type(error).__name__}: {error}"
        if any(s in text for s in ("CppCompileError", "InvalidCxxCompiler", "cc1plus", "C++ compiler")):
            pytest.skip(f"inductor toolchain unavailable: {type(error).__name__}")
        raise
