"""The across-lags study's rules (recipes/sim/across_lags.md) on hand-made rows, and its committed table."""

import json
import math
import subprocess
from pathlib import Path

import numpy as np
import pytest

from vcpo.studies.across_lags import (
    ARCHIVE,
    DESIGN,
    REGISTRATION,
    TABLE,
    confirm_report,
    counts,
    load_design,
    median_steps,
    report,
    search_report,
    steps_to_target,
    sync_target,
    timing_command,
)
from vcpo.studies.across_lags_report import time_lines
from vcpo.studies.statistics import equivalence

ROOT = Path(__file__).resolve().parents[1]


def test_steps_to_target_is_the_first_evaluation_at_or_above_it():
    curve = [(0, 0.20), (25, 0.24), (50, 0.31), (75, 0.29), (100, 0.33)]
    assert steps_to_target(curve, 0.30) == 50 and steps_to_target(curve, 0.24) == 25 and steps_to_target(curve, 0.4) is None
    # a run that never reaches it counts as later than every step: the median of 10 runs with 5 misses is beyond
    assert median_steps([25, 50, 50, 75, 100, None, None, None, None, None]) == math.inf
    assert median_steps([25, 50, 50, 75, 100, 125, None, None, None, None]) == 112.5


def test_the_target_is_the_best_sync_arms_mean_final_validation_accuracy():
    rows = [{"task": "countdown", "method": "sync", "arm": arm, "end": end, "end_validation": validation}
            for arm, end, validation in (("sync_lr2e-4", 0.26, 0.30), ("sync_lr2e-4", 0.28, 0.32),
                                         ("sync_lr1e-4", 0.31, 0.34), ("sync_lr1e-4", 0.29, 0.36))]
    assert sync_target(rows) == {"arm": "sync_lr1e-4", "target": pytest.approx(0.35), "n": 2}


def test_only_rows_started_after_the_registration_from_a_clean_tree_count():
    later, end = "2026-11-26T15:00:00+00:00", "2026-11-26T16:00:00+00:00"
    assert counts({"started": later, "dirty": False, "finished": end})
    assert not counts({"started": later, "dirty": True, "finished": end}) and not counts({"started": later, "dirty": None, "finished": end})
    assert not counts({"started": "2026-11-26T14:00:00+00:00", "dirty": False, "finished": end})
    assert not counts({"started": None, "dirty": False, "finished": end}) and not counts({"started": later, "dirty": False})


def test_equivalence_is_two_one_sided_t_tests():
    # n = 2 (one degree of freedom: the Cauchy distribution): differences 0 and 0.02, margin 0.03
    # mean 0.01, standard error 0.01; t = 4 and -2; p = max(1/2 - atan(4)/pi, 1/2 - atan(2)/pi)
    result = equivalence([0.0, 0.02], [0.0, 0.0], margin=0.03)
    assert result["p"] == pytest.approx(0.5 - math.atan(2) / math.pi)
    # p < 0.05 exactly when the 90% interval lies inside the margins (the TOST identity)
    generator = np.random.default_rng(0)
    for _ in range(200):
        differences = generator.normal(generator.uniform(-0.04, 0.04), generator.uniform(0.005, 0.05), size=10)
        r = equivalence(differences, np.zeros(10), margin=0.03)
        assert (r["p"] < 0.05) == (-r["margin"] < r["low90"] and r["high90"] < r["margin"])


def search_row(method, lr, lag, seed, *, holds=True, collapsed=False, scale=1.0, end_over_best=0.9):
    return {"method": method, "lr": lr, "lag": lag, "seed": seed, "holds": holds, "collapsed": collapsed,
            "mean_lr_scale": scale, "end_validation": end_over_best * 0.5, "best": 0.5, "end": 0.4}


