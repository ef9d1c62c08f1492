"""A run folder survives crashes and careless hands: one writer per folder (and per cached SFT base), torn
metrics lines, an interrupted rewrite, and readers that say what they skip."""

import json
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_sim_train import RESUME, _metrics_without_timing, base, uninterrupted  # noqa: F401 (fixtures)

from vcpo.locks import LOCK_FILE, FolderInUse, cache_entry_lock, run_folder_lock, write_atomic
from vcpo.reporting.run_data import read_metrics
from vcpo.runs import METRICS_FILE
from vcpo.sim.__main__ import main as sim_main


def command(base_dir, out):
    return [sys.executable, "-m", "vcpo.sim", "train", *[f"{k}={v}" for k, v in RESUME.items()], f"base={base_dir}",
            f"out={out}"]


def hold_lock(folder, ready, release):
    with run_folder_lock(folder):
        ready.set()
        release.wait(60)


def test_a_second_process_on_a_locked_folder_is_refused_at_once(tmp_path):
    context = multiprocessing.get_context("fork")
    ready, release = context.Event(), context.Event()
    holder = context.Process(target=hold_lock, args=(tmp_path, ready, release))
    holder.start()
    try:
        assert ready.wait(30)
        with pytest.raises(FolderInUse, match=rf"{tmp_path} is in use by process {holder.pid} on "), run_folder_lock(tmp_path):
            pass
        assert holder.is_alive() and not release.is_set()  # refused while the holder held on: it did not wait
    finally:
        release.set()
        holder.join()
    with run_folder_lock(tmp_path):  # free again once its holder ended
        pass


def test_a_lock_left_by_a_killed_process_does_not_block(tmp_path):
    context = multiprocessing.get_context("fork")
    ready, release = context.Event(), context.Event()
    holder = context.Process(target=hold_lock, args=(tmp_path, ready, release))
    holder.start()
    assert ready.wait(30)
    os.kill(holder.pid, signal.SIGKILL)
    holder.join()
    assert str(holder.pid) in (tmp_path / LOCK_FILE).read_text()  # the file stays, its lock does not
    with run_folder_lock(tmp_path):
        pass


