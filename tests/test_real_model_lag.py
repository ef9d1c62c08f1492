"""The real model's lag study runner (vcpo.studies.real_model_lag): the registered rules on scripted rows, and one run's
row built from verl's metrics (verl itself is replaced by a script that writes the metrics its file logger would)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from vcpo.recipes import read_yaml, recipes_dir
from vcpo.studies import real_model_lag as study

DESIGN = read_yaml(recipes_dir() / study.DESIGN)
RULE = DESIGN["regime"]


def row(run: study.Run, improves: bool = False, collapsed: bool = False) -> dict:
    return {"name": run.name, "outcome": {"improves": improves, "collapsed": collapsed}}


def regime_runs(rate: float) -> tuple[study.Run, study.Run]:
    return (study.Run("regime", "sync", "sync", 0, rate, 100), study.Run("regime", "seq_tis", "seq_tis_c8", 12, rate, 100))


def test_a_run_collapses_only_when_its_end_halves_its_best_and_its_ess_ratio_fell_to_a_tenth():
    """Hand cases of the registered definitions: base 0.20, best 0.40, end 0.20 is at half the best (collapsed when the
    ESS ratio reached 0.1, not at 0.11, nor when no ESS ratio was logged); sync improves from 0.20 to 0.25 (5 points,
    inclusive) but not to 0.24, and a collapsed run never improves."""
    heldout = [(0, 0.20), (10, 0.40), (60, 0.20)]
    assert study.run_outcome(heldout, 0.10, RULE) == {"base": 0.20, "best": 0.40, "end": 0.20, "ess_min": 0.10,
                                                          "collapsed": True, "improves": False}
    assert not study.run_outcome(heldout, 0.11, RULE)["collapsed"]
    assert not study.run_outcome(heldout, None, RULE)["collapsed"]
    assert not study.run_outcome([(0, 0.20), (10, 0.40), (60, 0.21)], 0.0, RULE)["collapsed"]
    assert study.run_outcome([(0, 0.20), (60, 0.25)], 0.9, RULE)["improves"]
    assert not study.run_outcome([(0, 0.20), (60, 0.24)], 0.9, RULE)["improves"]
    with pytest.raises(ValueError, match="step-0"):
        study.run_outcome([(10, 0.2)], 0.5, RULE)


def test_the_ladder_climbs_rate_by_rate_and_stops_at_the_first_rate_its_rule_takes():
    """1e-5: sync improves, seq-TIS holds; 3e-5: both as the rule wants, so 3e-5 is chosen and no higher rate runs.
    Before 3e-5's seq-TIS row exists, that run is what the ladder asks for."""
    sync1, seq1 = regime_runs(1e-5)
    sync3, seq3 = regime_runs(3e-5)
    rows = {r["name"]: r for r in (row(sync1, improves=True), row(seq1), row(sync3, improves=True))}
    assert study.ladder(DESIGN, rows) == ([seq3], None)
    rows[seq3.name] = row(seq3, collapsed=True)
    runs, regime = study.ladder(DESIGN, rows)
    assert runs == [] and regime["rate"] == 3e-5 and regime["by"].startswith("the lowest rate")
    assert [verdict["rate"] for verdict in regime["ladder"]] == [1e-5, 3e-5]
    assert study.ladder(DESIGN, {}) == (list(regime_runs(1e-5)), None)


@pytest.mark.parametrize(("sync_improves_at", "rate"), [((1e-5, 1e-4), 1e-4), ((), 1e-5)])
def test_a_ladder_no_rate_of_which_qualifies_falls_back_as_registered(sync_improves_at, rate):
    """No collapse anywhere: the highest rate at which sync improved; sync improving nowhere: the fallback rate."""
    rows = {}
    for each in RULE["rates"]:
        sync, seq = regime_runs(each)
        rows |= {sync.name: row(sync, improves=each in sync_improves_at), seq.name: row(seq)}
    runs, regime = study.ladder(DESIGN, rows)
    assert runs == [] and regime["rate"] == rate and regime["by"].startswith("fallback")