def test_the_search_chooses_by_the_registered_rule():
    rows = []
    for lr in (2e-4, 5e-4):
        rows += [search_row("sync", lr, 0, s) for s in range(3)]
    # (2e-4, 8): 2 collapses, VCPO's factor leaves 1 -> qualifies; (5e-4, 4): 3 collapses -> qualifies, ranks first
    # (5e-4, 8): 3 collapses but VCPO's factor stays at 1 -> does not
    for lr, lag, collapses, scale in ((2e-4, 8, 2, 0.8), (5e-4, 4, 3, 0.9), (5e-4, 8, 3, 0.99)):
        rows += [search_row("seq_tis_c8", lr, lag, s, collapsed=s < collapses) for s in range(3)]
        rows += [search_row("vcpo", lr, lag, s, scale=scale) for s in range(3)]
    result = search_report(rows)
    assert [(c["lr"], c["lag"], c["qualifies"]) for c in result["cells"]] == [(2e-4, 8, True), (5e-4, 4, True), (5e-4, 8, False)]
    assert result["chosen"] == {"lr": 5e-4, "lag": 4} and result["complete"]
    # a sync seed that does not hold disqualifies its rate's cells; an unfinished cell makes the search incomplete
    rows[3]["holds"] = False
    assert search_report(rows)["chosen"] == {"lr": 2e-4, "lag": 8}
    assert search_report(rows[:-1])["complete"] is False
    from vcpo.studies.across_lags_report import search_markdown

    written = search_markdown(search_report(rows))
    assert "Chosen cell (the registered rule): lr 2e-4, k = 8." in written and "| 5e-4 | 4 | 2/3 |" in written
    assert "No cell qualifies" in search_markdown(search_report([r for r in rows if not (r["lr"] == 2e-4 and r["lag"] == 8)]))


def test_the_timing_runs_use_both_cores_as_registered(tmp_path):
    design = load_design(ROOT / DESIGN)
    sync = timing_command(design, "sync_lr2e-4", tmp_path)
    vcpo = timing_command(design, "vcpo_k48", tmp_path)
    assert "threads=2" in sync and "threads=1" not in sync and "execution=concurrent" not in sync
    assert "threads=1" in vcpo and "execution=concurrent" in vcpo and "lag=48" in vcpo and "reference_lr=0.0002" in vcpo
    assert all("eval_every=0" in c and "lag_model=pipeline_overlap" in c for c in (sync, vcpo))


def test_the_report_compares_per_lag_and_times_to_target():
    design = load_design(ROOT / DESIGN)
    rows, generator = [], np.random.default_rng(1)
    arms = {"sync_lr2e-4": ("sync", 2e-4, 0, 0.28), "sync_lr1e-4": ("sync", 1e-4, 0, 0.30)}
    for lag in (12, 48):
        arms |= {f"vcpo_k{lag}": ("vcpo", 2e-4, lag, 0.29), f"seq_tis_lr5e-5_k{lag}": ("seq_tis_c8", 5e-5, lag, 0.25)}
    for arm, (method, lr, lag, end) in arms.items():
        for seed in range(10):
            value = end + generator.normal(0, 0.01)
            rows.append({"task": "countdown", "study_task": "countdown", "arm": arm, "method": method, "lr": lr, "lag": lag,
                         "seed": seed, "end": value, "end_validation": value, "last_quarter": value, "base": 0.2, "collapsed": False,
                         "mean_lr_scale": 1.0, "ess_mean": 1.0, "ess_min": 1.0, "grad_norm_max": 1.0, "counts": True,
                         "steps_to_target": 100 if method != "seq_tis_c8" and arm != "vcpo_k48" else None})
    timing = {"seconds_per_step": {"sync_lr1e-4": 0.4, "vcpo_k12": 0.3, "vcpo_k48": 0.5}}
    stats = report(rows, design, timing)["countdown"]
    primary = {c["a"]: c for c in stats["primary"]}
    assert primary["vcpo_k12"]["b"] == "seq_tis_lr5e-5_k12" and primary["vcpo_k12"]["verdict"] == "vcpo_k12 above seq_tis_lr5e-5_k12"
    assert primary["vcpo_k24"]["n"] == 0 and "verdict" not in primary["vcpo_k24"]  # no runs: not tested, not guessed
    assert [e["b"] for e in stats["equivalence"]] == ["sync_lr1e-4", "sync_lr1e-4"]
    assert stats["arms"]["seq_tis_lr5e-5_k12"]["median_steps"] == math.inf and stats["arms"]["vcpo_k12"]["reached"] == 10
    # vcpo_k48 never reaches the target: at least the 200 steps of the runs, 200 x 0.5 s against sync's 100 x 0.4 s
    assert [(t["lag"], t["ratio"], t["at_least"]) for t in stats["time_to_target"]] == [
        (12, pytest.approx(0.75), False), (48, pytest.approx(2.5), True)]
    assert time_lines(stats["time_to_target"])[-1] == "| 48 | > 200 x 0.500 = > 100 | 100 x 0.400 = 40 | > 2.50 |"


