"""The CPU launcher's console (vcpo.launch.console): start-up milestones from verl's log, one line per metrics record,
the closing lines; driven by a scripted process and a scripted clock, not by verl."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from vcpo.launch import console


def record(step: int, **data: float) -> dict:
    return {"step": step, "data": data}


def test_a_step_line_shows_what_the_step_logged_and_nothing_it_did_not():
    vcpo_step = record(10, **{"critic/score/mean": 0.3125, "val-core/sums/acc/mean@1": 0.27,
                              "actor/rollout_corr/seq_ess_ratio": 0.6249, "actor/lr_scale": 0.81,
                              "training/off_policy/trajectory_staleness/max": 12.0, "timing_s/step": 38.04,
                              "actor/pg_loss": 1.0})
    assert console.step_line(vcpo_step, 60) == (
        "step 10/60  score 0.312  held-out 27.0%  ESS 0.62  lr x0.81  staleness 12  38.0 s")
    sync_step = record(3, **{"critic/score/mean": 0.0, "timing_s/step": 2.0})
    assert console.step_line(sync_step, 60) == "step  3/60  score 0.000  2.0 s"
    assert console.step_line(record(0, **{"val-core/sums/acc/mean@1": 0.15}), 5) == "step 0/5  held-out 15.0%"
    assert console.step_line(record(4, **{"actor/pg_loss": 1.0}), 5) is None


class ScriptedVerl:
    """A process that, at each poll, appends the next scripted lines to verl's log and metrics file and ends (with
    ``code``) after its last entry."""

    def __init__(self, out: Path, script: list[tuple[str, str]], code: int = 0):
        self.out, self.script, self.code = out, list(script), code

    def poll(self):
        if not self.script:
            return self.code
        file, text = self.script.pop(0)
        with open(self.out / file, "a") as handle:
            handle.write(text)
        return None


def test_following_a_run_prints_each_milestone_once_then_each_step_and_returns_the_code(tmp_path, monkeypatch):
    """Milestones in verl's order, one skipped (never announced after a later one), a record written in two pieces
    (printed once it is complete), a heartbeat after 60 quiet seconds of start-up but none after 80 s between steps
    (a step may take minutes), and the process's exit code."""
    monkeypatch.setattr(console.time, "sleep", lambda seconds: None)
    ticks = iter(range(0, 10_000, 10))  # 10 s per clock read
    log, metrics = console.VERL_LOG, "metrics.jsonl"
    step_one = json.dumps(record(1, **{"critic/score/mean": 0.25, "timing_s/step": 40.0}))
    script = [
        (log, "noise\n2026 INFO worker.py -- Started a local Ray instance.\n"),
        (log, "(TaskRunner) dataset len: 970\n(TaskRunner) dataset len: 200\n"),
        (log, "(WorkerDict) LlamaForCausalLM contains 134.52M parameters\n"),  # 'rollout server up' never logged
        (log, "(TaskRunner) Creating file logger at x\n(TaskRunner) LLMServerManager: late\n"),
        *[(log, "quiet\n")] * 8,
        (metrics, json.dumps(record(0, **{"val-core/sums/acc/mean@1": 0.15})) + "\n"),
        (metrics, step_one[:20]),
        (metrics, step_one[20:] + "\n"),
        *[(log, "quiet\n")] * 8,
    ]
    said = []
    code = console.follow(ScriptedVerl(tmp_path, script, code=3), tmp_path, 2, say=said.append,
                          clock=lambda: next(ticks))
    assert code == 3
    stages = [line.split(" s  ", 1)[1] for line in said if line.startswith("start-up") and "still" not in line]
    assert stages == ["Ray started", "prompts loaded", "trainer's model built", "training starts (step 0's validation first, when asked)"]
    steps = [line for line in said if line.startswith("step ")]
    assert steps == ["step 0/2  held-out 15.0%", "step 1/2  score 0.250  40.0 s"]
    [heartbeat] = [line for line in said if "still running" in line]
    assert heartbeat.startswith("start-up") and console.VERL_LOG in heartbeat
    assert said.index(heartbeat) < said.index(steps[0])


def test_a_metrics_file_written_anew_is_read_from_its_start_and_a_line_that_is_no_record_is_said(tmp_path, monkeypatch):
    """A relaunch's verl opens metrics.jsonl with "wb": when the file is shorter than what was read, its new lines are
    read from its start (before, a resumed run's steps went unprinted and a line read from mid-record stopped the
    console, and the launcher with it). A complete line that is no record is said in one line, and following goes on."""
    monkeypatch.setattr(console.time, "sleep", lambda seconds: None)
    metrics = tmp_path / "metrics.jsonl"
    earlier = "".join(json.dumps(record(step, **{"critic/score/mean": 0.5, "timing_s/step": 99.0})) + "\n" for step in (1, 2))
    writes = iter([
        ("w", earlier),
        ("w", json.dumps(record(2, **{"critic/score/mean": 0.125})) + "\n"),  # anew, shorter than what was read
        ("a", "{not json\n"),
        ("a", json.dumps(record(3, **{"critic/score/mean": 0.25})) + "\n"),
    ])

    class Process:
        def poll(self):
            mode, text = next(writes, (None, None))
            if mode is None:
                return 0
            with open(metrics, mode) as handle:
                handle.write(text)
            return None

    said = []
    assert console.follow(Process(), tmp_path, 3, say=said.append, clock=lambda: 0.0) == 0
    assert [line for line in said if line.startswith(("step", "metrics"))] == [
        "step 1/3  score 0.500  99.0 s", "step 2/3  score 0.500  99.0 s", "step 2/3  score 0.125",
        "metrics.jsonl: a line that is no metrics record: '{not json'", "step 3/3  score 0.250"]


