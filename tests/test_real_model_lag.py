"""The real model's lag study runner (vcpo.studies.real_model_lag): the registered rules on scripted rows, and one run's
row built from verl's metrics (verl itself is replaced by a script that writes the metrics its file logger would)."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from vcpo.provenance import unrecorded
from vcpo.recipes import read_yaml, recipes_dir
from vcpo.studies import real_model_lag as study

ROOT = Path(__file__).resolve().parents[1]
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
    """Once the ladder decides, the runner's next_runs writes regime.json with its provenance (status's writes nothing)
    and runs nothing until that file is committed (without the gate, as the workflow's reproduction runs, at once);
    then the confirmation's runs come seed by seed (sync, seq-TIS, VCPO), without those already in runs.jsonl."""
    tables = tmp_path / "tables"
    tables.mkdir()
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    sync, seq = regime_runs(1e-5)
    done = study.Run("confirmation", "sync", "sync", 0, 1e-5, 0)
    rows = [row(sync, improves=True), row(seq, collapsed=True), row(done)]
    (tables / study.RUNS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    runs, where = study.next_runs(DESIGN, tables)  # as status asks: nothing written
    assert runs == [] and "`run` writes" in where and not (tables / study.REGIME_FILE).exists()
    runs, where = study.next_runs(DESIGN, tables, write=True)  # as the runner asks
    assert runs == [] and "commit" in where
    written = json.loads((tables / study.REGIME_FILE).read_text())
    assert written["rate"] == 1e-5 and not unrecorded(written)  # the choice says which code made it, where and when
    assert len(study.next_runs(DESIGN, tables, commit_gate=False)[0]) == 3 * 8 - 1  # a reproduction's results folder
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "regime"], check=True)
    runs, where = study.next_runs(DESIGN, tables)
    assert [(r.arm, r.seed, r.lag, r.rate) for r in runs[:3]] == [("seq_tis", 0, 12, 1e-5), ("vcpo", 0, 12, 1e-5),
                                                                  ("sync", 1, 0, 1e-5)]
    assert len(runs) == 3 * 8 - 1 and "1 of 24" in where


def test_the_runner_trains_one_run_at_a_time_in_the_registrations_order_and_stops_at_a_failure(tmp_path, monkeypatch):
    """run_study hands Snakemake one run per plan, in next_runs' order (seed by seed, not Snakemake's own choice among
    several), until the registration asks for none; a run that leaves no row stops the study, and the same command
    runs it again first."""
    tables = tmp_path / "tables"
    tables.mkdir()
    (tables / "task_choice.json").write_text((ROOT / "tables" / "real_model_lag" / "task_choice.json").read_text())
    sync, seq = regime_runs(1e-5)
    (tables / study.RUNS_FILE).write_text("".join(json.dumps(r) + "\n" for r in (row(sync, improves=True),
                                                                                  row(seq, collapsed=True))))
    planned = []

    def fake_snakemake(snakefile, plan, cores):
        [run] = json.loads(Path(plan).read_text())["runs"]
        planned.append(run["name"])
        if run["name"] != failing:
            with open(tables / study.RUNS_FILE, "a") as rows:
                rows.write(json.dumps({"name": run["name"]}) + "\n")

    monkeypatch.setattr(study, "run_jobs_with_snakemake", fake_snakemake)
    failing = "confirmation-vcpo-lr1e-05-seed1"
    assert study.run_study(tmp_path / "work", tables, commit=False, commit_gate=False) == 1
    order = [f"confirmation-{arm}-lr1e-05-seed{seed}" for seed in range(8) for arm in ("sync", "seq_tis", "vcpo")]
    assert planned == order[: order.index(failing) + 1]
    failing, planned[:] = None, []
    assert study.run_study(tmp_path / "work", tables, commit=False, commit_gate=False) == 0
    assert planned == order[order.index("confirmation-vcpo-lr1e-05-seed1"):]


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
    assert {"commit", "dirty", "start", "finish", "cpu", "load_at_start", "load_at_finish"} <= set(got)
    assert study.read_rows(tables)[run.name]["outcome"] == got["outcome"]
    with gzip.open(tables / study.METRICS_FOLDER / f"{run.name}.jsonl.gz", "rt") as kept:
        assert [json.loads(line) for line in kept] == records


