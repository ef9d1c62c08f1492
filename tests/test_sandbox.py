"""The Python sandbox stops hostile or broken programs without harming the calling process."""

import ast
import asyncio
import errno
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from vcpo.tools import sandbox
from vcpo.tools.sandbox import SandboxStatus, namespaces_available, run_python

ISOLATIONS = ["hooks"] + (["namespaces"] if namespaces_available() else [])
IS_ROOT = os.geteuid() == 0


@pytest.fixture(params=ISOLATIONS)
def isolation(request):
    _, dirs_before = sandbox.leftover_sandboxes(os.getpid())
    yield request.param
    pids, dirs_after = sandbox.leftover_sandboxes(os.getpid())
    assert pids == [], "a sandboxed process outlived run_python"
    assert dirs_after == dirs_before, "run_python left its working directory behind"


CALLER = """
import sys
from vcpo.tools.sandbox import run_python
print("calling", flush=True)
run_python("import time; print('started', flush=True); time.sleep(3600)", isolation=sys.argv[1], timeout_s=7200)
"""


def program_runs(caller: int) -> bool:
    """Whether the interpreter of ``caller``'s program has started, below its guard: the guard's trap is set and, in
    namespaces isolation, the setup that lays out its root (seconds on a loaded machine) is done. (The first call's
    probe of the syscall filter is an interpreter of the caller's own, not the program.)"""
    for pid in sandbox.leftover_sandboxes(caller)[0]:
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except OSError:  # ended while we looked
            continue
        if command[:2] == [sys.executable.encode(), b"-I"] and parent != caller:
            return True
    return False


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_the_program_and_its_folder_die_with_the_caller(isolation, how):
    """However the caller ends, its sleeping program, the program's helpers and the call's folder go with it (the
    program sleeps an hour: no CPU or wall-clock limit would end it within the minute the test waits)."""
    caller = subprocess.Popen([sys.executable, "-c", CALLER, isolation], stdout=subprocess.PIPE, text=True)
    assert caller.stdout.readline() == "calling\n"
    deadline = time.monotonic() + 120  # a guard against a hang only
    while not program_runs(caller.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(sandbox.leftover_sandboxes(caller.pid)[1]) == 1
    caller.send_signal(how)
    caller.wait()
    deadline = time.monotonic() + 60  # a guard against a hang only
    while sandbox.leftover_sandboxes(caller.pid) != ([], []) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandbox.leftover_sandboxes(caller.pid) == ([], [])


def test_a_disk_quota_bounds_all_files_together(isolation):
    """Many files, each below the per-file limit: namespaces isolation's tmpfs refuses the write past the
    quota (ENOSPC), hooks isolation stops the program (disk_limit); neither writes the 200 MB asked for."""
    code = """
    import os
    written = 0
    try:
        for i in range(200):
            with open(f"part{i}", "wb") as handle:
                handle.write(b"x" * (1 << 20))
            written += 1
    finally:
        print(written, flush=True)
    """
    result = run_python(textwrap.dedent(code), isolation=isolation, max_disk_mb=32, max_file_mb=16)
    if isolation == "namespaces":
        assert result.status is SandboxStatus.ERROR and "No space left on device" in result.stderr
        assert 28 <= int(result.stdout) <= 32
    else:
        assert result.status is SandboxStatus.DISK_LIMIT
        assert int(result.stdout or 0) < 200


def test_the_quota_caps_the_number_of_files_too(isolation):
    """Empty files cost no bytes but each costs the kernel an inode: past max_files, namespaces isolation's tmpfs
    refuses the next (ENOSPC), hooks isolation stops the program (disk_limit); neither makes the 100,000 asked for."""
    code = """
    import os
    made = 0
    try:
        for i in range(100_000):
            os.symlink("main.py", f"link{i}") if i % 2 else open(f"empty{i}", "w").close()
            made += 1
    finally:
        print(made, flush=True)
    """
    result, _ = run_timed(code, isolation=isolation, max_files=500, timeout_s=10)
    if isolation == "namespaces":
        assert result.status is SandboxStatus.ERROR and "No space left on device" in result.stderr
        assert int(result.stdout) == 500
    else:
        assert result.status is SandboxStatus.DISK_LIMIT and int(result.stdout or 0) < 100_000


def test_a_dead_callers_folder_is_removed_by_the_next_call(isolation, tmp_path):
    """A caller killed between making its folder and starting the guard leaves the folder: the next call removes
    it (its caller is gone and no process uses it), and keeps the folder of a caller that is alive."""
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(ended.stdout)
    folders = [Path(tempfile.mkdtemp(prefix=f"vcpo-sandbox-{dead}-")), Path(tempfile.mkdtemp(prefix="vcpo-sandbox-1-"))]
    (folders[0] / "work").mkdir()
    (folders[0] / "work" / "main.py").write_text("print(1)")
    try:
        assert run_python("print('ok')", isolation=isolation).stdout == "ok\n"
        assert not folders[0].exists() and folders[1].exists()  # pid 1 lives
    finally:
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)


