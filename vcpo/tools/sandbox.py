"""Run untrusted, model-written Python code in a separate, confined process.

``run_python(code)`` executes ``code`` in a fresh interpreter (``python -I``: no environment
variables, user site or current directory on the path) inside a private temporary working directory
that is deleted afterwards, and returns its stdout, stderr and exit status. It never raises for
anything the program does, and it returns within ``timeout_s`` plus a fraction of a second.

What confines the program, and who enforces it:

=========================  ======================================  ===============================
concern                    operating system                        audit hook in the child
=========================  ======================================  ===============================
CPU time                   RLIMIT_CPU (SIGXCPU, then SIGKILL)
wall time                  parent kills the process group /
                           the whole PID namespace
the caller's death         parent-death signals down the tree
                           (6); the guard removes the folder
disk (all files together)  size-limited tmpfs (2); hooks isolation:
                           parent polls the folder's size
memory                     RLIMIT_AS (allocation -> MemoryError)
file sizes                 RLIMIT_FSIZE, output caps in parent
processes (fork bombs)     seccomp-bpf (EPERM) (3),                fork/exec/spawn/subprocess refused
                           RLIMIT_NPROC (1)
network                    seccomp-bpf (EPERM) (3), Landlock (4),  connect/bind/send/DNS refused
                           empty network namespace (2)
reading host files,        minimal root (2), Landlock (4)
other processes' /proc
writes outside workdir     read-only minimal root (2),             open-for-write, rename, remove,
                           Landlock (4); metadata: seccomp (3)     chmod, ... outside workdir refused
signals to other procs     seccomp-bpf (EPERM) (3), Landlock (4),  kill/killpg of other pids refused
                           PID namespace (2)
the caller's environment   not inherited (``-I``, fresh env),
                           its /proc entry unreachable (2, 4)
root's powers (uid 0)      every capability dropped (5)
=========================  ======================================  ===============================

(1) The kernel exempts real uid 0 from RLIMIT_NPROC, even inside a user namespace. Run as root, the
    seccomp filter and the hook still refuse new processes (threads stay limited by RLIMIT_AS), and
    in ``namespaces`` isolation the PID namespace still takes every process down at the end.
(2) ``namespaces`` isolation only: ``unshare --user --map-root-user --mount --net --pid --ipc``,
    then a shell builds the program's root from read-only bind mounts of what Python needs (the
    system's programs and libraries under /usr, /bin, /lib*, ``/etc/ld.so.cache``; this interpreter's
    prefixes, standard library and site-packages; /dev/null, zero, random, urandom), the writable
    work directory and a /proc of the new PID namespace, switches to it with ``pivot_root`` and
    detaches the host's tree; ``setpriv`` drops all capabilities (so the program cannot remount)
    before starting the interpreter. Home directories, /etc, /tmp, /run, /sys and other processes do
    not exist there. This works as root and, where unprivileged user namespaces are allowed, as an
    ordinary user. Where they are not (some hardened CI hosts and clusters), ``isolation="auto"``
    falls back to ``hooks`` isolation with a warning.
(3) Every isolation: before the program's first line the child loads a seccomp-bpf filter, which the
    kernel enforces on native code too. execve/execveat, fork/vfork, clone without CLONE_THREAD
    (threads still work), socket/connect/bind/listen/accept (socketpair stays: asyncio needs it),
    ptrace, mount and the new mount API, unshare/setns/chroot, set*id, capset, module loading, bpf,
    perf_event_open, key rings, personality, process_vm_*, io_uring, signals to another process and
    file-metadata changes (chmod, chown, utime, xattrs; Landlock does not govern these) fail with
    EPERM (clone3 with ENOSYS, so that glibc falls back to clone); a syscall of a foreign ABI kills
    the process. If the filter cannot be loaded, the sandbox refuses to start (RuntimeError) unless
    the caller passes ``syscall_filter=False`` or sets ``VCPO_SANDBOX_ALLOW_NO_SECCOMP=1``.
(4) Every isolation where the kernel has Landlock (Linux >= 5.13, enabled in most distributions' kernels):
    the child restricts itself, irrevocably and without privileges, to reading the same host paths
    as (2), reading its own /proc entry and using its work directory; every other path, whoever owns
    it (root's /etc/shadow included), fails with EACCES. From Landlock ABI 4 TCP bind/connect is
    refused too, from ABI 6 signals and abstract Unix sockets outside the sandbox. In ``hooks`` isolation
    this is the only layer between the program and the caller's files, so without Landlock the
    sandbox refuses to start (RuntimeError) unless the caller passes ``hide_host_files=False`` or
    sets ``VCPO_SANDBOX_ALLOW_HOST_FILES=1``; ``namespaces`` isolation hides them with its root alone.
(5) Every isolation: the child empties its capability sets (and, as root, its bounding set) before the
    filter, so a program run as root cannot raise its resource limits, renice below the caller,
    schedule itself in real time, make device nodes, change the host name or read the kernel log.
    pidfd_open/pidfd_getfd, process_madvise, kcmp, move_pages/migrate_pages and userfaultfd, which
    reach other processes of the same user without any capability, are in the seccomp filter.
(6) However the caller ends (SIGKILL included), nothing of the call survives it by more than a moment:
    the caller starts a guard shell (``_GUARD_SCRIPT``) with a parent-death signal (``setpriv
    --pdeathsig``, so SIGTERM reaches it when the caller's thread dies); the guard starts the program's
    top process with a parent-death SIGKILL (the interpreter, or ``unshare``, whose ``--kill-child``
    takes the PID namespace down) and, on SIGTERM, kills it and removes the call's folder. Folders are
    named after the calling process (``vcpo-sandbox-<pid>-``), so ``leftover_sandboxes`` can tell one
    caller's from another's.

The filter is compiled once, in the calling process, with ``pyseccomp``, a pure-Python ctypes binding
to the system's libseccomp2 (packaged by default on Debian, Ubuntu and RHEL); each child patches its
pid into the BPF program and loads it with one prctl. Landlock is three syscalls made with ctypes. So
both install as ordinary Python dependencies. Sandboxes such as nsjail or bubblewrap are separate
binaries that pip cannot install and, for their full setup, need privileges or setuid; a seccomp
filter and Landlock rules need none once ``no_new_privs`` is set.

The audit hook also refuses ctypes foreign-function lookups and calls, but it is not a security
boundary: Python documents that native code can bypass audit hooks, private C entry points
(``_posixsubprocess.fork_exec``, say) raise no event, and the hook can be switched off from inside the
program. It stops careless code and gives clear error messages; the kernel layers stop hostile code.
"""