@pytest.mark.slow
def test_two_writers_on_one_run_folder(base, tmp_path, uninterrupted, capsys):  # noqa: F811
    """The second is refused before any work with one line naming the folder and the first; the first's run
    is the one a lone run writes."""
    out = tmp_path / "run"
    first = subprocess.Popen(command(base, out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not ((out / LOCK_FILE).exists() and str(first.pid) in (out / LOCK_FILE).read_text()):
        assert time.monotonic() < deadline and first.poll() is None
        time.sleep(0.02)
    assert sim_main(["train", *command(base, out)[4:]]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and f"{out} is in use by process {first.pid}" in error[0]  # refused while the first ran
    assert first.wait(300) == 0
    assert _metrics_without_timing(out / METRICS_FILE) == uninterrupted


def build_one(cache_dir, log):
    import dataclasses

    from vcpo.sim import base as sim_base
    from vcpo.sim.tasks import get_sim_task

    calls = []
    train_sft = sim_base.train_sft
    sim_base.train_sft = lambda *a, **k: calls.append(1) or train_sft(*a, **k)
    task = dataclasses.replace(get_sim_task("arithmetic"), train_size=64, validation_size=8)
    path = sim_base.sft_base(task, "tiny", steps=3, cache_dir=cache_dir, progress=False)
    log.put((str(path), len(calls)))


def test_two_processes_building_one_base_build_it_once(tmp_path):
    context = multiprocessing.get_context("spawn")  # the builders train with torch: no fork of its thread pools
    log = context.Queue()
    builders = [context.Process(target=build_one, args=(tmp_path, log)) for _ in range(2)]
    for builder in builders:
        builder.start()
    for builder in builders:
        builder.join(300)
    results = [log.get(timeout=5) for _ in builders]
    assert len({path for path, _ in results}) == 1 and sorted(calls for _, calls in results) == [0, 1]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_a_cache_entry_lock_waits_instead_of_refusing(tmp_path):
    context = multiprocessing.get_context("fork")
    ready, release = context.Event(), context.Event()

    def hold():
        with cache_entry_lock(tmp_path / "entry"):
            ready.set()
            release.wait(60)

    holder = context.Process(target=hold)
    holder.start()
    assert ready.wait(30)
    context.Process(target=lambda: (time.sleep(0.3), release.set())).start()
    with cache_entry_lock(tmp_path / "entry"):
        assert release.is_set()  # taken only once its holder let go
    holder.join()


def interrupted_run(base_dir, out, stop_after_lines):
    """A real run stopped by SIGKILL once ``stop_after_lines`` metric lines are written."""
    process = subprocess.Popen(command(base_dir, out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not ((out / METRICS_FILE).exists() and len((out / METRICS_FILE).read_text().splitlines()) >= stop_after_lines):
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.02)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()


@pytest.mark.slow
def test_a_torn_last_line_is_reported_and_the_run_resumes(base, tmp_path, uninterrupted):  # noqa: F811
    out = tmp_path / "run"
    interrupted_run(base, out, 5)
    with open(out / METRICS_FILE, "a") as handle:
        handle.write('{"step": 7, "critic/score/me')  # a write cut short
    result = subprocess.run(command(base, out), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert f"{out / METRICS_FILE}: a partial last line is left out" in result.stderr
    assert _metrics_without_timing(out / METRICS_FILE) == uninterrupted


@pytest.mark.slow
def test_a_torn_line_in_the_middle_is_an_error_naming_file_and_line(base, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    interrupted_run(base, out, 5)
    lines = (out / METRICS_FILE).read_text().splitlines()
    lines[1] = lines[1][: len(lines[1]) // 2]
    (out / METRICS_FILE).write_text("".join(line + "\n" for line in lines))
    result = subprocess.run(command(base, out), capture_output=True, text=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"{out / METRICS_FILE} line 2 cannot be read as a metrics record" in result.stderr


@pytest.mark.slow
def test_a_crash_during_the_resumes_rewrite_keeps_the_history(base, tmp_path, uninterrupted, monkeypatch):  # noqa: F811
    """The rewrite goes to a file beside and is renamed into place: a crash before the rename leaves the old
    file whole, and the next resume ends where an uninterrupted run does."""
    out = tmp_path / "run"
    interrupted_run(base, out, 5)
    before = (out / METRICS_FILE).read_text()
    import vcpo.sim.run_folder as run_folder_module
    from vcpo.sim.config import SimConfig, apply_overrides
    from vcpo.sim.train import Trainer

    def crash(path, text):
        partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        partial.write_text(text[: len(text) // 2])
        raise OSError("disk full")  # before the rename

    monkeypatch.setattr(run_folder_module, "write_atomic", crash)
    config = apply_overrides(SimConfig(), {**RESUME, "base": str(base), "out": str(out)})
    with pytest.raises(OSError, match="disk full"):
        Trainer(config).run()
    assert (out / METRICS_FILE).read_text() == before
    monkeypatch.undo()
    subprocess.run(command(base, out), check=True, capture_output=True)
    assert _metrics_without_timing(out / METRICS_FILE) == uninterrupted


def test_a_write_cut_short_leaves_the_old_file_whole(tmp_path, monkeypatch):
    """write_atomic's promise: a crash mid-write leaves the old content or the new, never a part of either."""
    target = tmp_path / "f.json"
    target.write_text("old content")
    write_text = Path.write_text

    def crash_halfway(self, text, *args, **kwargs):
        write_text(self, text[: len(text) // 2], *args, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", crash_halfway)
    with pytest.raises(OSError, match=f"No space left on device while writing {target}"):
        write_atomic(target, "new content, longer than the old")
    monkeypatch.undo()
    assert target.read_text() == "old content" and [p.name for p in tmp_path.iterdir()] == ["f.json"]  # no partial left
    write_atomic(target, "new content")
    assert target.read_text() == "new content"


def test_readers_say_what_they_skip(tmp_path, caplog):
    run = tmp_path / "countdown" / "sync" / "lag0" / "seed0"
    run.mkdir(parents=True)
    records = [{"step": 0, "val/accuracy": 0.1}, {"step": 1, "x": 1}, {"step": 1, "x": 2}, {"step": 2, "x": 3}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 3, "x"')
    with caplog.at_level(logging.WARNING):
        lines = read_metrics(run)
    assert [line["step"] for line in lines] == [0, 1, 2] and lines[1]["x"] == 1
    messages = [record.getMessage() for record in caplog.records]
    assert any(str(run) in m and "partial last line" in m for m in messages)
    assert any(str(run) in m and "steps [1] are logged more than once" in m for m in messages)


def test_rerunning_a_finished_run_keeps_its_metrics_and_a_failed_setup_frees_the_folder(base, tmp_path):  # noqa: F811
    from test_sim_train import small_config

    from vcpo.sim.config import ConfigError
    from vcpo.sim.train import Trainer

    out = tmp_path / "run"
    Trainer(small_config(base, out, eval_every=1)).run()
    before = (out / METRICS_FILE).read_text()
    assert json.loads(before.splitlines()[-1])["step"] == 2  # the final evaluation's line
    Trainer(small_config(base, out, eval_every=1)).run()  # the same command again: nothing to redo, nothing lost
    assert (out / METRICS_FILE).read_text() == before
    with pytest.raises(ConfigError, match="holds a checkpoint of a run with other settings"):
        Trainer(small_config(base, out, eval_every=1, reference_lr=1e-3))
    with run_folder_lock(out):  # the refused setup did not keep the lock
        pass
    trainer = Trainer(small_config(base, out, eval_every=1))
    trainer.run()
    with pytest.raises(RuntimeError, match="runs once"):
        trainer.run()


def test_a_reader_names_the_run_and_line_it_cannot_read(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1, "x"\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"run/metrics.jsonl line 2 cannot be read"):
        read_metrics(run)


def test_the_evidence_runner_says_what_it_could_not_do(tmp_path, capsys):
    from vcpo.studies.design import Arm, Design
    from vcpo.studies.runner import run_all

    design = Design(seeds=[0], configs={"countdown": str(tmp_path / "missing.yaml")}, settings={"countdown": {}},
                    arms=[Arm("countdown", "sync", "sync", 1)])
    assert run_all(design, tmp_path / "runs", 1, None, archive=tmp_path / "archive") == 2
    error = capsys.readouterr().err
    assert "failed: planning: config file" in error and "not run: countdown/sync seed 0" in error


def test_one_reader_rule_for_torn_and_repeated_lines_with_the_callers_report(tmp_path):
    from vcpo.runs import MetricsProblem, metric_records

    run = tmp_path / "run"
    run.mkdir()
    (run / METRICS_FILE).write_text('{"step": 0, "a": 1}\n{"step": 1, "a": 2}\n{"step": 1, "a": 9}\n{"step": 2, "a"')
    said = []
    records = metric_records(run, report=said.append)
    assert [record["a"] for _, record in records] == [1, 2]  # the first line of step 1; the torn tail left out
    assert len(said) == 2 and "partial last line" in said[0] and "steps [1] are logged more than once" in said[1]
    with pytest.raises(RuntimeError, match="partial last line"):  # a caller for whom it is an error raises

        def refuse(problem):
            raise RuntimeError(problem)

        metric_records(run, report=refuse)
    (run / METRICS_FILE).write_text('{"step": 0}\nnot json\n')
    with pytest.raises(MetricsProblem, match="line 2 cannot be read"):
        metric_records(run, report=said.append)


def test_the_run_folder_format_is_written_in_one_module():
    """Issue 35's must-hold: under vcpo/, the file names of a run and the ESS metric name appear as code
    literals only in the modules that own them (docstrings may name them)."""
    import ast

    owners = {"final/eval.json": {"vcpo/runs.py"}, "eval.json": {"vcpo/runs.py"}, "metrics.jsonl": {"vcpo/runs.py"},
              "rollout_corr/seq_ess_ratio": {"vcpo/core/ratios.py"}}
    root = Path(__file__).resolve().parents[1]
    found = {}
    for path in (root / "vcpo").rglob("*.py"):
        tree = ast.parse(path.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)) and node.body
                      and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                for literal in owners:
                    if node.value == literal or node.value.endswith("/" + literal):
                        found.setdefault(literal, set()).add(str(path.relative_to(root)))
    assert all(found.get(literal, set()) <= modules for literal, modules in owners.items()), found


def stopped_run(base, out, monkeypatch, lines: int):
    """The RESUME run in ``out``, stopped (as by a crash) after ``lines`` metrics lines."""
    from test_sim_concurrent import run_stopped_after

    from vcpo.sim.config import SimConfig, apply_overrides
    from vcpo.sim.train import Trainer
    from vcpo.sim.validation import validate

    config = validate(apply_overrides(SimConfig(), {**RESUME, "base": str(base), "out": str(out), "threads": "1", "progress": "false"}))
    run_stopped_after(Trainer(config), lines, monkeypatch)
    return config


def test_a_damaged_latest_checkpoint_resumes_from_the_one_before(base, tmp_path, uninterrupted, monkeypatch, capsys):
    from vcpo.runs import CHECKPOINT_FILE, PREVIOUS_CHECKPOINT_FILE
    from vcpo.sim.train import Trainer

    out = tmp_path / "run"
    config = stopped_run(base, out, monkeypatch, 7)  # checkpoints after steps 4 and 6 (every 2)
    assert torch.load(out / PREVIOUS_CHECKPOINT_FILE, weights_only=False)["step"] == 4
    checkpoint = out / CHECKPOINT_FILE
    checkpoint.write_bytes(checkpoint.read_bytes()[: checkpoint.stat().st_size // 2])  # a write cut short
    (out / f"{CHECKPOINT_FILE}.99999.tmp").write_bytes(b"left by a killed writer")
    Trainer(config).run()
    said = capsys.readouterr().err
    assert f"{checkpoint} is damaged" in said and "resuming from checkpoint.prev.pt (step 4)" in said
    assert _metrics_without_timing(out / METRICS_FILE) == uninterrupted
    assert not list(out.glob("*.tmp"))


def test_no_readable_checkpoint_is_one_line_naming_the_files(base, tmp_path, monkeypatch, capsys):
    from vcpo.runs import CHECKPOINT_FILE, PREVIOUS_CHECKPOINT_FILE

    out = tmp_path / "run"
    stopped_run(base, out, monkeypatch, 5)
    (out / CHECKPOINT_FILE).write_bytes(b"")
    (out / PREVIOUS_CHECKPOINT_FILE).unlink(missing_ok=True)
    command = ["train", *[f"{k}={v}" for k, v in RESUME.items()], f"base={base}", f"out={out}", "threads=1", "progress=false"]
    from vcpo.sim.__main__ import main as sim_main

    assert sim_main(command) == 2
    said = capsys.readouterr().err
    error = [line for line in said.splitlines() if line.startswith("error:")]
    assert "Traceback" not in said and len(error) == 1
    assert f"{out / CHECKPOINT_FILE} is damaged" in error[0] and "delete checkpoint.pt" in error[0]


def test_a_resume_is_checked_against_the_checkpoint_without_config_json(base, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    stopped_run(base, out, monkeypatch, 5)
    (out / "config.json").unlink()
    from vcpo.sim.__main__ import main as sim_main

    command = ["train", *[f"{k}={v}" for k, v in RESUME.items()], f"base={base}", f"out={out}", "threads=1", "progress=false"]
    assert sim_main([*command, "lr=1e-4"]) == 2  # reference_lr under its old name
    assert "(checkpoint.pt) holds a checkpoint of a run with other settings (reference_lr: 5e-05 -> 0.0001)" in capsys.readouterr().err


def test_a_full_disk_says_so_and_leaves_no_partial_file(base, tmp_path, monkeypatch, capsys):
    from vcpo.sim.__main__ import main as sim_main

    def full_disk(state, path):
        Path(path).write_bytes(b"partial")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4096 vs 2048")

    monkeypatch.setattr(torch, "save", full_disk)
    out = tmp_path / "run"
    command = ["train", *[f"{k}={v}" for k, v in RESUME.items()], f"base={base}", f"out={out}", "threads=1", "progress=false"]
    assert sim_main(command) == 2
    error = capsys.readouterr().err
    assert "no space left on device?" in error and "MiB free" in error and "unexpected pos" in error
    assert not list(out.glob("*.tmp"))


def study_design(base, tmp_path, steps: int):
    """A one-run study (sync, from the test's random base, ``steps`` steps) for the evidence runner."""
    from vcpo.studies.design import Arm, Design

    config = tmp_path / "study.yaml"
    config.write_text("task: countdown\nmodel_size: tiny\n")
    settings = {"base": str(base), "steps": steps, "eval_every": 0, "test_problems": 4, "test_samples": 1,
                "prompts_per_step": 2, "responses_per_prompt": 2, "micro_batch_size": 4}
    return Design(seeds=[0], configs={"countdown": str(config)}, settings={"countdown": settings},
                  arms=[Arm("countdown", "sync", "sync", 1)])


def test_one_runner_per_study_folder_and_a_running_child_is_waited_for(base, tmp_path, capfd):
    import threading

    from vcpo.locks import LOCK_FILE, FolderInUse, exclusive, run_folder_lock
    from vcpo.studies.design import run_folder
    from vcpo.studies.runner import run_all

    design, runs, archive = study_design(base, tmp_path, 6), tmp_path / "runs", tmp_path / "archive"
    with run_folder_lock(runs), pytest.raises(FolderInUse, match="is in use by"):
        run_all(design, runs, 1, None, archive=archive)  # a second runner on the folder: refused at once
    folder = run_folder(runs, design.arms[0], 0)
    held, release = threading.Event(), threading.Event()

    def earlier_training():  # a run left going by a runner that was killed
        with exclusive(folder / LOCK_FILE, wait=False):
            held.set()
            release.wait(30)

    def release_once_the_training_job_waits():  # the kernel lists a process blocked on this lock file (/proc/locks: "->")
        inode = f":{(folder / LOCK_FILE).stat().st_ino} "
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any("->" in line and inode in line for line in Path("/proc/locks").read_text().splitlines()):
            time.sleep(0.2)
        release.set()

    holder = threading.Thread(target=earlier_training)
    holder.start()
    held.wait(10)
    threading.Thread(target=release_once_the_training_job_waits, daemon=True).start()
    assert run_all(design, runs, 1, None, archive=archive) == 0  # waited for it, then ran: not a failure
    holder.join()
    assert "waiting:" in capfd.readouterr().out and (archive / "countdown" / "sync" / "seed0" / "final" / "eval.json").exists()


def assert_killing_it_ends_the_training(metrics: Path, runner: subprocess.Popen) -> None:
    """Once the training that writes ``metrics`` has logged two steps, killing ``runner`` frees its folder before
    the training finishes (it has hundreds of steps to go)."""
    from vcpo.locks import run_folder_lock
    from vcpo.runs import is_finished

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        time.sleep(0.2)
    assert metrics.exists(), "the training child never started"
    runner.kill()
    runner.wait()
    deadline = time.monotonic() + 300  # a guard against a hang only
    while time.monotonic() < deadline:
        try:
            with run_folder_lock(metrics.parent):  # free: the child is gone
                assert not is_finished(metrics.parent), "the training child outlived its runner: it ran to its end"
                return
        except FolderInUse:
            time.sleep(0.2)
    pytest.fail("the training child outlived its runner")


def test_a_killed_runner_takes_its_training_child_with_it(base, tmp_path):
    import yaml

    from vcpo.studies.design import run_folder

    design = study_design(base, tmp_path, 400)
    spec = {"seeds": [0], "tasks": {"countdown": {"config": design.configs["countdown"], "settings": design.settings["countdown"],
                                                  "arms": {"sync": {"method": "sync", "phase": 1}}}}}
    (tmp_path / "design.yaml").write_text(yaml.safe_dump(spec))
    runs = tmp_path / "runs"
    runner = subprocess.Popen([sys.executable, "-m", "vcpo.studies.evidence", "--design", str(tmp_path / "design.yaml"), "run",
                               "--out", str(runs), "--archive", str(tmp_path / "archive"), "--jobs", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = run_folder(runs, design.arms[0], 0) / METRICS_FILE
    assert_killing_it_ends_the_training(metrics, runner)


def test_a_killed_sweep_takes_its_training_child_with_it(base, tmp_path):
    """python -m vcpo.sim sweep runs its trainings under Snakemake: killing the sweep ends Snakemake and every
    training below it (as a study's runner does)."""
    out = tmp_path / "sweep"
    settings = study_design(base, tmp_path, 400).settings["countdown"]
    sweep = subprocess.Popen([sys.executable, "-m", "vcpo.sim", "sweep", "--config", str(tmp_path / "study.yaml"), "--methods", "sync",
                              "--lags", "0", "--out", str(out), *(f"{key}={value}" for key, value in settings.items())],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = out / "countdown" / "sync" / "lag0" / "seed0" / METRICS_FILE
    assert_killing_it_ends_the_training(metrics, sweep)


def test_runs_snakemake_left_are_named_once_with_how_to_resume(tmp_path, monkeypatch, capsys):
    """A Snakemake that ends without error with runs unarchived (one run archived of three): the runner plans once,
    returns the count left and names each with the command that resumes it; it does not plan again by itself."""
    import subprocess

    from vcpo.runs import FINAL_EVAL
    from vcpo.studies import runner
    from vcpo.studies.design import Arm, Design, run_folder

    arm = Arm("countdown", "sync", "sync", 1)
    design = Design(seeds=[0, 1, 2], configs={"countdown": str(Path(__file__).parents[1] / "recipes/sim/regime.yaml")}, settings={"countdown": {}},
                    arms=[arm])
    archive, calls = tmp_path / "archive", []

    def one_run(command, **kwargs):  # a Snakemake that archives seed 0 only and ends without error
        calls.append(command)
        folder = run_folder(archive, arm, 0)
        (folder / FINAL_EVAL).parent.mkdir(parents=True, exist_ok=True)
        (folder / FINAL_EVAL).write_text("{}")
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(subprocess, "run", one_run)  # the module the runner starts Snakemake with
    assert runner.run_all(design, tmp_path / "runs", 1, None, archive=archive) == 2
    assert len(calls) == 1
    _, err = capsys.readouterr()
    left = [line for line in err.splitlines() if line.startswith("not run: ")]
    assert [line.split(" (")[0] for line in left] == ["not run: countdown/sync seed 1", "not run: countdown/sync seed 2"]
    assert all("the same command resumes" in line for line in left)


def test_one_layout_for_the_workflows_runs_and_the_studies_arms(tmp_path):
    """recipes.run_path is the layout of both: <task>/<method>/lag<k>/seed<s>, and a study's arm in place of the
    method and its lag; the committed across-lags archive is laid out so (its Countdown rows: the tool-use rows' task
    key names the search or the confirmation)."""
    import json

    from vcpo.recipes import run_path
    from vcpo.studies.design import Arm, run_folder

    assert run_path("tir", "vcpo", 2, 0) == Path("tir/vcpo/lag2/seed0")
    assert run_path("*", "*", "*", "{seed}") == Path("*/*/lag*/seed{seed}")
    assert run_folder(tmp_path, Arm("countdown", "vcpo_lr1e-4_k12", "vcpo", 1), 3) == tmp_path / "countdown/vcpo_lr1e-4_k12/seed3"
    archive = Path(__file__).resolve().parents[1] / "tables" / "across_lags"
    rows = [json.loads(line) for line in (archive / "runs.jsonl").read_text().splitlines()]
    countdown = [row for row in rows if row["task"] == "countdown"]
    assert len(countdown) == 200
    assert all((archive / "runs" / run_path(row["task"], row["arm"], None, row["seed"])).is_dir() for row in countdown)


def test_a_verl_checkpoints_config_is_made_to_say_its_weights_dtype(tmp_path):
    """verl writes a checkpoint's Hugging Face config with bfloat16 whatever its weights are: label_checkpoint_dtypes
    reads the safetensors headers and makes each config say float32 where the weights are float32; a config already
    right, a folder of mixed dtypes and a run without checkpoints are left alone."""
    import torch
    from safetensors.torch import save_file

    from vcpo.runs import label_checkpoint_dtypes, weights_dtype

    run = tmp_path / "run"
    assert label_checkpoint_dtypes(run) == []
    folders = {}
    for step, tensors in ((1, {"w": torch.zeros(2, dtype=torch.float32), "ids": torch.zeros(2, dtype=torch.int64)}),
                          (2, {"w": torch.zeros(2, dtype=torch.bfloat16)}),
                          (3, {"a": torch.zeros(2), "b": torch.zeros(2, dtype=torch.bfloat16)})):
        folders[step] = run / "checkpoints" / f"global_step_{step}" / "actor" / "huggingface"
        folders[step].mkdir(parents=True)
        save_file(tensors, folders[step] / "model.safetensors")
        (folders[step] / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": "bfloat16"}))
    assert [weights_dtype(folders[step]) for step in (1, 2, 3)] == ["float32", "bfloat16", None]
    assert label_checkpoint_dtypes(run) == [folders[1] / "config.json"]
    assert json.loads((folders[1] / "config.json").read_text()) == {"model_type": "llama", "dtype": "float32"}
    assert json.loads((folders[3] / "config.json").read_text())["dtype"] == "bfloat16"


def test_a_checkpoint_a_kill_cut_short_is_left_unlabelled_not_an_error(tmp_path):
    """The launcher labels checkpoints however its run ended: weights cut inside their header, or a torn config, leave
    that checkpoint as it is (no dtype is claimed for it) and the others are labelled."""
    import torch
    from safetensors.torch import save_file

    from vcpo.runs import label_checkpoint_dtypes, weights_dtype

    folders = [tmp_path / "checkpoints" / f"global_step_{step}" / "actor" / "huggingface" for step in (1, 2, 3)]
    for folder in folders:
        folder.mkdir(parents=True)
        save_file({"w": torch.zeros(2)}, folder / "model.safetensors")
        (folder / "config.json").write_text(json.dumps({"dtype": "bfloat16"}))
    whole = (folders[0] / "model.safetensors").read_bytes()
    (folders[0] / "model.safetensors").write_bytes(whole[:20])  # cut inside the header
    (folders[1] / "config.json").write_text('{"dty')
    assert weights_dtype(folders[0]) is None and weights_dtype(folders[2]) == "float32"
    assert label_checkpoint_dtypes(tmp_path) == [folders[2] / "config.json"]
    assert (folders[1] / "config.json").read_text() == '{"dty'


def test_a_relaunch_killed_before_it_joined_its_metrics_is_joined_by_the_next(tmp_path):
    """A resumed verl run whose launcher was killed outright leaves the set-aside steps in metrics.resumed.jsonl and its
    own in metrics.jsonl (a torn last line among them); the next relaunch, from that relaunch's newer checkpoint, sets
    aside both, joined (the repeated step merged, the torn line left out), up to that checkpoint only."""
    from vcpo.runs import METRICS_BEFORE_RESUME, join_resumed_metrics, set_metrics_aside_for_resume

    def line(step: int, **data: float) -> str:
        return json.dumps({"step": step, "data": data}) + "\n"

    (tmp_path / METRICS_BEFORE_RESUME).write_text(line(1, a=1.0) + line(2, a=2.0))
    (tmp_path / "metrics.jsonl").write_text(line(2, v=0.5) + line(3, a=3.0) + line(4, a=4.0) + '{"step": 5, "da')
    set_metrics_aside_for_resume(tmp_path, checkpointed_step=3)
    assert not (tmp_path / "metrics.jsonl").exists()
    assert [json.loads(text) for text in (tmp_path / METRICS_BEFORE_RESUME).read_text().splitlines()] == [
        {"step": 1, "data": {"a": 1.0}}, {"step": 2, "data": {"v": 0.5, "a": 2.0}}, {"step": 3, "data": {"a": 3.0}}]
    (tmp_path / "metrics.jsonl").write_text(line(4, a=4.5))  # no validation before this relaunch's first step
    join_resumed_metrics(tmp_path)
    assert [json.loads(text)["data"]["a"] for text in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        1.0, 2.0, 3.0, 4.5]
    assert not (tmp_path / METRICS_BEFORE_RESUME).exists()
    set_metrics_aside_for_resume(tmp_path, checkpointed_step=0)  # no checkpoint: verl starts over, and so do its metrics
    assert (tmp_path / METRICS_BEFORE_RESUME).read_text() == "" and not (tmp_path / "metrics.jsonl").exists()
