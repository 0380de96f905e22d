"""A built-in `python` tool: the model's code runs in a sandbox and the tool answers with its output.

Model-written code is hostile (in RL it is written by a policy optimised for reward), so the sandbox is a
boundary, and it fails closed: the first `python_tool()` of a process (`load_env` builds every tool at start-up,
before any step) probes the isolation this machine gives (`sandbox_isolation`: bubblewrap, else Linux
namespaces of its own), logs it once, and raises `SandboxUnavailable` if there is none, unless the run opts out
with `[sandbox] unsafe_no_isolation = true` (logged as a warning).

Each run is a fresh PID, mount, network, IPC, UTS and user namespace whose root holds only the interpreter's
directories (read-only), a private /proc and a size-bounded tmpfs /tmp (its cwd, HOME and TMPDIR): no host
files, processes, sockets or network, loopback included. Its PID 1 enforces the wall-clock and process limits
from inside, and when the code ends every process of the namespace dies, however it was started; the sandbox
also dies with the process that started it. The code runs as the script `main.py` (the value of a final
expression is printed, as in a notebook) under rlimits (CPU seconds, address space, file size, no core files)
without capabilities, and with `no_new_privs`, so it cannot undo them. Stdout and stderr go to one file, bounded by the file size
limit, whose head and tail come back; every limit hit is named in what the model reads. At most
`max_concurrent` runs go at once per process (`start_sandbox`); more calls wait their turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import shutil
import signal
import tempfile
import threading
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Literal

from tandem.config import ConfigError
from tandem.config.env import SandboxConfig
from tandem.envs.sandbox_isolation import Launcher, probe
from tandem.envs.tools import Tool, ToolError, truncate

logger = logging.getLogger(__name__)

SandboxOutcome = Literal["ok", "error", "timeout", "cpu", "memory", "output", "file", "disk", "processes", "killed"]
"""How a run ended: cleanly, with an error (or a MemoryError), or at a limit: wall clock, CPU, output size, a
file's size, the temporary directory's size, the number of processes; or by a signal."""

STARTUP_GRACE_S = 10.0
"""The caller's own backstop waits this long past `wall_s` (PID 1 in the sandbox enforces `wall_s` itself)."""
TMP_DIR = "sandbox-tmp"
"""The run directory's folder for sandbox files (swept at start-up: a killed run's leftovers go on resume)."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use."""

    wall_s: float = 10.0
    """Wall-clock seconds before every process of the run is killed."""
    cpu_s: int = 10
    """CPU seconds (`RLIMIT_CPU`)."""
    memory_mb: int = 1024
    """Address space of each process in MiB (`RLIMIT_AS`); an allocation past it is a MemoryError."""
    file_mb: int = 16
    """Largest file the code may write, its output included, in MiB (`RLIMIT_FSIZE`)."""
    tmp_mb: int = 64
    """Size of the run's temporary directory (a tmpfs), all files together, in MiB."""
    max_processes: int = 64
    """Processes the run may have at once; past it every one is killed."""
    max_output_chars: int = 4000
    """Stdout and stderr together, cut to about this many characters (head and tail kept)."""
    subprocesses: bool = False
    """Let the code start processes (`subprocess`, `os.fork`, ...; they die with the run). Off, a Python audit
    hook refuses them with a clear error; the process limit holds either way."""


@dataclass(frozen=True)
class SandboxResult:
    """How a run ended, its output (stdout and stderr interleaved, truncated) and the launcher that isolated it."""

    output: str
    outcome: SandboxOutcome
    exit_code: int | None
    isolation: str
    """`bubblewrap`, `namespaces` or `none` (`sandbox_isolation`)."""
    limits: SandboxLimits

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"

    def text(self) -> str:
        """The output, with a last line that says why the run failed (for the model to read)."""
        limits = self.limits
        reason = {
            "ok": "",
            "error": f"[exit code {self.exit_code}]",
            "timeout": f"[killed after {limits.wall_s:g} s: wall-clock limit]",
            "cpu": f"[killed after {limits.cpu_s} s of CPU time: CPU limit]",
            "memory": f"[MemoryError: the memory limit is {limits.memory_mb} MiB]",
            "output": f"[killed: output limit ({limits.file_mb} MiB) reached]",
            "file": f"[killed: file size limit ({limits.file_mb} MiB) reached]",
            "disk": f"[exit code {self.exit_code}: temporary directory limit ({limits.tmp_mb} MiB) reached]",
            "processes": f"[killed: process limit ({limits.max_processes}) reached]",
            "killed": f"[killed by {_signal_name(self.exit_code)}]",
        }[self.outcome]
        output = self.output.rstrip("\n")
        if not reason:
            return output or "(no output)"
        return f"{output}\n{reason}" if output else reason