def nested(root: Path, depth: int) -> None:
    """``root/d/d/.../d``, ``depth`` folders deep (made relative to each parent: no path is long)."""
    folder = os.open(root, os.O_RDONLY)
    for _ in range(depth):
        os.mkdir("d", dir_fd=folder)
        inner = os.open("d", os.O_RDONLY, dir_fd=folder)
        os.close(folder)
        folder = inner
    with open(os.open("f", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=folder), "w") as handle:
        handle.write("x" * 5000)
    os.fchmod(folder, 0o500)  # the deepest folder read-only, as a program may leave it
    os.close(folder)


def test_planted_entries_in_a_shared_temp_folder_are_left_alone_and_a_dead_callers_deep_tree_is_removed(
        isolation, tmp_path, monkeypatch):
    """In a shared (1777) temp folder, entries by a sandbox folder's name that are not this user's real directories (a
    link to a directory, a plain file, a dangling link) neither make a call fail nor get touched, nor is the temp
    folder's mode changed; a dead caller's 10,000-deep tree (its deepest folder read-only) is measured and removed
    by the next call, without recursion."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep.txt").write_text("keep")
    (shared / f"vcpo-sandbox-{dead}-linkdirx").symlink_to(target)
    (shared / f"vcpo-sandbox-{dead}-plainfil").write_text("planted")
    (shared / f"vcpo-sandbox-{dead}-dangling").symlink_to(tmp_path / "nowhere")
    tree = shared / f"vcpo-sandbox-{dead}-deeptree"
    tree.mkdir()
    nested(tree, 10_000)
    assert sandbox._directory_usage(tree) [1] == 10_001  # 10,000 folders and the file
    assert run_python("print('ok')", isolation=isolation).stdout == "ok\n"
    assert not tree.exists() and (target / "keep.txt").read_text() == "keep"
    assert sorted(path.name for path in shared.iterdir()) == sorted(
        f"vcpo-sandbox-{dead}-{name}" for name in ("linkdirx", "plainfil", "dangling"))
    assert oct(shared.stat().st_mode & 0o7777) == "0o1777"


def run_timed(code: str, **kwargs):
    started = time.monotonic()
    result = run_python(textwrap.dedent(code), **kwargs)
    return result, time.monotonic() - started


def test_normal_program_returns_its_output(isolation):
    result = run_python(
        "import sys\nprint(sum(range(101)))\nprint(input()[::-1], file=sys.stderr)", stdin="abc\n", isolation=isolation
    )
    assert (result.status, result.exit_code, result.stdout, result.stderr) == (SandboxStatus.OK, 0, "5050\n", "cba\n")
    assert result.isolation == isolation and result.ok


def test_exceptions_and_exit_codes_are_reported(isolation):
    failed = run_python("x = 1\nraise ValueError('bad value')", isolation=isolation)
    assert (failed.status, failed.exit_code) == (SandboxStatus.ERROR, 1)
    assert 'File "main.py", line 2' in failed.stderr and "ValueError: bad value" in failed.stderr
    assert run_python("import sys; sys.exit(3)", isolation=isolation).exit_code == 3
    assert "SyntaxError" in run_python("def f(:", isolation=isolation).stderr


@pytest.mark.parametrize(
    ("code", "tracebacks"),
    [
        (
            "def f(x):\n    return 1 / x\n\ntry:\n    f(0)\nexcept ZeroDivisionError as exc:\n    raise KeyError('k') from exc\n",
            2,
        ),
        ("def f(:\n    pass\n", 0),
    ],
    ids=["chained", "syntax"],
)
def test_an_error_reads_as_with_plain_python(isolation, code, tracebacks, tmp_path):
    (tmp_path / "main.py").write_text(code)
    plain = subprocess.run([sys.executable, "-I", "main.py"], cwd=tmp_path, capture_output=True, text=True)
    expected = plain.stderr.replace(str(tmp_path / "main.py"), "main.py")  # python names the script absolutely
    result = run_python(code, isolation=isolation)
    assert plain.returncode == 1 and (result.exit_code, result.stderr) == (1, expected)
    assert expected.count('Traceback (most recent call last):\n  File "main.py"') == tracebacks


def test_program_can_use_its_directory_and_installed_packages(isolation):
    code = """
        import fractions, sympy
        with open("notes.txt", "w") as handle:
            handle.write(str(sympy.factorint(360)))
        print(open("notes.txt").read(), fractions.Fraction(1, 3) + fractions.Fraction(1, 6))
    """
    result, _ = run_timed(code, isolation=isolation)
    assert result.stdout == "{2: 3, 3: 2, 5: 1} 1/2\n", result.stderr


def test_infinite_loop_is_killed_at_the_wall_clock_limit(isolation):
    result, elapsed = run_timed("while True:\n    pass", timeout_s=1.0, cpu_time_s=30, isolation=isolation)
    assert result.status is SandboxStatus.TIMEOUT and result.timed_out
    assert elapsed >= 1.0  # not before its limit


def test_output_before_a_timeout_is_kept(isolation):
    result, _ = run_timed(
        "import time\nprint('partial', flush=True)\ntime.sleep(60)", timeout_s=1.0, isolation=isolation
    )
    assert result.status is SandboxStatus.TIMEOUT and result.stdout == "partial\n"


def test_cpu_time_limit(isolation):
    result, _ = run_timed("while True:\n    pass", timeout_s=20, cpu_time_s=1, isolation=isolation)
    assert result.status is SandboxStatus.CPU_LIMIT  # not TIMEOUT: the CPU limit ended it, not the wall clock


def test_ten_gigabyte_allocation_fails_inside_the_sandbox(isolation):
    result, _ = run_timed(
        "block = bytearray(10 * 1024**3)\nprint('allocated')", memory_mb=512, isolation=isolation
    )
    assert result.status is SandboxStatus.MEMORY_LIMIT and "MemoryError" in result.stderr and result.stdout == ""


def test_fork_bomb_is_refused(isolation):
    code = """
        import os
        while True:
            os.fork()
    """
    result, _ = run_timed(code, timeout_s=5, isolation=isolation)
    assert result.status is SandboxStatus.ERROR and "starting a process (os.fork)" in result.stderr  # refused, not timed out
    assert run_python("import subprocess; subprocess.run(['true'])", isolation=isolation).status is SandboxStatus.ERROR


@pytest.mark.skipif(IS_ROOT, reason="the kernel exempts real uid 0 from RLIMIT_NPROC")
def test_process_limit_is_enforced_by_the_kernel():
    # Threads count against RLIMIT_NPROC like processes, and the audit hook does not refuse them.
    code = """
        import threading, time
        threading.stack_size(256 * 1024)  # small stacks, so that RLIMIT_AS is not what stops them
        started = 0
        try:
            for _ in range(100):
                threading.Thread(target=time.sleep, args=(5,), daemon=True).start()
                started += 1
        finally:
            print(started)
    """
    result = run_python(textwrap.dedent(code), max_processes=8, memory_mb=8192)
    assert "can't start new thread" in result.stderr
    assert int(result.stdout) < 20  # the budget is 8 new tasks; other processes of this user may come and go


def test_writes_outside_the_directory_are_refused(isolation, tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    code = f"""
        import os, shutil
        refused = 0
        for attempt in (lambda: open({str(victim)!r}, "w"), lambda: os.remove({str(victim)!r}),
                        lambda: open({str(tmp_path / "new.txt")!r}, "x"), lambda: shutil.rmtree({str(tmp_path)!r}),
                        lambda: os.rename({str(victim)!r}, "stolen.txt"), lambda: os.chmod({str(victim)!r}, 0)):
            try:
                attempt()
            except PermissionError:
                refused += 1
        print(refused)
    """
    result, _ = run_timed(code, isolation=isolation)
    assert result.stdout == "6\n", result.stderr
    assert sorted(os.listdir(tmp_path)) == ["victim.txt"] and victim.read_text() == "precious"
    assert os.stat(victim).st_mode & 0o777 != 0


def tcp_connect_program(port: int) -> str:
    """A program printing "connected", or the errno with which connecting to the caller's port failed."""
    return f"""
        import socket
        try:
            socket.create_connection(("127.0.0.1", {port}), timeout=2)
            print("connected")
        except OSError as error:
            print(error.errno)
    """