def test_the_confirmation_compares_vcpo_with_seq_tis_then_sync_holm_over_the_two():
    from vcpo.studies.across_lags_report import summary_markdown

    design = load_design(ROOT / DESIGN)
    ends = {"sync_lr5e-4": 0.75, "seq_tis_lr5e-4_k8": 0.10, "vcpo_lr5e-4_k8": 0.20}
    methods = {"sync_lr5e-4": "sync", "seq_tis_lr5e-4_k8": "seq_tis_c8", "vcpo_lr5e-4_k8": "vcpo"}
    noise = {seed: 0.01 * (seed - 14.5) for seed in range(10, 20)}
    rows = [{"task": "tir", "study_task": "tir_confirm", "arm": arm, "method": methods[arm], "lr": 5e-4, "lag": 8 if "k8" in arm else 0,
             "seed": seed, "end": end + noise[seed] * (arm == "vcpo_lr5e-4_k8"), "end_validation": end, "last_quarter": end, "base": 0.6,
             "collapsed": False, "mean_lr_scale": 0.8, "ess_mean": 0.5, "ess_min": 0.1, "grad_norm_max": 1.0, "counts": True}
            for arm, end in ends.items() for seed in range(10, 20) if not (arm == "sync_lr5e-4" and seed == 19)]
    confirm = confirm_report(rows, design)
    primary, secondary = confirm["comparisons"]
    assert (primary["a"], primary["b"], secondary["b"]) == ("vcpo_lr5e-4_k8", "seq_tis_lr5e-4_k8", "sync_lr5e-4")
    # VCPO - seq-TIS: the ten differences are 0.10 + noise; the noise has mean 0 over seeds 10-19
    assert primary["n"] == 10 and primary["mean"] == pytest.approx(0.10)
    assert secondary["n"] == 9 and secondary["mean"] == pytest.approx(-0.55 + np.mean([noise[s] for s in range(10, 19)]))
    assert primary["p_holm"] == pytest.approx(min(1.0, 2 * min(primary["p"], secondary["p"])) if primary["p"] < secondary["p"]
                                              else max(min(1.0, 2 * secondary["p"]), primary["p"]))
    assert confirm["missing"] == {"sync_lr5e-4": [19]}
    stats = {**report(rows, design, None), "registration": {"commit": "0" * 40}}
    summary = summary_markdown(stats)
    assert "sync_lr5e-4 seeds 19" in summary and "| vcpo_lr5e-4_k8 - seq_tis_lr5e-4_k8 | 10 | +10.0" in summary


def committed_rows() -> list[dict]:
    path = ROOT / TABLE
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_the_registration_constant_is_the_commit_that_added_the_registration():
    added = subprocess.run(["git", "log", "--diff-filter=A", "--format=%H %cI", "--", "recipes/sim/across_lags.md"],
                           cwd=ROOT, capture_output=True, text=True)
    if added.returncode != 0 or not added.stdout.strip():
        pytest.skip("no git history here")
    commit, time = added.stdout.split()[-2:]
    assert REGISTRATION == {"commit": commit, "time": time}


def committed_table_and_archive() -> tuple[list[dict], list[Path]]:
    """The rows and the archived runs' final evaluations as committed (HEAD), so that a runner archiving into this
    working tree meanwhile changes nothing; the files themselves where there is no git history."""
    table = subprocess.run(["git", "show", f"HEAD:{TABLE}"], cwd=ROOT, capture_output=True, text=True)
    listed = subprocess.run(["git", "ls-tree", "-r", "--name-only", "HEAD", str(ARCHIVE)], cwd=ROOT, capture_output=True, text=True)
    if table.returncode != 0 or listed.returncode != 0:
        return committed_rows(), sorted((ROOT / ARCHIVE).glob("*/*/seed*/final/eval.json"))
    rows = [json.loads(line) for line in table.stdout.splitlines() if line.strip()]
    return rows, [Path(name) for name in listed.stdout.splitlines() if name.endswith("final/eval.json")]


def test_every_committed_row_names_its_commit_and_started_after_the_registration():
    rows, finals = committed_table_and_archive()
    if not rows:
        pytest.skip("no across-lags runs archived yet")
    assert all(row["commit"] and row["started"] > REGISTRATION["time"] and row["counts"] for row in rows)
    archived = {(p.parts[-5], p.parts[-4], int(p.parts[-3].removeprefix("seed"))) for p in finals}
    assert {(row["study_task"], row["arm"], row["seed"]) for row in rows} == archived  # one row per archived run