from __future__ import annotations

import enum
import errno
import functools
import logging
import marshal
import math
import os
import re
import selectors
import shutil
import signal
import site
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from vcpo.tools import _sandbox_child

logger = logging.getLogger(__name__)

ISOLATIONS = ("auto", "namespaces", "hooks")
_MAIN_FILE = "main.py"
_TEMP_PREFIX = "vcpo-sandbox-"
_FOLDER_NAME = re.compile(rf"{_TEMP_PREFIX}(\d+)-[a-z0-9_]{{8}}")  # tempfile.mkdtemp(prefix=_folder_prefix(pid))
_CHILD_SOURCE = Path(_sandbox_child.__file__).read_text(encoding="utf-8")
_READ_CHUNK = 64 * 1024
_POLL_S = 0.02
# How often hooks isolation measures the work directory against max_disk_mb: a program writing at disk speed
# can exceed the quota by that speed times this interval before it is stopped.
_DISK_POLL_S = 0.05
# How long output is still read after the program exits, for a descendant that keeps the pipes open.
_DRAIN_AFTER_EXIT_S = 0.5
# Tasks that exist in namespaces isolation besides the program: the supervising shell and the interpreter.
_SUPERVISOR_TASKS = 2
_NICENESS = 10
_ALLOW_NO_SECCOMP_ENV = "VCPO_SANDBOX_ALLOW_NO_SECCOMP"
_ALLOW_HOST_FILES_ENV = "VCPO_SANDBOX_ALLOW_HOST_FILES"
# What the program sees of the host, read-only, besides its interpreter: the system's programs and
# shared libraries (the dynamic loader needs its cache), and a few devices. Nothing else of /etc,
# /home, /root, /tmp, /proc (other than its own), /sys or /run.
_SYSTEM_PATHS = ("/usr", "/bin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache")
_DEVICE_PATHS = (
    "/dev/null",
    "/dev/zero",
    "/dev/random",
    "/dev/urandom",
    "/dev/fd",
    "/dev/stdin",
    "/dev/stdout",
    "/dev/stderr",
)
_SYSCONFIG_PATHS = ("stdlib", "platstdlib", "purelib", "platlib")
_NIX_STORE = "/nix/store"
_CHILD_ENV_THREADS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS")

