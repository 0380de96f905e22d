"""`tandem dashboard` warns when it binds beyond loopback: it has no authentication."""

from __future__ import annotations

import pytest

from tandem.config.dashboard import DashboardConfig
from tandem.dashboard import main


@pytest.mark.parametrize(("host", "warned"), [("0.0.0.0", True), ("192.168.1.5", True), ("::", True),
                                               ("127.0.0.1", False), ("localhost", False), ("::1", False)])  # fmt: skip
def test_binding_beyond_loopback_logs_a_warning(tmp_path, monkeypatch, capsys, host, warned):
    served = []
    monkeypatch.setattr(main.uvicorn, "run", lambda app, **kwargs: served.append(kwargs))
    assert main.run(DashboardConfig(outputs=tmp_path, host=host, port=8265)) == 0
    assert served == [{"host": host, "port": 8265, "log_level": "warning"}]
    err = capsys.readouterr().err
    assert ("beyond loopback" in err) is warned, err
