"""The evidence study's statistics against hand-computed values, its run plan, and the two simulator keys
it added: the final test-split evaluation and the replayed step-size factor (lr_scale_from)."""

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
from prose_quotes import assert_quotes_are_the_statistics, study_prose
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
    by_pair,
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
    assert settings["lr"] == pytest.approx(1e-4) and settings["base_seed"] == 1 and settings["seed"] == 1


def test_a_replayed_step_factor_drives_the_optimizer_step(base, tmp_path):
    write_metrics(tmp_path / "source", [0.5, 0.25, 0.125])
    config = small_config(base, tmp_path / "run", method="seq_tis_c8", steps=3, lr_scale_from=str(tmp_path / "source"))
    out = Trainer(config).run()
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


def test_the_readme_quotes_the_regime_studys_paired_differences_as_computed_from_its_table():
    """The 3-seed comparisons the regime study's write-up (docs/studies.md) states are recomputed from the
    committed outcomes."""

    runs = json.loads((ROOT / "tables/regime_study/outcomes.json").read_text())["runs"]

    def ends(method):
        return {r["seed"]: r["end"] for r in runs if r["method"] == method and (r["lag"] == 48 or method == "sync")}

    doc = " ".join((ROOT / "docs" / "studies.md").read_text().split())
    for a, b, label in [("vcpo", "seq_tis_c8", "VCPO - seq-TIS is"), ("vcpo", "sync", "VCPO - sync"),
                        ("vcpo", "tis_ess", "VCPO - ESS step only (0.278)"), ("vcpo", "tis_opob", "VCPO - OPOB only (0.137)"),
                        ("tis_ess", "seq_tis_c8", "ESS step only - seq-TIS"), ("tis_opob", "seq_tis_c8", "OPOB only - seq-TIS")]:
        first, second = ends(a), ends(b)
        seeds = sorted(first.keys() & second.keys())
        result = paired_difference([first[s] for s in seeds], [second[s] for s in seeds])
        quoted = (f"{label} {100 * result['mean']:+.1f}{' points' if label.endswith('is') else ''} "
                  f"[{100 * result['low']:.1f}, {100 * result['high']:.1f}], p = {result['p']:.2g}")
        assert quoted in doc, quoted


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
    assert row["ess_mean"] == pytest.approx(1.0 - 0.1 * 3.5)
    assert run_row(design, arm, 0, tmp_path / "archive")["command"].endswith(
        "--out RUNS/countdown/sync/seed0 test_problems=1000 test_samples=4 base_seed=0 lag=0 threads=1 progress=false")


ROOT = Path(__file__).resolve().parents[1]


def committed_stats() -> dict:
    """The evidence study's committed statistics (tables/evidence/stats.json), which the prose quotes."""
    return json.loads((ROOT / "tables/evidence/stats.json").read_text())


def evidence_prose(path):
    """The evidence study's section of a document, whitespace-joined, with typographic minus signs as '-'."""
    return study_prose(ROOT, path, ("## The evidence study", "## The across-lags study"), "evidence")


def test_every_interval_the_prose_quotes_is_in_the_committed_statistics():
    """Every interval and comparison the evidence study's prose quotes is in its committed stats.json."""
    stats = committed_stats()
    arms = [arm for entry in stats["tasks"].values() for arm in entry["arms"].values()]
    comparisons = []
    for entry in stats["tasks"].values():
        learning_rate = entry.get("learning_rate", {})
        comparisons += (entry["comparisons"] + entry["comparisons_last_quarter"] + learning_rate.get("comparisons", [])
                        + learning_rate.get("tuned_against_tuned", []))
    assert_quotes_are_the_statistics(evidence_prose("docs/studies.md"), arms, comparisons)


