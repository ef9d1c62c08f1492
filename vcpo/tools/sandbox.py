"""Run untrusted, model-written Python code in a separate, confined process.

``run_python(code)`` executes ``code`` in a fresh interpreter (``python -I``: no environment
variables, user site or current directory on the path) inside a private temporary working directory
that is deleted afterwards, and returns its stdout, stderr and exit status. It never raises for
anything the program does, and it returns within ``timeout_s`` plus a fraction of a second.

What confines the program, and who enforces it:

=========================  =====================================  ================================
concern                    operating system                       audit hook in the child
=========================  =====================================  ================================
CPU time                   RLIMIT_CPU (SIGXCPU, then SIGKILL)
wall time                  parent kills the process group /
                           the whole PID namespace
memory                     RLIMIT_AS (allocation -> MemoryError)
file sizes                 RLIMIT_FSIZE, output caps in parent
processes (fork bombs)     seccomp-bpf (EPERM) (3),               fork/exec/spawn/subprocess refused
                           RLIMIT_NPROC (1)
network                    seccomp-bpf (EPERM) (3),               connect/bind/send/DNS refused
                           empty network namespace (2)
writes outside workdir     every mount read-only but workdir (2)  open-for-write, rename, remove,
                                                                  chmod, ... outside workdir refused
signals to other procs     seccomp-bpf (EPERM) (3),               kill/killpg of other pids refused
                           PID namespace (2)
=========================  =====================================  ================================

(1) The kernel exempts real uid 0 from RLIMIT_NPROC, even inside a user namespace. Run as root, the
    seccomp filter and the hook still refuse new processes (threads stay limited by RLIMIT_AS), and
    in ``namespaces`` mode the PID namespace still takes every process down at the end.
(2) ``namespaces`` isolation only: ``unshare --user --map-root-user --mount --net --pid --ipc``,
    then a shell remounts every mount read-only except the work directory and ``setpriv`` drops all
    capabilities (so the program cannot remount) before starting the interpreter. This works as root
    and, where unprivileged user namespaces are allowed, as an ordinary user. Where they are not (some
    hardened CI hosts), ``isolation="auto"`` falls back to ``hooks`` mode: resource limits, the seccomp
    filter and the audit hook only, with a warning.
(3) Every mode: before the program's first line the child loads a seccomp-bpf filter, which the
    kernel enforces on native code too. execve/execveat, fork/vfork, clone without CLONE_THREAD
    (threads still work), socket/connect/bind/listen/accept (socketpair stays: asyncio needs it),
    ptrace, mount/unshare/setns/chroot, set*id, capset, module loading, bpf, perf_event_open, key
    rings, personality, process_vm_*, io_uring and signals to another process fail with EPERM
    (clone3 with ENOSYS, so that glibc falls back to clone); a syscall of a foreign ABI kills the
    process. If the filter cannot be loaded, the sandbox refuses to start (RuntimeError) unless the
    caller passes ``syscall_filter=False`` or sets ``VCPO_SANDBOX_ALLOW_NO_SECCOMP=1``.

The filter is built with ``pyseccomp``, a pure-Python ctypes binding to the system's libseccomp2
(packaged by default on Debian, Ubuntu and RHEL), so it installs as an ordinary Python dependency.
Sandboxes such as nsjail or bubblewrap are separate binaries that pip cannot install and, for
their full setup, need privileges or setuid; a seccomp filter needs none once ``no_new_privs`` is set.

The audit hook also refuses ctypes foreign-function lookups and calls, but it is not a security
boundary: Python documents that native code can bypass audit hooks, and private C entry points
(``_posixsubprocess.fork_exec``, say) raise no event. It stops careless code; the OS layers stop
hostile code. In ``hooks`` mode only rlimits and the seccomp filter remain against a deliberately
hostile program: it cannot start processes, open sockets (Unix-domain sockets on the host
included) or signal other processes, but it can still read and write whatever files the calling user
can.
"""

from __future__ import annotations

import enum
import functools
import json
import logging
import math
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from vcpo.tools import _sandbox_child

logger = logging.getLogger(__name__)

