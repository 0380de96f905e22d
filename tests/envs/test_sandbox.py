"""The sandboxed python tool: output comes back, every limit ends the run with an error that says which, the
sandbox is a boundary that hostile code does not get through (with bubblewrap, and with tandem's own namespaces
where bubblewrap is missing), nothing outlives a call, and a machine without isolation refuses to start."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

import pytest

import tandem
from tandem.config import ConfigError
from tandem.config.env import EnvConfig, SandboxConfig
from tandem.envs import load_env, sandbox
from tandem.envs.sandbox import SandboxLimits, SandboxUnavailable, python_tool, run_python, start_sandbox
from tandem.envs.sandbox_isolation import Launcher, Probe, probe, trial
from tandem.envs.tools import ToolBox, ToolCall

QUICK = SandboxLimits(wall_s=60.0, cpu_s=30)
"""Limits no well-behaved snippet here comes near (a loaded machine must not fail them)."""
BWRAP = shutil.which("bwrap")


def _namespaces_work() -> bool:
    return trial(Launcher("namespaces")) is None


LAUNCHERS = [
    pytest.param(
        Launcher("bubblewrap", BWRAP), id="bubblewrap", marks=pytest.mark.skipif(not BWRAP, reason="no bwrap")
    ),
    pytest.param(Launcher("namespaces"), id="namespaces"),
]


@pytest.fixture(autouse=True)
def fresh_settings(monkeypatch):
    """Every test starts from the default settings (no run directory, no opt-out)."""
    monkeypatch.setattr(sandbox, "_settings", sandbox._Settings())
    monkeypatch.setattr(sandbox, "_slots", sandbox._Slots(8))


@pytest.fixture(params=LAUNCHERS)
def launcher(request, monkeypatch) -> Launcher:
    """Runs go through each isolated launcher in turn (the namespaces one is the fallback without bwrap)."""
    chosen = request.param
    if chosen.name == "namespaces" and not _namespaces_work():
        pytest.skip(f"this machine refuses namespaces: {trial(chosen)}")
    monkeypatch.setattr(sandbox, "probe", lambda: Probe(chosen, ()))
    return chosen


def use(monkeypatch, launcher: Launcher | None, refused: tuple[str, ...] = ()) -> None:
    monkeypatch.setattr(sandbox, "probe", lambda: Probe(launcher, refused))


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


def host_pids(marker: str) -> list[int]:
    """Live processes of the host whose command line holds `marker`."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "cmdline").read_text():
                pids.append(int(entry.name))
        except OSError:
            continue
    return [pid for pid in pids if alive(pid)]


