"""The sandboxed python tool: output comes back, and every limit ends the run with an error that says which."""

from __future__ import annotations

import asyncio
import os
import socket
import tempfile
import time
from pathlib import Path

import pytest

from tandem.envs import sandbox
from tandem.envs.sandbox import SandboxLimits, python, python_tool, run_python
from tandem.envs.tools import ToolBox, ToolCall

QUICK = SandboxLimits(wall_s=60.0, cpu_s=30)
"""Limits no well-behaved snippet here comes near (a loaded machine must not fail them)."""


def run(code: str, limits: SandboxLimits = QUICK) -> sandbox.SandboxResult:
    return asyncio.run(run_python(code, limits))


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie nobody reaps counts as dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def eventually(condition, what: str, limit_s: float = 60.0) -> None:
    """Poll until `condition()`; the bound only catches a hang (a kill takes milliseconds)."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_prints_and_final_expression():
    result = run("import math\nprint('hello', flush=True)\nfor i in range(2): print(i)\nmath.factorial(20)")
    assert result.ok and result.exit_code == 0
    assert result.output == "hello\n0\n1\n2432902008176640000\n"
    assert result.text() == "hello\n0\n1\n2432902008176640000"
    assert run("x = 1").text() == "(no output)"
    assert "network-namespace" in result.isolation or "socket-block" in result.isolation


def test_exception_gives_the_traceback_of_the_code():
    result = run("def f():\n    return 1 / 0\nprint('before')\nf()")
    assert (result.outcome, result.exit_code) == ("error", 1)
    text = result.text()
    assert text.startswith("before\nTraceback (most recent call last):\n")
    assert 'File "main.py", line 4, in <module>' in text and 'File "main.py", line 2, in f' in text
    assert text.endswith("ZeroDivisionError: division by zero\n[exit code 1]")
    assert "<string>" not in text  # the sandbox's own prelude is not in the traceback
    syntax = run("def f(:\n")
    assert syntax.outcome == "error" and "SyntaxError" in syntax.text() and "ast.py" not in syntax.text()
    assert run("import sys; sys.exit(3)").text() == "[exit code 3]"


def test_infinite_loop_is_killed_on_the_wall_clock():
    result = run("print('start', flush=True)\nwhile True: pass", SandboxLimits(wall_s=1.0, cpu_s=600))
    assert (result.outcome, result.exit_code) == ("timeout", -9)
    assert result.text() in ("start\n[killed after 1 s: wall-clock limit]", "[killed after 1 s: wall-clock limit]")


def test_cpu_limit():
    result = run("while True: pass", SandboxLimits(wall_s=600.0, cpu_s=1))
    assert result.outcome == "cpu"
    assert result.text() == "[killed after 1 s of CPU time: CPU limit]"


def test_memory_bomb_is_a_memory_error():
    result = run("blocks = []\nwhile True: blocks.append(bytearray(10**7))", SandboxLimits(memory_mb=256))
    assert result.outcome == "memory"
    assert result.text().endswith("MemoryError\n[MemoryError: the memory limit is 256 MiB]")


def test_file_size_limit():
    result = run("open('big', 'wb').write(b'x' * (2 << 20))", SandboxLimits(file_mb=1))
    assert result.outcome == "error" and "File too large" in result.text()


@pytest.fixture
def listener():
    """A TCP server on localhost that must never see a connection."""
    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)
    yield server
    with pytest.raises(BlockingIOError):
        server.accept()
    server.close()


def test_no_network(listener):
    port = listener.getsockname()[1]
    result = run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=5)\nprint('connected')")
    assert result.outcome == "error" and "connected" not in result.output
    lookup = run("import socket\nsocket.getaddrinfo('example.com', 80)")
    assert lookup.outcome == "error"


def test_socket_block_where_namespaces_are_refused(listener, monkeypatch):
    """Without namespaces the audit hook refuses connections; local sockets (asyncio's self-pipe) still work."""
    assert "namespaced = unshare()" in sandbox._CHILD
    monkeypatch.setattr(sandbox, "_CHILD", sandbox._CHILD.replace("namespaced = unshare()", "namespaced = False"))
    port = listener.getsockname()[1]
    result = run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=5)")
    assert result.isolation[0] == "socket-block"
    assert "PermissionError: network access is disabled in this sandbox (socket." in result.text()
    assert run("import asyncio\nasyncio.run(asyncio.sleep(0))\nprint('ok')").output == "ok\n"