def test_a_rows_commit_waits_out_another_commits_index_lock_and_fails_loudly_on_anything_else(tmp_path, monkeypatch):
    """The lock is released during the first wait (the patched sleep), so the commit lands on the second try; a path
    git does not know is an error that no waiting mends."""
    monkeypatch.chdir(tmp_path)
    for command in (["init", "-q"], ["config", "user.email", "t@t"], ["config", "user.name", "t"]):
        subprocess.run(["git", *command], check=True)
    (tmp_path / "row.txt").write_text("1\n")
    lock = tmp_path / ".git" / "index.lock"
    lock.write_text("")
    waits = []
    monkeypatch.setattr(study.time, "sleep", lambda seconds: (waits.append(seconds), lock.unlink()))
    study.git_with_retry("add", "--", "row.txt")
    assert len(waits) == 1
    study.git_with_retry("commit", "-q", "-m", "row", "--", "row.txt")
    assert subprocess.run(["git", "log", "--oneline"], capture_output=True, text=True).stdout.count("\n") == 1
    with pytest.raises(RuntimeError, match="git add failed"):
        study.git_with_retry("add", "--", "no-such-file.txt")
    assert len(waits) == 1


def scripted_row(phase: str, arm: str, seed: int, end: float, collapsed: bool = False, rate: float = 3e-5) -> dict:
    lag = DESIGN["confirmation"]["arms"][arm]["lag"]
    run = study.Run(phase, arm, DESIGN["confirmation"]["arms"][arm]["method"], lag, rate, seed)
    return {**study.asdict(run), "name": run.name, "task": "sums_2digit_brief", "staleness": [[s, min(s - 1, lag), min(s - 1, lag)] for s in (1, 14, 20)],
            "outcome": {"base": 0.15, "best": max(end, 0.15), "end": end, "ess_min": 0.05 if collapsed else 0.8,
                        "collapsed": collapsed, "improves": end > 0.2}, "median_step_s": 30.0 + seed}


