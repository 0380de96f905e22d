"""Start the built-in inference server for a local model, wait until it is healthy, stop it afterwards.

`tandem eval --model DIR` without `--base-url` runs `tandem inference` as a
child process on loopback with `--port 0`: the server picks a free port and
announces its URL in `<eval run>/inference/server.json`, so no other process
can take the port between choosing and binding it. Its console output goes to
`<eval run>/logs/inference-server.log`.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from tandem.config import LoadedModelConfig
from tandem.run import log_tail

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"


class ServerStartError(RuntimeError):
    """The built-in server exited, or never answered /health, before the eval could start."""


def _inline_table(values: dict[str, Any]) -> str:
    """`{key = value, ...}`, a TOML inline table (JSON scalars and arrays are valid TOML values; tables nest)."""
    return "{" + ", ".join(f"{key} = {_toml_value(value)}" for key, value in values.items()) + "}"


def _toml_value(value: Any) -> str:
    return _inline_table(value) if isinstance(value, dict) else json.dumps(value)


def _wait_until_healthy(server_file: Path, process: subprocess.Popen, log_path: Path, timeout_s: float) -> str:
    """The URL the server announces in `server_file`, once its /health answers 200."""
    deadline = time.monotonic() + timeout_s
    url = None
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerStartError(
                f"the built-in inference server exited with code {process.returncode} before it was healthy; "
                f"last lines of {log_path}:\n{log_tail(log_path, 20)}"
            )
        if url is None and server_file.exists():
            url = json.loads(server_file.read_text())["url"]
        try:
            if url is not None and httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return url
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise ServerStartError(
        f"the built-in inference server was not healthy within {timeout_s:g}s "
        f"(startup_timeout_s); last lines of {log_path}:\n{log_tail(log_path, 20)}"
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
    model: LoadedModelConfig,
    *,
    run_dir: Path,
    seq_len: int,
    log_level: str,
    startup_timeout_s: float,
    served_model_name: str = "",
) -> Iterator[str]:
    """Serve `model` with `tandem inference` while the block runs; yields the server's base URL."""
    command = [
        sys.executable, "-m", "tandem", "inference",
        "--model", _inline_table(model.model_dump(mode="json", exclude_none=True)),
        "--seq-len", str(seq_len),
        "--host", HOST,
        "--port", "0",
        "--output-dir", str(run_dir),
        "--run-name", "inference",
        "--log.level", log_level,
        *(["--served-model-name", served_model_name] if served_model_name else []),
    ]  # fmt: skip
    log_path = run_dir / "logs" / "inference-server.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    server_file = run_dir / "inference" / "server.json"
    server_file.unlink(missing_ok=True)  # left by an earlier run of this eval
    logger.info("starting the built-in inference server for %s", model.name)
    with open(log_path, "ab") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        url = _wait_until_healthy(server_file, process, log_path, startup_timeout_s)
        logger.info("the built-in inference server is up at %s", url)
        yield url
    finally:
        _stop(process)
