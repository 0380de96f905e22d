"""A built-in `python` tool: the model's code runs in a limited subprocess and the tool answers with its output.

The child is `sys.executable -I` (no user site, no PYTHON* variables) in a fresh temporary directory (its cwd,
HOME and TMPDIR, removed afterwards) with a minimal environment (no proxies, no tokens) and its own process
group, which is killed when the call ends (a wall-clock timeout, a cancelled call, or normal exit), so what it
started dies with it (a process that leaves the group with setsid() is not tracked). The code runs as the script
`main.py`, and the value of a final expression is printed, as in a notebook. Stdout and stderr go to one file
(bounded by the file-size limit) whose head and tail come back. Before the code runs, a prelude in the child
sets up what the kernel enforces:

- rlimits: CPU seconds (`RLIMIT_CPU`), address space (`RLIMIT_AS`), file size (`RLIMIT_FSIZE`), no core files;
- where the kernel lets it (root with `CAP_SYS_ADMIN`, or an unprivileged user namespace): a new network
  namespace (no interface but a downed loopback: every connection fails, localhost too) and a new mount
  namespace whose filesystem is read-only except the temporary directory;
- then it drops every capability and sets `no_new_privs`, so the code cannot undo any of that or raise a limit.

Where namespaces are refused, an audit hook blocks socket connections, binds and name lookups instead (a
Python-level guard: code that loads C through ctypes can get past it). `SandboxResult.isolation` says which
layers a run had. An audit hook also refuses starting processes (unless `SandboxLimits.subprocesses`) and
signalling other processes: `RLIMIT_NPROC` bounds nothing for uid 0, so this hook is what stops a fork bomb.
This is a guard for RL against runaway or naive code, not a boundary against code written to escape.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Literal

from tandem.envs.tools import Tool, ToolError, truncate

SandboxOutcome = Literal["ok", "error", "timeout", "cpu", "memory", "killed"]
"""How a sandboxed run ended: cleanly, with an error (or a MemoryError), at its wall or CPU limit, or by a signal."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use."""

    wall_s: float = 10.0
    """Wall-clock seconds before the process group is killed."""
    cpu_s: int = 10
    """CPU seconds (`RLIMIT_CPU`)."""
    memory_mb: int = 1024
    """Address space in MiB (`RLIMIT_AS`); an allocation past it is a MemoryError."""
    file_mb: int = 16
    """Largest file the code may write, in MiB (`RLIMIT_FSIZE`)."""
    max_output_chars: int = 4000
    """Stdout and stderr together, cut to about this many characters (head and tail kept)."""
    subprocesses: bool = False
    """Let the code start processes (they share the limits and die with the group; their number is unbounded)."""


@dataclass(frozen=True)
class SandboxResult:
    """How a run ended, its output (stdout and stderr interleaved, truncated) and the isolation it had."""

    output: str
    outcome: SandboxOutcome
    exit_code: int | None
    isolation: tuple[str, ...]
    """Layers that held: `network-namespace` or `socket-block`, `read-only-fs`, `no-capabilities`."""
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


async def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `code` as a script in the sandbox; never raises for anything the code does."""
    limits = limits or SandboxLimits()
    workdir = tempfile.mkdtemp(prefix="tandem-sandbox-")
    # Output goes to an unlinked file, not a pipe: a process the code leaves behind cannot hold the run open
    # (asyncio waits for a child's pipes to close), and RLIMIT_FSIZE bounds how much it can write.
    with tempfile.TemporaryFile() as output_file:
        try:
            Path(workdir, "main.py").write_text(code, encoding="utf-8")
            status_read, status_write = os.pipe()
            config = {**asdict(limits), "status_fd": status_write, "workdir": workdir}
            try:
                proc = await asyncio.create_subprocess_exec(
                    *(sys.executable, "-I", "-u", "-X", "utf8", "-c", _CHILD, json.dumps(config)),
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=output_file,
                    stderr=asyncio.subprocess.STDOUT,
                    cwd=workdir,
                    env=_child_env(workdir),
                    start_new_session=True,
                    pass_fds=(status_write,),
                )
            finally:
                os.close(status_write)
            with os.fdopen(status_read, "rb") as status:
                timed_out = False
                try:
                    await asyncio.wait_for(proc.wait(), limits.wall_s)
                except TimeoutError:
                    timed_out = True
                finally:  # on a timeout, a normal exit, and a cancelled call alike
                    _kill_group(proc.pid)
                    await proc.wait()
                isolation = tuple(json.loads(status.read() or b"{}").get("isolation", ()))
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        output = _read_output(output_file, limits.max_output_chars)
    exit_code = proc.returncode
    return SandboxResult(output, _outcome(exit_code, timed_out, output), exit_code, isolation, limits)


def _outcome(exit_code: int | None, timed_out: bool, output: str) -> SandboxOutcome:
    if timed_out:
        return "timeout"
    if exit_code == 0:
        return "ok"
    if exit_code in (-signal.SIGXCPU, -signal.SIGKILL):  # SIGXCPU at the soft CPU limit, SIGKILL at the hard one
        return "cpu"
    if exit_code is not None and exit_code < 0:
        return "killed"
    last = output.rstrip().rsplit("\n", 1)[-1]
    return "memory" if last.startswith("MemoryError") else "error"


def _child_env(workdir: str) -> dict[str, str]:
    """Nothing of the caller's environment: no proxies, tokens or paths; numeric libraries single-threaded."""
    threads = dict.fromkeys(("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"), "1")
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8", **threads}


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


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
    """The sandboxed Python tool, with its limits; a failed run (an exception, a limit) is a tool error."""
    limits = limits or SandboxLimits()

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
    # the ToolBox's timeout is only a backstop: the sandbox kills the code itself, with a clearer message
    return Tool(python, name, description, parameters, timeout_s=limits.wall_s + 30.0)