def test_sync_rows_repeat_the_evidence_studys_on_the_same_cpu():
    """The study's sync arms are the evidence study's sync configuration: on the same CPU type each seed must end
    exactly where the evidence study's did (the determinism the kernels section relies on)."""
    rows = [row for row in committed_rows() if row["method"] == "sync" and row["study_task"] == "countdown"]
    if not rows:
        pytest.skip("no sync runs archived yet")
    evidence = {(row["arm"], row["seed"]): row for row in
                (json.loads(line) for line in (ROOT / "tables/evidence/runs.jsonl").read_text().splitlines()) if row["task"] == "countdown"}
    pairs = [(row, evidence[("sync" if row["lr"] == 2e-4 else "sync_lr1e-4", row["seed"])]) for row in rows]
    same_cpu = [(new, old) for new, old in pairs if new["cpu"] == old["cpu"]]
    assert same_cpu and all(new["end"] == old["end"] for new, old in same_cpu)


def test_the_committed_search_table_is_what_the_rows_give():
    """The committed tir_search.md is what search_markdown writes from the search's rows."""
    from vcpo.studies.across_lags_report import search_markdown

    rows = [row for row in committed_rows() if row["counts"] and row["study_task"] == "tir_search"]
    outcome = search_report(rows)
    if not outcome["complete"]:
        pytest.skip("the search is not complete in the committed rows")
    assert (ROOT / "tables/across_lags/tir_search.md").read_text() == search_markdown(outcome)


def test_the_studies_config_keeps_the_floating_point_order_of_every_archived_row():
    """OPOB combines "deferred" by default since both studies ran; every archived row's command reads
    recipes/sim/regime.yaml, which keeps the two-buffer combination they ran with, and none overrides it."""
    from vcpo.sim.config import SimConfig, load_config_file

    assert SimConfig().opob_combination == "deferred"
    assert load_config_file(ROOT / "recipes/sim/regime.yaml").opob_combination == "buffers"
    for table in (ROOT / TABLE, ROOT / "tables/evidence/runs.jsonl"):
        commands = [json.loads(line)["command"] for line in table.read_text().splitlines()]
        assert commands and all("--config recipes/sim/regime.yaml " in c and "opob_combination" not in c for c in commands)


def test_the_transfer_sentence_says_when_a_best_rate_moves_with_the_lag():
    from vcpo.studies.across_lags_report import rate_transfer_sentence

    rows = [{"method": "m", "lag": lag, "ends": ends, "best_lr": 0.0}
            for lag, ends in ((12, {"1e-4": 0.30, "2e-4": 0.25}), (96, {"1e-4": 0.20, "2e-4": 0.25, "5e-5": 0.4}))]
    assert "the best rate changes with the lag for m" in rate_transfer_sentence(rows)
    rows[1]["ends"]["1e-4"] = 0.26
    assert "its best is the same at every lag (m 1e-4)" in rate_transfer_sentence(rows)  # 5e-5 was not tried at k = 12


# -- damaged archives (a copy of one archived run, never the committed archive itself) ---------------------------
ARCHIVED_RUN = ROOT / "tables/across_lags/runs/tir_search/vcpo_lr2e-4_k4/seed1"


@pytest.fixture
def archived_copy(tmp_path):
    import shutil

    folder = tmp_path / "run"
    shutil.copytree(ARCHIVED_RUN, folder)
    return folder


def test_an_archive_cut_short_is_refused_naming_the_file_and_the_missing_steps(archived_copy):
    from vcpo.runs import MetricsProblem
    from vcpo.studies.design import archived_metrics

    assert len(archived_metrics(archived_copy)) == 81  # whole: steps 0-79 and the final evaluation's line
    metrics = archived_copy / "metrics.jsonl"
    metrics.write_text("".join(metrics.read_text().splitlines(keepends=True)[:41]))  # steps 0-40 kept
    with pytest.raises(MetricsProblem, match=rf"{metrics} lacks steps 41, 42, 43, 44, 45, \.\.\. \(39 in all\) of the 80"):
        archived_metrics(archived_copy)