def descendants(pid: int) -> set[int]:
    """Every live process below `pid`."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit():
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
        except (OSError, ValueError):
            continue
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.add(child)
            todo.append(child)
    return {p for p in found if alive(p)}


# --- what comes back ------------------------------------------------------------------------------------------


def test_prints_and_final_expression(launcher):
    result = run("import math\nprint('hello', flush=True)\nfor i in range(2): print(i)\nmath.factorial(20)")
    assert result.ok and result.exit_code == 0 and result.isolation == launcher.name
    assert result.output == "hello\n0\n1\n2432902008176640000\n"
    assert result.text() == "hello\n0\n1\n2432902008176640000"
    assert run("x = 1").text() == "(no output)"


def test_exception_gives_the_traceback_of_the_code(launcher):
    result = run("def f():\n    return 1 / 0\nprint('before')\nf()")
    assert (result.outcome, result.exit_code) == ("error", 1)
    text = result.text()
    assert text.startswith("before\nTraceback (most recent call last):\n")
    assert 'File "main.py", line 4, in <module>' in text and 'File "main.py", line 2, in f' in text
    assert text.endswith("ZeroDivisionError: division by zero\n[exit code 1]")
    assert "<string>" not in text  # the sandbox's own program is not in the traceback
    syntax = run("def f(:\n")
    assert syntax.outcome == "error" and "SyntaxError" in syntax.text() and "ast.py" not in syntax.text()
    assert run("import sys; sys.exit(3)").text() == "[exit code 3]"
    assert run("import sys; sys.exit('bye')").text() == "bye\n[exit code 1]"


def test_output_is_truncated_keeping_head_and_tail(launcher):
    result = run("print('HEAD')\nfor i in range(200000): print(i)\nprint('TAIL')", SandboxLimits(max_output_chars=500))
    assert result.ok and len(result.output) < 700
    assert result.output.startswith("HEAD\n0\n1\n") and result.output.endswith("TAIL\n")
    assert "characters truncated ...]" in result.output


def test_the_code_works_in_a_fresh_private_tmp(launcher):
    code = "import os\nprint(os.getcwd(), sorted(os.listdir('.')), os.environ['HOME'])\nn = open('mine.txt', 'w').write('x')"
    first, second = run(code), run(code)
    assert first.output == second.output == "/tmp ['main.py'] /tmp\n"  # nothing left from another run


# --- every limit, named -------------------------------------------------------------------------------------


def test_infinite_loop_is_killed_on_the_wall_clock(launcher):
    result = run("print('start', flush=True)\nwhile True: pass", SandboxLimits(wall_s=1.0, cpu_s=600))
    assert (result.outcome, result.exit_code) == ("timeout", -9)
    assert result.text() in ("start\n[killed after 1 s: wall-clock limit]", "[killed after 1 s: wall-clock limit]")


def test_cpu_limit(launcher):
    result = run("while True: pass", SandboxLimits(wall_s=600.0, cpu_s=1))
    assert result.outcome == "cpu"
    assert result.text() == "[killed after 1 s of CPU time: CPU limit]"


def test_memory_bomb_is_a_memory_error(launcher):
    result = run("blocks = []\nwhile True: blocks.append(bytearray(10**7))", SandboxLimits(memory_mb=256))
    assert result.outcome == "memory"
    assert result.text().endswith("MemoryError\n[MemoryError: the memory limit is 256 MiB]")


def test_file_output_and_temporary_directory_limits_are_named(launcher):
    big_file = run("open('big', 'wb').write(b'x' * (2 << 20))", SandboxLimits(file_mb=1))
    assert (big_file.outcome, big_file.text()) == ("file", "[killed: file size limit (1 MiB) reached]")
    flood = run("import sys\nwhile True: sys.stdout.write('x' * 100_000)", SandboxLimits(file_mb=1))
    assert flood.outcome == "output" and flood.text().endswith("\n[killed: output limit (1 MiB) reached]")
    many = "for i in range(10): open(f'f{i}', 'wb').write(b'x' * (1 << 20))"
    full = run(many, SandboxLimits(file_mb=2, tmp_mb=4))
    assert full.outcome == "disk" and "No space left on device" in full.text()
    assert full.text().endswith("[exit code 1: temporary directory limit (4 MiB) reached]")


def test_process_limit(launcher):
    """A fork loop through ctypes (past the audit hook) hits the process limit and everything is killed."""
    code = "import ctypes, time\nlibc = ctypes.CDLL(None)\nfor _ in range(100):\n    if libc.fork() == 0:\n        time.sleep(600)\ntime.sleep(600)"
    result = run(code, SandboxLimits(wall_s=120.0, max_processes=16))
    assert (result.outcome, result.text()) == ("processes", "[killed: process limit (16) reached]")


# --- the boundary: each attack of issue #38 fails --------------------------------------------------------------


def test_host_files_are_not_there(launcher, tmp_path):
    """/etc/passwd, a secret beside the caller, the project source and a stand-in for the shared data dir."""
    secret = secrets.token_hex(8)
    beside = tmp_path / "secret.txt"
    beside.write_text(secret)
    data = tmp_path / "shared" / "gsm8k" / "test.jsonl"
    data.parent.mkdir(parents=True)
    data.write_text(f'{{"answer": "{secret}"}}')
    targets = [
        "/etc/passwd",
        str(beside),
        str(data),
        tandem.__file__,
        str(Path(tandem.__file__).parents[2] / "README.md"),
    ]
    code = "import os\nfor path in %r:\n    try:\n        print(open(path).read())\n    except OSError as e:\n        print('refused', e.errno)"
    result = run(code % targets)
    assert result.ok and result.output == "refused 2\n" * len(targets)  # ENOENT: not in the sandbox at all
    assert Path("/etc/passwd").read_text() and secret not in result.output


def test_no_host_process_is_visible(launcher, monkeypatch):
    """Not the caller's environment (`/proc/<ppid>/environ`), nor any host command line (an admin token)."""
    token = secrets.token_hex(12)
    monkeypatch.setenv("HF_TOKEN", token)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", f"--admin-token={token}"])
    try:
        eventually(lambda: host_pids(token), "the token holder did not start")
        code = textwrap.dedent("""
            import os
            for pid in sorted(p for p in os.listdir('/proc') if p.isdigit()):
                for name in ('cmdline', 'environ'):
                    try:
                        print(pid, name, open(f'/proc/{pid}/{name}', 'rb').read())
                    except OSError as e:
                        print(pid, name, 'refused', e.errno)
            print('ppid', os.getppid(), open(f'/proc/{os.getppid()}/environ', 'rb').read())
        """)
        result = run(code, SandboxLimits(wall_s=60.0, cpu_s=30, max_output_chars=10**6))
        assert result.ok and token not in result.output
        assert {line.split()[0] for line in result.output.splitlines()} == {"1", "2", "ppid"}  # the sandbox only
    finally:
        holder.kill()
        holder.wait()


