"""`tandem dashboard`: serve the dashboard with uvicorn and print its URL."""

from __future__ import annotations

import logging

import uvicorn

from tandem.config.dashboard import DashboardConfig
from tandem.dashboard.server import create_app
from tandem.net import is_loopback
from tandem.run import setup_logging

logger = logging.getLogger(__name__)


def run(config: DashboardConfig) -> int:
    setup_logging("info")
    if not is_loopback(config.host):
        logger.warning(
            "the dashboard binds %s, beyond loopback: anyone who can reach this host and port can read every "
            "run's metrics and samples under %s (it has no authentication)",
            config.host,
            config.outputs.resolve(),
        )
    print(f"tandem dashboard: http://{config.host}:{config.port}/ over {config.outputs.resolve()}", flush=True)
    uvicorn.run(create_app(config.outputs), host=config.host, port=config.port, log_level="warning")
    return 0