ISOLATION_MODES = ("auto", "namespaces", "hooks")
_MAIN_FILE = "main.py"
_CHILD_SOURCE = Path(_sandbox_child.__file__).read_text(encoding="utf-8")
_READ_CHUNK = 64 * 1024
_POLL_S = 0.02
# How long output is still read after the program exits, for a descendant that keeps the pipes open.
_DRAIN_AFTER_EXIT_S = 0.5
# Tasks that exist in namespaces mode besides the program: the supervising shell and the interpreter.
_SUPERVISOR_TASKS = 2
_NICENESS = 10
_ALLOW_NO_SECCOMP_ENV = "VCPO_SANDBOX_ALLOW_NO_SECCOMP"
_CHILD_ENV_THREADS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS")

_NAMESPACE_COMMAND = (
    "unshare",
    "--user",
    "--map-root-user",
    "--mount",
    "--net",
    "--pid",
    "--ipc",
    "--fork",
    "--kill-child",
)
# Runs as root of the new user namespace, before the interpreter. The bind mount makes the work
# directory its own (writable) mount; `cd` moves onto it, as the inherited cwd still points below it.
# Mount points in mountinfo escape spaces as octal (\040); printf %b decodes them. The private mount
# propagation of `unshare --mount` keeps all of this invisible outside. `set +e` before the program:
# its failure is the result to report, and `exit $?` (not exec) keeps the shell as PID 1 so that the
# interpreter receives SIGXCPU like any process and its death by signal becomes status 128+N.
_NAMESPACE_SETUP_SCRIPT = r"""
set -eu
workdir=$1; shift
mount --bind "$workdir" "$workdir"
cd "$workdir"
while read -r _id _parent _dev _root mountpoint _rest; do
  mountpoint=$(printf '%b' "$mountpoint")
  [ "$mountpoint" = "$workdir" ] || mount -o remount,bind,ro "$mountpoint"
done < /proc/self/mountinfo
set +e
setpriv --no-new-privs --bounding-set=-all --inh-caps=-all -- "$@"
exit $?
"""


class SandboxStatus(str, enum.Enum):
    """How the program ended. Checked in this order: a limit the parent enforced wins."""

    OK = "ok"  # exit status 0
    ERROR = "error"  # non-zero exit status (an uncaught exception exits with 1)
    TIMEOUT = "timeout"  # wall-clock limit; the parent killed it
    OUTPUT_LIMIT = "output_limit"  # stdout or stderr exceeded max_output_bytes; the parent killed it
    CPU_LIMIT = "cpu_limit"  # RLIMIT_CPU (SIGXCPU)
    MEMORY_LIMIT = "memory_limit"  # MemoryError reached the top level
    KILLED = "killed"  # any other signal


@dataclass(frozen=True)
class SandboxResult:
    stdout: str
    stderr: str
    status: SandboxStatus
    exit_code: int | None  # None when the program died of a signal or was killed
    signal: int | None
    stdout_truncated: bool
    stderr_truncated: bool
    wall_time_s: float
    isolation: str  # "namespaces" or "hooks": the mode that actually ran

    @property
    def ok(self) -> bool:
        return self.status is SandboxStatus.OK

    @property
    def timed_out(self) -> bool:
        return self.status is SandboxStatus.TIMEOUT