python = python_tool()
"""The built-in `python` tool with the default SandboxLimits."""


# The child's prelude (run with -c: it must not import tandem). It sets the limits, reports the isolation it got
# on the status fd, then runs main.py as __main__, printing a final expression's value and a traceback without
# its own frame.
_CHILD = r"""
import ast, ctypes, json, os, resource, sys, traceback, types

cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET = 0x20000, 0x10000000, 0x40000000
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 0x40000
SYS_MOUNT_SETATTR, AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = 442, -100, 0x8000, 1
isolation = []


class MountAttr(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("attr_set", "attr_clr", "propagation", "userns_fd")]


def unshare():
    uid, gid = os.geteuid(), os.getegid()
    user = CLONE_NEWUSER if uid != 0 else 0
    if libc.unshare(user | CLONE_NEWNS | CLONE_NEWNET) != 0:
        return False
    if user:  # keep our ids inside the new user namespace (unmapped, the code would see itself as nobody)
        try:
            for path, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
                with open(f"/proc/self/{path}", "w") as f:
                    f.write(text)
        except OSError:
            pass
    return True


def setattr_mount(path, flags, attr_set, attr_clr):
    attr = MountAttr(attr_set, attr_clr, 0, 0)
    size = ctypes.sizeof(attr)
    return libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, path, flags, ctypes.byref(attr), size) == 0


def read_only_root(workdir):
    return (
        libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) == 0
        and libc.mount(workdir, workdir, None, MS_BIND, None) == 0
        and setattr_mount(b"/", AT_RECURSIVE, MOUNT_ATTR_RDONLY, 0)
        and setattr_mount(workdir, 0, 0, MOUNT_ATTR_RDONLY)
    )


def drop_capabilities():
    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
    try:
        last_cap = int(open("/proc/sys/kernel/cap_last_cap").read())
    except OSError:
        last_cap = 63
    for cap in range(last_cap + 1):
        libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    data = (ctypes.c_uint32 * 6)()
    return libc.capset(ctypes.byref(Header(0x20080522, 0)), data) == 0  # _LINUX_CAPABILITY_VERSION_3


NET_EVENTS = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"}
LOOKUPS = {"socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo"}
PROCESS_EVENTS = {"os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system"}
PROCESS_EVENTS |= {"subprocess.Popen", "pty.spawn"}


def make_hook(block_network, block_processes):
    me = os.getpid()

    def hook(event, args):
        if block_network and (event in LOOKUPS or (event in NET_EVENTS and args[0].family != 1)):  # 1: AF_UNIX
            raise PermissionError(f"network access is disabled in this sandbox ({event})")
        if block_processes and event in PROCESS_EVENTS:
            raise PermissionError(f"starting processes is disabled in this sandbox ({event})")
        if event in ("os.kill", "os.killpg") and args[0] not in (me, 0):
            raise PermissionError("signalling other processes is disabled in this sandbox")

    return hook


workdir = cfg["workdir"].encode()
namespaced = unshare()
if namespaced:
    isolation.append("network-namespace")
    if read_only_root(workdir):
        isolation.append("read-only-fs")
    os.chdir(workdir)  # the inherited cwd is the directory under the bind mount, read-only now
else:
    isolation.append("socket-block")
if drop_capabilities():
    isolation.append("no-capabilities")
for limit, value in (
    (resource.RLIMIT_CPU, (cfg["cpu_s"], cfg["cpu_s"] + 1)),
    (resource.RLIMIT_AS, (cfg["memory_mb"] << 20,) * 2),
    (resource.RLIMIT_FSIZE, (cfg["file_mb"] << 20,) * 2),
    (resource.RLIMIT_CORE, (0, 0)),
):
    resource.setrlimit(limit, value)
sys.addaudithook(make_hook(not namespaced, not cfg["subprocesses"]))
with os.fdopen(cfg["status_fd"], "w") as status:
    status.write(json.dumps({"isolation": isolation}))

main = types.ModuleType("__main__")
main.__file__ = "main.py"
sys.modules["__main__"], sys.argv = main, ["main.py"]
del cfg, libc, status
try:
    with open("main.py", encoding="utf-8") as f:
        tree = ast.parse(f.read(), "main.py")
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, "main.py", "exec"), main.__dict__)
    if last is not None:
        value = eval(compile(ast.Expression(last.value), "main.py", "eval"), main.__dict__)
        if value is not None:
            print(repr(value))
except SystemExit:
    raise
except BaseException as e:
    tb = None if isinstance(e, SyntaxError) else e.__traceback__.tb_next  # the code's frames only
    traceback.print_exception(type(e), e, tb)
    sys.exit(1)
"""
