"""Bad or empty input at the command-line entry points: one line naming the argument, exit 2, no work."""

import subprocess
import sys

import pytest


def run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def test_an_evaluation_of_no_benchmark_is_refused_before_a_model_loads(tmp_path):
    result = run("eval", "--model", str(tmp_path / "no-model"), "--benchmarks", " , ", "--out", str(tmp_path / "out"))
    assert result.returncode == 2 and "--benchmarks: no benchmark named" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", [["figure", "fig5"], ["table1"]])
def test_tables_over_a_missing_runs_folder_are_refused(tmp_path, command):
    out = tmp_path / "out.md"
    result = run("vcpo.tables", *command, "--runs", str(tmp_path / "nothing"), "--scale", "smoke", "--out", str(out))
    assert result.returncode == 2 and f"--runs {tmp_path / 'nothing'}: no such folder" in result.stderr
    assert not out.exists()
