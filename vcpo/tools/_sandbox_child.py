"""Bootstrap that runs inside the sandbox interpreter, before the model's code.

The parent (``vcpo.tools.sandbox``) passes this file's source with ``python -I -c`` and one argument,
its config in ``marshal`` format (hex): the same interpreter reads it, and unlike json and base64 the
module is built in, so that a tool call does not pay for importing them (~5 ms of a ~50 ms call). It
lowers the resource limits, installs an audit hook that refuses writes outside the work directory,
subprocesses, signals to other processes and network access, and then executes ``main.py`` from the
work directory as ``__main__``. Before the audit hook, and before any of the program's code, it loads
a seccomp-bpf syscall filter (``install_syscall_filter``) and Landlock file access rules
(``install_landlock``) that the kernel enforces on this process and everything it could start.

The audit hook is defence in depth, not a security boundary: Python documents that audit hooks can be
bypassed by native code (``ctypes``). The operating-system layers set up by the parent (namespaces,
a minimal read-only root, resource limits), the seccomp filter and the Landlock rules are what a
determined program cannot undo.

Importing this module has no side effects; the parent imports it only to read the constants below.
"""

import builtins
import ctypes
import errno
import marshal
import os
import resource
import stat
import sys
import threading

# Exit status that tells the parent the program died of MemoryError under the address-space limit.
MEMORY_ERROR_EXIT_CODE = 121
# Exit status of a bootstrap that could not confine the program; the program did not run.
SETUP_FAILED_EXIT_CODE = 122

# seccomp-bpf policy: default ALLOW; these syscalls fail with EPERM (an OSError in Python, not a
# killed process). New processes and program execution:
_SECCOMP_PROCESS_SYSCALLS = ("execve", "execveat", "fork", "vfork")
# Sockets: with no socket() there is no network (nor a host Unix socket) to reach. socketpair()
# stays allowed: it connects two descriptors of this process only, and asyncio needs it.
_SECCOMP_NETWORK_SYSCALLS = ("socket", "connect", "bind", "listen", "accept", "accept4")
# Privilege, namespace, kernel-module, tracing and key-ring operations; io_uring, whose queued
# operations (socket, connect, open) would not pass through this filter; signals sent by thread id.
_SECCOMP_PRIVILEGED_SYSCALLS = (
    "ptrace", "process_vm_readv", "process_vm_writev",
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns",
    "setuid", "setgid", "setreuid", "setregid", "setresuid", "setresgid", "setgroups", "setfsuid", "setfsgid",
    "capset", "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "bpf", "perf_event_open", "keyctl", "add_key", "request_key", "personality",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "tkill", "pidfd_send_signal",
    "open_tree", "open_tree_attr", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
    # Reaching into another process of the same user needs no capability: file descriptors through a
    # pidfd, memory placement, kernel-object comparison. userfaultfd mostly serves kernel exploits.
    "pidfd_open", "pidfd_getfd", "process_madvise", "kcmp", "move_pages", "migrate_pages", "userfaultfd",
)  # fmt: skip
# File metadata, which Landlock does not govern: without these rules a program in hooks isolation could
# chmod, chown, touch or tag any file the calling user owns.
_SECCOMP_METADATA_SYSCALLS = (
    "chmod", "fchmod", "fchmodat", "fchmodat2", "chown", "fchown", "lchown", "fchownat",
    "utime", "utimes", "futimesat", "utimensat",
    "setxattr", "lsetxattr", "fsetxattr", "setxattrat", "removexattr", "lremovexattr", "fremovexattr", "removexattrat",
)  # fmt: skip
# Syscalls newer than some libseccomp releases know, by their number in the unified syscall table
# (the same on every architecture).
_UNIFIED_SYSCALL_NUMBERS = {"fchmodat2": 452, "setxattrat": 463, "removexattrat": 466, "open_tree_attr": 467}
# Signals: these take the target process as their first argument; only this process is allowed.
_SECCOMP_OWN_PID_SYSCALLS = ("kill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo")
_CLONE_THREAD = 0x00010000