_NAMESPACE_TOOLS = ("unshare", "setpriv", "mount", "umount", "pivot_root", "cp")
# Stands between the caller and the program (docstring, (6)): the program's top process runs in the
# background so that the guard can act on SIGTERM, which it receives when the caller dies; its own exit
# status is the program's (a death by signal N as 128+N). Standard input reaches the program through
# fd 3 (an asynchronous command's stdin would otherwise be /dev/null). The trap first points its own
# output at /dev/null: the dead caller's pipes would end it with SIGPIPE at its first message.
# How the caller starts the guard: with SIGTERM as its parent-death signal.
_GUARD_START = ("setpriv", "--pdeathsig", "TERM", "--")
_GUARD_SCRIPT = r"""
folder=$1
shift
program=
trap 'exec >/dev/null 2>&1; if [ -n "$program" ]; then kill -KILL "$program"; wait "$program"; fi; chmod -R u+rwx "$folder"; rm -rf "$folder"; exit 143' TERM
exec 3<&0
setpriv --pdeathsig KILL -- "$@" <&3 3<&- &
program=$!
exec 3<&-
wait "$program"
"""
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
# Runs as root of the new user namespace, before the interpreter. The parent has laid out in the
# root directory the program's file system: directories, symlinks and empty mount points for the
# listed host paths (``_root_skeleton``), and written an fstab of the binds onto them: the host paths
# read-only, the work directory a size-limited tmpfs (``_write_fstab``) into which the program file is
# copied, so that the program's writes count against its quota and vanish with the namespace. One
# `mount --all` makes every bind (util-linux
# >= 2.27 applies ro to a bind itself; one process instead of one per path saves ~2 ms a path), then
# a /proc of the new PID namespace; the script makes it the root with pivot_root and detaches the old
# one, so that nothing else of the host can be reached by any path. (A /proc mount can be refused where
# the host's own /proc is partly masked, as in containers: the program then has an empty /proc.) The
# private mount propagation of `unshare --mount` keeps all of this invisible outside. `set +e` before
# the program: its failure is the result to report, and `exit $?` (not exec) keeps the shell as PID 1
# so that the interpreter receives SIGXCPU like any process and its death by signal becomes status 128+N.
_NAMESPACE_SETUP_SCRIPT = r"""
set -eu
root=$1; workdir=$2; fstab=$3; main=$4
shift 4
mount --bind "$root" "$root"
mount --all --fstab "$fstab"
cp "$workdir/$main" "$root$workdir/$main"
mount -t proc -o nosuid,nodev,noexec proc "$root/proc" 2>/dev/null || :
cd "$root"
PATH=/usr/sbin:/sbin:$PATH pivot_root . .
umount -l .
mount -o remount,bind,ro /
cd "$workdir"
set +e
setpriv --no-new-privs --bounding-set=-all --inh-caps=-all -- "$@"
exit $?
"""
# Bytes an fstab field writes as \ooo octal escapes (fstab(5)), which libmount reads back.
_FSTAB_ESCAPED_BYTES = frozenset(b" \t\n\\#")


class SandboxStatus(str, enum.Enum):
    """How the program ended. Checked in this order: a limit the parent enforced wins."""

    OK = "ok"  # exit status 0
    ERROR = "error"  # non-zero exit status (an uncaught exception exits with 1)
    TIMEOUT = "timeout"  # wall-clock limit; the parent killed it
    OUTPUT_LIMIT = "output_limit"  # stdout or stderr exceeded max_output_bytes; the parent killed it
    DISK_LIMIT = "disk_limit"  # hooks isolation: its files exceeded max_disk_mb or max_files; the parent killed it
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
    isolation: str  # "namespaces" or "hooks": the isolation that actually ran

    @property
    def ok(self) -> bool:
        return self.status is SandboxStatus.OK

    @property
    def timed_out(self) -> bool:
        return self.status is SandboxStatus.TIMEOUT


# Wall-clock limit of a program when the caller names none: the paper-scale tool's (recipes/tools).
DEFAULT_TIMEOUT_S = 10.0


