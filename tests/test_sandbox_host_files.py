"""The sandboxed program cannot see the host's files, other processes or the caller's environment.

Every program here runs with the audit hook switched off (``run_unhooked``), so what refuses is the
kernel: the minimal root of namespaces isolation and the Landlock rules of every isolation.
"""

import errno
import logging
import os
import platform
import struct
import textwrap

import pytest
import test_sandbox
import test_sandbox_seccomp
from test_sandbox_seccomp import run_unhooked

from vcpo.tools import sandbox
from vcpo.tools.sandbox import SandboxStatus, run_python

isolation = test_sandbox.isolation
SECRET = "machine hub.example password hunter2"
REFUSED = {errno.ENOENT, errno.EACCES, errno.EPERM, errno.EXDEV, errno.EROFS}
needs_landlock = pytest.mark.skipif(sandbox._landlock_abi() < 1, reason="the kernel has no Landlock")


def read_attempts(*paths: str) -> str:
    """A program printing, for each path, the errno that reading it failed with (or its contents)."""
    return f"""
        import os
        for path in {list(paths)!r}:
            try:
                with open(path) as handle:
                    print(handle.read().strip())
            except OSError as error:
                print(error.errno)
    """


@pytest.fixture
def planted_secret(tmp_path):
    """A credentials file outside the sandbox's directory, readable by the calling user."""
    secret = tmp_path / ".netrc"
    secret.write_text(SECRET + "\n")
    return secret


def assert_all_refused(result, count: int):
    lines = result.stdout.splitlines()
    assert len(lines) == count and {int(line) for line in lines} <= REFUSED, (result.stdout, result.stderr)


def test_a_planted_secret_and_system_credentials_are_unreadable(isolation, planted_secret):
    result = run_unhooked(read_attempts(str(planted_secret), "/etc/shadow", "/etc/passwd"), isolation)
    assert_all_refused(result, 3)
    assert SECRET not in result.stdout


def test_links_from_the_directory_to_a_secret_do_not_open_it(isolation, planted_secret):
    code = f"""
        import os
        for make in (os.symlink, os.link):
            try:
                make({str(planted_secret)!r}, "via_" + make.__name__)
                print(open("via_" + make.__name__).read().strip())
            except OSError as error:
                print(error.errno)
    """
    result = run_unhooked(code, isolation)
    assert_all_refused(result, 2)


