"""The program a sandbox runs (as `python -I -c <this file's text> <config json>`; it never imports tandem).

It starts as PID 1 of the sandbox's own PID namespace (bubblewrap's `--as-pid-1`; or, with `launcher =
"namespaces"`, after making the namespaces and the minimal root itself, see `enter_namespaces`). PID 1 is the
supervisor: it forks the model's code, enforces the wall-clock and process limits from inside (so the limit
holds even if the caller is gone or stuck), and when the code ends kills every process left in the namespace.
The code cannot signal it (the kernel drops SIGKILL and SIGSTOP sent to a PID namespace's init from inside)
and cannot see the host's processes. The code's process sets the rlimits, drops every capability, sets
`no_new_privs` and runs `main.py`; the value of a final expression is printed, as in a notebook. The supervisor
writes one JSON report on the status fd: how the code ended and which limit, if any, ended it.
"""

import ast
import ctypes
import json
import os
import resource
import select
import signal
import sys
import time
import traceback
import types

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x20000, 0x4000000, 0x8000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 0x1000, 0x4000, 0x40000
SYS_PIVOT_ROOT, SYS_MOUNT_SETATTR, AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY, MNT_DETACH = 155, 442, -100, 0x8000, 1, 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP = 1, 38, 24
DEVICES = ("null", "zero", "full", "random", "urandom")

libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    """Isolation that could not be set up: the code must not run."""


def check(ok, what):
    if not ok:
        raise SetupError(f"{what}: {os.strerror(ctypes.get_errno())}")


def die_with_parent():
    """SIGKILL this process when the one that started it exits (or already has)."""
    parent = os.getppid()
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


class MountAttr(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("attr_set", "attr_clr", "propagation", "userns_fd")]


def mount(source, target, fstype, flags, data=None):
    enc = [None if s is None else s.encode() for s in (source, target, fstype, data)]
    check(libc.mount(enc[0], enc[1], enc[2], flags, enc[3]) == 0, f"mount {target}")


def read_only(path, flags=AT_RECURSIVE):
    attr = MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
    ok = libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, path.encode(), flags, ctypes.byref(attr), ctypes.sizeof(attr)) == 0
    check(ok, f"read-only {path}")


def enter_namespaces(cfg):
    """Make the namespaces bubblewrap would (user where not root, mount, PID, network, IPC, UTS), fork PID 1
    into them and give it a root of its own: a tmpfs with the interpreter's directories bound read-only, a
    private /proc, a few devices and a size-bounded /tmp. This process waits for PID 1 and exits with it."""
    uid, gid = os.geteuid(), os.getegid()
    user = CLONE_NEWUSER if uid != 0 else 0
    flags = user | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    check(libc.unshare(flags) == 0, "unshare")
    if user:  # keep our ids inside the user namespace (unmapped, the code would run as nobody)
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    pid = os.fork()
    if pid:
        os.close(cfg["status_fd"])
        _, status = os.waitpid(pid, 0)
        os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
    die_with_parent()
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    root = cfg["mountpoint"]
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for path in cfg["binds"]:
        os.makedirs(root + path, exist_ok=True)
        mount(path, root + path, None, MS_BIND | MS_REC)
        read_only(root + path)
    for link, target in cfg["symlinks"]:
        os.symlink(target, root + link)
    os.mkdir(root + "/proc")
    mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.mkdir(root + "/dev")
    for device in DEVICES:
        open(f"{root}/dev/{device}", "w").close()
        mount(f"/dev/{device}", f"{root}/dev/{device}", None, MS_BIND)
    os.mkdir(root + "/tmp")
    mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg['tmp_bytes']},mode=1777")
    os.chdir(root)
    check(libc.syscall(SYS_PIVOT_ROOT, b".", b".") == 0, "pivot_root")  # the old root now lies under the new one
    check(libc.umount2(b".", MNT_DETACH) == 0, "detach the old root")
    os.chdir("/")
    read_only("/", 0)
    libc.sethostname(b"sandbox", 7)


def drop_capabilities():
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    for cap in range(64):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    check(libc.capset(ctypes.byref(Header(0x20080522, 0)), (ctypes.c_uint32 * 6)()) == 0, "drop capabilities")


def count_processes():
    return sum(name.isdigit() for name in os.listdir("/proc"))