def run_python(
    code: str,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    cpu_time_s: int | None = None,
    memory_mb: int = 1024,
    max_output_bytes: int = 64 * 1024,
    max_file_mb: int = 16,
    max_disk_mb: int = 64,
    max_files: int = 4096,
    max_processes: int = 16,
    max_open_files: int = 256,
    stdin: str = "",
    site_packages: bool = True,
    isolation: str = "auto",
    syscall_filter: bool = True,
    hide_host_files: bool = True,
) -> SandboxResult:
    """Run ``code`` as ``__main__`` in a confined interpreter and return what it printed.

    Args:
        code: Python source, executed as the file ``main.py`` in a fresh temporary directory.
        timeout_s: wall-clock limit; the whole process group (and namespace) is killed after it.
        cpu_time_s: CPU-time limit (RLIMIT_CPU); defaults to ``ceil(timeout_s)``.
        memory_mb: address-space limit of the interpreter (RLIMIT_AS).
        max_output_bytes: bytes kept per stream; more output stops the program (status output_limit).
        max_file_mb: largest file the program may write (RLIMIT_FSIZE).
        max_disk_mb: all its files together: in namespaces isolation the size of its tmpfs work directory
            (a write beyond it fails with ENOSPC), in hooks isolation the parent polls the directory's size
            every ``_DISK_POLL_S`` and stops the program above it (status disk_limit).
        max_files: files, folders and links it may create (each costs the kernel memory, whatever its size):
            the tmpfs's inodes in namespaces isolation (ENOSPC beyond), polled with the size in hooks isolation.
        max_processes: tasks (processes and threads) the program may add (RLIMIT_NPROC).
        max_open_files: RLIMIT_NOFILE.
        stdin: text fed to the program's standard input.
        site_packages: allow importing installed packages (numpy, sympy, ...), as tool-integrated
            reasoning expects; False adds ``-S`` and leaves only the standard library.
        isolation: "namespaces" (required; RuntimeError if unavailable), "hooks" (no namespaces), or
            "auto" (namespaces when this machine allows them, else hooks with a one-time warning).
        syscall_filter: load the seccomp-bpf filter in the child (required: RuntimeError where it
            cannot be loaded, unless ``VCPO_SANDBOX_ALLOW_NO_SECCOMP=1``); False runs without it.
        hide_host_files: show the program only its interpreter, libraries and directory (required:
            RuntimeError in hooks isolation on a kernel without Landlock, unless
            ``VCPO_SANDBOX_ALLOW_HOST_FILES=1``); False loads no Landlock rules (namespaces isolation
            still builds its minimal root).
    """
    cpu_time_s = cpu_time_s if cpu_time_s is not None else max(1, math.ceil(timeout_s))
    _check_limits(timeout_s=timeout_s, cpu_time_s=cpu_time_s, memory_mb=memory_mb, max_output_bytes=max_output_bytes,
                  max_file_mb=max_file_mb, max_disk_mb=max_disk_mb, max_files=max_files, max_processes=max_processes,
                  max_open_files=max_open_files)
    _check_guard()
    use_namespaces = _use_namespaces(isolation)
    seccomp = _seccomp_config(syscall_filter)
    confine_files = _landlock_wanted(hide_host_files, use_namespaces)
    rlimits = _rlimits(cpu_time_s, memory_mb, max_file_mb, _process_budget(max_processes, use_namespaces), max_open_files)
    with _private_dirs() as (workdir, root), _stdin_file(stdin) as stdin_handle:
        (workdir / _MAIN_FILE).write_text(code, encoding="utf-8", errors="replace")
        child = {"rlimits": rlimits, "seccomp": seccomp, "landlock": _landlock_rules(workdir) if confine_files else None}
        command = _guarded_command(workdir, root, child, site_packages, use_namespaces, max_disk_mb, max_files)
        disk_used = None if use_namespaces else functools.partial(_directory_usage, workdir)
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
            capture = _capture_output(process, started + timeout_s, max_output_bytes, disk_used, max_disk_mb << 20,
                                      max_files + 1)  # main.py is the first entry
        finally:
            _kill_process_group(process)
        wall_time_s = time.monotonic() - started
    return _make_result(capture, process.returncode, use_namespaces, wall_time_s)


def _rlimits(cpu_time_s: int, memory_mb: int, max_file_mb: int, processes: int, max_open_files: int) -> dict:
    """The child's resource limits (soft, hard), which it sets on itself before the program starts; no core dumps."""
    return {
        "RLIMIT_CPU": [cpu_time_s, cpu_time_s + 1],
        "RLIMIT_AS": [memory_mb << 20] * 2,
        "RLIMIT_FSIZE": [max_file_mb << 20] * 2,
        "RLIMIT_NPROC": [processes] * 2,
        "RLIMIT_NOFILE": [max_open_files] * 2,
        "RLIMIT_CORE": [0, 0],
    }