def test_the_callers_environment_and_proc_entry_are_out_of_reach(isolation, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    code = (
        read_attempts(f"/proc/{os.getpid()}/environ", f"/proc/{os.getpid()}/cmdline", "/proc/1/environ")
        + """
        print(sorted(key for key in os.environ if key.endswith("_KEY")))
        print(open("/proc/self/status").read().count("Pid:") > 0)  # its own entry stays readable
    """
    )
    result = run_unhooked(code, isolation)
    lines = result.stdout.splitlines()
    assert {int(line) for line in lines[:3]} <= REFUSED and lines[3:] == ["[]", "True"], (result.stdout, result.stderr)
    assert SECRET not in result.stdout


def test_home_directories_and_other_processes_cannot_be_listed(isolation):
    code = f"""
        import os
        for path in ({os.path.expanduser("~")!r}, "/home", "/proc", "/tmp", "/run", "/etc"):
            try:
                names = os.listdir(path)
                print(path, "listed", [name for name in names if name.isdigit() or name.startswith(".")])
            except OSError as error:
                print(path, error.errno)
    """
    result = run_unhooked(code, isolation)
    for line in result.stdout.splitlines():
        path, outcome = line.split(" ", 1)
        # Namespaces mode shows /proc of its own PID namespace: the shell and the interpreter, nothing else.
        if outcome.startswith("listed"):
            assert path == "/proc" and isolation == "namespaces" and outcome == "listed ['1', '2']", line
        else:
            assert int(outcome) in REFUSED, line
    assert len(result.stdout.splitlines()) == 6, result.stderr


def test_nothing_is_written_outside_the_directory(isolation, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    code = f"""
        import os
        attempts = (lambda: open({str(victim)!r}, "w"), lambda: os.remove({str(victim)!r}),
                    lambda: open({str(tmp_path / "new.txt")!r}, "x"), lambda: os.rename({str(victim)!r}, "stolen"),
                    lambda: os.chmod({str(victim)!r}, 0), lambda: os.mkdir("/tmp/vcpo-escape"))
        for attempt in attempts:
            try:
                attempt()
                print("done")
            except OSError as error:
                print(error.errno)
    """
    result = run_unhooked(code, isolation)
    assert all(line != "done" for line in result.stdout.splitlines()) and len(result.stdout.splitlines()) == 6, (
        result.stdout,
        result.stderr,
    )
    assert sorted(os.listdir(tmp_path)) == ["victim.txt"] and victim.read_text() == "precious"
    assert os.stat(victim).st_mode & 0o777 != 0 and not os.path.exists("/tmp/vcpo-escape")


def minimal_static_elf(exit_code: int) -> bytes:
    """A complete x86-64 Linux program, statically linked, that calls exit(exit_code)."""
    base, header_size = 0x400000, 64 + 56
    code = b"\xbf" + struct.pack("<I", exit_code) + b"\xb8\x3c\x00\x00\x00\x0f\x05"  # mov edi; mov eax, 60; syscall
    size = header_size + len(code)
    ident = b"\x7fELF\x02\x01\x01" + bytes(9)
    elf_header = struct.pack("<16sHHIQQQIHHHHHH", ident, 2, 0x3E, 1, base + header_size, 64, 0, 0, 64, 56, 1, 0, 0, 0)
    program_header = struct.pack("<IIQQQQQQ", 1, 5, 0, base, base, size, size, 0x1000)
    return elf_header + program_header + code


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the hand-written binary is x86-64 code")
def test_a_static_binary_written_into_the_directory_cannot_be_executed(isolation):
    code = f"""
        import os
        with open(os.open("escape", os.O_WRONLY | os.O_CREAT, 0o755), "wb") as handle:
            handle.write({minimal_static_elf(42)!r})
        try:
            os.execv("./escape", ["escape"])
        except OSError as error:
            print(error.errno)
    """
    result = run_unhooked(code, isolation)
    assert result.stdout == test_sandbox_seccomp.EPERM_LINE, result.stderr
    # The binary itself works: without the syscall filter it replaces the interpreter and exits with 42.
    assert run_unhooked(code, isolation, syscall_filter=False).exit_code == 42


@needs_landlock
def test_hooks_mode_without_landlock_refuses_to_start_unless_told(monkeypatch, caplog, planted_secret):
    monkeypatch.setattr(sandbox, "_landlock_abi", lambda: 0)
    monkeypatch.delenv("VCPO_SANDBOX_ALLOW_HOST_FILES", raising=False)
    with pytest.raises(RuntimeError, match="Landlock.*hide_host_files=False"):
        run_python("print('ran')", isolation="hooks")
    # What the refusal protects: without Landlock, hooks isolation reads the planted secret.
    exposed = run_unhooked(read_attempts(str(planted_secret)), "hooks", hide_host_files=False)
    assert exposed.stdout == SECRET + "\n"
    monkeypatch.setenv("VCPO_SANDBOX_ALLOW_HOST_FILES", "1")
    with caplog.at_level(logging.WARNING, logger=sandbox.__name__):
        assert run_python("print('ran')", isolation="hooks").stdout == "ran\n"
    assert "every file the calling user can" in caplog.text
    sandbox._warn_once.cache_clear()


@pytest.mark.skipif("namespaces" not in test_sandbox.ISOLATIONS, reason="namespaces unavailable here")
def test_namespaces_hide_host_files_without_landlock(monkeypatch, planted_secret):
    monkeypatch.setattr(sandbox, "_landlock_abi", lambda: 0)
    result = run_unhooked(read_attempts(str(planted_secret), "/etc/shadow"), "namespaces")
    assert result.stdout == f"{errno.ENOENT}\n" * 2, result.stderr


@needs_landlock
def test_landlock_rules_that_fail_to_load_stop_the_program(isolation, monkeypatch):
    monkeypatch.setattr(sandbox, "_landlock_rules", lambda workdir: [["/usr", "not a number"]])
    result = run_python("print('ran')", isolation=isolation)
    assert result.stdout == "" and result.exit_code == sandbox._sandbox_child.SETUP_FAILED_EXIT_CODE
    assert "installing the Landlock file rules" in result.stderr and result.status is SandboxStatus.ERROR


def test_resolution_chain_lists_every_symlink_on_the_way(tmp_path):
    (tmp_path / "real" / "lib").mkdir(parents=True)
    (tmp_path / "alias").symlink_to("real")
    (tmp_path / "real" / "current").symlink_to(tmp_path / "alias" / "lib")
    chain = sandbox._resolution_chain(str(tmp_path / "alias" / "current" / "."))
    assert chain == [
        str(tmp_path / "alias"),
        str(tmp_path / "real" / "current"),
        str(tmp_path / "alias"),
        str(tmp_path / "real" / "lib"),
    ]
    (tmp_path / "loop").symlink_to("loop")
    with pytest.raises(OSError, match="too many"):
        sandbox._resolution_chain(str(tmp_path / "loop"))


def test_visible_paths_are_the_interpreter_and_system_libraries_only():
    visible = sandbox._visible_paths()
    home = os.path.realpath(os.path.expanduser("~"))
    assert home not in visible and "/" not in visible and "/etc" not in visible and "/tmp" not in visible
    assert any(os.path.realpath(os.__file__).startswith(path + "/") for path in visible)
    directories = [path for path in visible if os.path.isdir(path) and not os.path.islink(path)]
    assert not [(a, b) for a in directories for b in visible if b.startswith(a + "/")]  # nothing listed twice


def test_the_verl_tool_and_the_multi_turn_simulator_use_the_hardened_sandbox(planted_secret):
    import asyncio

    from vcpo.sim.rollout import sandbox_tool
    from vcpo.tools.python_tool import PythonSandboxTool

    code = test_sandbox_seccomp.DISABLE_AUDIT_HOOK + textwrap.dedent(
        read_attempts(str(planted_secret))
        + """
        print([line for line in open("/proc/self/status") if line.startswith("Seccomp:")][0].split()[1])
        """
    )
    expected = {f"{errno.ENOENT}\n2\n", f"{errno.EACCES}\n2\n"}  # the secret refused; filter mode 2
    assert sandbox_tool(timeout_s=10.0)(code).text in expected
    tool = PythonSandboxTool({"type": "native"}, None)
    response, _, metrics = asyncio.run(tool.execute("id", {"code": code}))
    assert response.text + "\n" in expected and metrics["status"] == "ok"
    with pytest.MonkeyPatch.context() as patch, pytest.raises(RuntimeError, match="Landlock"):
        patch.setattr(sandbox, "_landlock_abi", lambda: 0)
        patch.delenv("VCPO_SANDBOX_ALLOW_HOST_FILES", raising=False)
        PythonSandboxTool({"type": "native", "isolation": "hooks"}, None)  # refused when verl builds it


@pytest.mark.skipif(sandbox._landlock_abi() < 6, reason="TCP rules need Landlock ABI 4, signal scoping ABI 6")
def test_landlock_alone_refuses_tcp_and_signals_to_the_caller(listener):
    # Without the seccomp filter and with the audit hook off, only Landlock stands in hooks isolation.
    port, accepted = listener
    code = (
        test_sandbox.tcp_connect_program(port)
        + f"""
        import os, signal
        try:
            os.kill({os.getpid()}, signal.SIGCONT)  # harmless if it got through: the caller is not stopped
            print("signalled")
        except OSError as error:
            print(error.errno)
    """
    )
    result = run_unhooked(code, "hooks", syscall_filter=False)
    assert result.stdout == f"{errno.EACCES}\n{errno.EPERM}\n" and accepted == [], result.stderr
    unconfined = run_unhooked(code, "hooks", syscall_filter=False, hide_host_files=False)
    assert unconfined.stdout == "connected\nsignalled\n"  # what Landlock stopped
