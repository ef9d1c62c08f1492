"""Bad or empty input at the command-line entry points: one line naming the argument, exit 2, no work."""

import subprocess
import sys

import pytest


def run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def test_an_evaluation_of_no_benchmark_is_refused_before_a_model_loads(tmp_path):
    result = run("vcpo.evaluation", "--model", str(tmp_path / "no-model"), "--benchmarks", " , ", "--out", str(tmp_path / "out"))
    assert result.returncode == 2 and "--benchmarks: no benchmark named" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", [["figure", "fig5"], ["table1"]])
def test_tables_over_a_missing_runs_folder_are_refused(tmp_path, command):
    out = tmp_path / "out.md"
    result = run("vcpo.reporting", *command, "--runs", str(tmp_path / "nothing"), "--scale", "smoke", "--out", str(out))
    assert result.returncode == 2 and f"--runs {tmp_path / 'nothing'}: no such folder" in result.stderr
    assert not out.exists()


def test_the_overhead_figure_draws_no_runs_so_it_needs_no_runs_folder(tmp_path):
    out = tmp_path / "fig3.png"
    result = run(
        "vcpo.reporting", "figure", "fig3", "--runs", str(tmp_path / "nothing"), "--scale", "smoke", "--out", str(out),
        "--measured", str(tmp_path / "none.json"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert out.stat().st_size > 0 and result.stdout.strip() == str(out)


@pytest.mark.parametrize(
    "args, message",
    [
        (["train", "--method", "vcpo"], "config key 'out': a run needs an output folder (--out DIR)"),
        (["train", "--method", "vcpo", "--out", "{file}/run"], "is a file, not a folder"),
        (["sweep", "--methods", "vcpo", "--lags", "2", "--out", "{tmp}/runs", "--jobs", "0"], "--jobs 0: must be >= 1"),
        (["sweep", "--methods", "vcpo", "--lags", "2", "--out", "{file}"], "is a file, not a folder"),
    ],
)
def test_the_simulator_refuses_a_bad_output_or_job_count_in_one_line(tmp_path, args, message):
    afile = tmp_path / "afile"
    afile.write_text("x")
    args = [arg.format(file=afile, tmp=tmp_path) for arg in args]
    result = run("vcpo.sim", *args)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr, result.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "{tmp}", "--out", "{tmp}/out"], "not a model folder (no config.json"),
        (["--model", "Qwen/Qwen2-1.5B", "--out", "{tmp}/out", "--source-dir", "{tmp}/nothing"], "--source-dir {tmp}/nothing: no such folder"),
        (["--model", "Qwen/Qwen2-1.5B", "--out", "{file}/out"], "is a file"),
    ],
)
def test_an_evaluation_checks_its_folders_before_generating(tmp_path, args, message):
    afile = tmp_path / "afile"
    afile.write_text("x")
    args = [arg.format(tmp=tmp_path, file=afile) for arg in args]
    result = run("vcpo.evaluation", *args, "--benchmarks", "gsm8k")
    assert result.returncode == 2 and message.format(tmp=tmp_path) in result.stderr, result.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["vcpo.data", "build", "countdown", "--out", "{file}/data"], "is a file, not a folder"),
        (["vcpo.sim.base", "--task", "nonesuch"], "argument --task: invalid choice: 'nonesuch'"),
        (["vcpo.sim.base", "--size", "huge"], "argument --size: invalid choice: 'huge'"),
        (["vcpo.methods", "show", "nonesuch"], "unknown method 'nonesuch'"),
        (["vcpo.local_models", "{file}"], "is a file, not a folder"),
        (["vcpo.launch.cpu", "--out", "{file}"], "is a file, not a folder"),
        (["vcpo.launch.cpu", "--out", "{tmp}/run", "--method", "nonesuch"], "unknown method 'nonesuch'"),
    ],
)
def test_other_entry_points_refuse_bad_input_in_one_line_before_any_work(tmp_path, args, message):
    afile = tmp_path / "afile"
    afile.write_text("x")
    result = run(*[arg.format(file=afile, tmp=tmp_path) for arg in args])
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr
    assert "building" not in result.stdout and not (tmp_path / "run").exists()  # no download, no model written