def _signal_name(exit_code: int | None) -> str:
    try:
        return signal.Signals(-(exit_code or 0)).name
    except ValueError:
        return f"signal {-(exit_code or 0)}"


class SandboxUnavailable(ConfigError):
    """No isolation on this machine and no opt-out: the run must not start."""


class SandboxError(RuntimeError):
    """A sandbox that could not start a run (a fault of the machine, not of the code)."""


class _Slots:
    """A process-wide cap on concurrent runs, awaitable from any event loop (each waiter is woken on its own)."""

    def __init__(self, limit: int) -> None:
        self.limit, self._used = limit, 0
        self._lock = threading.Lock()
        self._waiters: deque[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = deque()

    async def __aenter__(self) -> None:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._used < self.limit and not self._waiters:
                self._used += 1
                return
            waiter = (loop, loop.create_future())
            self._waiters.append(waiter)
        try:
            await waiter[1]
        except asyncio.CancelledError:
            with self._lock:
                queued = waiter in self._waiters
                if queued:
                    self._waiters.remove(waiter)
            if not queued:  # the slot was handed over as the call was cancelled: pass it on
                self._release()
            raise

    async def __aexit__(self, *exc: object) -> None:
        self._release()

    def _release(self) -> None:
        with self._lock:
            if not self._waiters:
                self._used -= 1
                return
            loop, future = self._waiters.popleft()  # the slot goes straight to the next waiter
        loop.call_soon_threadsafe(lambda: future.done() or future.set_result(None))


@dataclass
class _Settings:
    """This process's sandbox settings (`start_sandbox`)."""

    unsafe_no_isolation: bool = False
    tmp_root: Path | None = None  # None: the system's temporary directory
    swept: bool = False
    announced: Launcher | None = None


_settings = _Settings()
_slots = _Slots(min(os.cpu_count() or 1, 8))


def start_sandbox(config: SandboxConfig | None = None, run_dir: Path | None = None) -> None:
    """Set this process's sandbox from a command's `[sandbox]` section; commands call it before they load
    environments. The runs' files go to `<run_dir>/sandbox-tmp`, which is swept before the first run (of a run
    that was killed, a resume removes what it left)."""
    config = config or SandboxConfig()
    _settings.unsafe_no_isolation = config.unsafe_no_isolation
    _settings.tmp_root = None if run_dir is None else Path(run_dir) / TMP_DIR
    _settings.swept = False
    _slots.limit = config.max_concurrent or min(os.cpu_count() or 1, 8)


def _tmp_root() -> Path | None:
    """The directory of the runs' files (None: the system's), emptied the first time it is used."""
    root = _settings.tmp_root
    if root is not None and not _settings.swept:
        shutil.rmtree(root, ignore_errors=True)
        _settings.swept = True
    if root is not None:
        root.mkdir(parents=True, exist_ok=True)
    return root


def require_isolation() -> Launcher:
    """The launcher of this process's runs, logged the first time: the probe's, or `none` where the user opted
    out; SandboxUnavailable where there is no isolation and no opt-out."""
    found = probe()
    launcher = found.launcher
    if launcher is None:
        if not _settings.unsafe_no_isolation:
            raise SandboxUnavailable(
                "the python tool needs a sandbox, and this machine has none ("
                + "; ".join(found.refused)
                + "): install bubblewrap (apt-get install bubblewrap) or allow user namespaces, or set "
                "`sandbox.unsafe_no_isolation = true` to run model-written code unisolated"
            )
        launcher = Launcher("none")
    if launcher != _settings.announced:
        _settings.announced = launcher
        if launcher.isolated:
            logger.info("python sandbox: %s", launcher.describe())
        else:
            logger.warning("UNSAFE: python sandbox: %s; refused: %s", launcher.describe(), "; ".join(found.refused))
    return launcher


async def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `code` as a script in the sandbox; never raises for anything the code does (SandboxUnavailable where
    there is no isolation, SandboxError where the sandbox itself cannot start)."""
    limits = limits or SandboxLimits()
    launcher = require_isolation()
    async with _slots:
        root = _tmp_root()
        # Output goes to a file, not a pipe (RLIMIT_FSIZE bounds it, and nothing can hold the run open); the
        # code comes on stdin. Only an unisolated run needs a directory on the host, removed afterwards.
        workdir = None if launcher.isolated else tempfile.mkdtemp(prefix="run-", dir=root)
        try:
            with tempfile.TemporaryFile(dir=root) as output, tempfile.TemporaryFile(dir=root) as source:
                source.write(code.encode("utf-8", errors="surrogateescape"))
                source.seek(0)
                report, exit_code, timed_out = await _launch(launcher, limits, source, output, workdir)
                size = os.fstat(output.fileno()).st_size
                text = _read_output(output, limits.max_output_chars)
        finally:
            if workdir is not None:
                shutil.rmtree(workdir, ignore_errors=True)
    if "setup_error" in report or ("exit_code" not in report and not timed_out):
        raise SandboxError(f"the sandbox could not start ({launcher.name}): {report.get('setup_error') or text}")
    exit_code = report.get("exit_code", exit_code)
    outcome = _outcome(exit_code, timed_out or report.get("limit") == "timeout", report, size, limits, text)
    return SandboxResult(text, outcome, exit_code, launcher.name, limits)


async def _launch(
    launcher: Launcher, limits: SandboxLimits, source: IO[bytes], output: IO[bytes], workdir: str | None
) -> tuple[dict, int | None, bool]:
    """Start the run and wait for it (PID 1 inside ends it at `wall_s`; this waits a grace period longer); kill
    what is left on any exit, a cancelled call included. Returns the child's report, exit code, and whether the
    backstop fired."""
    status_read, status_write = os.pipe()
    config = {**asdict(limits), "tmp_bytes": limits.tmp_mb << 20, "status_fd": status_write, "workdir": workdir}
    argv, env = launcher.command(config)
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=source,
            stdout=output,
            stderr=asyncio.subprocess.STDOUT,
            cwd=workdir or "/",
            env=env,
            start_new_session=True,
            pass_fds=(status_write,),
        )
    finally:
        os.close(status_write)
    with os.fdopen(status_read, "rb") as status:
        timed_out = False
        try:
            await asyncio.wait_for(proc.wait(), limits.wall_s + STARTUP_GRACE_S)
        except TimeoutError:
            timed_out = True
        finally:  # the launcher's death takes the sandbox with it (--die-with-parent, PR_SET_PDEATHSIG)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
        os.set_blocking(status.fileno(), False)  # PID 1 wrote its report (one small write) before it exited
        try:
            report = json.loads(status.read() or b"{}")
        except (BlockingIOError, ValueError):
            report = {}
    return report, proc.returncode, timed_out


def _outcome(
    exit_code: int | None, timed_out: bool, report: dict, output_size: int, limits: SandboxLimits, text: str
) -> SandboxOutcome:
    if timed_out:
        return "timeout"
    if report.get("limit") == "processes":
        return "processes"
    if exit_code == 0:
        return "ok"
    if output_size >= limits.file_mb << 20:
        return "output"
    if exit_code == -signal.SIGXFSZ:
        return "file"
    if exit_code in (-signal.SIGXCPU, -signal.SIGKILL):  # SIGXCPU at the soft CPU limit, SIGKILL at the hard one
        return "cpu"
    if exit_code is not None and exit_code < 0:
        return "killed"
    if report.get("tmp_full"):
        return "disk"
    last = text.rstrip().rsplit("\n", 1)[-1]
    return "memory" if last.startswith("MemoryError") else "error"


def _read_output(file: IO[bytes], max_chars: int) -> str:
    """The output file's first and last `max_chars` bytes (all of it if it is short), truncated to `max_chars`."""
    size = os.fstat(file.fileno()).st_size
    file.seek(0)
    if size <= 2 * max_chars:
        return truncate(file.read().decode("utf-8", errors="replace"), max_chars)
    head = file.read(max_chars)
    file.seek(size - max_chars)
    text = head.decode("utf-8", errors="replace") + file.read().decode("utf-8", errors="replace")
    return truncate(text, max_chars, omitted=size - 2 * max_chars)


def python_tool(limits: SandboxLimits | None = None, name: str = "python") -> Tool:
    """The sandboxed Python tool, with its limits; a failed run (an exception, a limit) is a tool error.
    SandboxUnavailable where this machine has no isolation and the run did not opt out."""
    limits = limits or SandboxLimits()
    require_isolation()

    async def python(code: str) -> str:
        result = await run_python(code, limits)
        if not result.ok:
            raise ToolError(result.text())
        return result.text()

    description = (
        "Run a Python 3 script and return what it prints (stdout and stderr); the value of a final expression is "
        f"printed too, as in a notebook. No network, no state kept between calls, {limits.wall_s:g} s and "
        f"{limits.memory_mb} MiB at most."
    )
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "The Python source to run."}},
        "required": ["code"],
        "additionalProperties": False,
    }
    # No ToolBox timeout: the sandbox ends the code itself, with a clearer message, and a call that waits for a
    # free slot has not started its clock (the episode's own timeout still bounds it).
    return Tool(python, name, description, parameters, timeout_s=math.inf)