def test_the_report_pairs_ends_by_seed_corrects_by_holm_and_gives_the_registered_verdicts(tmp_path):
    """Eight seeds per arm with hand-chosen ends: VCPO above seq-TIS on all 8 (reproduced), VCPO within noise of sync
    (not detected worse), sync above seq-TIS on 4 of 8 (no detectable difference). The paired means, t intervals and
    p against scipy's direct computation, Holm by hand, the one-sided sign test's p exactly (1/256), the collapses
    with Wilson's interval; the figures drawn from the runs' metrics."""
    from scipy import stats

    from vcpo.studies import real_model_lag_report as report

    seq_tis = [0.05, 0.10, 0.02, 0.20, 0.08, 0.04, 0.30, 0.06]
    vcpo = [0.25, 0.30, 0.22, 0.31, 0.28, 0.27, 0.33, 0.26]
    sync = [s + d for s, d in zip(seq_tis, (0.3, -0.01, 0.25, -0.2, 0.2, -0.02, -0.3, 0.02), strict=True)]
    rows = {}
    for arm, ends in (("seq_tis", seq_tis), ("vcpo", vcpo), ("sync", sync)):
        for seed, end in enumerate(ends):
            row_ = scripted_row("confirmation", arm, seed, end, collapsed=arm == "seq_tis" and end < 0.07)
            rows[row_["name"]] = row_
    ladder_row = scripted_row("regime", "seq_tis", 100, 0.02, collapsed=True)
    rows[ladder_row["name"]] = ladder_row
    folder = tmp_path / study.METRICS_FOLDER
    folder.mkdir()
    for name, row_ in rows.items():
        lines = [{"step": 0, "data": {"val-core/gsm8k/acc/mean@1": 0.15}}] + [
            {"step": s, "data": {"critic/score/mean": 0.1 * s, "actor/rollout_corr/seq_ess_ratio": 0.9, "actor/lr_scale": 0.8,
                                 "training/off_policy/trajectory_staleness/max": min(s - 1, row_["lag"])}} for s in (1, 2, 3)]
        lines[-1]["data"]["val-core/gsm8k/acc/mean@1"] = row_["outcome"]["end"]
        with gzip.open(folder / f"{name}.jsonl.gz", "wt") as handle:
            handle.writelines(json.dumps(line) + "\n" for line in lines)
    got = report.write_report(tmp_path, rows, DESIGN, study.METRICS_FOLDER)

    by_pair = {(c["a"], c["b"]): c for c in got["comparisons"]}
    raw_p = []
    for (a, b), (ends_a, ends_b) in {("vcpo", "seq_tis"): (vcpo, seq_tis), ("vcpo", "sync"): (vcpo, sync),
                                     ("sync", "seq_tis"): (sync, seq_tis)}.items():
        differences = [x - y for x, y in zip(ends_a, ends_b, strict=True)]
        c = by_pair[(a, b)]
        half = stats.t.ppf(0.975, 7) * stats.tstd(differences) / 8**0.5
        assert c["n"] == 8 and c["mean"] == pytest.approx(sum(differences) / 8)
        assert (c["low"], c["high"]) == pytest.approx((c["mean"] - half, c["mean"] + half))
        assert c["p"] == pytest.approx(stats.ttest_rel(ends_a, ends_b).pvalue)
        raw_p.append(c["p"])
    order = sorted(range(3), key=lambda i: raw_p[i])  # Holm: the k-th smallest times (3 - k), kept monotone
    holm = {}
    running = 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (3 - rank) * raw_p[index]))
        holm[index] = running
    assert [c["p_holm"] for c in got["comparisons"]] == pytest.approx([holm[0], holm[1], holm[2]])
    assert by_pair[("vcpo", "seq_tis")]["sign_p_one_sided"] == pytest.approx(1 / 256)
    assert by_pair[("vcpo", "seq_tis")]["verdict"] == "reproduced"
    assert by_pair[("vcpo", "sync")]["verdict"] == "reproduced (not detected worse)"
    assert by_pair[("sync", "seq_tis")]["verdict"] == "not reproduced (no detectable difference)"
    seq = got["arms"]["seq_tis"]
    assert seq["collapsed"] == 4 and (seq["collapse_low"], seq["collapse_high"]) == pytest.approx((0.2152, 0.7848), abs=1e-4)
    assert seq["staleness_max"] == 12 and seq["median_step_s"] == 33.5
    text = (tmp_path / "report.md").read_text()
    assert "4 of 8 [21.5%, 78.5%]" in text and "8 of 8 seeds above" in text
    assert (tmp_path / "curves.png").stat().st_size > 20_000 and (tmp_path / "ladder.png").stat().st_size > 10_000

    # docs/claims.md's rows, by its rule: VCPO above seq-TIS on 8 of 8 (one-sided sign p 1/256) is reproduced; sync -
    # seq-TIS silent, quoted with the difference its 8 pairs detect at Holm's first step (0.05 / 3) with 80% power; a
    # difference test cannot show VCPO matching sync, and nothing opposes it
    from vcpo.studies.statistics import detectable_difference

    rows = {int(line.split(" | ")[0].strip("| ")): line.split(" | ") for line in report.claims_markdown(got).splitlines()[2:]}
    silent = by_pair[("sync", "seq_tis")]
    assert rows[9][3] == f"not detected: {100 * detectable_difference(silent['sd'], 8, 0.05 / 3, 0.8):.1f} points detectable"
    assert rows[10][3] == "reproduced" and rows[11][3] == "not detected"
    assert "VCPO − seq-TIS: +" in rows[10][2] and "8 of 8 seeds above (one-sided sign test p = 0.004): reproduced" in rows[10][2]
    assert "seq-TIS ends 10.6% [2.6, 18.6] over 8 seeds, collapses in 4 of 8 [21.5%, 78.5%]" in rows[9][2]
    assert "staleness max 12, mean after filling 12.00" in rows[9][2]

    # before any confirmation run (the ladder under way) the rows say so
    empty = report.claims_markdown(report.study_statistics({ladder_row["name"]: ladder_row}, DESIGN))
    assert "| No confirmation run of these arms yet. The registered comparison, no pair yet. (" in empty
    assert empty.count("untested: the confirmation is under way (0 of 8 pairs)") == 3


def test_a_verdict_in_the_other_direction_and_one_with_too_few_pairs():
    from vcpo.studies.real_model_lag_report import verdict

    worse = {"n": 8, "mean": -0.1, "p_holm": 0.01, "sign_positive": 1, "sign_n": 8, "sign_p_one_sided": 0.99}
    assert verdict(worse, "above") == "not reproduced (the other direction)"
    assert verdict(worse, "not_below") == "not reproduced (detected worse)"
    assert verdict({**worse, "mean": 0.1, "sign_positive": 6, "sign_p_one_sided": 0.145}, "above") == (
        "not reproduced (no detectable difference)")
    assert verdict({**worse, "mean": 0.1, "sign_positive": 7, "sign_p_one_sided": 9 / 256}, "above") == "reproduced"
    assert verdict({"n": 1}, "above").startswith("not tested yet")


