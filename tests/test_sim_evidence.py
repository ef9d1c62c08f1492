"""The evidence study's statistics against hand-computed values, its run plan, and the two simulator keys
it added: the final test-split evaluation and the replayed step-size factor (lr_scale_from)."""

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
from test_sim_train import small_config

from vcpo.local_models import save_random_model
from vcpo.recipes import recipes_dir
from vcpo.runs import METRICS_FILE
from vcpo.sim.config import ConfigError, SimConfig, settings_changed
from vcpo.sim.train import Trainer
from vcpo.sim.validation import validate
from vcpo.studies.design import Arm, Design, run_folder, run_settings
from vcpo.studies.evidence import compare, ess_predictor, last_quarter_mean, predictor_report
from vcpo.studies.statistics import (
    base_bootstrap_auc_interval,
    detectable_difference,
    holm,
    mean_interval,
    paired_difference,
    roc_auc,
    wilson_interval,
)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return str(save_random_model(tmp_path_factory.mktemp("base"), hidden_size=32, num_layers=1))


def test_mean_interval_is_the_student_t_interval():
    # t(0.975, 4) = 2.7764451; SD of 1..5 = sqrt(2.5)
    mean, low, high = mean_interval([1, 2, 3, 4, 5])
    assert mean == 3 and high - mean == pytest.approx(2.7764451 * math.sqrt(2.5) / math.sqrt(5), rel=1e-6)
    assert mean - low == pytest.approx(high - mean)


def test_paired_difference_with_one_degree_of_freedom_is_a_cauchy_tail():
    # two pairs: t has 1 degree of freedom (Cauchy), p = 1 - (2/pi) atan(|t|)
    a, b = [0.30, 0.50], [0.20, 0.30]
    differences = np.array([0.10, 0.20])
    t = differences.mean() / (differences.std(ddof=1) / math.sqrt(2))
    result = paired_difference(a, b)
    assert result["n"] == 2 and result["mean"] == pytest.approx(0.15)
    assert result["p"] == pytest.approx(1 - 2 / math.pi * math.atan(t), rel=1e-9)
    # pairing: a constant shift is certain however spread the arms are
    assert paired_difference([0.5, 1.0, 1.5], [0.25, 0.75, 1.25])["p"] == 0.0  # differences exactly 0.25