def test_fresh_workdir_removed_after_and_nothing_written_outside(tmp_path):
    outside = tmp_path / "escape.txt"
    code = (
        "import os, pathlib\nprint(os.getcwd())\nprint(sorted(os.listdir('.')))\npathlib.Path('mine.txt').write_text('x')\n"
        f"try:\n    open({str(outside)!r}, 'w').write('x')\nexcept OSError as e:\n    print('refused', e.errno)"
    )
    first, second = run(code), run(code)
    cwd, listing, *rest = first.output.splitlines()
    assert Path(cwd).name.startswith("tandem-sandbox-") and Path(cwd).parent == Path(tempfile.gettempdir())
    assert listing == "['main.py']"  # nothing left from another run
    assert second.output.splitlines()[0] != cwd
    assert not Path(cwd).exists() and not Path(second.output.splitlines()[0]).exists()
    if "read-only-fs" in first.isolation:
        assert rest == ["refused 30"] and not outside.exists()  # EROFS


def test_processes_and_signals_are_refused_by_default():
    spawn = run("import subprocess\nsubprocess.run(['true'])")
    assert "PermissionError: starting processes is disabled in this sandbox (subprocess.Popen)" in spawn.text()
    fork = run("import os\nos.fork()")
    assert "starting processes is disabled in this sandbox (os.fork)" in fork.text()
    kill = run(f"import os\nos.kill({os.getpid()}, 9)")
    assert "signalling other processes is disabled" in kill.text()


@pytest.mark.parametrize(("ending", "wall_s", "outcome"), [("while True: pass", 3.0, "timeout"), ("pass", 600.0, "ok")])
def test_the_process_group_dies_with_the_run(ending, wall_s, outcome):
    """A child the code starts is killed when the run ends, by timeout or by exiting normally."""
    code = "import subprocess\np = subprocess.Popen(['sleep', '600'])\nprint(p.pid, flush=True)\n" + ending
    result = run(code, SandboxLimits(wall_s=wall_s, cpu_s=600, subprocesses=True))
    assert result.outcome == outcome
    grandchild = int(result.output.split()[0])
    eventually(lambda: not alive(grandchild), f"the code's child {grandchild} outlived the run")


def test_a_cancelled_call_kills_the_child(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def sandbox_pids() -> list[int]:
        pids = []
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and str(tmp_path) in (entry / "cmdline").read_text():
                    pids.append(int(entry.name))
            except OSError:
                continue
        return [pid for pid in pids if alive(pid)]

    async def cancel_midway() -> None:
        task = asyncio.ensure_future(run_python("import time\ntime.sleep(600)", SandboxLimits(wall_s=600.0)))
        while not sandbox_pids():
            await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_midway())
    eventually(lambda: not sandbox_pids(), "the sandbox outlived its cancelled call")
    assert list(tmp_path.iterdir()) == []


def test_output_is_truncated_keeping_head_and_tail():
    result = run("print('HEAD')\nfor i in range(200000): print(i)\nprint('TAIL')", SandboxLimits(max_output_chars=500))
    assert result.ok and len(result.output) < 700
    assert result.output.startswith("HEAD\n0\n1\n") and result.output.endswith("TAIL\n")
    assert "characters truncated ...]" in result.output


def test_python_tool_in_a_toolbox():
    box = ToolBox([python, python_tool(SandboxLimits(wall_s=1.0, cpu_s=600), name="quick_python")])
    assert [s["function"]["name"] for s in box.schemas()] == ["python", "quick_python"]
    assert box.schemas()[0]["function"]["parameters"]["required"] == ["code"]

    async def calls():
        return (
            await box.execute(ToolCall("python", {"code": "print(2**100)"})),
            await box.execute(ToolCall("python", {"code": "raise ValueError('bad input')"})),
            await box.execute(ToolCall("quick_python", {"code": "while True: pass"})),
            await box.execute(ToolCall("python", {"source": "1"})),
        )

    ok, exception, timeout, bad_args = asyncio.run(calls())
    assert (ok.content, ok.is_error) == ("1267650600228229401496703205376", False)
    assert exception.is_error and exception.error == "tool" and "ValueError: bad input" in exception.content
    assert timeout.error == "tool" and timeout.content.endswith("[killed after 1 s: wall-clock limit]")
    assert bad_args.error == "invalid_arguments"
    assert box.stats.as_metrics()["tool_errors"] == 3.0
