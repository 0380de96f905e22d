"""Which isolation the `python` sandbox gets on this machine, found once per process, and the command of a run.

Launchers, best first:

- `bubblewrap`: `bwrap` with new user, PID, mount, network, IPC and UTS namespaces (`--unshare-all
  --unshare-user`), `--die-with-parent`, `--new-session`, a cleared environment and no capabilities. Its root
  holds only `/usr` (the system's libraries), the interpreter's own directories (prefix, stdlib,
  site-packages), all read-only, a private `/proc`, a minimal `/dev` and a size-bounded tmpfs `/tmp`: no `/etc`,
  no home, no project source, no data, no sockets of the host; the loopback of its network namespace is down.
- `namespaces`: where `bwrap` is missing, the child makes the same namespaces and root itself
  (`sandbox_child.enter_namespaces`), if the kernel lets this process unshare.
- `none`: no boundary at all (rlimits and a Python audit hook only), used only when the user opts out with
  `unsafe_no_isolation`.

`probe()` runs one real sandboxed snippet through each launcher and takes the first that works, so a launcher is
used only where it was seen to hold (PID 2 in a fresh PID namespace, no host `/etc`).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

CHILD = (Path(__file__).parent / "sandbox_child.py").read_text(encoding="utf-8")
"""The program every sandboxed run executes (with `-c`: the sandbox need not see tandem's source)."""

LauncherName = Literal["bubblewrap", "namespaces", "none"]
TOP_LEVEL = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
"""Merged-/usr symlinks (or, on older systems, directories) a dynamically linked interpreter may need."""
MOUNTPOINTS = ("/mnt", "/media", "/srv", "/opt", "/tmp", "/var/tmp")
"""Where the `namespaces` launcher may mount its new root, in its own mount namespace (the first one free)."""
PROBE = "import os\nassert os.getpid() == 2 and not os.path.exists('/etc'), 'not isolated'\n"


@dataclass(frozen=True)
class Launcher:
    """How runs start: the launcher's name and, for bubblewrap, the `bwrap` binary."""

    name: LauncherName
    bwrap: str | None = None

    @property
    def isolated(self) -> bool:
        return self.name != "none"

    def describe(self) -> str:
        if self.name == "bubblewrap":
            return f"bubblewrap ({self.bwrap}): user, PID, mount, network, IPC and UTS namespaces, read-only root"
        if self.name == "namespaces":
            return "tandem's own user, PID, mount, network, IPC and UTS namespaces, read-only root (no bubblewrap)"
        return "none: model-written code runs with this process's user, files and network (unsafe_no_isolation)"

    def command(self, config: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
        """The argv and environment (nothing of the caller's) of one run whose child gets `config`."""
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": "/tmp",
            "TMPDIR": "/tmp",
            "LANG": "C.UTF-8",
            **dict.fromkeys(("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"), "1"),
        }
        roots = root_layout()
        config = {**config, "launcher": self.name, "isolated": self.isolated, **roots}
        python = [sys.executable, "-I", "-u", "-X", "utf8", "-c", CHILD, json.dumps(config)]
        if self.name != "bubblewrap":
            if not self.isolated:
                env |= {"HOME": config["workdir"], "TMPDIR": config["workdir"]}
            return python, env
        argv = [self.bwrap or "bwrap", "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session"]
        argv += ["--as-pid-1", "--cap-drop", "ALL", "--hostname", "sandbox", "--clearenv"]
        for key, value in env.items():
            argv += ["--setenv", key, value]
        for path in roots["binds"]:
            argv += ["--ro-bind", path, path]
        for link, target in roots["symlinks"]:
            argv += ["--symlink", target, link]
        argv += ["--proc", "/proc", "--dev", "/dev", "--size", str(config["tmp_bytes"]), "--tmpfs", "/tmp"]
        argv += ["--chdir", "/tmp", "--", *python]
        return argv, env


@functools.cache
def root_layout() -> dict[str, Any]:
    """What a sandbox's root holds: read-only `binds` (/usr and the interpreter's directories, none inside
    another), `symlinks` of the top-level library links, and a free `mountpoint` for the namespaces launcher."""
    paths = {"/usr", sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    paths |= {os.path.dirname(os.path.realpath(sys.executable))}
    paths |= {sysconfig.get_path(key) for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    symlinks = []
    for top in TOP_LEVEL:
        if os.path.islink(top):
            symlinks.append((top, os.readlink(top)))
        elif os.path.isdir(top):
            paths.add(top)
    real = sorted({os.path.realpath(p) for p in paths if p and os.path.isdir(p)} - {"/"})
    binds = [p for p in real if not any(p.startswith(q + "/") for q in real)]
    free = [m for m in MOUNTPOINTS if os.path.isdir(m) and not any(_overlaps(m, b) for b in binds)]
    return {"binds": binds, "symlinks": symlinks, "mountpoint": free[0] if free else "/mnt"}


def _overlaps(a: str, b: str) -> bool:
    return a == b or a.startswith(b + "/") or b.startswith(a + "/")


@dataclass(frozen=True)
class Probe:
    """What `probe()` found: the best launcher that works (None: no isolation here) and why the others did not."""

    launcher: Launcher | None
    refused: tuple[str, ...]


@functools.cache
def probe() -> Probe:
    """Try bubblewrap, then the in-house namespaces, each with one real sandboxed run (cached per process)."""
    refused = []
    bwrap = shutil.which("bwrap")
    candidates = [Launcher("bubblewrap", bwrap)] if bwrap else []
    if not bwrap:
        refused.append("bubblewrap: not installed (apt-get install bubblewrap)")
    for launcher in [*candidates, Launcher("namespaces")]:
        failure = trial(launcher)
        if failure is None:
            return Probe(launcher, tuple(refused))
        refused.append(f"{launcher.name}: {failure}")
    return Probe(None, tuple(refused))


def trial(launcher: Launcher) -> str | None:
    """Run PROBE through `launcher`: None if it ran isolated, else the one-line reason it did not."""
    status_read, status_write = os.pipe()
    config = {"wall_s": 60.0, "cpu_s": 30, "memory_mb": 1024, "file_mb": 1, "tmp_bytes": 1 << 20}
    config |= {"max_processes": 16, "subprocesses": False, "status_fd": status_write, "workdir": "/tmp"}
    argv, env = launcher.command(config)
    try:
        done = subprocess.run(
            argv, input=PROBE.encode(), capture_output=True, env=env, cwd="/", pass_fds=(status_write,), timeout=120
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return str(error)
    finally:
        os.close(status_write)
    with os.fdopen(status_read, "rb") as status:
        report = json.loads(status.read() or b"{}")
    if report.get("exit_code") == 0:
        return None
    lines = (report.get("setup_error") or (done.stdout + done.stderr).decode(errors="replace")).strip().splitlines()
    return lines[-1] if lines else f"exit code {done.returncode}"