def test_no_pairs_yet_is_nan_without_a_warning():
    """A study's comparison before its arms share a seed (the lag study's report after its first confirmation run):
    nothing to average, said as nan (its interval unbounded), no verdict, and no numpy warning on the reader's
    terminal; compare states it as paired_difference does."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = paired_difference([], [])
        [compared] = compare({"vcpo": {}, "sync": {0: {"end": 0.3}}}, [("vcpo", "sync")])
    assert result["n"] == 0 and all(math.isnan(result[key]) for key in ("mean", "p", "sd"))
    assert {key: compared[key] for key in result} == pytest.approx(result, nan_ok=True)  # the same statement
    assert compared["sign_n"] == 0 and math.isnan(compared["sign_p"]) and "verdict" not in compared  # not tested


def test_holm_adjusts_step_down_and_stays_monotone():
    # sorted 0.01, 0.03, 0.04 -> 3 x 0.01, 2 x 0.03, max(0.06, 1 x 0.04)
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])


def test_wilson_interval_matches_the_textbook_values():
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.27753), abs=1e-4)
    assert wilson_interval(5, 10) == pytest.approx((0.23659, 0.76341), abs=1e-4)
    assert wilson_interval(10, 10) == pytest.approx((1 - 0.27753, 1.0), abs=1e-4)  # the mirror of 0/10


def test_roc_auc_counts_ordered_pairs():
    # positives 3, 1 against negatives 2, 0: 3 > 2, 3 > 0, 1 < 2, 1 > 0 -> 3/4
    assert roc_auc([3, 1, 2, 0], [True, True, False, False]) == 0.75
    assert roc_auc([1, 1], [True, False]) == 0.5
    assert math.isnan(roc_auc([1, 2], [True, True]))


def test_last_quarter_mean_and_the_ess_predictor_read_the_registered_windows():
    lines = [{"step": s, "val/accuracy": s / 100} for s in range(0, 201, 25)]
    assert last_quarter_mean(lines, 200) == pytest.approx(np.mean([1.5, 1.75, 2.0]))
    ess = [{"step": s, "rollout_corr/seq_ess_ratio": 1.0 - s / 100} for s in range(0, 80)]
    assert ess_predictor(ess, None) == pytest.approx(1.0 - 49 / 100)  # the first 50 steps only
    assert ess_predictor(ess, 30) == pytest.approx(1.0 - 29 / 100)  # before the fall only


def test_predictor_report_counts_hits_false_alarms_and_leads():
    rows = [
        {"ess_predictor": 0.05, "collapsed": True, "fall_step": 75, "ess_alarm_step": 20, "lag": 48, "base_seed": 0},
        {"ess_predictor": 0.50, "collapsed": True, "fall_step": 100, "ess_alarm_step": 90, "lag": 48, "base_seed": 1},
        {"ess_predictor": 0.08, "collapsed": False, "fall_step": None, "ess_alarm_step": 30, "lag": 48, "base_seed": 0},
        {"ess_predictor": 0.90, "collapsed": False, "fall_step": None, "ess_alarm_step": None, "lag": 0, "base_seed": 1},
    ]
    report = predictor_report(rows)
    assert (report["hits"], report["false_alarms"]) == (1, 1)
    assert report["lead_steps"] == [55]
    assert report["auc"] == 0.75  # -0.05 beats both others, -0.50 beats -0.90 only
    # without the sync run (lag 0): -0.05 beats -0.08, -0.50 does not
    assert (report["lagged_runs"], report["lagged_auc"]) == (3, 0.5)


def test_the_predictors_base_bootstrap_resamples_whole_bases():
    # every base holds one collapsed run with a low predictor and one other: any draw of bases separates perfectly
    rows = [{"ess_predictor": p, "collapsed": c, "base_seed": b} for b in range(5) for p, c in ((0.05, True), (0.6, False))]
    assert base_bootstrap_auc_interval(rows, resamples=200) == (1.0, 1.0)
    # a base whose two runs are ordered the other way pulls some draws below 1 (resampling runs alone would too,
    # but never to a draw made only of that base, which has AUC 0)
    rows += [{"ess_predictor": 0.6, "collapsed": True, "base_seed": 5}, {"ess_predictor": 0.05, "collapsed": False, "base_seed": 5}]
    low, high = base_bootstrap_auc_interval(rows, resamples=500)
    assert low < 1.0 and high == 1.0


def test_compare_pairs_by_seed_and_names_the_verdict():
    by_arm = {"a": {s: {"end": 0.3 + 0.01 * s} for s in range(5)}, "b": {s: {"end": 0.1 + 0.01 * s + 0.001 * (s % 2)} for s in range(6)}}
    (result,) = compare(by_arm, [("a", "b")])
    assert result["n"] == 5 and result["mean"] == pytest.approx(0.2 - 0.001 * 2 / 5)
    assert result["verdict"] == "a above b" and result["p_holm"] == result["p"]
    by_arm["a"] = {s: {"end": 0.1 + 0.01 * s + (0.02 if s % 2 else -0.02)} for s in range(6)}
    (result,) = compare(by_arm, [("a", "b")])
    assert result["verdict"] == "no detectable difference"


def write_metrics(folder, scales):
    folder.mkdir(parents=True)
    lines = [{"step": step, "actor/lr_scale": scale} for step, scale in enumerate(scales)]
    (folder / METRICS_FILE).write_text("".join(json.dumps(line) + "\n" for line in lines))
    (folder / "config.json").write_text(json.dumps({"steps": len(scales)}) + "\n")  # what a finished run records
    (folder / "final").mkdir()
    (folder / "final" / "eval.json").write_text("{}\n")


def test_control_arms_wait_for_their_sources_then_read_them(tmp_path):
    arms = [Arm("countdown", "vcpo", "vcpo", 1), Arm("countdown", "replay", "seq_tis_c8", 2, lr_scale_from="vcpo"),
            Arm("countdown", "mean", "seq_tis_c8", 2, lr_from_mean_scale_of="vcpo")]
    design = Design(seeds=[0, 1], configs={"countdown": "recipes/sim/regime.yaml"}, settings={"countdown": {}}, arms=arms)
    assert run_settings(design, arms[1], 0, tmp_path) is None and run_settings(design, arms[2], 0, tmp_path) is None
    write_metrics(run_folder(tmp_path, arms[0], 0), [0.5, 0.25])
    assert run_settings(design, arms[1], 0, tmp_path)["lr_scale_from"] == str(run_folder(tmp_path, arms[0], 0))
    assert run_settings(design, arms[2], 0, tmp_path) is None  # seed 1 of the source still missing
    write_metrics(run_folder(tmp_path, arms[0], 1), [1.0, 0.25])
    settings = run_settings(design, arms[2], 1, tmp_path)
    # regime lr 2e-4 x the mean factor over both runs' steps (0.5)
    assert settings["reference_lr"] == pytest.approx(1e-4) and settings["base_seed"] == 1 and settings["seed"] == 1


def test_a_replayed_step_factor_drives_the_optimizer_step(base, tmp_path, monkeypatch):
    import vcpo.sim.validation as validation

    write_metrics(tmp_path / "source", [0.5, 0.25, 0.125])
    config = small_config(base, tmp_path / "run", method="seq_tis_c8", steps=3, lr_scale_from=str(tmp_path / "source"))
    reads, read = [], validation.metric_records
    monkeypatch.setattr(validation, "metric_records", lambda run, report: reads.append(run) or read(run, report))
    out = Trainer(config).run()
    assert len(reads) == 1  # the replayed run's metrics are read once, when the run is resolved
    lines = [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines()]
    assert [line["actor/lr_scale"] for line in lines] == [0.5, 0.25, 0.125]
    for line in lines:
        assert line["actor/effective_lr"] == pytest.approx(line["actor/lr"] * line["actor/lr_scale"])


@pytest.mark.parametrize(
    ("scales", "method", "message"),
    [([0.5, 0.5], "vcpo", "sets its own step size"), ([0.5], "seq_tis_c8", "no actor/lr_scale for steps"), (None, "seq_tis_c8", "no ")],
)
def test_a_replay_that_cannot_be_honoured_is_refused(base, tmp_path, scales, method, message):
    if scales is not None:
        write_metrics(tmp_path / "source", scales)
    with pytest.raises(ConfigError, match=message):
        validate(small_config(base, tmp_path / "run", method=method, lr_scale_from=str(tmp_path / "source")))


def test_final_evaluation_scores_the_test_split(base, tmp_path):
    out = Trainer(small_config(base, tmp_path / "run", method="sync", lag=0, eval_every=2, test_problems=6, test_samples=2)).run()
    final = json.loads((out / "final" / "eval.json").read_text())
    assert "val/accuracy" in final and final["test/accuracy"] == final["test-core/countdown/acc/mean@2"]
    # 6 problems x 2 samples: the accuracy is a multiple of 1/12
    assert round(final["test/accuracy"] * 12, 9) == round(final["test/accuracy"] * 12)
    with pytest.raises(ConfigError, match="test_problems"):
        validate(small_config(base, tmp_path / "x", test_problems=10**6))


def test_a_run_recorded_before_a_key_existed_resumes_with_its_default():
    config = validate(SimConfig())
    recorded = {key: value for key, value in config.recorded().items() if key not in ("test_problems", "test_samples", "lr_scale_from")}
    assert settings_changed(recorded, config) == []
    assert settings_changed(recorded, validate(SimConfig(test_problems=5))) == ["test_problems: 0 -> 5"]


def test_a_run_recorded_before_opob_combination_existed_resumes_only_with_the_buffers_it_used():
    """Runs recorded before the key combined OPOB in two buffers, not the "deferred" default that came with it:
    the studies' config (which keeps the buffers) resumes them, a config with the new default is refused."""
    from vcpo.sim.config import load_config_file

    studies = validate(load_config_file(Path(__file__).resolve().parents[1] / "recipes/sim/regime.yaml"))
    recorded = {key: value for key, value in studies.recorded().items() if key != "opob_combination"}
    assert settings_changed(recorded, studies) == []
    default = validate(dataclasses.replace(studies, opob_combination=SimConfig().opob_combination))
    assert settings_changed(recorded, default) == ["opob_combination: 'buffers' -> 'deferred'"]


