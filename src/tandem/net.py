"""Network addresses and the admin token: which hosts only this machine can reach, and what a server's admin
routes ask of the rest."""

from __future__ import annotations

import ipaddress
import os

ADMIN_TOKEN_ENV = "TANDEM_ADMIN_TOKEN"
"""The environment variable that holds the admin token where a config names none: how `tandem rl` gives its
run's token to its servers and orchestrator without a command line or a file, which other processes could read."""


def is_loopback(host: str) -> bool:
    """True for `localhost` and loopback addresses (127.0.0.0/8, ::1): a server bound there is not reachable
    from other machines."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def admin_token(configured: str | None) -> str | None:
    """The bearer token of the servers' admin routes: the configured one, else $TANDEM_ADMIN_TOKEN, else none."""
    return configured or os.environ.get(ADMIN_TOKEN_ENV) or None
