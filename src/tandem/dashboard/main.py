"""`tandem dashboard`: serve the dashboard with uvicorn and print its URL."""

from __future__ import annotations

import logging

import uvicorn

from tandem.config import ConfigError
from tandem.config.dashboard import DashboardConfig
from tandem.dashboard.server import create_app
from tandem.net import bind_server_socket, is_loopback
from tandem.run import setup_logging

logger = logging.getLogger(__name__)


def run(config: DashboardConfig) -> int:
    setup_logging("info")
    outputs = config.outputs.resolve()
    if not outputs.is_dir():  # a mistyped --outputs would otherwise serve an empty list without a word
        what = "is not a directory" if outputs.exists() else "does not exist"
        raise ConfigError(
            f"--outputs {config.outputs} ({outputs}) {what}: pass the --output-dir your runs write to "
            "(default `outputs`, created by a run's first start)"
        )
    with bind_server_socket(config.host, config.port) as sock:  # a port in use ends here, before the URL is printed
        if not is_loopback(config.host):
            logger.warning(
                "the dashboard binds %s, beyond loopback: anyone who can reach this host and port can read every "
                "run's metrics and samples under %s (it has no authentication)",
                config.host,
                outputs,
            )
        host, port = sock.getsockname()[:2]
        print(f"tandem dashboard: http://{f'[{host}]' if ':' in host else host}:{port}/ over {outputs}", flush=True)
        server = uvicorn.Server(uvicorn.Config(create_app(config.outputs), log_level="warning", lifespan="off"))
        server.run(sockets=[sock])
    return 0