def run_python(
    code: str,
    *,
    timeout_s: float = 10.0,
    cpu_time_s: int | None = None,
    memory_mb: int = 1024,
    max_output_bytes: int = 64 * 1024,
    max_file_mb: int = 16,
    max_processes: int = 16,
    max_open_files: int = 256,
    stdin: str = "",
    site_packages: bool = True,
    isolation: str = "auto",
    syscall_filter: bool = True,
) -> SandboxResult:
    """Run ``code`` as ``__main__`` in a confined interpreter and return what it printed.

    Args:
        code: Python source, executed as the file ``main.py`` in a fresh temporary directory.
        timeout_s: wall-clock limit; the whole process group (and namespace) is killed after it.
        cpu_time_s: CPU-time limit (RLIMIT_CPU); defaults to ``ceil(timeout_s)``.
        memory_mb: address-space limit of the interpreter (RLIMIT_AS).
        max_output_bytes: bytes kept per stream; more output stops the program (status output_limit).
        max_file_mb: largest file the program may write (RLIMIT_FSIZE).
        max_processes: tasks (processes and threads) the program may add (RLIMIT_NPROC).
        max_open_files: RLIMIT_NOFILE.
        stdin: text fed to the program's standard input.
        site_packages: allow importing installed packages (numpy, sympy, ...), as tool-integrated
            reasoning expects; False adds ``-S`` and leaves only the standard library.
        isolation: "namespaces" (required; RuntimeError if unavailable), "hooks" (no namespaces), or
            "auto" (namespaces when this machine allows them, else hooks with a one-time warning).
        syscall_filter: load the seccomp-bpf filter in the child (required: RuntimeError where it
            cannot be loaded, unless ``VCPO_SANDBOX_ALLOW_NO_SECCOMP=1``); False runs without it.
    """
    cpu_time_s = cpu_time_s if cpu_time_s is not None else max(1, math.ceil(timeout_s))
    _check_limits(
        timeout_s=timeout_s,
        cpu_time_s=cpu_time_s,
        memory_mb=memory_mb,
        max_output_bytes=max_output_bytes,
        max_file_mb=max_file_mb,
        max_processes=max_processes,
        max_open_files=max_open_files,
    )
    use_namespaces = _use_namespaces(isolation)
    seccomp = _seccomp_config(syscall_filter)
    rlimits = {
        "RLIMIT_CPU": [cpu_time_s, cpu_time_s + 1],
        "RLIMIT_AS": [memory_mb << 20] * 2,
        "RLIMIT_FSIZE": [max_file_mb << 20] * 2,
        "RLIMIT_NPROC": [_process_budget(max_processes, use_namespaces)] * 2,
        "RLIMIT_NOFILE": [max_open_files] * 2,
        "RLIMIT_CORE": [0, 0],
    }
    with _private_workdir() as workdir, _stdin_file(stdin) as stdin_handle:
        (workdir / _MAIN_FILE).write_text(code, encoding="utf-8", errors="replace")
        config = {
            "workdir": str(workdir),
            "main": _MAIN_FILE,
            "rlimits": rlimits,
            "niceness": _NICENESS,
            "seccomp": seccomp,
        }
        command = _interpreter_command(config, site_packages)
        if use_namespaces:
            command = _in_namespaces(command, workdir)
        started = time.monotonic()
        process = subprocess.Popen(
            command,
            cwd=workdir,
            env=_child_env(workdir),
            stdin=stdin_handle,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        try:
            capture = _capture_output(process, started + timeout_s, max_output_bytes)
        finally:
            _kill_process_group(process)
        wall_time_s = time.monotonic() - started
    return _make_result(capture, process.returncode, use_namespaces, wall_time_s)


def namespaces_available() -> bool:
    """Whether this machine lets the sandbox run in its own user, mount, network and PID namespaces."""
    return _probe_namespaces()


def _check_limits(**limits: float) -> None:
    for name, value in limits.items():
        if not value > 0:
            raise ValueError(f"run_python: {name} must be positive, got {value!r}")


def _use_namespaces(isolation: str) -> bool:
    if isolation not in ISOLATION_MODES:
        raise ValueError(f"run_python: isolation must be one of {ISOLATION_MODES}, got {isolation!r}")
    if isolation == "hooks":
        return False
    available = _probe_namespaces()
    if isolation == "namespaces" and not available:
        raise RuntimeError(
            "run_python: isolation='namespaces' but this machine does not allow "
            "`unshare --user --mount --net --pid` (see the warning logged by the probe)"
        )
    return available


@functools.lru_cache(maxsize=1)
def _probe_namespaces() -> bool:
    """Run the namespace setup once with a trivial program; cache whether it worked."""
    missing = [tool for tool in ("unshare", "setpriv", "mount") if shutil.which(tool) is None]
    if missing:
        logger.warning("sandbox: %s not found; running untrusted code with hooks and rlimits only", missing)
        return False
    with _private_workdir() as workdir:
        probe = _in_namespaces([sys.executable, "-I", "-S", "-c", "pass"], workdir)
        try:
            completed = subprocess.run(probe, cwd=workdir, capture_output=True, text=True, timeout=30)
        except subprocess.TimeoutExpired:
            completed = None
    if completed is not None and completed.returncode == 0:
        return True
    reason = completed.stderr.strip() if completed is not None else "timed out"
    logger.warning("sandbox: namespaces unavailable (%s); running untrusted code with hooks and rlimits only", reason)
    return False


def _seccomp_config(requested: bool) -> dict | None:
    """What the child needs to load the syscall filter, or None to run without it."""
    if not requested:
        return None
    seccomp, reason = _probe_syscall_filter()
    if seccomp is not None:
        return seccomp
    if os.environ.get(_ALLOW_NO_SECCOMP_ENV) == "1":
        _warn_once(f"sandbox: running untrusted code without a seccomp syscall filter ({reason})")
        return None
    raise RuntimeError(
        f"run_python: cannot confine the program with a seccomp syscall filter ({reason}). Install the "
        f"system libseccomp2 and `pip install pyseccomp`, or opt out explicitly with syscall_filter=False "
        f"or {_ALLOW_NO_SECCOMP_ENV}=1"
    )


@functools.cache
def _warn_once(message: str) -> None:
    logger.warning(message)


@functools.lru_cache(maxsize=1)
def _probe_syscall_filter() -> tuple[dict | None, str]:
    """Load the filter once in a throwaway child; cache (the child's seccomp config, or None, and why)."""
    try:
        import ctypes.util

        import pyseccomp
    except (ImportError, OSError, RuntimeError) as exc:  # pyseccomp raises RuntimeError without libseccomp
        return None, f"pyseccomp unavailable: {exc!r}"
    libraries = {name: ctypes.util.find_library(name) for name in ("c", "seccomp")}
    seccomp = {"module": pyseccomp.__file__, "libraries": libraries}
    config = {"main": _MAIN_FILE, "rlimits": {}, "niceness": 0, "seccomp": seccomp}
    with _private_workdir() as workdir:
        (workdir / _MAIN_FILE).write_text("print(open('/proc/self/status').read())", encoding="utf-8")
        command = _interpreter_command({**config, "workdir": str(workdir)}, site_packages=False)
        try:
            completed = subprocess.run(command, cwd=workdir, capture_output=True, text=True, timeout=30)
        except subprocess.TimeoutExpired:
            return None, "the probe timed out"
    # Seccomp mode 2: a filter is active.
    if completed.returncode == 0 and "\nSeccomp:\t2\n" in completed.stdout:
        return seccomp, ""
    return None, completed.stderr.strip() or f"probe exited with {completed.returncode}"


def _process_budget(max_processes: int, use_namespaces: bool) -> int:
    """RLIMIT_NPROC value giving the program ``max_processes`` tasks of its own.

    The kernel counts every task of the real user: inside a fresh user namespace that is only the
    sandbox itself, otherwise it includes everything this user already runs.
    """
    if use_namespaces:
        return _SUPERVISOR_TASKS + max_processes
    return _count_tasks_of_user(os.getuid()) + max_processes


def _count_tasks_of_user(uid: int) -> int:
    count = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid == uid:
                count += len(os.listdir(f"/proc/{entry.name}/task"))
        except OSError:  # the process ended while we looked
            continue
    return count


@contextmanager
def _private_workdir() -> Iterator[Path]:
    workdir = Path(tempfile.mkdtemp(prefix="vcpo-sandbox-")).resolve()
    try:
        yield workdir
    finally:
        _remove_tree(workdir)


def _remove_tree(path: Path) -> None:
    """Delete ``path`` even if the program made parts of it read-only or unreadable."""

    def make_writable_and_retry(function, failed_path, _exc_info):
        os.chmod(os.path.dirname(failed_path), stat.S_IRWXU)
        if os.path.isdir(failed_path) and not os.path.islink(failed_path):
            os.chmod(failed_path, stat.S_IRWXU)
        function(failed_path)

    shutil.rmtree(path, onerror=make_writable_and_retry)


@contextmanager
def _stdin_file(text: str) -> Iterator[IO[bytes] | int]:
    """The program's stdin, from an anonymous file so that a program that never reads cannot block us."""
    if not text:
        yield subprocess.DEVNULL
        return
    with tempfile.TemporaryFile() as handle:
        handle.write(text.encode("utf-8"))
        handle.seek(0)
        yield handle


def _interpreter_command(config: dict, site_packages: bool) -> list[str]:
    # -I: ignore PYTHON* variables, user site and cwd; -B: no .pyc writes; -u: output survives a kill.
    flags = ["-I", "-B", "-u", "-X", "utf8"] + ([] if site_packages else ["-S"])
    return [sys.executable, *flags, "-c", _CHILD_SOURCE, json.dumps(config)]


def _in_namespaces(command: list[str], workdir: Path) -> list[str]:
    return [*_NAMESPACE_COMMAND, "sh", "-c", _NAMESPACE_SETUP_SCRIPT, "sandbox-setup", str(workdir), *command]


def _child_env(workdir: Path) -> dict[str, str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(workdir), "TMPDIR": str(workdir), "LANG": "C.UTF-8"}
    # Numeric libraries start a thread per core, which would use up the RLIMIT_NPROC budget.
    env.update({name: "1" for name in _CHILD_ENV_THREADS})
    return env


@dataclass
class _Capture:
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool
    stderr_truncated: bool
    stopped_by: SandboxStatus | None  # a limit the parent enforced, if any


def _capture_output(process: subprocess.Popen, deadline: float, max_bytes: int) -> _Capture:
    """Read both pipes until the program exits, the deadline passes or a stream exceeds ``max_bytes``."""
    buffers = {process.stdout.fileno(): bytearray(), process.stderr.fileno(): bytearray()}
    truncated = dict.fromkeys(buffers, False)
    stopped_by = None
    drain_until = None
    with selectors.DefaultSelector() as selector:
        for fd in buffers:
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_READ)
        while stopped_by is None:
            now = time.monotonic()
            if now >= deadline:
                stopped_by = SandboxStatus.TIMEOUT
                break
            if drain_until is None and _has_exited(process):
                drain_until = now + _DRAIN_AFTER_EXIT_S
            if drain_until is not None and (now >= drain_until or not selector.get_map()):
                break
            if not selector.get_map():
                time.sleep(_POLL_S)
                continue
            for key, _events in selector.select(timeout=_POLL_S):
                chunk = os.read(key.fd, _READ_CHUNK)
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                buffer = buffers[key.fd]
                room = max_bytes - len(buffer)
                buffer += chunk[:room]
                if len(chunk) > room:
                    truncated[key.fd] = True
                    stopped_by = SandboxStatus.OUTPUT_LIMIT
    stdout_fd, stderr_fd = process.stdout.fileno(), process.stderr.fileno()
    return _Capture(
        stdout=bytes(buffers[stdout_fd]),
        stderr=bytes(buffers[stderr_fd]),
        stdout_truncated=truncated[stdout_fd],
        stderr_truncated=truncated[stderr_fd],
        stopped_by=stopped_by,
    )


