"""What starting a server means for either engine: the context check before anything loads, SIGTERM handling,
and the announcement once it listens.

The built-in runner (`main.py`) and vLLM's (`vllm/launch.py`, and its middleware `vllm/routes.py`, which writes
the announcement from inside vLLM's server) share these. Standard library, config and the models' config.json
reader only, so the vLLM side imports them without the built-in engine.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
from pathlib import Path
from typing import Any

from tandem.config import ConfigError
from tandem.files import atomic_write_text
from tandem.models.config import read_hf_config

SERVER_FILE = "server.json"


class Terminated(Exception):
    """SIGTERM arrived: stop serving and exit cleanly."""


def _terminate(signum: int, frame: Any) -> None:
    raise Terminated


def stop_on_sigterm() -> None:
    """From now on SIGTERM raises `Terminated` in the main thread (a no-op on other threads)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)


def check_context(seq_len: int, model_dir: Path) -> None:
    """ConfigError when `seq_len` is longer than the model's `max_position_embeddings`, read from its config.json
    unparsed (so it holds for architectures only vLLM serves); a config without one leaves it to the engine."""
    value = read_hf_config(model_dir).get("max_position_embeddings")
    if isinstance(value, int) and seq_len > value:
        raise ConfigError(f"seq_len {seq_len} is longer than the model's max_position_embeddings {value}")


def announce(run_dir: Path, sock: socket.socket, name: str) -> str:
    """Once the server accepts connections on `sock`: write `<run_dir>/server.json` (`{"url", "pid", "model"}`,
    atomically, so a parent that passed port 0 finds the port), print the listening line; returns the URL."""
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    atomic_write_text(run_dir / SERVER_FILE, json.dumps({"url": url, "pid": os.getpid(), "model": name}) + "\n")
    print(f"tandem inference listening on {url}", flush=True)
    return url
