"""`tandem dashboard`: serve the dashboard with uvicorn and print its URL."""

from __future__ import annotations

import uvicorn

from tandem.config.dashboard import DashboardConfig
from tandem.dashboard.server import create_app


def run(config: DashboardConfig) -> int:
    print(f"tandem dashboard: http://{config.host}:{config.port}/ over {config.outputs.resolve()}", flush=True)
    uvicorn.run(create_app(config.outputs), host=config.host, port=config.port, log_level="warning")
    return 0