@pytest.mark.parametrize(("file", "content", "message"), [
    ("final/eval.json", "{not json", r"final/eval.json cannot be read as JSON \(JSONDecodeError"),
    ("final/eval.json", "{}", "final/eval.json lacks test/accuracy"),
    ("final/eval.json", "[1, 2]", "final/eval.json holds a JSON list, not an object"),
    ("config.json", '{"steps": 80}', "config.json lacks task, lag, reference_lr, base_seed"),
])
def test_a_damaged_run_file_is_one_sentence_naming_it(archived_copy, file, content, message):
    from vcpo.runs import RunFileProblem
    from vcpo.studies.across_lags import DESIGN
    from vcpo.studies.design import load_design
    from vcpo.studies.evidence import run_row

    design = load_design(ROOT / DESIGN)
    arm = design.arm("tir_search", "vcpo_lr2e-4_k4")
    root = archived_copy.parent / "archive"
    folder = root / "tir_search" / "vcpo_lr2e-4_k4" / "seed1"
    folder.parent.mkdir(parents=True)
    archived_copy.rename(folder)
    assert run_row(design, arm, 1, root)["end"] == json.loads((ARCHIVED_RUN / "final/eval.json").read_text())["test/accuracy"]
    (folder / file).write_text(content)
    with pytest.raises(RunFileProblem, match=message):
        run_row(design, arm, 1, root)


def test_a_run_twice_in_a_table_is_refused_by_every_reader(tmp_path):
    import sys

    from vcpo.runs import RunFileProblem
    from vcpo.studies.evidence import read_rows

    lines = (ROOT / "tables/evidence/runs.jsonl").read_text().splitlines(keepends=True)
    table = tmp_path / "runs.jsonl"
    table.write_text("".join([*lines[:3], lines[1]]))
    row = json.loads(lines[1])
    with pytest.raises(RunFileProblem, match=rf"{table} lines 2 and 4 are the same run \({row['task']}/{row['arm']}/{row['seed']}\)"):
        read_rows(table)
    for study in ("evidence", "across_lags"):
        done = subprocess.run([sys.executable, "-m", f"vcpo.studies.{study}", "report", "--table", str(table), "--out", str(tmp_path)],
                              capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert done.returncode == 1 and done.stderr.strip().splitlines() == [f"error: {table} lines 2 and 4 are the same run "
                                                                           f"({row['task']}/{row['arm']}/{row['seed']})"]


def test_a_partial_last_line_is_reported_once_however_often_the_file_is_read(archived_copy, caplog):
    from vcpo.reporting.run_data import read_metrics

    with open(archived_copy / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 80, "actor/lr')
    for _ in range(3):
        assert len(read_metrics(archived_copy)) == 81
    assert sum("a partial last line is left out" in record.message for record in caplog.records) == 1


def test_every_committed_row_records_its_start_end_and_attempts():
    """Every archived row has `finished`: the run's record, or (two rows whose record a restart after the end
    overwrote) the start of that later attempt, an upper bound, said so in `finished_source`."""
    rows = committed_rows()
    assert rows and all(row["finished"] and row["started"] <= row["finished"] for row in rows)
    derived = [row for row in rows if row["finished_source"] != "recorded"]
    assert [(row["arm"], row["seed"]) for row in derived] == [("vcpo_k12", 3), ("vcpo_lr1e-4_k12", 3)]
    for row in derived:
        assert row["finished"] == row["attempts"][-1]["started"] and row["attempts"][-1]["step"] == row["steps"]
    assert all(row["attempts"] and row["attempts"][0]["started"] == row["started"] for row in rows)


def test_a_row_without_its_end_does_not_count():
    row = next(row for row in committed_rows() if row["counts"])
    assert counts(row) and not counts({**row, "finished": None}) and not counts({**row, "dirty": True})


def test_a_report_refuses_analysis_code_other_than_the_registered_commit():
    from vcpo.studies.design import analysis_commit_problem

    assert analysis_commit_problem({"commit": "a" * 40}, "b" * 40) is None  # registered before the rule: names none
    assert analysis_commit_problem({"analysis_commit": "c" * 40}, "c" * 40) is None
    problem = analysis_commit_problem({"analysis_commit": "c" * 40}, "d" * 40)
    assert "names analysis code at commit cccccccccccc, but vcpo/studies is at dddddddddddd" in problem
    assert "--any-analysis-commit" in problem