def test_the_report_quotes_its_statistics_and_lists_missing_runs(tmp_path):
    from vcpo.studies.design import load_design
    from vcpo.studies.evidence import DESIGN, report
    from vcpo.studies.evidence_report import write_report

    design = load_design(recipes_dir() / DESIGN)

    def row(arm, method, seed, end, lr=2e-4, lag=48, collapsed=False):
        return {"task": "countdown", "arm": arm, "method": method, "seed": seed, "base_seed": seed, "end": end, "lr": lr, "lag": lag,
                "last_quarter": end, "base": 0.2, "collapsed": collapsed, "mean_lr_scale": 1.0, "ess_predictor": 0.5,
                "fall_step": None, "ess_alarm_step": None, "end_validation": end,
                "ess_mean": 0.5 + 0.1 * seed, "ess_min": 0.1, "grad_norm_max": 1.0 + seed}

    rows = [row("vcpo", "vcpo", s, 0.25 + 0.01 * s) for s in range(3)]
    rows += [row("seq_tis", "seq_tis_c8", s, 0.10 + 0.01 * s + 0.001 * s * s) for s in range(3)]
    rows += [row("sync", "sync", s, 0.30, lag=0) for s in range(2)]
    stats = report(rows, design)
    write_report(stats, tmp_path)
    summary = (tmp_path / "summary.md").read_text()
    # vcpo - seq_tis per seed: 0.150, 0.149, 0.146 -> mean 14.8 points
    assert "| vcpo - seq_tis | 3 | +14.8 " in summary
    assert "| vcpo | 0.600 / 0.100 | 3.00 |" in summary  # ESS means 0.5, 0.6, 0.7; the largest of norms 1, 2, 3
    assert "sync seeds 2, 3, 4, 5, 6, 7, 8, 9" in summary and "No finished runs yet." in summary  # tir
    assert (tmp_path / "lr.png").stat().st_size > 0
    assert json.loads((tmp_path / "stats.json").read_text())["tasks"]["countdown"]["arms"]["vcpo"]["n"] == 3