@pytest.fixture
def listener():
    """A TCP server on localhost that must never see a connection."""
    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)
    yield server
    with pytest.raises(BlockingIOError):
        server.accept()
    server.close()


def test_no_network_no_loopback_no_unix_sockets(launcher, listener, tmp_path):
    port = listener.getsockname()[1]
    unix_path = tmp_path / "control.sock"
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(str(unix_path))
    unix.listen()
    unix.setblocking(False)
    code = textwrap.dedent(f"""
        import ctypes, socket, struct
        for family, address in ((socket.AF_INET, ('127.0.0.1', {port})), (socket.AF_UNIX, {str(unix_path)!r})):
            try:
                socket.socket(family).connect(address)
                print('connected')
            except OSError as e:
                print('refused', type(e).__name__)
        libc = ctypes.CDLL(None, use_errno=True)  # straight through libc: no audit hook to get past
        fd = libc.socket(socket.AF_INET, socket.SOCK_STREAM, 0)
        addr = struct.pack('<HH4s8x', socket.AF_INET, socket.htons({port}), socket.inet_aton('127.0.0.1'))
        print('libc connect', libc.connect(fd, addr, len(addr)), ctypes.get_errno())
        try:
            socket.getaddrinfo('example.com', 80)
            print('resolved')
        except OSError:
            print('no lookup')
    """)
    try:
        result = run(code)
        lines = result.output.splitlines()
        # the sandbox's own loopback (bwrap brings it up; the in-house one leaves it down), never the host's
        assert lines[0] in ("refused ConnectionRefusedError", "refused OSError")
        assert "connected" not in result.output
        assert lines[1] == "refused FileNotFoundError"  # the socket's file is not in the sandbox
        assert lines[2].startswith("libc connect -1 ") and lines[3] == "no lookup"
        with pytest.raises(BlockingIOError):
            unix.accept()
    finally:
        unix.close()


def test_the_caller_and_host_processes_cannot_be_signalled(launcher):
    victim = subprocess.Popen(["sleep", "600"])
    try:
        code = textwrap.dedent(f"""
            import ctypes, os, signal
            libc = ctypes.CDLL(None, use_errno=True)
            for pid in (os.getppid(), {os.getpid()}, {victim.pid}):
                try:
                    signal.pidfd_send_signal(os.pidfd_open(pid), 9)
                except OSError as e:
                    print('pidfd', pid, 'refused', e.errno)
                print('libc kill', pid, libc.kill(pid, 9), ctypes.get_errno())
            print('still here')
        """)
        result = run(code)
        assert result.output.endswith("still here\n") and alive(victim.pid)  # and so are we, the caller
        assert "libc kill 1 0" in result.output  # the sandbox's PID 1 is protected by the kernel, not by an error
    finally:
        victim.kill()
        victim.wait()


def test_site_packages_cannot_be_written_even_through_libc(launcher):
    """The interpreter's directories are read-only: no `.pth` that would run in every later Python start."""
    target = Path(sysconfig.get_path("purelib")) / f"tandem-sandbox-{secrets.token_hex(4)}.pth"
    code = textwrap.dedent(f"""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.open({str(target).encode()!r}, os.O_WRONLY | os.O_CREAT, 0o644)
        print(fd, ctypes.get_errno())
        if fd >= 0:
            libc.write(fd, b'import os; os.system("touch /tmp/pwned")', 40)
    """)
    try:
        result = run(code)
        assert result.output == "-1 30\n" and not target.exists()  # EROFS
    finally:
        target.unlink(missing_ok=True)


# --- nothing outlives a call -------------------------------------------------------------------------------------

