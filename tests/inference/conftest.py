"""Fixtures for the inference tests: tiny fp32 models, engines, and in-process servers on 127.0.0.1:0."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from support.inference import ServerThread, engine_config
from support.tiny_models import quiet_transformers  # noqa: F401 (autouse for this directory)
from tandem.inference.engine import Engine
from tandem.inference.main import eos_token_ids
from tandem.models import load_model


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir("qwen3"))


@pytest.fixture
def make_engine(model_dir):
    """`make_engine(arch="qwen3", path=None, **config)` -> a started fp32 engine (CPU unless `device` is given),
    stopped after the test."""
    engines: list[Engine] = []

    def make(arch: str = "qwen3", path: Path | None = None, **overrides) -> Engine:
        from transformers import AutoTokenizer

        path = path or model_dir(arch)
        tok = AutoTokenizer.from_pretrained(path)
        config = engine_config(path, **{"device": "cpu", **overrides})
        model = load_model(path, dtype=torch.float32, device=config.device)
        engine = Engine(model, config, tokenizer=tok, eos_token_ids=eos_token_ids(path, tok))
        engines.append(engine.start())
        return engine

    yield make
    for engine in engines:
        engine.stop()


@pytest.fixture
def serve(tokenizer, tmp_path):
    """`serve(engine, admin_token=None, weights_dir=tmp_path, tokenizer=None, **InferenceServer options)` -> a running
    ServerThread, stopped after the test."""
    servers: list[ServerThread] = []

    def start(
        engine: Engine, admin_token: str | None = None, weights_dir: Path | None = None, tokenizer=tokenizer, **options
    ) -> ServerThread:
        servers.append(ServerThread(engine, tokenizer, weights_dir or tmp_path, admin_token, **options))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()
