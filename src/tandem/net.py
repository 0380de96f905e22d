"""Network addresses, the socket a server listens on, and the admin token: which hosts only this machine can
reach, and what a server's admin routes ask of the rest."""

from __future__ import annotations

import ipaddress
import os
import socket

from tandem.config import ConfigError

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


def bind_server_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host:port` for a server to serve on (the server's event loop makes it listen).

    A command binds it before it loads or prints anything, so a port in use (or a host that is not this
    machine's) is a one-line `ConfigError` at once, not after a model has loaded; and since the server then
    serves on this very socket, no other process can take the port in between. Port 0 picks a free one.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP: asyncio then sets TCP_NODELAY on each connection; without it Nagle + delayed ACK add ~40 ms
    # to every response under ~64 KB (a rollout in msgpack, /health, /pause, /update_weights, /resume)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a server restarted at once may take its port
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    return sock


def admin_token(configured: str | None) -> str | None:
    """The bearer token of the servers' admin routes: the configured one, else $TANDEM_ADMIN_TOKEN, else none."""
    return configured or os.environ.get(ADMIN_TOKEN_ENV) or None