def pasted(line: str, prefix: str) -> list[str]:
    """The command a closing line gives after ``prefix``, as a shell reads it, without ``python -m``."""
    assert line.startswith(prefix), line
    words = shlex.split(line[len(prefix):])
    assert words[:2] == ["python", "-m"], words
    return words[2:]


def test_the_closing_lines_name_the_metrics_the_checkpoint_and_the_commands_or_the_failure(tmp_path):
    """The evaluation command the closing lines print is read by the evaluation's own parser as it stands (every
    required argument there, the run folder read as its last checkpoint, the benchmark one of recipes/benchmarks.yaml);
    a run whose prompts are no benchmark is told so, with no command that would fail."""
    from vcpo.evaluation.__main__ import BENCHMARKS_FILE, parse_args
    from vcpo.evaluation.harness import load_benchmarks

    run = tmp_path / "my run"  # a path a shell must be given quoted
    weights = run / "checkpoints" / "global_step_4" / "actor" / "huggingface"
    weights.mkdir(parents=True)
    (weights / "config.json").write_text("{}")
    (run / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("4")
    done = console.closing_lines(run, 0, "sums_2digit_brief")
    assert str(run / "metrics.jsonl") in done[0] and done[1] == f"last checkpoint: {weights}"
    module, *arguments = pasted(done[2], "evaluate it: ")
    args = parse_args(arguments)  # a missing required argument ends the test here (SystemExit)
    assert module == "vcpo.evaluation" and args.model == str(weights) and args.out == run / "eval"
    assert [benchmark.name for benchmark in load_benchmarks(BENCHMARKS_FILE, args.benchmark_names)] == ["sums_2digit_brief"]
    assert pasted(done[3], "draw its curves: ") == ["vcpo.reporting", "curves", str(run), "--out", str(run / "curves.png")]
    unnamed = console.closing_lines(run, 0)
    assert unnamed[2].startswith("evaluate it: its prompts") and "no held-out benchmark" in unnamed[2]
    assert "--model" not in unnamed[2] and len(unnamed) == len(done)
    (tmp_path / console.VERL_LOG).write_text("".join(f"line {n}\n" for n in range(100)) + "RuntimeError: boom\n")
    failed = console.closing_lines(tmp_path, 1)
    assert failed[-2] == "RuntimeError: boom" and len(failed) == console.TAIL_LINES + 1
    assert failed[-1].startswith("verl's trainer exited with 1")


@pytest.mark.parametrize("code", [0, 2])
def test_run_quietly_keeps_verls_output_in_its_log_and_the_terminal_short(tmp_path, capfd, code):
    """A real child process standing in for verl: what it prints lands in main_ppo.log, not on the terminal."""
    import sys

    script = ("import json, sys; print('x' * 50, 'No supported accelerator detected'); "
              "open('metrics.jsonl', 'w').write(json.dumps({'step': 1, 'data': {'timing_s/step': 1.5}}) + '\\n'); "
              f"sys.exit({code})")
    assert console.run_quietly([sys.executable, "-c", script], {}, tmp_path, 1) == code
    terminal = capfd.readouterr()
    assert "No supported accelerator" not in terminal.out and "step 1/1  1.5 s" in terminal.out
    assert "No supported accelerator detected" in (tmp_path / console.VERL_LOG).read_text()
    assert ("exited with 2" in terminal.err) == bool(code)


def test_a_launcher_killed_outright_takes_verls_trainer_with_it(tmp_path):
    """SIGKILL leaves the launcher no chance to clean up: the trainer standing in for verl (it writes its pid, then
    sleeps an hour) must die with it all the same."""
    import os
    import signal
    import subprocess
    import sys
    import time

    child = "import os, time; open('pid', 'w').write(str(os.getpid())); time.sleep(3600)"
    launcher = ("import sys; from pathlib import Path; from vcpo.launch.console import run_quietly; "
                f"run_quietly([sys.executable, '-c', {child!r}], {{}}, Path({str(tmp_path)!r}), 1)")
    process = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.DEVNULL)
    pid_file = tmp_path / "pid"
    deadline = time.monotonic() + 120  # a guard against a hang, not a bound on the time it takes
    while not (pid_file.is_file() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    trainer = int(pid_file.read_text())
    process.send_signal(signal.SIGKILL)
    process.wait()
    while time.monotonic() < deadline:
        try:
            os.kill(trainer, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    pytest.fail(f"verl's stand-in (pid {trainer}) outlived its killed launcher")


def test_the_help_and_the_docs_give_an_evaluation_command_that_parses(tmp_path):
    """`python -m vcpo.launch.cpu --help` and docs/verl.md give the command that evaluates a run's last checkpoint:
    with the run folder in place of their placeholder, the evaluation's own parser takes it as it stands, on the
    registered task's benchmark."""
    import re

    from vcpo.evaluation.__main__ import parse_args
    from vcpo.launch.cpu import layout

    weights = tmp_path / "checkpoints" / "global_step_2" / "actor" / "huggingface"
    weights.mkdir(parents=True)
    (weights / "config.json").write_text("{}")
    (tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("2")
    [helped] = [line.strip() for line in layout().splitlines() if "vcpo.evaluation" in line]
    docs = (Path(__file__).resolve().parents[1] / "docs" / "verl.md").read_text()
    [documented] = re.findall(r"`(python -m vcpo\.evaluation --model DIR[^`]*)`", docs)
    for command, placeholder in ((helped, "OUT"), (documented, "DIR")):
        words = [word.replace(placeholder, str(tmp_path)) for word in shlex.split(command)]
        assert words[:3] == ["python", "-m", "vcpo.evaluation"], command
        args = parse_args(words[3:])
        assert (args.model, args.benchmark_names, args.out) == (str(weights), ["sums_2digit_brief"], tmp_path / "eval")