def _guarded_command(workdir: Path, root: Path, child: dict, site_packages: bool, use_namespaces: bool,
                     max_disk_mb: int, max_files: int) -> list[str]:
    """The command that runs the program: the interpreter with the child's bootstrap configuration (``child``: its
    rlimits, seccomp filter and Landlock rules), inside the namespaces where they are used, under the guard that
    deletes ``workdir``'s folder whatever happens to the caller."""
    config = {"workdir": str(workdir), "main": _MAIN_FILE, "rlimits": child["rlimits"], "niceness": _NICENESS,
              "seccomp": child["seccomp"], "landlock": child["landlock"]}
    command = _interpreter_command(config, site_packages)
    if use_namespaces:
        command = _in_namespaces(command, workdir, root, max_disk_mb, max_files)
    return [*_GUARD_START, "sh", "-c", _GUARD_SCRIPT, "sandbox-guard", str(workdir.parent), *command]


def namespaces_available() -> bool:
    """Whether this machine lets the sandbox run in its own user, mount, network and PID namespaces."""
    return _probe_namespaces()


def leftover_sandboxes(caller: int | None = None) -> tuple[list[int], list[str]]:
    """Pids of processes still running a sandbox program and sandbox directories still in the temporary
    directory, of every caller or of the process ``caller``; both are empty whenever no ``run_python``
    call (of that caller) is in progress."""
    prefix = _TEMP_PREFIX if caller is None else _folder_prefix(caller)
    pids = []
    for entry in os.scandir("/proc"):
        try:
            if entry.name.isdigit() and prefix.encode() in Path(entry.path, "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:  # the process ended while we looked
            continue
    directories = sorted(name for name, _ in _sandbox_folders() if name.startswith(prefix))
    return pids, directories


def _sandbox_folders() -> list[tuple[str, int]]:
    """(name, caller pid) of the temporary directory's sandbox folders: real directories of this user whose name is
    ``mkdtemp``'s for a caller in full. A link, a file or another user's entry by such a name is not one."""
    temporary, found = tempfile.gettempdir(), []
    for name in os.listdir(temporary):
        match = _FOLDER_NAME.fullmatch(name)
        if match is None:
            continue
        try:
            status = os.lstat(os.path.join(temporary, name))
        except FileNotFoundError:  # removed while we looked
            continue
        if stat.S_ISDIR(status.st_mode) and status.st_uid == os.getuid():
            found.append((name, int(match.group(1))))
    return found


def _folder_prefix(caller: int) -> str:
    return f"{_TEMP_PREFIX}{caller}-"


def _check_limits(**limits: float) -> None:
    for name, value in limits.items():
        if not value > 0:
            raise ValueError(f"run_python: {name} must be positive, got {value!r}")


class SandboxUnavailableError(RuntimeError):
    """`run_python` cannot start a program on this machine (what is missing is named)."""


def check_sandbox() -> None:
    """SandboxUnavailableError naming what is missing when `run_python` could not start a program here."""
    _check_guard()


@functools.lru_cache(maxsize=1)
def _check_guard() -> None:
    """The guard needs ``setpriv --pdeathsig`` (util-linux >= 2.33); without it a program could outlive
    its caller, so the sandbox refuses to start."""
    try:
        ok = subprocess.run([*_GUARD_START, "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    if not ok:
        raise SandboxUnavailableError(
            "run_python: `setpriv --pdeathsig` (util-linux >= 2.33) is needed so that a sandboxed program "
            "cannot outlive its caller; install util-linux"
        )


def _use_namespaces(isolation: str) -> bool:
    if isolation not in ISOLATIONS:
        raise ValueError(f"run_python: isolation must be one of {ISOLATIONS}, got {isolation!r}")
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
    search_path = f"/usr/sbin:/sbin:{os.environ.get('PATH', '/usr/bin:/bin')}"
    missing = [tool for tool in _NAMESPACE_TOOLS if shutil.which(tool, path=search_path) is None]
    if missing:
        logger.warning("sandbox: %s not found; running untrusted code with hooks and rlimits only", missing)
        return False
    with _private_dirs() as (workdir, root):
        (workdir / _MAIN_FILE).touch()
        probe = _in_namespaces([sys.executable, "-I", "-S", "-c", "pass"], workdir, root, max_disk_mb=1)
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
    """Compile the filter here, load it once in a throwaway child; cache (the child's seccomp config, or
    None, and why)."""
    try:
        import pyseccomp

        program = _sandbox_child.compile_syscall_filter(pyseccomp)
    except (ImportError, OSError, RuntimeError) as exc:  # pyseccomp raises RuntimeError without libseccomp
        return None, f"pyseccomp unavailable: {exc!r}"
    seccomp = {"program": program}
    config = {"main": _MAIN_FILE, "rlimits": {}, "niceness": 0, "seccomp": seccomp, "landlock": None}
    with _private_dirs() as (workdir, _root):
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
def _private_dirs() -> Iterator[tuple[Path, Path]]:
    """A fresh temporary directory with the program's work directory and an empty mount point, on
    which namespaces isolation builds the program's root; deleted afterwards. Folders of callers that died before
    their guard could remove them (a kill between the folder and the guard's start) are removed first."""
    _remove_dead_callers_folders()
    base = Path(tempfile.mkdtemp(prefix=_folder_prefix(os.getpid()))).resolve()
    try:
        (base / "work").mkdir()
        (base / "root").mkdir()
        yield base / "work", base / "root"
    finally:
        _remove_tree(base)


def _remove_dead_callers_folders() -> None:
    """Remove every sandbox folder whose calling process has ended and that no process still uses (a guard
    cleaning up names its folder in its command line)."""
    temporary = Path(tempfile.gettempdir())
    for name, caller in _sandbox_folders():
        if not _process_exists(caller) and not leftover_sandboxes(caller)[0]:
            _remove_tree_if_present(temporary / name)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _remove_tree_if_present(path: Path) -> None:
    try:
        _remove_tree(path)
    except FileNotFoundError:  # another caller swept it first
        pass


def _remove_tree(path: Path) -> None:
    """Delete the directory ``path`` and everything under it, even parts the program made read-only or unreadable:
    one directory open at a time, reached by name from its parent and left through ``..`` (no recursion, no path
    length, so a tree of any depth goes), links removed and never followed, and modes changed only below ``path``."""
    names: list[str] = []  # from path down to the directory open now
    if not stat.S_ISDIR(os.lstat(path).st_mode):
        raise NotADirectoryError(f"{path}: not a directory")
    os.chmod(path, stat.S_IRWXU)  # the sandbox's own folder, which the program may have locked
    folder = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        while True:
            child = _first_subfolder_emptied_of_files(folder)
            if child is not None:
                os.chmod(child, stat.S_IRWXU, dir_fd=folder)  # a real directory (lstat), below path
                inner = os.open(child, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=folder)
                os.close(folder)
                folder, names = inner, [*names, child]
                continue
            if not names:
                break
            parent = os.open("..", os.O_RDONLY | os.O_DIRECTORY, dir_fd=folder)
            os.close(folder)
            folder = parent
            os.rmdir(names.pop(), dir_fd=folder)
    finally:
        os.close(folder)
    os.rmdir(path)


def _first_subfolder_emptied_of_files(folder: int) -> str | None:
    """Unlink every entry of the open directory ``folder`` that is not a directory (links included); the name of its
    first subdirectory, or None when none is left."""
    with os.scandir(folder) as scan:
        entries = list(scan)  # read whole before unlinking: a directory changed while read may skip entries
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            return entry.name
        os.unlink(entry.name, dir_fd=folder)
    return None


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
    # The work directory in clear after the config marks the process as this call's (leftover_sandboxes).
    flags = ["-I", "-B", "-u", "-X", "utf8"] + ([] if site_packages else ["-S"])
    return [sys.executable, *flags, "-c", _CHILD_SOURCE, marshal.dumps(config).hex(), config["workdir"]]


def _in_namespaces(command: list[str], workdir: Path, root: Path, max_disk_mb: int, max_files: int = 4096) -> list[str]:
    """``command`` run in new namespaces with ``root`` as its file system (laid out here, its mounts in an
    fstab beside it, outside what the program sees)."""
    fstab = _write_fstab(root.parent / "binds.fstab", root, _root_skeleton(root, workdir), workdir, max_disk_mb, max_files)
    setup = ["sh", "-c", _NAMESPACE_SETUP_SCRIPT, "sandbox-setup", str(root), str(workdir), str(fstab), _MAIN_FILE]
    return [*_NAMESPACE_COMMAND, *setup, *command]


def _write_fstab(path: Path, root: Path, read_only: list[str], workdir: Path, max_disk_mb: int, max_files: int) -> Path:
    """An fstab binding each of ``read_only`` onto its place under ``root`` read-only, then a tmpfs of
    ``max_disk_mb`` and ``max_files`` entries (its root and main.py besides) at ``workdir``'s place."""
    binds = [
        b"%s %s none bind,ro 0 0\n" % (_fstab_field(source), _fstab_field(str(root) + source)) for source in read_only
    ]
    work = b"tmpfs %s tmpfs size=%dm,nr_inodes=%d,mode=0700,nosuid,nodev 0 0\n" % (
        _fstab_field(str(root) + str(workdir)), max_disk_mb, max_files + 2)
    path.write_bytes(b"".join(binds) + work)
    return path


def _fstab_field(path: str) -> bytes:
    """``path`` as an fstab field: its file-system bytes (any encoding), separators escaped."""
    return b"".join(b"\\%03o" % byte if byte in _FSTAB_ESCAPED_BYTES else bytes([byte]) for byte in os.fsencode(path))


def _root_skeleton(root: Path, workdir: Path) -> list[str]:
    """Lay out in ``root`` the program's file system: the visible host paths as symlinks (copied) or
    as empty mount points, plus mount points for the work directory and /proc. Returns the host paths
    to bind onto their mount points."""
    binds = []
    for path in _visible_paths():
        inside = root / path.lstrip("/")
        inside.parent.mkdir(parents=True, exist_ok=True)
        if os.path.islink(path):
            inside.symlink_to(os.readlink(path))
            continue
        if os.path.isdir(path):
            inside.mkdir()
        else:
            inside.touch()
        binds.append(path)
    (root / str(workdir).lstrip("/")).mkdir(parents=True)
    (root / "proc").mkdir()
    return binds


def _landlock_wanted(hide_host_files: bool, use_namespaces: bool) -> bool:
    """Whether the child loads Landlock rules; RuntimeError where host files would stay visible."""
    if not hide_host_files:
        return False
    if _landlock_abi() >= 1:
        return True
    if use_namespaces:  # the namespace root alone holds only the visible paths
        return False
    if os.environ.get(_ALLOW_HOST_FILES_ENV) == "1":
        _warn_once("sandbox: the program can read every file the calling user can (no Landlock, no namespaces)")
        return False
    raise RuntimeError(
        "run_python: in hooks isolation only Landlock can keep the program away from the host's files (home "
        "directories, credentials, other processes' /proc entries, the caller's environment), and this "
        "kernel does not provide it (Linux >= 5.13 with landlock in the lsm= list). Use namespaces "
        "isolation, or opt in explicitly with hide_host_files=False or "
        f"{_ALLOW_HOST_FILES_ENV}=1"
    )


@functools.lru_cache(maxsize=1)
def _landlock_abi() -> int:
    return _sandbox_child.landlock_abi()


def _landlock_rules(workdir: Path) -> list:
    """The child's Landlock rules: the visible host paths read-only, its own /proc entry, the work
    directory with every right."""
    read = [[path, _sandbox_child.LANDLOCK_READ] for path in _visible_paths() if not os.path.islink(path)]
    devices = [[path, _sandbox_child.LANDLOCK_READ_WRITE] for path in sorted(_sandbox_child.WRITABLE_DEVICES)]
    own = [["/proc/self", _sandbox_child.LANDLOCK_READ], [str(workdir), _sandbox_child.LANDLOCK_ALL]]
    return read + devices + own


@functools.lru_cache(maxsize=1)
def _visible_paths() -> tuple[str, ...]:
    """Host paths the program may read: system programs and libraries, this interpreter (prefixes,
    standard library, site-packages) and a few devices, with every symlink met on the way to them
    (so that the interpreter's own paths resolve in the namespace root). Sorted; nothing listed lies
    under a listed directory."""
    interpreter = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix, os.path.dirname(sys.executable)}
    interpreter.update(site.getsitepackages())
    interpreter.update(sysconfig.get_paths()[name] for name in _SYSCONFIG_PATHS)
    # A Nix interpreter links its libraries from other store paths; the store is world-readable by design.
    if any(path.startswith(_NIX_STORE + "/") for path in interpreter):
        interpreter.add(_NIX_STORE)
    # Devices are taken as they are: /dev/fd and /dev/std* link to /proc/self, which is the program's own.
    listed = {path for path in _DEVICE_PATHS if os.path.lexists(path)}
    for path in (*_SYSTEM_PATHS, *sorted(interpreter)):
        if os.path.lexists(path):
            listed.update(_resolution_chain(path))
    home = os.path.realpath(os.path.expanduser("~"))
    visible, directories = [], []
    for path in sorted(listed):
        if any(path.startswith(directory + "/") for directory in directories):
            continue
        if path == "/" or home == path or home.startswith(path + "/"):
            raise RuntimeError(
                f"run_python: the interpreter's files lie in {path!r}, which contains the home directory "
                f"{home!r}; the sandbox cannot show one without the other. Install Python elsewhere."
            )
        visible.append(path)
        if os.path.isdir(path) and not os.path.islink(path):
            directories.append(path)
    return tuple(visible)


def _resolution_chain(path: str) -> list[str]:
    """``path`` resolved one component at a time: each symlink met (at its resolved location), then
    the real path it leads to."""
    links, resolved, pending = [], "/", [part for part in path.split("/") if part]
    while pending:
        part = pending.pop(0)
        if part in (".", ".."):
            resolved = resolved if part == "." else os.path.dirname(resolved)
            continue
        candidate = os.path.join(resolved, part)
        if not os.path.islink(candidate):
            resolved = candidate
            continue
        if len(links) >= 40:  # the kernel's limit (ELOOP)
            raise OSError(errno.ELOOP, "too many symbolic links", path)
        links.append(candidate)
        target = os.readlink(candidate)
        resolved = "/" if target.startswith("/") else resolved
        pending[:0] = [part for part in target.split("/") if part]
    return [*links, resolved]


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


def _capture_output(
    process: subprocess.Popen, deadline: float, max_bytes: int, disk_used=None, max_disk_bytes: int = 0,
    max_entries: int = 0,
) -> _Capture:
    """Read both pipes until the program exits, the deadline passes, a stream exceeds ``max_bytes`` or
    ``disk_used()`` (bytes, entries; polled every ``_DISK_POLL_S``, if given) exceeds ``max_disk_bytes`` or
    ``max_entries``."""
    buffers = {process.stdout.fileno(): bytearray(), process.stderr.fileno(): bytearray()}
    truncated = dict.fromkeys(buffers, False)
    stopped_by = None
    drain_until = None
    next_disk_check = time.monotonic()
    with selectors.DefaultSelector() as selector:
        for fd in buffers:
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_READ)
        while stopped_by is None:
            now = time.monotonic()
            if now >= deadline:
                stopped_by = SandboxStatus.TIMEOUT
                break
            if disk_used is not None and now >= next_disk_check:
                next_disk_check = now + _DISK_POLL_S
                used, entries = disk_used()
                if used > max_disk_bytes or entries > max_entries:
                    stopped_by = SandboxStatus.DISK_LIMIT
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


def _directory_usage(path: Path) -> tuple[int, int]:
    """Disk space taken by everything under ``path`` (allocated blocks; links not followed), and its entries: one
    directory open at a time, as ``_remove_tree`` walks, so any depth is measured."""
    total = entries = 0
    try:
        folder = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:  # gone, or made unreadable: nothing to count
        return 0, 0
    pending = [os.listdir(folder)]  # per open level, the names still to look at
    try:
        while pending:
            if not pending[-1]:
                pending.pop()
                if pending:
                    parent = os.open("..", os.O_RDONLY | os.O_DIRECTORY, dir_fd=folder)
                    os.close(folder)
                    folder = parent
                continue
            name = pending[-1].pop()
            try:
                status = os.stat(name, dir_fd=folder, follow_symlinks=False)
            except OSError:  # removed while we looked
                continue
            entries += 1
            total += status.st_blocks * 512
            if not stat.S_ISDIR(status.st_mode):
                continue
            try:
                inner = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=folder)
            except OSError:  # removed, or made unreadable: its own entries are not counted
                continue
            try:
                names = os.listdir(inner)
            except OSError:
                os.close(inner)
                continue
            os.close(folder)
            folder = inner
            pending.append(names)
    finally:
        os.close(folder)
    return total, entries


def _has_exited(process: subprocess.Popen) -> bool:
    # WNOWAIT leaves the child unreaped, so its pid (= the process group id) cannot be reused
    # by an unrelated process before _kill_process_group runs.
    return os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _kill_process_group(process: subprocess.Popen) -> None:
    """SIGKILL everything left in the program's process group (in namespaces isolation, its PID namespace
    dies with it), then reap the child and close the pipes."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()
    process.stdout.close()
    process.stderr.close()


def _make_result(capture: _Capture, returncode: int, used_namespaces: bool, wall_time_s: float) -> SandboxResult:
    exit_code, signal_number = _split_returncode(returncode)
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


def _split_returncode(returncode: int) -> tuple[int | None, int | None]:
    """(exit code, signal) from a Popen return code; the guard shell reports death by signal N as 128+N."""
    if returncode < 0:
        return None, -returncode
    if returncode > 128:
        return None, returncode - 128
    return returncode, None