def test_the_evidence_studys_counts_and_predictor_in_the_prose_are_the_committed_ones():

    stats = committed_stats()
    countdown = stats["tasks"]["countdown"]
    arms, predictor = countdown["arms"], countdown["predictor"]
    prose = evidence_prose("docs/studies.md")
    low, high = predictor["auc_interval"]
    assert (f"ROC AUC {predictor['auc']:.2f} (95% bootstrap {low:.2f}-{high:.2f}), hits {predictor['hits']} of "
            f"{predictor['collapsed']} collapses, false alarms in {predictor['false_alarms']} of the "
            f"{predictor['runs'] - predictor['collapsed']} runs") in prose
    assert f"lead times of {min(predictor['lead_steps'])}-{max(predictor['lead_steps'])} steps" in prose
    assert f"on the {predictor['runs']} new runs" in prose
    for name, label in [("seq_tis", "seq-TIS 13.8% [8.5, 19.1]"), ("tis_opob", "12.2% [9.6, 14.7]")]:
        assert f"{label} ({arms[name]['collapses']} of {arms[name]['n']} collapse" in prose
    assert f"{arms['vcpo']['mean_lr_scale']:.2f}× the nominal rate" in prose
    assert f"as a constant ({arms['seq_tis_vcpo_mean_lr']['lr']:.3g})".replace("0.000112", "1.12e-4") in prose
    assert (f"{100 * arms['sync']['end_sd']:.1f} points for sync, {100 * arms['vcpo']['end_sd']:.1f} for VCPO, "
            f"{100 * arms['seq_tis']['end_sd']:.1f} for seq-TIS") in prose
    vcpo_rates = [arm for arm in arms.values() if arm["method"] == "vcpo"]
    assert f"none of its {sum(a['n'] for a in vcpo_rates)} runs" in prose and not any(a["collapses"] for a in vcpo_rates)
    assert [arms[a]["collapses"] for a in ("seq_tis_lr5e-5", "seq_tis_lr1e-4", "seq_tis_lr1.5e-4", "seq_tis")] == [0, 1, 0, 3]


def test_each_difference_the_prose_quotes_is_signed_as_its_label_says():
    """'A - B +X' must be the comparison a - b (not b - a, nor another pair that happens to share the interval)."""

    from vcpo.studies.evidence_report import interval, signed_points

    stats = committed_stats()
    countdown = stats["tasks"]["countdown"]
    comparisons = by_pair(countdown["comparisons"] + countdown["learning_rate"]["comparisons"])

    def quote(a, b):
        c = comparisons[(a, b)]
        return f"{signed_points(c['mean'])} points {interval(c['low'], c['high'], signed=True)}"

    studies = evidence_prose("docs/studies.md")
    for prose, label, pair in [
        (studies, "VCPO - seq-TIS", ("vcpo", "seq_tis")), (studies, "ESS step alone - seq-TIS", ("tis_ess", "seq_tis")),
        (studies, "VCPO - ESS step alone is", ("vcpo", "tis_ess")), (studies, "OPOB alone - seq-TIS", ("tis_opob", "seq_tis")),
        (studies, "VCPO against sync:", ("vcpo", "sync")), (studies, "against tuned seq-TIS:", ("vcpo", "seq_tis_lr5e-5")),
        (studies, "against sync at 1e-4:", ("vcpo", "sync_lr1e-4")), (studies, "(1.12e-4) VCPO is", ("vcpo", "seq_tis_vcpo_mean_lr")),
        (studies, "per-step factor", ("vcpo", "seq_tis_vcpo_replay")),
    ]:
        assert f"{label} {quote(*pair)}" in prose, (label, quote(*pair))


