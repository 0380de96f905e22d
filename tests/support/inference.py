"""What the inference tests share: engine configs, the inference server on a thread, a toolchain guard."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from support.servers import AppThread
from tandem.config.inference import InferenceConfig
from tandem.inference.engine import Engine
from tandem.inference.server import InferenceServer

SEQ_LEN = 256


def engine_config(path: Path, **overrides) -> InferenceConfig:
    return InferenceConfig(**{"model": {"name": str(path), "dtype": "float32"}, "seq_len": SEQ_LEN, **overrides})


class ServerThread(AppThread):
    """`InferenceServer` for `engine`, serving the model name "tiny" on a free loopback port until `stop()`."""

    def __init__(self, engine: Engine, tokenizer, weights_dir: Path, admin_token: str | None = None, **options) -> None:
        self.engine = engine
        server = InferenceServer(engine, tokenizer, "tiny", admin_token=admin_token, weights_dir=weights_dir, **options)
        super().__init__(server.app())


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
