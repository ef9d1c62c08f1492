"""A script that writes a table under tables/ never replaces it with one that holds less: fewer rows, or a row over
fewer problems, runs, seeds or rounds is refused in one line before anything runs or is written; --out (or --json,
--table, --tables) writes elsewhere."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_local_models import _benchmark_module

from vcpo.cli import shrink_problem

TABLES = Path(__file__).resolve().parents[1] / "tables"


def test_a_table_loses_nothing_a_run_would_drop():
    recorded = {"gsm8k": 65, "math500": 500}
    assert shrink_problem(Path("t.json"), recorded, {"gsm8k": 65, "math500": 500, "aime24": 30}, "pass --tables") is None
    assert shrink_problem(Path("t.json"), recorded, {"gsm8k": 65}, "pass --tables", rows="benchmarks") == (
        "t.json holds benchmarks math500 that this run lacks: nothing written; pass --tables")
    assert shrink_problem(Path("t.json"), recorded, {"gsm8k": 1, "math500": 500}, "pass --tables", unit="problems") == (
        "t.json has gsm8k over 65 problems and this run would have 1: nothing written; pass --tables")
    many = shrink_problem(Path("t.json"), dict.fromkeys("abcde", 1), {}, "pass --out")
    assert many == "t.json holds rows a, b, c and 2 more that this run lacks: nothing written; pass --out"


def folder_files(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


@pytest.fixture
def no_processes(monkeypatch):
    """A benchmark that refuses starts none of its runs."""
    for start in ("run", "Popen"):
        monkeypatch.setattr(subprocess, start, lambda command, *args, **kwargs: pytest.fail(f"started {command}"))


def refused(run, folder: Path) -> str:
    """The one line with which ``run()`` refuses, having written nothing under ``folder``."""
    before = folder_files(folder)
    with pytest.raises(SystemExit) as stopped:
        run()
    assert folder_files(folder) == before
    message = str(stopped.value.code)
    assert message.startswith("error: ") and "\n" not in message and ": nothing written; pass --" in message
    return message


@pytest.mark.parametrize(
    ("script", "recorded", "name", "argv", "expected"),
    [
        ("async_speed", "async_speed/async_speed.json", "async_speed.json", ["--out", "{out}", "--lags", "4"],
         "holds configurations countdown seq_tis_c8 k=1, countdown seq_tis_c8 k=2, countdown seq_tis_c8 k=12 and 13 more"),
        ("verl_async_speed", "verl_async_speed/verl_async_speed.json", "verl_async_speed.json",
         ["--out", "{out}", "--lags", "0,1"], "holds runs lag 2 that this run lacks"),
        ("verl_async_speed", "verl_async_speed/verl_async_speed.json", "verl_async_speed.json",
         ["--out", "{out}", "--steps", "6"], "has lag 0 over 10 timed steps and this run would have 2"),
        ("sim_update_cost", "opob_sim/update_cost.json", "update_cost.json", ["--json", "{out}/update_cost.json"],
         "has seq_tis_c8 over 32 updates and this run would have 12"),
        ("opob_memory", "opob_memory/results.json", "results.json", ["--out", "{out}", "--models", "small"],
         "holds points 50m plain G=1, 50m single G=1, 50m two_pass G=1 and 10 more"),
        ("real_model_step", "real_model/step/lag12_final.json", "lag12_final.json",
         ["--json", "{out}/lag12_final.json", "--skip-run"], "holds parts the verl run that this run lacks"),
    ],
)
def test_a_benchmark_run_that_would_measure_less_is_refused_before_it_starts(tmp_path, no_processes, script, recorded, name,
                                                                               argv, expected):
    module = _benchmark_module(script)
    shutil.copy(TABLES / recorded, tmp_path / name)
    message = refused(lambda: module.main([part.format(out=tmp_path) for part in argv]), tmp_path)
    assert message.startswith(f"error: {tmp_path / name} ") and expected in message
    assert "pass --out for a folder of your own" in message or "pass --json for a file of your own" in message


def test_kernel_pinning_refuses_fewer_repeats(tmp_path, monkeypatch, no_processes):
    module = _benchmark_module("kernel_pinning")
    shutil.copy(TABLES / "kernel_pinning" / "kernel_pinning.json", tmp_path)
    monkeypatch.setattr(sys, "argv", ["kernel_pinning.py", "--out", str(tmp_path), "--repeats", "1"])
    assert "has native over 2 repeats and this run would have 1: nothing written; pass --out" in refused(
        module.main, tmp_path)


def test_the_answer_audit_refuses_a_report_over_fewer_responses(tmp_path):
    module = _benchmark_module("answer_format_audit")
    response = {"id": "sums/0/0", "task": "sums", "question": "2 + 3?", "ground_truth": "5", "response": "5", "ended": True,
                "tokens": 1, "scores": {"strict": "correct", "lenient": "correct"}}
    (tmp_path / "samples.jsonl").write_text(json.dumps(response) + "\n")
    (tmp_path / "labels.jsonl").write_text(json.dumps({"id": "sums/0/0", "label": "correct"}) + "\n")
    shutil.copy(TABLES / "real_model" / "answer_audit" / "audit.json", tmp_path)
    message = refused(lambda: module.main(["report", "--out", str(tmp_path)]), tmp_path)
    assert message == (f"error: {tmp_path / 'audit.json'} has the audit over 384 responses and this run would have 1: "
                       "nothing written; pass --out for a folder of your own")


def test_a_summary_table_is_not_replaced_by_one_over_fewer_runs(tmp_path):
    from vcpo.studies.plots import main

    shutil.copy(TABLES / "sim_study" / "core_k12.md", tmp_path)
    argv = [str(tmp_path / "no_runs"), "--lag", "12", "--out", str(tmp_path / "core.png"), "--table", str(tmp_path / "core_k12.md")]
    message = refused(lambda: main(argv), tmp_path)
    assert "holds rows sync at lag 0, seq_tis_c8 at lag 12, vcpo at lag 12 that this run lacks" in message


@pytest.mark.parametrize("study", ["evidence", "across_lags"])
def test_a_study_table_keeps_every_run_and_its_report_every_run_it_counted(tmp_path, capsys, study):
    """The table of rows from an archive without every run (a fresh clone's, say), and a report from a table with fewer
    runs than the one that wrote the report there: one line each, nothing written."""
    import importlib

    main = importlib.import_module(f"vcpo.studies.{study}").main
    lines = (TABLES / study / "runs.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "runs.jsonl").write_text("".join(lines[:20]))
    (tmp_path / "archive").mkdir()
    message = refused(lambda: main(["rows", "--archive", str(tmp_path / "archive"), "--table", str(tmp_path / "runs.jsonl")]),
                      tmp_path)
    assert message.startswith(f"error: {tmp_path / 'runs.jsonl'} holds runs ") and "and 17 more that this run lacks" in message
    (tmp_path / "out").mkdir()
    shutil.copy(TABLES / study / "stats.json", tmp_path / "out")
    before = folder_files(tmp_path)
    argv = ["report", "--table", str(tmp_path / "runs.jsonl"), "--out", str(tmp_path / "out")]
    assert main(argv + (["--any-analysis-commit"] if study == "across_lags" else [])) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith(f"error: {tmp_path / 'out' / 'stats.json'} ") and folder_files(tmp_path) == before
    expected = "has the report over 272 runs and this run would have 20" if study == "across_lags" else "holds arms countdown/"
    assert expected in error[0]


def test_a_driver_kills_its_child_when_it_dies(tmp_path):
    """dies_with_this_thread, as the table scripts start their children: a SIGKILLed driver's child ends with it."""
    driver = ("import subprocess, sys, time; from vcpo.lifetimes import dies_with_this_thread; "
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], preexec_fn=dies_with_this_thread); "
              "print(child.pid, flush=True); time.sleep(600)")
    process = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE, text=True)
    child = Path(f"/proc/{int(process.stdout.readline())}")
    process.kill()
    process.wait()
    deadline = time.monotonic() + 60  # a guard against a hang only: left alone, the child sleeps ten minutes
    while child.exists() and child.joinpath("stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline, "the child outlived its driver"
        time.sleep(0.05)


def test_the_regime_report_refuses_a_runs_folder_without_every_run_it_judged(tmp_path):
    """A fresh clone's empty runs folder, and a run over fewer steps: one line, no figure or table written."""
    from vcpo.studies.regime_report import keep_every_run, main

    out, runs = tmp_path / "out", tmp_path / "runs"
    out.mkdir(), runs.mkdir()
    shutil.copy(TABLES / "regime_study" / "outcomes.json", out)
    message = refused(lambda: main([str(runs), "--out", str(out)]), tmp_path)
    assert message.startswith(f"error: {out / 'outcomes.json'} holds runs dsv32_mis at lag 48 seed 0, ")
    judged = json.loads((out / "outcomes.json").read_text())["runs"]
    keep_every_run(out / "outcomes.json", judged)  # the same runs: nothing to refuse
    shorter = [{**judged[0], "steps": judged[0]["steps"] // 2}, *judged[1:]]
    with pytest.raises(SystemExit, match=r"has dsv32_mis at lag 48 seed 0 over 200 steps and this run would have 100: "):
        keep_every_run(out / "outcomes.json", shorter)


@pytest.mark.parametrize("part_exit", [0, 1])
def test_a_gpu_check_replaces_the_committed_check_only_when_every_part_passes(tmp_path, monkeypatch, part_exit):
    """Parts stood in for by functions that write their log and exit with ``part_exit``: a failing check leaves the
    committed folder byte-identical and its own files beside it; a passing one replaces the folder."""
    module = _benchmark_module("gpu_check")
    out = tmp_path / "gpu_check"
    shutil.copytree(TABLES / "gpu_check", out)
    committed = folder_files(out)

    def part(name):
        def run(args, folder):
            (folder / f"{name}.log").write_text(f"new {name}")
            return {"command": [name], "exit": part_exit, "seconds": 0.0}
        return run

    for name in module.PARTS:
        monkeypatch.setattr(module, name, part(name))
    monkeypatch.setattr(module, "shrink_problem", lambda *args, **kwargs: None)  # sizes are the other test's
    code = module.main(["--out", str(out), "--device", "cpu", "--model", "0.1m", "--seq-len", "64", "--repeats", "1"])
    assert code == part_exit
    written = {f"{name}.log" for name in module.PARTS} | {"gpu_check.json", "provenance.json"}
    if part_exit:
        assert folder_files(out) == committed
        assert {path.name for path in (tmp_path / "gpu_check.failed").iterdir()} == written
    else:
        assert {path.name for path in out.iterdir()} == written and not (tmp_path / "gpu_check.failed").exists()
        assert (out / "overhead.log").read_text() == "new overhead"
        # the new logs, which the committed folder's provenance.json no longer names, are the new run's, as it says
        from vcpo.provenance import unrecorded

        folder_record = json.loads((out / "provenance.json").read_text())
        assert not unrecorded(folder_record) and folder_record["commit"] == json.loads((out / "gpu_check.json").read_text())["provenance"]["commit"]
    assert not (tmp_path / ".gpu_check.before").exists()


def test_the_gpu_check_refuses_a_cpu_dry_check_or_fewer_repeats_over_a_gpus_numbers(tmp_path, no_processes):
    module = _benchmark_module("gpu_check")
    shutil.copy(TABLES / "gpu_check" / "gpu_check.json", tmp_path)
    argv = ["--out", str(tmp_path), "--device", "cpu", "--model", "0.1m", "--seq-len", "64", "--repeats", "1"]
    message = refused(lambda: module.main(argv), tmp_path)
    assert message.startswith(f"error: {tmp_path / 'gpu_check.json'} holds parts overhead on cuda, model 0.5b, 2048 tokens, ")
    recorded = module.recorded_sizes(json.loads((tmp_path / "gpu_check.json").read_text()))
    assert shrink_problem(tmp_path, recorded, module.part_sizes(module.PARTS, "cuda", "0.5b", 2048, 5), "") is None
    assert "has overhead on cuda, model 0.5b, 2048 tokens over 5 repeats and this run would have 2: " in shrink_problem(
        tmp_path, recorded, module.part_sizes(module.PARTS, "cuda", "0.5b", 2048, 2), "", unit="repeats")


def test_the_across_lags_timing_refuses_fewer_arms_before_it_runs_any(tmp_path, monkeypatch, no_processes):
    from vcpo.studies import across_lags

    design = across_lags.load_design(across_lags.DESIGN)
    shutil.copy(TABLES / "across_lags" / "timing.json", tmp_path)
    recorded = json.loads((tmp_path / "timing.json").read_text())["seconds_per_step"]
    assert list(recorded) == across_lags.timing_arms(design)  # the design's arms are the table's
    monkeypatch.setattr(across_lags, "timing_arms", lambda design: list(recorded)[:-1])
    argv = ["timing", "--out", str(tmp_path / "runs"), "--table", str(tmp_path / "timing.json")]
    assert refused(lambda: across_lags.main(argv), tmp_path) == (
        f"error: {tmp_path / 'timing.json'} holds arms seq_tis_lr5e-5_k96 that this run lacks: nothing written; "
        "pass --table for a file of your own")


def test_the_tool_use_search_is_written_again_only_with_every_cell(tmp_path, capsys):
    """The committed rows write the committed outcome again, byte for byte; rows of one rate only (complete at that
    rate) are refused in one line, the outcome left as it was."""
    from vcpo.studies.across_lags import main

    shutil.copy(TABLES / "across_lags" / "tir_search.md", tmp_path)
    assert main(["search", "--out", str(tmp_path / "tir_search.md")]) == 0
    assert (tmp_path / "tir_search.md").read_bytes() == (TABLES / "across_lags" / "tir_search.md").read_bytes()
    rows = [line for line in (TABLES / "across_lags" / "runs.jsonl").read_text().splitlines(keepends=True)
            if json.loads(line)["study_task"] != "tir_search" or json.loads(line)["lr"] == 2e-4]
    (tmp_path / "runs.jsonl").write_text("".join(rows))
    capsys.readouterr()
    before = folder_files(tmp_path)
    assert main(["search", "--table", str(tmp_path / "runs.jsonl"), "--out", str(tmp_path / "tir_search.md")]) == 2
    assert folder_files(tmp_path) == before
    assert capsys.readouterr().err == (f"error: {tmp_path / 'tir_search.md'} holds cells lr 5e-4 at lag 4, lr 5e-4 at lag 8, "
                                       "lr 5e-4 at lag 16 that this run lacks: nothing written; pass --out for a file of "
                                       "your own\n")


def test_the_memory_model_check_refuses_fewer_points(tmp_path, no_processes):
    module = _benchmark_module("memory_model_check")
    points = [{"engine": "fsdp2", "model": model, "kind": "plain", "ranks": []} for model in ("small", "50m")]
    (tmp_path / "results.json").write_text(json.dumps({"rows": points}))
    argv = ["--out", str(tmp_path), "--engines", "fsdp2", "--models", "small", "--kinds", "plain"]
    assert refused(lambda: module.main(argv), tmp_path) == (
        f"error: {tmp_path / 'results.json'} holds points fsdp2 50m plain that this run lacks: nothing written; "
        "pass --out for a folder of your own")


def test_table1_refuses_a_table_over_fewer_seeds(tmp_path):
    from vcpo.reporting.__main__ import main

    (tmp_path / "runs").mkdir()
    shutil.copy(TABLES / "tir" / "table1_smoke.json", tmp_path / "table1.json")
    argv = ["table1", "--runs", str(tmp_path / "runs"), "--scale", "smoke", "--task", "countdown", "--task", "simpletir=tir",
            "--out", str(tmp_path / "table1.md")]
    assert refused(lambda: main(argv), tmp_path) == (
        f"error: {tmp_path / 'table1.json'} has countdown sync over 3 seeds and this run would have 0: nothing written; "
        "pass --out for a file of your own")