def _has_exited(process: subprocess.Popen) -> bool:
    # WNOWAIT leaves the child unreaped, so its pid (= the process group id) cannot be reused
    # by an unrelated process before _kill_process_group runs.
    return os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _kill_process_group(process: subprocess.Popen) -> None:
    """SIGKILL everything left in the program's process group (in namespaces mode, its PID namespace
    dies with it), then reap the child and close the pipes."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()
    process.stdout.close()
    process.stderr.close()


def _make_result(capture: _Capture, returncode: int, used_namespaces: bool, wall_time_s: float) -> SandboxResult:
    exit_code, signal_number = _split_returncode(returncode, used_namespaces)
    if capture.stopped_by is not None:
        status, exit_code = capture.stopped_by, None
    elif signal_number == signal.SIGXCPU:
        status = SandboxStatus.CPU_LIMIT
    elif signal_number is not None:
        status = SandboxStatus.KILLED
    elif exit_code == _sandbox_child.MEMORY_ERROR_EXIT_CODE:
        status = SandboxStatus.MEMORY_LIMIT
    else:
        status = SandboxStatus.OK if exit_code == 0 else SandboxStatus.ERROR
    return SandboxResult(
        stdout=capture.stdout.decode("utf-8", errors="replace"),
        stderr=capture.stderr.decode("utf-8", errors="replace"),
        status=status,
        exit_code=exit_code,
        signal=signal_number,
        stdout_truncated=capture.stdout_truncated,
        stderr_truncated=capture.stderr_truncated,
        wall_time_s=wall_time_s,
        isolation="namespaces" if used_namespaces else "hooks",
    )


def _split_returncode(returncode: int, via_shell: bool) -> tuple[int | None, int | None]:
    """(exit code, signal) from a Popen return code; the setup shell reports death by signal N as 128+N."""
    if returncode < 0:
        return None, -returncode
    if via_shell and returncode > 128:
        return None, returncode - 128
    return returncode, None