def test_an_archived_run_gives_the_same_row_as_the_run_itself(tmp_path):
    """The archive keeps only the metrics the study reads, and the rows computed from it are the full run's."""
    from vcpo.studies.design import archive_run, load_design
    from vcpo.studies.evidence import DESIGN, run_row

    design = load_design(recipes_dir() / DESIGN)
    arm = design.arm("countdown", "sync")
    folder = run_folder(tmp_path / "runs", arm, 0)
    (folder / "final").mkdir(parents=True)
    # recorded before reference_lr had its name: the row reads it through the map of renamed keys
    config = {"task": "countdown", "lag": 0, "lr": 2e-4, "base_seed": 0, "steps": 8, "test_problems": 1000,
              "test_samples": 4, "config_file": "recipes/sim/regime.yaml", "threads": 1}
    (folder / "config.json").write_text(json.dumps(config))
    lines = [{"step": s, "rollout_corr/seq_ess_ratio": 1.0 - 0.1 * s, "actor/lr_scale": 1.0, "actor/effective_lr": 2e-4,
              "actor/grad_norm": 0.5 + s % 3, "tool/calls_per_response": 0.5 + 0.1 * s, "tool/error_frac": 0.2,
              "timing_s/step": 0.5, "async/lag_hist": [1, 2]} | ({"val/accuracy": 0.2 + 0.01 * s} if s % 4 == 0 else {})
             for s in range(8)]
    lines.append({"step": 8, "val/accuracy": 0.3, "test/accuracy": 0.25})
    (folder / METRICS_FILE).write_text("".join(json.dumps(line) + "\n" for line in lines))
    (folder / "final" / "eval.json").write_text(json.dumps({"step": 8, "val/accuracy": 0.3, "test/accuracy": 0.25}))
    archived = run_folder(tmp_path / "archive", arm, 0)
    archive_run(folder, archived)
    kept = [json.loads(line) for line in (archived / METRICS_FILE).read_text().splitlines()]
    assert all("timing_s/step" not in line and "async/lag_hist" not in line for line in kept) and len(kept) == 9
    row = run_row(design, arm, 0, tmp_path / "archive")
    assert row == run_row(design, arm, 0, tmp_path / "runs")
    assert (row["grad_norm_max"], row["tool_calls_first"], row["tool_calls_last"], row["tool_error_last"]) == (2.5, 0.5, 0.5 + 0.1 * 7, 0.2)
    assert row["ess_mean"] == pytest.approx(1.0 - 0.1 * 3.5) and row["lr"] == 2e-4
    assert run_row(design, arm, 0, tmp_path / "archive")["command"].endswith(
        "--out RUNS/countdown/sync/seed0 test_problems=1000 test_samples=4 base_seed=0 lag=0 threads=1 progress=false")