def test_the_tool_use_paragraph_quotes_the_committed_tir_statistics():

    from vcpo.studies.evidence_report import interval, signed_points

    tir = committed_stats()["tasks"]["tir"]
    rows = [json.loads(line) for line in (ROOT / "tables/evidence/runs.jsonl").read_text().splitlines()]
    rows = [row for row in rows if row["task"] == "tir"]
    arms, prose = tir["arms"], evidence_prose("docs/studies.md")
    pick = by_pair(tir["comparisons"])
    secondary = by_pair(tir["comparisons_last_quarter"])

    def quote(c):
        return f"{signed_points(c['mean'])} points {interval(c['low'], c['high'], signed=True)}"

    for label, c in [("VCPO - seq-TIS", pick[("vcpo", "seq_tis")]), ("VCPO - sync", pick[("vcpo", "sync")]),
                     ("VCPO - OPOB at k = 0", pick[("vcpo", "tis_opob_sync")]), ("OPOB at k = 0 - sync", pick[("tis_opob_sync", "sync")]),
                     ("VCPO - seq-TIS", secondary[("vcpo", "seq_tis")]), ("VCPO - sync", secondary[("vcpo", "sync")])]:
        assert f"{label} {quote(c)}" in prose, (label, quote(c))
    assert all(c["verdict"] == "no detectable difference" for c in tir["comparisons"])
    assert not any(arm["collapses"] for arm in arms.values()) and "no run collapses" in prose
    sds = sorted(100 * arm["end_sd"] for name, arm in arms.items() if name != "sync")
    assert f"an SD of {100 * arms['sync']['end_sd']:.1f} points (sync; {sds[0]:.1f}-{sds[-1]:.1f} for the others)" in prose
    assert f"the ten bases score {100 * min(r['base'] for r in rows):.0f}-{100 * max(r['base'] for r in rows):.0f}% at step 0" in prose
    by_seed = {}
    for row in rows:
        by_seed.setdefault(row["seed"], []).append(row["end"])
    assert f"end within {100 * max(max(v) - min(v) for v in by_seed.values()):.1f} points of each other" in prose
    assert f"(mean step factor {arms['vcpo']['mean_lr_scale']:.3f} at" in prose
    assert (f"lowest ESS ratio is {arms['seq_tis']['ess_min']:.3f} on average against VCPO's {arms['vcpo']['ess_min']:.3f}, its "
            f"largest gradient norm {arms['seq_tis']['grad_norm_max']:.2f} against {arms['vcpo']['grad_norm_max']:.2f} "
            f"(sync {arms['sync']['grad_norm_max']:.2f})") in prose
    first = sorted(arm["tool_calls_first"] for arm in arms.values())
    last = sorted(arm["tool_calls_last"] for arm in arms.values())
    assert f"from {first[0]:.2f}-{first[-1]:.2f} in the first step's batch to {last[0]:.2f}-{last[-1]:.2f} in the last" in prose
    errors = {name: f"{100 * arm['tool_error_last']:.1f}%" for name, arm in arms.items()}
    assert (f"{errors['sync']} for sync and {errors['seq_tis']} for seq-TIS against {errors['vcpo']} for VCPO and "
            f"{errors['tis_opob_sync']} for OPOB at k = 0") in prose
    predictor = tir["predictor"]
    assert predictor["collapsed"] == 0 and f"the alarm fired in {predictor['false_alarms']} of {predictor['runs']}" in prose
    table1_section = " ".join((ROOT / "docs/studies.md").read_text().split())
    countdown = committed_stats()["tasks"]["countdown"]["arms"]
    assert (f"an arm's end has an SD of {100 * arms['sync']['end_sd']:.1f} points across bases "
            f"({100 * countdown['sync']['end_sd']:.1f}-{100 * countdown['vcpo']['end_sd']:.1f} on Countdown for sync and VCPO, "
            f"{100 * countdown['seq_tis']['end_sd']:.1f} for seq-TIS") in table1_section


def test_detectable_difference_matches_the_textbook_power_of_a_paired_t_test():
    # Cohen's tables: n = 10 pairs, two-sided 0.05, 80% power needs d = 1.00; 90% needs 1.15
    assert detectable_difference(1.0, 10, 0.05, 0.8) == pytest.approx(0.997, abs=0.005)
    assert detectable_difference(1.0, 10, 0.05, 0.9) == pytest.approx(1.155, abs=0.005)
    # a larger sample detects less; the difference scales with the SD
    assert detectable_difference(1.0, 40) < detectable_difference(1.0, 10)
    assert detectable_difference(3.0, 10) == pytest.approx(3 * detectable_difference(1.0, 10))


def test_the_across_lags_registration_quotes_the_power_of_the_realised_sds():
    """recipes/sim/across_lags.md: the paired SDs it names are the evidence table's, and the detectable
    differences it quotes are detectable_difference's of them."""
    text = " ".join((ROOT / "recipes/sim/across_lags.md").read_text().split())
    rows = [json.loads(line) for line in (ROOT / "tables/evidence/runs.jsonl").read_text().splitlines()]
    end = {(row["arm"], row["seed"]): row["end"] for row in rows if row["task"] == "countdown"}

    def paired_sd(a: str, b: str) -> float:
        return float(np.std([end[(a, s)] - end[(b, s)] for s in range(10)], ddof=1)) * 100

    primary, collapsing = paired_sd("vcpo", "seq_tis_lr5e-5"), paired_sd("vcpo", "seq_tis")
    assert f"SD {primary:.2f} points" in text and f"SD was {collapsing:.1f}" in text
    for power, quoted in ((0.9, "is {} / {} points at SD {} (level 0.05 / 0.0125, the first Holm step of four) and {} / {} points at SD {}"),
                          (0.8, "at 80% power {} / {} and {} / {}")):
        values = [f"{detectable_difference(sd, 10, alpha, power):.1f}" for sd in (primary, collapsing) for alpha in (0.05, 0.0125)]
        expected = quoted.format(values[0], values[1], f"{primary:.2f}", values[2], values[3], f"{collapsing:.1f}") if power == 0.9 \
            else quoted.format(*values)
        assert expected in text, expected