ORPHANS = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
read, write = os.pipe()
os.set_inheritable(write, True)
program = b"import os, sys, time; os.write(int(sys.argv[1]), b'x'); time.sleep(600)"
for _ in range(3):  # ctypes fork (no audit event), setsid, a second fork: an orphan in its own session
    if libc.fork() == 0:
        libc.setsid()
        if libc.fork() == 0:
            args = [sys.executable.encode(), b"-c", program, str(write).encode(), b"MARKER"]
            libc.execv(args[0], (ctypes.c_char_p * 6)(*args, None))
        os._exit(0)
got = b""
while len(got) < 3:
    got += os.read(read, 3)
print("started", len(got), flush=True)
"""


@pytest.mark.parametrize("ending", ["exit", "timeout"])
def test_nothing_the_code_started_outlives_the_call(launcher, ending):
    marker = f"orphan-{secrets.token_hex(6)}"
    code = ORPHANS.replace("MARKER", marker) + ("import time\ntime.sleep(600)\n" if ending == "timeout" else "")
    result = run(code, SandboxLimits(wall_s=60.0 if ending == "exit" else 5.0, cpu_s=30))
    assert result.output.startswith("started 3\n") and result.outcome == ("ok" if ending == "exit" else "timeout")
    eventually(lambda: not host_pids(marker), "a process the code started outlived the call")


def test_a_cancelled_call_kills_the_sandbox(launcher):
    marker = f"cancel-{secrets.token_hex(6)}"
    code = f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', {marker!r}])\nimport time\ntime.sleep(600)"

    async def cancel_midway() -> None:
        task = asyncio.ensure_future(run_python(code, SandboxLimits(wall_s=600.0, subprocesses=True)))
        while not host_pids(marker):
            await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_midway())
    eventually(lambda: not host_pids(marker), "the sandbox outlived its cancelled call")


KILLED_CALLER = """
import asyncio, sys
from pathlib import Path
from tandem.config.env import SandboxConfig
from tandem.envs import sandbox
from tandem.envs.sandbox_isolation import Launcher, Probe
launcher = Launcher(sys.argv[2], sys.argv[3] or None)
sandbox.probe = lambda: Probe(launcher if launcher.isolated else None, ())
sandbox.start_sandbox(SandboxConfig(unsafe_no_isolation=True), Path(sys.argv[1]))
asyncio.run(sandbox.run_python("import time\\ntime.sleep(600)", sandbox.SandboxLimits(wall_s=float(sys.argv[4]))))
"""


@pytest.mark.parametrize(
    "chosen",
    [*LAUNCHERS, pytest.param(Launcher("none"), id="none")],
)
@pytest.mark.parametrize("fate", ["killed", "stuck"])
def test_a_dead_or_stuck_caller_leaves_no_sandbox_and_the_next_start_sweeps(chosen, fate, tmp_path, monkeypatch):
    """SIGKILL the caller: its sandbox dies with it. SIGSTOP it: the sandbox still ends at its own wall limit.
    Either way the next start sweeps what the run left in `<run_dir>/sandbox-tmp`."""
    if chosen.name == "namespaces" and not _namespaces_work():
        pytest.skip("this machine refuses namespaces")
    wall_s = 600.0 if fate == "killed" else 2.0
    argv = [sys.executable, "-c", KILLED_CALLER, str(tmp_path), chosen.name, chosen.bwrap or "", str(wall_s)]
    caller = subprocess.Popen(argv, env={**os.environ, "PYTHONPATH": str(Path(tandem.__file__).parents[1])})
    try:
        started = 3 if chosen.isolated else 2  # (bwrap or the namespaces' outer process,) PID 1, the code
        eventually(lambda: len(descendants(caller.pid)) >= started, "the sandbox did not start")
        below = descendants(caller.pid)
        caller.send_signal(signal.SIGKILL if fate == "killed" else signal.SIGSTOP)
        eventually(lambda: not any(alive(p) for p in below), f"a sandbox process outlived its {fate} caller")
    finally:
        caller.kill()
        caller.wait()
    left = tmp_path / sandbox.TMP_DIR
    if chosen.name == "none" and fate == "killed":
        assert [p.name[:4] for p in left.iterdir()] == ["run-"]  # the unisolated run's working directory
    use(monkeypatch, chosen if chosen.isolated else None)
    start_sandbox(SandboxConfig(unsafe_no_isolation=True), tmp_path)
    assert run("print('next')").output == "next\n"
    assert list(left.iterdir()) == []


# --- the tool, the start-up check, the opt-out, the cap -----------------------------------------------------------


def test_python_tool_in_a_toolbox(launcher):
    box = ToolBox([python_tool(), python_tool(SandboxLimits(wall_s=1.0, cpu_s=600), name="quick_python")])
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


def test_without_isolation_the_tool_refuses_unless_opted_out(monkeypatch, caplog, listener):
    use(monkeypatch, None, ("bubblewrap: not installed (apt-get install bubblewrap)", "namespaces: unshare: EPERM"))
    with pytest.raises(SandboxUnavailable) as refused:
        python_tool()
    message = str(refused.value)
    assert isinstance(refused.value, ConfigError) and "\n" not in message
    assert "bubblewrap: not installed" in message and "sandbox.unsafe_no_isolation = true" in message
    with pytest.raises(ConfigError, match="the python tool needs a sandbox"):
        load_env(EnvConfig(id="calculator", args={"tool": "python"}))  # at start-up, before any step
    start_sandbox(SandboxConfig(unsafe_no_isolation=True))
    with caplog.at_level("WARNING", logger="tandem.envs.sandbox"):
        python_tool()
        python_tool()
    assert [r.message.split(":")[0] for r in caplog.records] == ["UNSAFE"]  # logged once per process
    port = listener.getsockname()[1]
    result = run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=5)")
    assert result.isolation == "none"
    assert "PermissionError: network access is disabled in this sandbox (socket." in result.text()


FAIL_CLOSED = """
import logging, sys
from tandem.config.env import EnvConfig, SandboxConfig
from tandem.envs import load_env
from tandem.envs.sandbox import SandboxUnavailable, python_tool, run_python, start_sandbox
import asyncio
try:
    load_env(EnvConfig(id="calculator", args={"tool": "python"}))
    print("STARTED")
