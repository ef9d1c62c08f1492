"""Bootstrap that runs inside the sandbox interpreter, before the model's code.

The parent (``vcpo.tools.sandbox``) passes this file's source with ``python -I -c`` and one JSON
argument. It lowers the resource limits, installs an audit hook that refuses writes outside the work
directory, subprocesses, signals to other processes and network access, and then executes
``main.py`` from the work directory as ``__main__``.

The audit hook is defence in depth, not a security boundary: Python documents that audit hooks can be
bypassed by native code (``ctypes``). The operating-system layers set up by the parent (namespaces,
read-only mounts, resource limits) are what a determined program cannot undo.

Importing this module has no side effects; the parent imports it only to read the constants below.
"""

import builtins
import errno
import json
import os
import resource
import sys
import threading
import traceback

# Exit status that tells the parent the program died of MemoryError under the address-space limit.
MEMORY_ERROR_EXIT_CODE = 121

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
_WRITABLE_DEVICES = frozenset({os.devnull})

_PROCESS_EVENTS = frozenset(
    {"os.system", "os.exec", "os.spawn", "os.posix_spawn", "os.fork", "os.forkpty", "subprocess.Popen", "pty.spawn"}
)
# Unix-domain sockets are included: a socket file on the host (a Docker daemon, say) is reachable
# from inside a network namespace. socketpair() raises none of these, so asyncio keeps working.
_NETWORK_EVENTS = frozenset(
    {
        "socket.connect",
        "socket.bind",
        "socket.sendto",
        "socket.sendmsg",
        "socket.getaddrinfo",
        "socket.gethostbyname",
        "socket.gethostbyaddr",
        "socket.getnameinfo",
        "socket.sethostname",
    }
)
# Calling native code through ctypes would bypass every check here; importing ctypes stays allowed
# (numpy does) but looking up or calling a foreign function is refused.
_NATIVE_CODE_EVENTS = frozenset({"ctypes.dlsym", "ctypes.dlsym/handle", "ctypes.call_function"})
# Audit events that modify the filesystem: event -> ((path argument, its dir_fd argument or None), ...).
_PATH_EVENTS = {
    "os.remove": ((0, 1),),
    "os.rmdir": ((0, 1),),
    "os.mkdir": ((0, 2),),
    "os.chmod": ((0, 2),),
    "os.chown": ((0, 3),),
    "os.utime": ((0, 3),),
    "os.truncate": ((0, None),),
    "os.setxattr": ((0, None),),
    "os.removexattr": ((0, None),),
    "os.rename": ((0, 2), (1, 3)),
    "os.link": ((0, 2), (1, 3)),
    "os.symlink": ((1, 2),),
    "shutil.rmtree": ((0, 1),),
}


def apply_rlimits(rlimits: dict) -> None:
    """Set each ``resource.RLIMIT_*`` named in ``rlimits`` to its ``[soft, hard]`` pair."""
    for name, (soft, hard) in rlimits.items():
        resource.setrlimit(getattr(resource, name), (soft, hard))


def _fd_path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


def resolve_event_path(path, dir_fd=None) -> str:
    """Absolute, symlink-free path that an audited call with ``path`` (and ``dir_fd``) acts on."""
    if isinstance(path, int):
        return _fd_path(path)
    path = os.fsdecode(path)
    # Audit events pass -1 (or AT_FDCWD) when the call had no dir_fd.
    base = _fd_path(dir_fd) if dir_fd is not None and dir_fd >= 0 else os.getcwd()
    return os.path.realpath(os.path.join(base, path))


def make_audit_hook(workdir: str):
    """Audit hook enforcing the sandbox policy for a program confined to ``workdir``."""
    workdir = os.path.realpath(workdir)
    reentry = threading.local()  # the hook's own path lookups must not be audited by itself

    def is_writable(path, dir_fd=None) -> bool:
        try:
            resolved = resolve_event_path(path, dir_fd)
        except (OSError, ValueError):  # fail closed on a path that cannot be resolved
            return False
        return resolved in _WRITABLE_DEVICES or os.path.commonpath([resolved, workdir]) == workdir

    def refuse(what: str):
        raise PermissionError(errno.EACCES, f"sandbox: {what} is not allowed")

    def check(event: str, args: tuple) -> None:
        if event == "open":
            path, _mode, flags = args
            if flags & _WRITE_FLAGS and not isinstance(path, int) and not is_writable(path):
                refuse(f"writing {os.fsdecode(path)!r} (outside the working directory)")
        elif event in _PATH_EVENTS:
            for path_index, dir_fd_index in _PATH_EVENTS[event]:
                dir_fd = args[dir_fd_index] if dir_fd_index is not None else None
                if not is_writable(args[path_index], dir_fd):
                    refuse(f"{event} on {args[path_index]!r} (outside the working directory)")
        elif event in _PROCESS_EVENTS:
            refuse(f"starting a process ({event})")
        elif event in _NETWORK_EVENTS:
            refuse(f"network access ({event})")
        elif event in _NATIVE_CODE_EVENTS:
            refuse(f"calling native code ({event})")
        elif event in ("os.kill", "os.killpg") and not (event == "os.kill" and args[0] == os.getpid()):
            refuse(f"signalling another process ({event})")

    def hook(event: str, args: tuple) -> None:
        if getattr(reentry, "active", False):
            return
        reentry.active = True
        try:
            check(event, args)
        finally:
            reentry.active = False

    return hook


def _print_exception(exc: BaseException, traceback_start) -> None:
    traceback.print_exception(type(exc), exc, traceback_start, file=sys.stderr)


def run_main(main_path: str) -> int:
    """Execute ``main_path`` as ``__main__``; return the process exit status."""
    with open(main_path, encoding="utf-8") as handle:
        source = handle.read()
    try:
        code = compile(source, os.path.basename(main_path), "exec")
    except (SyntaxError, ValueError) as exc:
        _print_exception(exc, None)
        return 1
    namespace = {"__name__": "__main__", "__file__": main_path, "__builtins__": builtins}
    try:
        exec(code, namespace)
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - report whatever the program raised, like the interpreter
        # Skip this frame so the traceback starts in the program, as if run with `python main.py`.
        _print_exception(exc, exc.__traceback__.tb_next)
        return MEMORY_ERROR_EXIT_CODE if isinstance(exc, MemoryError) else 1
    return 0


def main(config: dict) -> int:
    apply_rlimits(config["rlimits"])
    # Below the caller's priority, so that a program busy in all its tasks cannot starve the
    # caller, which has to enforce the wall-clock limit.
    os.nice(config["niceness"])
    workdir = config["workdir"]
    sys.path.insert(0, workdir)
    sys.argv = [config["main"]]
    sys.addaudithook(make_audit_hook(workdir))
    return run_main(os.path.join(workdir, config["main"]))


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