def test_the_across_lags_registration_quotes_the_kernel_measurement():
    table = json.loads((ROOT / "tables/kernel_pinning/kernel_pinning.json").read_text())["settings"]
    text = " ".join((ROOT / "recipes/sim/across_lags.md").read_text().split())
    assert (f"COMPATIBLE could, at {table['compatible']['time_vs_native']:.2f}x the native run time (AVX2 pinning: "
            f"{table['avx2']['time_vs_native']:.2f}x)") in text
    prints = [json.dumps(setting["fingerprint"]) for setting in table.values()]
    assert len(set(prints)) == len(prints) and all(setting["repeats_identical"] for setting in table.values())


def test_the_evidence_corrections_quote_the_committed_power_framing_and_predictor():
    """Issue 36's corrections: the detectable differences of the realised SDs, the tuned-against-tuned framing and
    the predictor without sync runs with a bootstrap over bases, each as stats.json has it."""
    from vcpo.studies.evidence_report import interval, p_value, signed_points

    countdown = committed_stats()["tasks"]["countdown"]
    pairs = by_pair(countdown["comparisons"])
    studies = evidence_prose("docs/studies.md")

    def sd(pair):
        return f"{100 * pairs[pair]['sd']:.1f}"

    def detectable(pair):
        return f"{100 * pairs[pair]['detectable_90']:.1f}"

    ess, opob, core = ("vcpo", "tis_ess"), ("tis_opob", "seq_tis"), ("vcpo", "seq_tis")
    assert (f"the realised SDs are {sd(ess)} points for VCPO - ESS step alone and {sd(opob)} for OPOB alone - seq-TIS, so "
            f"only differences of {detectable(ess)} and {detectable(opob)} points would have been found with 90% power "
            f"({detectable(core)} for VCPO - seq-TIS, whose SD is {sd(core)})") in studies
    tuned = countdown["learning_rate"]["tuned_against_tuned"][0]
    assert (tuned["a"], tuned["b"]) == ("vcpo_lr1e-4", "seq_tis_lr5e-5")
    quote = f"{signed_points(tuned['mean'])} points {interval(tuned['low'], tuned['high'], signed=True)}, p = {p_value(tuned['p'])}"
    assert f"VCPO at 1e-4 - seq-TIS at 5e-5 is {quote}" in studies
    assert set(countdown["learning_rate"]["best_at_grid_edge"].values()) == {"lowest"}
    assert "every method's best rate is the lowest of its grid" in studies
    predictor = countdown["predictor"]
    low, high = predictor["lagged_auc_base_interval"]
    assert (f"on the {predictor['lagged_runs']} lagged runs the AUC is {predictor['lagged_auc']:.2f} with a 95% bootstrap over "
            f"SFT bases of {low:.2f}-{high:.2f}, which includes chance") in studies and low < 0.5 < high


def test_the_runner_trains_every_committed_row_with_the_command_the_row_records(tmp_path, monkeypatch):
    """Snakemake's train job (vcpo.studies.runner.train) runs exactly each row's recorded command, the runs
    it reads (the controls' lr_scale_from and lr_from_mean_scale_of) taken from the committed archive."""
    from vcpo.studies import runner
    from vcpo.studies.design import load_design
    from vcpo.studies.evidence import ARCHIVE, DESIGN, TABLE, read_rows

    design, ran = load_design(recipes_dir() / DESIGN), []
    monkeypatch.setattr(runner, "wait_for_an_earlier_writer", lambda folder: None)
    monkeypatch.setattr(runner.subprocess, "run", lambda command, **kwargs: ran.append(command))
    rows = read_rows(ROOT / TABLE)
    for row in rows:
        runner.train(design, design.arm(row["task"], row["arm"]), row["seed"], tmp_path / "RUNS", ROOT / ARCHIVE)
    recorded = [row["command"] for row in rows]
    assert len(ran) == len(rows) > 100
    assert [" ".join(["python", *command[1:]]).replace(f"{tmp_path}/", "").replace(f"{ROOT / ARCHIVE}/", "RUNS/") for command in ran] == recorded
