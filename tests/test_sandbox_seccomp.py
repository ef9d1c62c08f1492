"""The seccomp-bpf filter stops, in the kernel, what native code or a bypassed audit hook would do."""

import errno
import logging
import os
import sys
import textwrap

import pytest
import test_sandbox

from vcpo.tools import sandbox
from vcpo.tools.sandbox import SandboxStatus, run_python

# The fixtures of test_sandbox: every isolation, checking that no process or directory is left
# behind; a TCP server on the caller's loopback.
isolation = test_sandbox.isolation

# Prepended to a program: switches the audit hook off for the main thread through its own
# re-entry guard (reachable with gc), as hostile code could, so that only the kernel's filter remains.
DISABLE_AUDIT_HOOK = """
import gc, threading
for _obj in gc.get_objects():
    if type(_obj).__name__ == "function" and _obj.__name__ == "hook" and _obj.__closure__:
        for _cell in _obj.__closure__:
            if isinstance(_cell.cell_contents, threading.local):
                _cell.cell_contents.active = True
"""
EPERM_LINE = f"{errno.EPERM}\n"


def run_unhooked(code: str, isolation: str, **kwargs):
    return run_python(DISABLE_AUDIT_HOOK + textwrap.dedent(code), isolation=isolation, **kwargs)


def test_the_hook_bypass_works_so_the_kernel_is_what_refuses(isolation):
    # Without the filter, the same program gets past the hook: the tests below exercise the kernel.
    code = "import ctypes\nprint(ctypes.CDLL(None).getpid() > 0)"
    assert "calling native code" in run_python(code, isolation=isolation).stderr
    assert run_unhooked(code, isolation).stdout == "True\n"


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the private fork_exec signature below is CPython 3.11's")
def test_posixsubprocess_fork_exec_cannot_start_a_shell(isolation):
    # A private C entry point that raises no audit event: the hook never sees it. (Its signature
    # is that of CPython 3.11's subprocess module.)
    code = """
        import _posixsubprocess, os
        errpipe_read, errpipe_write = os.pipe()
        try:
            pid = _posixsubprocess.fork_exec(
                [b"/bin/sh", b"-c", b"echo escaped"], [b"/bin/sh"], True, (errpipe_write,), None, None,
                -1, -1, -1, -1, -1, -1, errpipe_read, errpipe_write, False, False, -1, None, None, None, -1,
                None, True,
            )
            os.waitpid(pid, 0)
            print("started")
        except OSError as error:
            print(error.errno)
    """
    result = run_python(textwrap.dedent(code), isolation=isolation)
    assert result.stdout == EPERM_LINE, result.stderr
    unfiltered = run_python(textwrap.dedent(code), isolation=isolation, syscall_filter=False)
    assert unfiltered.stdout == "escaped\nstarted\n", unfiltered.stderr  # the hole the filter closes


def test_fork_through_ctypes_fails(isolation):
    code = """
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        print(libc.fork(), ctypes.get_errno())
    """
    result = run_unhooked(code, isolation)
    assert result.stdout == f"-1 {errno.EPERM}\n", result.stderr


def test_fork_bomb_through_ctypes_starts_nothing(isolation):
    code = """
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        forked = 0
        for _ in range(200):
            pid = libc.fork()
            if pid == 0:
                os._exit(0)
            forked += pid > 0
        print(forked, ctypes.get_errno())
    """
    result = run_unhooked(code, isolation, timeout_s=5)
    assert result.stdout == f"0 {errno.EPERM}\n", result.stderr


def test_copied_binary_cannot_be_executed(isolation):
    code = """
        import os
        with open("/bin/true", "rb") as source, open(os.open("mytrue", os.O_WRONLY | os.O_CREAT, 0o755), "wb") as copy:
            copy.write(source.read())
        try:
            os.execv("./mytrue", ["mytrue"])
        except OSError as error:
            print(error.errno)
    """
    result = run_unhooked(code, isolation)
    assert result.stdout == EPERM_LINE, result.stderr


def test_sockets_to_the_callers_loopback_or_a_host_unix_socket_fail(isolation, listener):
    port, accepted = listener
    code = f"""
        import socket
        for family, address in ((socket.AF_INET, ("127.0.0.1", {port})), (socket.AF_UNIX, "/run/host.sock")):
            try:
                socket.socket(family).connect(address)
            except OSError as error:
                print(error.errno)
    """
    result = run_unhooked(code, isolation)
    assert result.stdout == EPERM_LINE * 2 and accepted == [], result.stderr