# Landlock (Linux >= 5.13): unprivileged, stackable file-access rules that hold for this process and
# its descendants, whoever owns the files. The three syscalls have the same numbers on every
# architecture that has them (the unified syscall table).
_LANDLOCK_CREATE_RULESET, _LANDLOCK_ADD_RULE, _LANDLOCK_RESTRICT_SELF = 444, 445, 446
_LANDLOCK_CREATE_RULESET_VERSION = 1
_LANDLOCK_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
_BPF_INSTRUCTION_BYTES = 8
# Stands for the child's pid in the compiled filter: above PID_MAX_LIMIT (2**22), so never a real pid,
# and unlike any syscall number, architecture, errno or flag constant of the program.
PID_PLACEHOLDER = 0x5EC05EC0
_PR_CAPBSET_DROP, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 24, 47, 4
_CAPABILITY_VERSION_3 = 0x20080522
_CAP_SETPCAP = 8
_FS_EXECUTE, _FS_WRITE_FILE, _FS_READ_FILE, _FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_FS_REFER, _FS_TRUNCATE = 1 << 13, 1 << 14  # Landlock ABI 2 and 3
_FS_ABI1 = (1 << 13) - 1  # execute ... make_sym: every right of the first ABI
# Rights that apply to a file, as opposed to a directory's entries.
_FS_FILE_RIGHTS = _FS_EXECUTE | _FS_WRITE_FILE | _FS_READ_FILE | _FS_TRUNCATE
_NET_BIND_TCP, _NET_CONNECT_TCP = 1 << 0, 1 << 1  # ABI 4
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6
LANDLOCK_READ = _FS_EXECUTE | _FS_READ_FILE | _FS_READ_DIR
LANDLOCK_READ_WRITE = _FS_READ_FILE | _FS_WRITE_FILE | _FS_TRUNCATE
LANDLOCK_ALL = -1  # every right the running kernel handles

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
# Devices the program may open for writing, outside its work directory.
WRITABLE_DEVICES = frozenset({os.devnull})

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


def compile_syscall_filter(seccomp) -> bytes:
    """The seccomp-bpf filter's BPF program (``struct sock_filter`` array, native byte order).

    Built once in the parent with ``pyseccomp``, with ``PID_PLACEHOLDER`` in the own-process rules;
    the child only patches in its pid and loads it (``install_syscall_filter``), so that it needs
    neither pyseccomp nor libseccomp.
    """
    import tempfile

    eperm = seccomp.ERRNO(errno.EPERM)
    syscall_filter = seccomp.SyscallFilter(seccomp.ALLOW)
    # A syscall of another ABI (int 0x80 on x86-64) would dodge the rules, which name native numbers.
    syscall_filter.set_attr(seccomp.Attr.ACT_BADARCH, seccomp.KILL_PROCESS)
    refused = (
        _SECCOMP_PROCESS_SYSCALLS
        + _SECCOMP_NETWORK_SYSCALLS
        + _SECCOMP_PRIVILEGED_SYSCALLS
        + _SECCOMP_METADATA_SYSCALLS
    )
    for name in refused:
        number = seccomp.resolve_syscall(seccomp.Arch.NATIVE, name)
        number = number if number >= 0 else _UNIFIED_SYSCALL_NUMBERS.get(name, -1)
        if number >= 0:  # else: no such syscall on this architecture (fork on aarch64, say)
            syscall_filter.add_rule(eperm, number)
    # clone() starts a thread when CLONE_THREAD is set (threading, OpenBLAS), a process otherwise.
    # The flags are the first argument on x86-64 and aarch64 (not on s390x, which swaps the two).
    syscall_filter.add_rule(eperm, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, _CLONE_THREAD, 0))
    # clone3() passes its flags in memory, which seccomp cannot read. ENOSYS makes glibc fall back to
    # clone(), which the rule above checks.
    syscall_filter.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    for name in _SECCOMP_OWN_PID_SYSCALLS:
        syscall_filter.add_rule(eperm, name, seccomp.Arg(0, seccomp.NE, PID_PLACEHOLDER))
    with tempfile.TemporaryFile() as handle:
        syscall_filter.export_bpf(handle)
        handle.seek(0)
        return handle.read()