def test_network_is_refused(isolation, listener):
    port, accepted = listener
    result, _ = run_timed(tcp_connect_program(port), isolation=isolation)
    assert result.stdout in (f"{errno.EACCES}\n", f"{errno.EPERM}\n") and accepted == []  # refused, not timed out


def test_signals_to_the_caller_are_refused(isolation):
    code = f"""
        import os, signal
        for send in (lambda: os.kill({os.getpid()}, signal.SIGKILL), lambda: os.killpg(0, signal.SIGKILL)):
            try:
                send()
            except PermissionError:
                print("refused")
    """
    assert run_python(textwrap.dedent(code), isolation=isolation).stdout == "refused\nrefused\n"


def test_native_calls_through_ctypes_are_refused(isolation):
    code = "import ctypes\nctypes.CDLL(None).fork()"
    assert "calling native code" in run_python(code, isolation=isolation).stderr


def test_output_flood_is_truncated_and_stopped(isolation):
    result, _ = run_timed(
        "while True:\n    print('x' * 1000)", max_output_bytes=10_000, timeout_s=10, isolation=isolation
    )
    assert result.status is SandboxStatus.OUTPUT_LIMIT and result.stdout_truncated and not result.stderr_truncated
    assert len(result.stdout) == 10_000


def test_invalid_limits_name_the_argument():
    with pytest.raises(ValueError, match="memory_mb"):
        run_python("pass", memory_mb=0)
    with pytest.raises(ValueError, match="isolation"):
        run_python("pass", isolation="docker")