def supervise(pid, cfg):
    """Wait for the code's process; end it at the wall-clock or process limit; reap every orphan (PID 1's job)."""
    deadline = time.monotonic() + cfg["wall_s"]
    pidfd = os.pidfd_open(pid)
    status, limit = None, None
    while status is None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            limit = "timeout"
            break
        select.select([pidfd], [], [], min(remaining, 0.05))
        while True:  # reap every zombie: the code's process, and the orphans its children became
            try:
                reaped, wait_status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if not reaped:
                break
            if reaped == pid:
                status = wait_status
        if status is None and cfg["isolated"] and count_processes() > cfg["max_processes"]:
            limit = "processes"
            break
    try:
        if cfg["isolated"]:
            os.kill(-1, signal.SIGKILL)  # from PID 1: every other process of this namespace
        else:
            os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:  # none left
        pass
    if status is None:
        status = os.waitpid(pid, 0)[1]
    tmp = os.statvfs(".")
    return {
        "exit_code": os.waitstatus_to_exitcode(status),
        "limit": limit,
        "tmp_full": cfg["isolated"] and tmp.f_bavail * tmp.f_frsize < 64 << 10,
    }


NET_EVENTS = {"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"}
LOOKUPS = {"socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo"}
PROCESS_EVENTS = {"os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system"}
PROCESS_EVENTS |= {"subprocess.Popen", "pty.spawn"}


def make_hook(block_network, block_processes):
    """Friendly errors for what the namespaces stop anyway (without isolation: a Python-level guard only)."""
    me = os.getpid()

    def hook(event, args):
        if block_network and (event in LOOKUPS or (event in NET_EVENTS and args[0].family != 1)):  # 1: AF_UNIX
            raise PermissionError(f"network access is disabled in this sandbox ({event})")
        if block_processes and event in PROCESS_EVENTS:
            raise PermissionError(f"starting processes is disabled in this sandbox ({event})")
        if event in ("os.kill", "os.killpg") and args[0] not in (me, 0):
            raise PermissionError("signalling other processes is disabled in this sandbox")

    return hook


def run_code(cfg):
    """The code's process: limits, no privileges, then main.py as __main__ (never returns)."""
    limits = [
        (resource.RLIMIT_CPU, (cfg["cpu_s"], cfg["cpu_s"] + 1)),
        (resource.RLIMIT_AS, (cfg["memory_mb"] << 20,) * 2),
        (resource.RLIMIT_FSIZE, (cfg["file_mb"] << 20,) * 2),
        (resource.RLIMIT_CORE, (0, 0)),
    ]
    if cfg["isolated"]:  # counted per user namespace, where the caller is not root; PID 1 counts them too
        limits.append((resource.RLIMIT_NPROC, (cfg["max_processes"],) * 2))
    else:  # no PID namespace: the code's own group, which the supervisor kills
        os.setpgid(0, 0)
        die_with_parent()
    for limit, value in limits:
        resource.setrlimit(limit, value)
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # a file past the limit kills the run, which then says so
    sys.addaudithook(make_hook(not cfg["isolated"], not cfg["subprocesses"]))
    main = types.ModuleType("__main__")
    main.__file__ = "main.py"
    sys.modules["__main__"], sys.argv = main, ["main.py"]
    try:
        with open("main.py", encoding="utf-8") as f:
            tree = ast.parse(f.read(), "main.py")
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, "main.py", "exec"), main.__dict__)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), "main.py", "eval"), main.__dict__)
            if value is not None:
                print(repr(value))
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException as e:
        tb = None if isinstance(e, SyntaxError) else e.__traceback__.tb_next  # the code's frames only
        traceback.print_exception(type(e), e, tb)
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except OSError:
        pass
    os._exit(code & 0xFF)


def main():
    cfg = json.loads(sys.argv[1])
    status = os.fdopen(cfg["status_fd"], "w")
    source = sys.stdin.buffer.read()  # the code comes on stdin; the code itself reads an empty one
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    try:
        if cfg["launcher"] != "bubblewrap":  # (bubblewrap: --die-with-parent)
            die_with_parent()
        if cfg["launcher"] == "namespaces":
            enter_namespaces(cfg)
        if cfg["isolated"]:
            drop_capabilities()
            os.chdir("/tmp")
        with open("main.py", "wb") as f:
            f.write(source)
    except (SetupError, OSError) as e:
        status.write(json.dumps({"setup_error": str(e)}))
        status.close()
        os._exit(1)
    pid = os.fork()
    if pid == 0:
        status.close()
        run_code(cfg)
    status.write(json.dumps(supervise(pid, cfg)))
    status.close()
    os._exit(0)


if __name__ == "__main__":
    main()