def install_syscall_filter(program: bytes) -> None:
    """Load a program of ``compile_syscall_filter`` into this process, with its own pid patched in.

    ``no_new_privs`` first: it is what lets an unprivileged process load a filter, and it stops a
    set-uid binary from gaining privileges. The filter holds for every thread started afterwards
    (this runs before the program starts any) and every child.
    """
    instructions = bytearray(program)
    placeholder = PID_PLACEHOLDER.to_bytes(4, sys.byteorder)
    for offset in range(0, len(instructions), _BPF_INSTRUCTION_BYTES):
        constant = slice(offset + 4, offset + 8)  # struct sock_filter {u16 code; u8 jt, jf; u32 k}
        if instructions[constant] == placeholder:
            instructions[constant] = os.getpid().to_bytes(4, sys.byteorder)
    buffer = (ctypes.c_char * len(instructions)).from_buffer(instructions)
    fprog = _SockFprog(len(instructions) // _BPF_INSTRUCTION_BYTES, ctypes.cast(buffer, ctypes.c_void_p))
    libc = _libc()
    _checked(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    _checked(libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "prctl(PR_SET_SECCOMP)")


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class _CapabilityHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapabilityData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def drop_capabilities() -> None:
    """Give up every capability for good (a no-op for an ordinary user).

    Run as root without namespaces, the program would otherwise keep root's powers that no file rule
    covers: raising its own resource limits, real-time scheduling, renicing below the caller, device
    nodes, the host name, the kernel log, opening files by handle. Without capabilities, uid 0 is an
    ordinary owner of files, and Landlock decides which of them it can reach.
    """
    libc = _libc()
    header = _CapabilityHeader(version=_CAPABILITY_VERSION_3, pid=0)
    current = (_CapabilityData * 2)()
    _checked(libc.capget(ctypes.byref(header), current), "capget")
    if current[0].effective & (1 << _CAP_SETPCAP):  # empty the bounding set too: nothing to regain on exec
        capability = 0
        while libc.prctl(_PR_CAPBSET_DROP, capability, 0, 0, 0) == 0:
            capability += 1
    libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)  # EINVAL before Linux 4.3: none then
    _checked(libc.capset(ctypes.byref(header), (_CapabilityData * 2)()), "capset")


class _LandlockRulesetAttr(ctypes.Structure):
    # struct landlock_ruleset_attr; older kernels accept it whole as long as the fields they do not
    # know are zero.
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


class _LandlockPathBeneathAttr(ctypes.Structure):
    _pack_ = 1  # struct landlock_path_beneath_attr is __packed
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def landlock_abi() -> int:
    """The Landlock ABI version of the running kernel; 0 where Landlock is missing or disabled."""
    version = _libc().syscall(
        _LANDLOCK_CREATE_RULESET,
        ctypes.c_void_p(None),
        ctypes.c_size_t(0),
        ctypes.c_uint32(_LANDLOCK_CREATE_RULESET_VERSION),
    )
    return max(int(version), 0)


def _checked(result: int, what: str) -> int:
    if result < 0:
        error = ctypes.get_errno()
        raise OSError(error, f"{what}: {os.strerror(error)}")
    return result


def install_landlock(rules: list) -> None:
    """Restrict this process (and its descendants) to the files in ``rules``, irrevocably.

    ``rules`` holds ``[path, rights]`` pairs: the rights (``LANDLOCK_READ``, ``LANDLOCK_READ_WRITE``,
    ``LANDLOCK_ALL``) hold for ``path`` and everything beneath it; anything not beneath a rule path
    cannot be read, listed, written, created or executed. Missing paths are skipped. Where the
    kernel's ABI allows it, TCP bind/connect, connections to abstract Unix sockets and signals to
    processes outside this sandbox are refused as well.
    """
    abi = landlock_abi()
    if abi < 1:
        raise OSError(errno.EOPNOTSUPP, "Landlock is not available in this kernel")
    libc = _libc()
    handled_fs = _FS_ABI1 | (_FS_REFER if abi >= 2 else 0) | (_FS_TRUNCATE if abi >= 3 else 0)
    attr = _LandlockRulesetAttr(
        handled_access_fs=handled_fs,
        handled_access_net=(_NET_BIND_TCP | _NET_CONNECT_TCP) if abi >= 4 else 0,
        scoped=(_SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL) if abi >= 6 else 0,
    )
    ruleset = _checked(
        libc.syscall(
            _LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)), ctypes.c_uint32(0)
        ),
        "landlock_create_ruleset",
    )
    try:
        for path, rights in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                allowed = handled_fs & rights
                if not stat.S_ISDIR(os.fstat(fd).st_mode):
                    allowed &= _FS_FILE_RIGHTS
                rule = _LandlockPathBeneathAttr(allowed_access=allowed, parent_fd=fd)
                _checked(
                    libc.syscall(
                        _LANDLOCK_ADD_RULE,
                        ctypes.c_int(ruleset),
                        ctypes.c_int(_LANDLOCK_RULE_PATH_BENEATH),
                        ctypes.byref(rule),
                        ctypes.c_uint32(0),
                    ),
                    f"landlock_add_rule({path!r})",
                )
            finally:
                os.close(fd)
        _checked(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
        _checked(
            libc.syscall(_LANDLOCK_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)), "landlock_restrict_self"
        )
    finally:
        os.close(ruleset)


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
        return resolved in WRITABLE_DEVICES or os.path.commonpath([resolved, workdir]) == workdir

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
    # The interpreter's own display of an uncaught exception (C code: no `traceback` import, ~7 ms
    # of every call); it shows the exception's own traceback, so that is cut to start where wanted.
    sys.__excepthook__(type(exc), exc, exc.with_traceback(traceback_start).__traceback__)


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
    layer = "dropping capabilities"
    try:
        drop_capabilities()  # before the filter, which refuses capset
        if config["seccomp"] is not None:
            layer = "installing the seccomp syscall filter"
            install_syscall_filter(config["seccomp"]["program"])
        if config["landlock"] is not None:
            layer = "installing the Landlock file rules"
            install_landlock(config["landlock"])
    except Exception as exc:  # noqa: BLE001 - fail closed: unconfined, the program must not run
        print(f"sandbox: cannot confine the program ({layer}): {exc!r}", file=sys.stderr)
        return SETUP_FAILED_EXIT_CODE
    workdir = config["workdir"]
    sys.path.insert(0, workdir)
    sys.argv = [config["main"]]
    sys.addaudithook(make_audit_hook(workdir))
    return run_main(os.path.join(workdir, config["main"]))


if __name__ == "__main__":
    sys.exit(main(marshal.loads(bytes.fromhex(sys.argv[1]))))