def test_auto_falls_back_to_hooks_with_a_warning_where_namespaces_are_missing(monkeypatch, caplog):
    monkeypatch.setattr(sandbox.shutil, "which", lambda tool, path=None: None)
    sandbox._probe_namespaces.cache_clear()
    try:
        assert run_python("print('ran')").isolation == "hooks"
        assert "not found" in caplog.text
        with pytest.raises(RuntimeError, match="namespaces"):
            run_python("pass", isolation="namespaces")
    finally:
        sandbox._probe_namespaces.cache_clear()


# The operating-system layer alone, with an interpreter that has no audit hook at all, as native
# code that bypassed the hook would see it.
needs_namespaces = pytest.mark.skipif("namespaces" not in ISOLATIONS, reason="namespaces unavailable here")


def run_without_hooks(code: str) -> subprocess.CompletedProcess:
    with sandbox._private_dirs() as (workdir, root):
        (workdir / "main.py").touch()  # what the setup copies into the work directory's tmpfs
        command = sandbox._in_namespaces([sys.executable, "-I", "-c", textwrap.dedent(code)], workdir, root, max_disk_mb=8)
        return subprocess.run(command, cwd=workdir, capture_output=True, text=True, timeout=30)


@needs_namespaces
def test_namespaces_show_only_a_read_only_minimal_root(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    code = f"""
        import errno, os, sys
        open("inside.txt", "w").write("ok")
        print(sorted(os.listdir("/")))
        print(os.listdir("/etc"))
        for path in ({str(victim)!r}, "/etc/passwd", sys.prefix + "/new.txt"):
            try:
                open(path, "w")
            except OSError as error:
                print(errno.errorcode[error.errno])
    """
    completed = run_without_hooks(code)
    lines = completed.stdout.splitlines()
    system = {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "usr", "proc", "tmp", "nix"}
    prefixes = {Path(prefix).parts[1] for prefix in (sys.prefix, sys.base_prefix)}
    assert set(ast.literal_eval(lines[0])) <= system | prefixes, completed.stderr
    assert lines[1:] == ["['ld.so.cache']", "ENOENT", "EROFS", "EROFS"]
    assert victim.read_text() == "precious"


@needs_namespaces
def test_namespaces_bind_paths_with_spaces_tabs_and_backslashes(tmp_path, monkeypatch):
    """The binds go through an fstab, whose fields escape whitespace: a temporary folder named with a
    space, a tab and a backslash still gives the program its writable work directory and nothing else."""
    import tempfile

    folder = tmp_path / "sand box\tdir\\x"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    code = """
        import os
        open("inside.txt", "w").write("ok")
        print(os.getcwd())
        print(open("inside.txt").read())
        print(sorted(line.split()[4] for line in open("/proc/self/mountinfo") if "sandbox" in line))
    """
    result = run_python(textwrap.dedent(code), isolation="namespaces")
    workdir, content, mounts = result.stdout.splitlines()
    assert result.ok and content == "ok" and workdir.startswith(str(folder) + "/vcpo-sandbox-"), result.stderr
    escaped = workdir.replace("\\", "\\134").replace(" ", "\\040").replace("\t", "\\011")  # as mountinfo shows it
    assert workdir.endswith("/work") and mounts == repr(["/", escaped])


@needs_namespaces
def test_namespaces_bind_paths_that_are_not_utf8(tmp_path, monkeypatch):
    """A temporary folder whose name is not UTF-8 (byte 0xff) or holds a '#': the fstab is written in
    the file system's bytes."""
    import tempfile

    folder = tmp_path / os.fsdecode(b"sand#box\xff")
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    result = run_python("open('inside.txt', 'w').write('ok'); print(open('inside.txt').read())", isolation="namespaces")
    assert result.ok and result.stdout == "ok\n", result.stderr


@needs_namespaces
def test_namespaces_hide_the_network_and_the_callers_processes(listener):
    port, accepted = listener
    code = f"""
        import os, socket
        print(socket.if_nameindex())
        try:
            socket.create_connection(("127.0.0.1", {port}), timeout=2)
        except OSError as error:
            print(error.errno)
        try:
            os.kill({os.getpid()}, 0)  # signal 0 only checks whether the pid exists
            print("caller visible")
        except ProcessLookupError:
            print("caller hidden")
    """
    completed = run_without_hooks(code)
    lines = completed.stdout.splitlines()
    assert lines[0] == "[(1, 'lo')]" and lines[2] == "caller hidden", completed.stderr
    assert int(lines[1]) in (101, 111) and accepted == []  # ENETUNREACH / ECONNREFUSED


def test_verl_tool_from_the_recipe_yaml():
    from verl.tools.tool_registry import initialize_tools_from_config

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "tools" / "python_sandbox.yaml"
    (tool,) = initialize_tools_from_config(str(recipe))
    assert tool.name == "code_interpreter"

    async def call(parameters):
        instance_id, _ = await tool.create()
        try:
            return await tool.execute(instance_id, parameters)
        finally:
            await tool.release(instance_id)

    response, reward, metrics = asyncio.run(call({"code": "print(6 * 7)"}))
    assert (response.text, reward, metrics["status"]) == ("42", 0.0, "ok")
    response, _, _ = asyncio.run(call({"source": "print(1)"}))
    assert "'code' argument" in response.text


def test_verl_tool_reports_why_a_program_was_stopped():
    from vcpo.tools.python_tool import PythonSandboxTool

    # A CPU limit above the wall-clock one: at the default (equal) the busy loop can reach either first.
    tool = PythonSandboxTool({"type": "native", "timeout_s": 1, "cpu_time_s": 5, "max_output_bytes": 5}, None)
    response, _, metrics = asyncio.run(tool.execute("id", {"code": "print('abc')\nwhile True: pass"}))
    assert (response.text, metrics["status"]) == ("abc\n[stopped: wall-clock time limit reached]", "timeout")
    response, _, _ = asyncio.run(tool.execute("id", {"code": "print('abcdefgh')"}))
    assert response.text == "abcde\n...(output truncated)\n[stopped: output limit reached]"


def test_verl_tool_rejects_unknown_config_keys():
    from vcpo.tools.python_tool import PythonSandboxTool

    with pytest.raises(ValueError, match="timeout_seconds"):
        PythonSandboxTool({"type": "native", "timeout_seconds": 3}, None)