def test_signals_to_other_processes_fail(isolation):
    code = f"""
        import os, signal, threading
        for pid in ({os.getpid()}, -1, 0):
            try:
                os.kill(pid, signal.SIGCONT)
            except OSError as error:
                print(error.errno)
        os.kill(os.getpid(), 0)  # itself: allowed, also by thread (tgkill with its own pid)
        signal.pthread_kill(threading.get_ident(), 0)
    """
    result = run_unhooked(code, isolation)
    assert result.stdout == EPERM_LINE * 3, result.stderr


def test_numerical_code_threads_and_asyncio_still_work(isolation):
    code = """
        import asyncio, fractions, math, threading
        import numpy, sympy
        results = []
        threads = [threading.Thread(target=lambda i=i: results.append(i * i)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        print(sorted(results), math.comb(10, 3), fractions.Fraction(1, 3) + fractions.Fraction(1, 6))
        print(int(numpy.linalg.solve(numpy.eye(3) * 2, numpy.ones(3) * 4).sum()), sympy.factorint(360))
        print(asyncio.run(asyncio.sleep(0, result="async")))
    """
    result = run_python(textwrap.dedent(code), isolation=isolation, memory_mb=2048)
    assert result.status is SandboxStatus.OK, result.stderr
    assert result.stdout == "[0, 1, 4, 9] 120 1/2\n6 {2: 3, 3: 2, 5: 1}\nasync\n"


def test_the_sandbox_refuses_to_start_without_the_filter_unless_told(isolation, monkeypatch, caplog):
    monkeypatch.setattr(sandbox, "_probe_syscall_filter", lambda: (None, "pyseccomp unavailable: test"))
    monkeypatch.delenv("VCPO_SANDBOX_ALLOW_NO_SECCOMP", raising=False)
    with pytest.raises(RuntimeError, match="seccomp.*pyseccomp unavailable: test.*syscall_filter=False"):
        run_python("print('ran')", isolation=isolation)
    assert run_python("print('ran')", isolation=isolation, syscall_filter=False).stdout == "ran\n"
    monkeypatch.setenv("VCPO_SANDBOX_ALLOW_NO_SECCOMP", "1")
    with caplog.at_level(logging.WARNING, logger=sandbox.__name__):
        assert run_python("print('ran')", isolation=isolation).stdout == "ran\n"
    sandbox._warn_once.cache_clear()


def test_a_filter_that_fails_to_load_stops_the_program_before_it_runs(isolation, monkeypatch):
    seccomp, _ = sandbox._probe_syscall_filter()
    broken = {**seccomp, "program": "AAAA"}  # 3 bytes: not a whole BPF instruction, the kernel refuses it
    monkeypatch.setattr(sandbox, "_probe_syscall_filter", lambda: (broken, ""))
    result = run_python("print('ran')", isolation=isolation)
    assert result.stdout == "" and result.exit_code == sandbox._sandbox_child.SETUP_FAILED_EXIT_CODE
    assert "installing the seccomp syscall filter" in result.stderr


def test_the_program_holds_no_capabilities_even_as_root(isolation):
    # Run as root without namespaces, it would otherwise raise its own limits, renice below the caller,
    # make device nodes or change the host name. (Only harmless attempts here: they act on the sandbox.)
    code = """
        import os
        status = dict(line.split(":\\t") for line in open("/proc/self/status").read().splitlines() if ":\\t" in line)
        print(*(int(status[name], 16) for name in ("CapInh", "CapPrm", "CapEff", "CapAmb", "CapBnd")))
        for attempt in (lambda: os.setpriority(os.PRIO_PROCESS, 0, -5),
                        lambda: os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1)),
                        lambda: os.mknod("disk", 0o600 | 0o060000, os.makedev(8, 0))):
            try:
                attempt()
                print("allowed")
            except OSError as error:
                print(error.errno)
    """
    result = run_unhooked(code, isolation)
    lines = result.stdout.splitlines()
    inheritable, permitted, effective, ambient, bounding = map(int, lines[0].split())
    assert (inheritable, permitted, effective, ambient) == (0, 0, 0, 0), result.stderr
    assert bounding == 0 or os.geteuid() != 0  # only a process with CAP_SETPCAP can empty it
    assert lines[1:] == [str(errno.EACCES), str(errno.EPERM), str(errno.EPERM)], result.stderr


def test_the_callers_file_descriptors_cannot_be_taken_through_a_pidfd(isolation):
    code = f"""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        print(libc.syscall(434, {os.getpid()}, 0), ctypes.get_errno())  # pidfd_open (same number everywhere)
    """
    result = run_unhooked(code, isolation)
    assert result.stdout == f"-1 {errno.EPERM}\n", result.stderr