ROOT = Path(__file__).resolve().parents[1]


def test_detectable_difference_matches_the_textbook_power_of_a_paired_t_test():
    # Cohen's tables: n = 10 pairs, two-sided 0.05, 80% power needs d = 1.00; 90% needs 1.15
    assert detectable_difference(1.0, 10, 0.05, 0.8) == pytest.approx(0.997, abs=0.005)
    assert detectable_difference(1.0, 10, 0.05, 0.9) == pytest.approx(1.155, abs=0.005)
    # a larger sample detects less; the difference scales with the SD
    assert detectable_difference(1.0, 40) < detectable_difference(1.0, 10)
    assert detectable_difference(3.0, 10) == pytest.approx(3 * detectable_difference(1.0, 10))


def test_the_runner_trains_every_committed_row_with_the_command_the_row_records(tmp_path, monkeypatch):
    """Snakemake's train job (vcpo.studies.runner.train) runs exactly each row's recorded command, the runs
    it reads (the controls' lr_scale_from and lr_from_mean_scale_of) taken from the committed archive."""
    import subprocess

    from vcpo.studies import runner
    from vcpo.studies.design import load_design
    from vcpo.studies.evidence import ARCHIVE, DESIGN, TABLE, read_rows

    design, ran = load_design(recipes_dir() / DESIGN), []
    monkeypatch.setattr(runner, "wait_for_an_earlier_writer", lambda folder: None)
    monkeypatch.setattr(subprocess, "run", lambda command, **kwargs: ran.append(command))  # vcpo.runs.train_logged runs it
    rows = read_rows(ROOT / TABLE)
    for row in rows:
        runner.train(design, design.arm(row["task"], row["arm"]), row["seed"], tmp_path / "RUNS", ROOT / ARCHIVE)
    recorded = [row["command"] for row in rows]
    assert len(ran) == len(rows) > 100
    assert [" ".join(["python", *command[1:]]).replace(f"{tmp_path}/", "").replace(f"{ROOT / ARCHIVE}/", "RUNS/") for command in ran] == recorded
