"""`tandem dashboard` as a command: it refuses an --outputs that is not a directory and a port in use before it
prints its URL, and warns when it binds beyond loopback (it has no authentication)."""

from __future__ import annotations

import socket
import subprocess

import pytest

from support.runs import tandem_command
from support.servers import taken_port
from tandem.cli import main as cli
from tandem.config.dashboard import DashboardConfig
from tandem.dashboard import main


def served(monkeypatch) -> list[tuple[str, int]]:
    """Where `main.run` would serve (the bound socket's address), instead of serving."""
    addresses = []
    monkeypatch.setattr(main.uvicorn.Server, "run", lambda self, sockets: addresses.append(sockets[0].getsockname()))
    return addresses


@pytest.mark.parametrize(("host", "warned"), [("0.0.0.0", True), ("192.168.1.5", True), ("::", True),
                                               ("127.0.0.1", False), ("localhost", False), ("::1", False)])  # fmt: skip
def test_binding_beyond_loopback_logs_a_warning(tmp_path, monkeypatch, capsys, host, warned):
    bound = []

    def bind(host: str, port: int) -> socket.socket:  # any host: the warning depends on the name alone
        bound.append((host, port))
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        return sock

    monkeypatch.setattr(main, "bind_server_socket", bind)
    addresses = served(monkeypatch)
    assert main.run(DashboardConfig(outputs=tmp_path, host=host, port=8265)) == 0
    assert bound == [(host, 8265)] and len(addresses) == 1
    err = capsys.readouterr().err
    assert ("beyond loopback" in err) is warned, err


def test_it_prints_the_url_it_serves_on(tmp_path, monkeypatch, capsys):
    addresses = served(monkeypatch)
    assert main.run(DashboardConfig(outputs=tmp_path, port=0)) == 0
    ((host, port),) = addresses
    assert capsys.readouterr().out == f"tandem dashboard: http://{host}:{port}/ over {tmp_path.resolve()}\n"


@pytest.mark.parametrize("what", ["does not exist", "is not a directory"])
def test_an_outputs_that_is_not_a_directory_exits_2_in_one_line(tmp_path, monkeypatch, capsys, what):
    outputs = tmp_path / "outptus"
    if what == "is not a directory":
        outputs.write_text("")
    addresses = served(monkeypatch)
    assert cli(["dashboard", "--outputs", str(outputs), "--port", "0"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and addresses == []
    assert captured.err.startswith(f"tandem dashboard: error: --outputs {outputs} ") and what in captured.err
    assert captured.err.count("\n") == 1, captured.err


def test_a_port_in_use_exits_2_in_one_line_before_the_url(tmp_path):
    with taken_port() as port:
        command = tandem_command("dashboard", "--outputs", str(tmp_path), "--port", str(port))
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""  # no URL of a server that never served
    assert done.stderr == f"tandem dashboard: error: cannot listen on 127.0.0.1:{port}: Address already in use\n"