def test_the_real_models_default_training_is_the_lag_studys():
    """recipes/real_model_launch.yaml (what `python -m vcpo.launch.cpu --model smollm2-135m-instruct` trains) holds the
    lag study's chosen task, response length and temperature and its registered batch, group, prompt length,
    answer format and held-out evaluation."""
    choice = json.loads((Path(__file__).resolve().parents[1] / study.TABLES / "task_choice.json").read_text())
    default = read_yaml(recipes_dir() / "real_model_launch.yaml")
    training = DESIGN["training"]
    assert default["task"] == choice["chosen"] and default["answer_format"] == DESIGN["task_choice"]["answer_format"]
    assert default["training"] == {
        "prompts_per_step": training["prompts_per_step"], "responses_per_prompt": training["responses_per_prompt"],
        "max_response_length": choice["max_response_length"], "max_prompt_length": training["max_prompt_length"],
        "temperature": choice["temperature"],
        "validation": {"every": training["validation"]["every"], "problems": DESIGN["task_choice"]["test_problems"]}}
    assert default["validation_split"] == "test"


def test_the_ladder_table_gives_each_runs_load_or_says_it_was_not_recorded():
    from vcpo.studies.real_model_lag_report import ladder_markdown

    older = scripted_row("regime", "sync", 100, 0.145, rate=1e-5)
    newer = {**scripted_row("regime", "seq_tis", 100, 0.005, collapsed=True, rate=3e-5),
             "load_at_start": 1.04, "load_at_finish": 7.96}
    header, rule, *rows = ladder_markdown([older, newer])
    assert header.endswith("| load at start, finish |") and rule.count("|") == header.count("|")
    assert rows[0].endswith("| 130.0 s | not recorded |") and rows[1].endswith("| 130.0 s | 1.0, 8.0 |")


def test_a_panel_no_run_logs_says_so(tmp_path, monkeypatch):
    """The ladder has no VCPO run, so no line of its lr scale: that panel says no run logs it, the others draw."""
    from vcpo.reporting import figures

    saved = []
    monkeypatch.setattr(figures, "save", lambda figure, out: saved.append(figure))
    lines = [{"step": step, "critic/score/mean": 0.1 * step, figures.SEQ_ESS_RATIO: 0.5} for step in (1, 2, 3)]
    figures.draw_runs({"seq_tis lr 1e-05": [lines]}, tmp_path / "ladder.png", "ladder")
    panels = {axis.get_title(): axis for axis in saved[0].axes}
    empty = {title for title, axis in panels.items() if any(text.get_text() == "no run here logs it" for text in axis.texts)}
    assert empty == {label for key, label in figures.RUN_PANELS if key not in ("critic/score/mean", figures.SEQ_ESS_RATIO)}
    assert len(panels["sequence ESS ratio"].lines) >= 1


def test_a_comparison_below_two_pairs_says_how_many_it_has():
    from vcpo.studies import real_model_lag_report as report

    untested = {"a": "vcpo", "b": "seq_tis", "verdict": "not tested yet (fewer than 2 pairs)"}
    assert report.comparison_sentence({**untested, "n": 0}) == "VCPO − seq-TIS: 0 pairs so far; not tested yet (fewer than 2 pairs)."
    assert report.comparison_sentence({**untested, "n": 1}).startswith("VCPO − seq-TIS: 1 pair so far;")


def test_a_verdict_on_fewer_pairs_than_registered_says_it_is_interim():
    """Two of eight registered seeds paired: the verdict is the registered rule's, marked as standing so far."""
    from vcpo.studies import real_model_lag_report as report

    arms = {arm: [scripted_row("confirmation", arm, seed, end) for seed, end in enumerate(ends)]
            for arm, ends in (("vcpo", (0.3, 0.2)), ("seq_tis", (0.1, 0.25)), ("sync", (0.2, 0.2, 0.3)))}
    by_pair = {(c["a"], c["b"]): c for c in report.comparisons(arms, DESIGN["confirmation"])}
    assert by_pair[("vcpo", "seq_tis")]["verdict"] == "not reproduced (no detectable difference) so far, 2 of 8 registered pairs"
    assert by_pair[("sync", "seq_tis")]["n"] == 2 and by_pair[("vcpo", "sync")]["verdict"].endswith("so far, 2 of 8 registered pairs")
