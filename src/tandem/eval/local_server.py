"""Start the built-in inference server for a local model, wait until it is healthy, stop it afterwards.

`tandem eval --model DIR` without `--base-url` runs `tandem inference` as a
child process on a free loopback port, with its run directory inside the
eval's (`<eval run>/inference/`) and its console output in
`<eval run>/logs/inference-server.log`.
"""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from tandem.config import ModelConfig

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"


class ServerStartError(RuntimeError):
    """The built-in server exited, or never answered /health, before the eval could start."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


def _inline_table(values: dict[str, Any]) -> str:
    """`{key = value, ...}`, a TOML inline table (JSON scalars and arrays are valid TOML values)."""
    return "{" + ", ".join(f"{key} = {json.dumps(value)}" for key, value in values.items()) + "}"


def _tail(path: Path, lines: int = 20) -> str:
    text = path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""
    return "\n".join(text.splitlines()[-lines:]) or "(no output)"


def _wait_until_healthy(url: str, process: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerStartError(
                f"the built-in inference server exited with code {process.returncode} before it was healthy; "
                f"last lines of {log_path}:\n{_tail(log_path)}"
            )
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise ServerStartError(
        f"the built-in inference server did not answer {url}/health within {timeout_s:g}s "
        f"(startup_timeout_s); last lines of {log_path}:\n{_tail(log_path)}"
    )


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        logger.warning("the built-in inference server ignored SIGTERM for 30 s; killing it")
        process.kill()
        process.wait()


@contextmanager
def local_server(
    model: ModelConfig, *, run_dir: Path, seq_len: int, log_level: str, startup_timeout_s: float
) -> Iterator[str]:
    """Serve `model` with `tandem inference` while the block runs; yields the server's base URL."""
    port = _free_port()
    url = f"http://{HOST}:{port}"
    command = [
        sys.executable, "-m", "tandem", "inference",
        "--model", _inline_table(model.model_dump(mode="json", exclude_none=True)),
        "--seq-len", str(seq_len),
        "--host", HOST,
        "--port", str(port),
        "--output-dir", str(run_dir),
        "--run-name", "inference",
        "--log.level", log_level,
    ]  # fmt: skip
    log_path = run_dir / "logs" / "inference-server.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    logger.info("starting the built-in inference server for %s on %s", model.name, url)
    with open(log_path, "ab") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        _wait_until_healthy(url, process, log_path, startup_timeout_s)
        yield url
    finally:
        _stop(process)