except SandboxUnavailable as error:
    print("REFUSED", error)
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(message)s")
start_sandbox(SandboxConfig(unsafe_no_isolation=True))
python_tool()
print("RAN", asyncio.run(run_python("print(6 * 7)")).text())
"""


@pytest.mark.skipif(not (shutil.which("unshare") and shutil.which("setpriv")), reason="needs util-linux")
def test_probe_fails_closed_where_namespaces_are_refused():
    """A real machine without isolation: a user namespace whose nested user namespaces are capped at 0, and no
    capabilities (like root in a default Docker container). bwrap and the in-house namespaces both fail there,
    so building the calculator with the python tool refuses with one line; the logged opt-out runs unisolated."""
    script = 'echo 0 > /proc/sys/user/max_user_namespaces && exec setpriv --bounding-set -all --inh-caps -all "$@"'
    argv = ["unshare", "--user", "--map-root-user", "sh", "-c", script, "sh", sys.executable, "-c", FAIL_CLOSED]
    env = {**os.environ, "PYTHONPATH": str(Path(tandem.__file__).parents[1])}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    if "unshare failed" in done.stderr or "max_user_namespaces" in done.stderr:
        pytest.skip(f"cannot make a user namespace here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("REFUSED the python tool needs a sandbox, and this machine has none (")
    assert "namespaces: unshare: " in lines[0] and "unsafe_no_isolation = true" in lines[0]
    assert lines[1].startswith("WARNING UNSAFE: python sandbox: none") and lines[2] == "RAN 42"


def test_probe_picks_bubblewrap_where_installed():
    found = probe()
    if BWRAP:
        assert found.launcher == Launcher("bubblewrap", BWRAP)
    else:
        assert found.refused[0].startswith("bubblewrap: not installed")


def test_concurrent_runs_are_capped(launcher):
    """Eight calls at once through two slots: never more than two sandboxes alive together."""
    start_sandbox(SandboxConfig(max_concurrent=2))
    marker = f"slot-{secrets.token_hex(6)}"
    code = f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', 'import time; time.sleep(0.3)', {marker!r}])"
    peak = 0

    async def watch(done: asyncio.Event) -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, len(host_pids(marker)))
            await asyncio.sleep(0.01)

    async def main() -> list[sandbox.SandboxResult]:
        done = asyncio.Event()
        watcher = asyncio.ensure_future(watch(done))
        limits = SandboxLimits(wall_s=120.0, subprocesses=True)
        results = await asyncio.gather(*(run_python(code, limits) for _ in range(8)))
        done.set()
        await watcher
        return results

    results = asyncio.run(main())
    assert all(r.ok for r in results) and 1 <= peak <= 2