def test_the_confirmation_waits_for_the_committed_regime_then_runs_seed_by_seed(tmp_path):
    """Once the ladder decides, next_runs writes regime.json and runs nothing until that file is committed; then the
    confirmation's runs come seed by seed (sync, seq-TIS, VCPO), without those already in runs.jsonl."""
    tables = tmp_path / "tables"
    tables.mkdir()
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    sync, seq = regime_runs(1e-5)
    done = study.Run("confirmation", "sync", "sync", 0, 1e-5, 0)
    rows = [row(sync, improves=True), row(seq, collapsed=True), row(done)]
    (tables / study.RUNS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    runs, where = study.next_runs(DESIGN, tables)
    assert runs == [] and "commit" in where
    assert json.loads((tables / study.REGIME_FILE).read_text())["rate"] == 1e-5
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "regime"], check=True)
    runs, where = study.next_runs(DESIGN, tables)
    assert [(r.arm, r.seed, r.lag, r.rate) for r in runs[:3]] == [("seq_tis", 0, 12, 1e-5), ("vcpo", 0, 12, 1e-5),
                                                                  ("sync", 1, 0, 1e-5)]
    assert len(runs) == 3 * 8 - 1 and "1 of 24" in where


def test_a_finished_run_leaves_a_row_with_verls_staleness_its_heldout_accuracies_and_its_metrics(tmp_path, monkeypatch):
    """run_one with verl replaced by a script writing three steps of metrics as verl's file logger does: the row carries
    the staleness per step verl recorded (not the lag asked), the val-core accuracies at steps 0 and 3, the outcome
    from them and the lowest ESS ratio, the median step time, the provenance; the metrics are kept gzipped."""
    tables, work = tmp_path / "tables", tmp_path / "work"
    tables.mkdir()
    (tables / "task_choice.json").write_text(json.dumps({"chosen": "sums_2digit_brief", "max_response_length": 64,
                                                         "temperature": 1.0}))
    accuracy = "val-core/gsm8k/acc/mean@1"
    records = [{"step": 0, "data": {accuracy: 0.30}}] + [
        {"step": step, "data": {"training/off_policy/trajectory_staleness/max": min(step - 1, 12),
                                "training/off_policy/trajectory_staleness/mean": min(step - 1, 12) - 0.5,
                                "actor/rollout_corr/seq_ess_ratio": ess, "timing_s/step": time}}
        for step, ess, time in ((1, 0.9, 40.0), (2, 0.05, 30.0), (3, 0.5, 35.0))]
    records[-1]["data"][accuracy] = 0.10
    commands, run_process = [], subprocess.run

    def fake_verl(command, **kwargs):
        if "vcpo.launch.cpu" not in command:  # git, for the row's provenance
            return run_process(command, **kwargs)
        commands.append(command)
        out = Path(command[command.index("--out") + 1])
        out.mkdir()  # as the launcher does
        with open(out / "metrics.jsonl", "w") as handle:
            handle.writelines(json.dumps(record) + "\n" for record in records)
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(study.subprocess, "run", fake_verl)
    run = study.Run("regime", "seq_tis", "seq_tis_c8", 12, 3e-5, 100)
    (work / "runs" / run.name).mkdir(parents=True)  # an earlier attempt's folder: removed, the run starts over
    (work / "runs" / run.name / "stale").write_text("")
    got = study.run_one(run, work, tables, commit=False)
    [command] = commands
    assert command[:3] == [sys.executable, "-m", "vcpo.launch.cpu"] and "actor_rollout_ref.actor.optim.lr=3e-05" in command
    assert "actor_rollout_ref.rollout.temperature=1.0" in command and "data.max_response_length=64" in command
    assert not (work / "runs" / run.name / "stale").exists()
    assert got["staleness"] == [[1, 0, -0.5], [2, 1, 0.5], [3, 2, 1.5]] and got["steps"] == 3
    assert got["heldout"] == [[0, 0.30], [3, 0.10]]
    assert got["outcome"] == {"base": 0.30, "best": 0.30, "end": 0.10, "ess_min": 0.05, "collapsed": True, "improves": False}
    assert got["median_step_s"] == 35.0 and got["rate"] == 3e-5
    assert {"commit", "dirty", "start", "finish", "cpu"} <= set(got)
    assert study.read_rows(tables)[run.name]["outcome"] == got["outcome"]
    with gzip.open(tables / study.METRICS_FOLDER / f"{run.name}.jsonl.gz", "rt") as kept:
        assert [json.loads(line) for line in kept] == records
