"""The regime as a file (``--config``) and the pre-registered hold / collapse criteria."""

import json

import pytest

from vcpo.local_models import save_random_model
from vcpo.sim.__main__ import main as sim_main
from vcpo.sim.config import ConfigError, load_config_file
from vcpo.studies.stability import outcome

SHORT = [
    "prompts_per_step=2", "responses_per_prompt=2", "micro_batch_size=4", "max_response_tokens=8",
    "update_tokens=4", "eval_every=0", "warmup_steps=0", "checkpoint_every=1", "progress=false",
]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return str(save_random_model(tmp_path_factory.mktemp("base"), hidden_size=32, num_layers=1))


def test_config_file_values_then_flags_then_key_values(base, tmp_path):
    regime = tmp_path / "regime.yaml"
    regime.write_text("reference_lr: 2.5e-4  # the file's value\nsteps: 7\nlag: 3\nbetas: [0.8, 0.99]\nrho_on: null\n")
    out = tmp_path / "run"
    code = sim_main(["train", "--config", str(regime), "--method", "seq_tis_c8", "--steps", "2", "--out", str(out),
                     f"base={base}", "lag=1", *SHORT])
    assert code == 0
    config = json.loads((out / "config.json").read_text())
    assert config["config_file"] == str(regime)
    assert config["reference_lr"] == 2.5e-4 and config["betas"] == [0.8, 0.99]  # from the file
    assert config["steps"] == 2 and config["lag"] == 1  # the flag and the key=value win over the file
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2


def test_sweep_reads_the_config_file_and_records_it(base, tmp_path):
    regime = tmp_path / "regime.yaml"
    regime.write_text("lr: 3.0e-4\nlag: 2\n")  # the key's old name, read as reference_lr
    code = sim_main(["sweep", "--config", str(regime), "--methods", "seq_tis_c8", "--lags", "2", "--steps", "2",
                     "--out", str(tmp_path / "runs"), f"base={base}", *SHORT])
    assert code == 0
    config = json.loads((tmp_path / "runs/countdown/seq_tis_c8/lag2/seed0/config.json").read_text())
    assert config["config_file"] == str(regime) and config["reference_lr"] == 3.0e-4 and "lr" not in config


@pytest.mark.parametrize("method", ["sync", "seq_tis_c8", "vcpo"])
def test_the_committed_regime_runs_a_few_steps(base, tmp_path, method):
    from vcpo.methods import is_synchronous

    out = tmp_path / method
    lag = [] if is_synchronous(method) else ["lag=2"]  # the file's 48 needs more steps than a test takes
    assert sim_main(["train", "--config", "recipes/sim/regime.yaml", "--method", method, "--steps", "3",
                     "--out", str(out), f"base={base}", *SHORT, *lag]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["config_file"] == "recipes/sim/regime.yaml" and config["reference_lr"] == 2.0e-4 and config["task"] == "countdown"
    assert config["lag"] == (0 if is_synchronous(method) else 2)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2]


@pytest.mark.parametrize(
    "text, message",
    [
        ("reference_lr: 1e-4\nlag_modle: fixed\n", "unknown config key 'lag_modle' (did you mean 'lag_model'?)"),
        ("steps: many\n", "config key 'steps': cannot read 'many'"),
        ("- reference_lr\n", "expected a mapping"),
        ("lr: 1e-4\nreference_lr: 2e-4\n", "'lr' and 'reference_lr' are one key (renamed)"),
        ("config_file: other.yaml\n", "'config_file' cannot be set"),
    ],
)
def test_a_bad_config_file_names_the_file_and_the_key(tmp_path, capsys, text, message):
    regime = tmp_path / "bad.yaml"
    regime.write_text(text)
    with pytest.raises(ConfigError) as error:
        load_config_file(regime)
    assert str(regime) in str(error.value) and message in str(error.value)
    assert sim_main(["train", "--config", str(regime), "--out", str(tmp_path / "run")]) == 2
    assert str(regime) in capsys.readouterr().err and not (tmp_path / "run").exists()


def test_a_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="nothing.yaml.*cannot read"):
        load_config_file(tmp_path / "nothing.yaml")


def _run(accuracy: dict[int, float], ess: list[float]) -> list[dict]:
    """Metrics lines as vcpo.sim writes them: a line per step, the final evaluation as a last line."""
    last = max(accuracy)
    lines = [{"step": step, "rollout_corr/seq_ess_ratio": value} for step, value in enumerate(ess)]
    for line in lines:
        if line["step"] in accuracy:
            line["val/accuracy"] = accuracy[line["step"]]
    return [*lines, {"step": last, "val/accuracy": accuracy[last]}]


def test_a_collapse_needs_both_the_fall_and_the_ess_alarm():
    ess = [1.0] * 30 + [0.09] + [0.5] * 69  # the alarm at step 30
    collapsed = outcome(_run({0: 0.2, 25: 0.3, 50: 0.32, 75: 0.15, 100: 0.16}, ess))
    assert collapsed.best == 0.32 and collapsed.best_step == 50 and collapsed.end == 0.16
    assert collapsed.collapsed and not collapsed.holds  # 0.16 <= 0.5 x 0.32
    assert collapsed.ess_alarm_step == 30 and collapsed.fall_step == 75 and collapsed.ess_lead == 45
    just_above_half = outcome(_run({0: 0.2, 50: 0.32, 100: 0.161}, ess))
    assert not just_above_half.collapsed and just_above_half.fall_step is None
    no_alarm = outcome(_run({0: 0.2, 50: 0.32, 100: 0.1}, [0.11] * 100))
    assert not no_alarm.collapsed and no_alarm.ess_alarm_step is None and no_alarm.ess_lead is None


def test_sync_holds_needs_the_gain_and_the_level():
    ones = [1.0] * 101
    assert outcome(_run({0: 0.20, 50: 0.30, 100: 0.25}, ones)).holds  # +5 points, 0.25 >= 0.8 x 0.30
    assert not outcome(_run({0: 0.20, 50: 0.24, 100: 0.249}, ones)).holds  # +4.9 points only
    assert not outcome(_run({0: 0.20, 50: 0.40, 100: 0.31}, ones)).holds  # 0.31 < 0.8 x 0.40


def test_a_run_without_a_base_evaluation_cannot_be_judged():
    with pytest.raises(ValueError, match="step-0"):
        outcome([{"step": 3, "val/accuracy": 0.2}])



def _row(method, lag, seed, lr, accuracy, ess, size="tiny"):
    return {"task": "countdown", "method": method, "lag": lag, "seed": seed, "lr": lr, "model_size": size,
            "outcome": outcome(_run(accuracy, ess))}


def test_the_closest_candidate_rule_counts_collapses_then_depth_and_needs_sync_to_hold():
    from vcpo.studies.stability import rank_candidates

    alarm = [0.05] * 100
    held = {0: 0.2, 50: 0.35, 100: 0.3}
    fell = lambda end: {0: 0.2, 50: 0.3, 100: end}  # noqa: E731  (end / best = end / 0.3)
    rows = [_row("sync", 0, seed, lr, held, [1.0] * 100) for seed in (0, 1, 2) for lr in (1e-4, 2e-4)]
    rows.append(_row("sync", 0, 1, 3e-4, {0: 0.2, 100: 0.21}, [1.0] * 100))  # sync fails in seed 1 at 3e-4
    rows += [_row("sync", 0, seed, 3e-4, held, [1.0] * 100) for seed in (0, 2)]
    ends = {(1e-4, 24): (0.03, 0.3, 0.3), (1e-4, 48): (0.12, 0.06, 0.3), (2e-4, 48): (0.03, 0.06, 0.3),
            (3e-4, 12): (0.0, 0.0, 0.0)}
    rows += [_row("seq_tis_c8", lag, seed, lr, fell(end), alarm) for (lr, lag), seed_ends in ends.items()
             for seed, end in enumerate(seed_ends)]
    rows.append(_row("seq_tis_c8", 12, 0, 1e-4, fell(0.0), alarm))  # seed 0 only: not eligible
    ranked = rank_candidates(rows)
    # two collapses each at (1e-4, 48) and (2e-4, 48): the deeper mean fall (0.1 + 0.2 + 1) / 3 wins over
    # (0.4 + 0.2 + 1) / 3; one collapse at (1e-4, 24); (3e-4, 12) is out because sync fails in seed 1
    assert [(c.lr, c.lag, c.collapses) for c in ranked] == [(2e-4, 48, 2), (1e-4, 48, 2), (1e-4, 24, 1)]
    assert ranked[0].mean_end_over_best == pytest.approx((0.1 + 0.2 + 1.0) / 3)


def test_the_ess_predictor_counts_leads_and_false_alarms():
    from vcpo.studies.regime_report import ess_predictor

    alarm_at_10 = [1.0] * 10 + [0.05] + [0.5] * 89
    rows = [
        _row("seq_tis_c8", 24, 0, 1e-4, {0: 0.2, 50: 0.3, 75: 0.1, 100: 0.1}, alarm_at_10),  # collapsed, lead 65
        _row("seq_tis_c8", 24, 1, 1e-4, {0: 0.2, 50: 0.3, 100: 0.3}, alarm_at_10),  # held despite the alarm
        _row("vcpo", 24, 0, 1e-4, {0: 0.2, 50: 0.3, 100: 0.3}, [0.5] * 100),  # held, no alarm
        _row("sync", 0, 0, 1e-4, {0: 0.2, 50: 0.3, 100: 0.3}, [1.0] * 100),  # sync: neither
    ]
    result = ess_predictor(rows)
    assert [(r["method"], r["seed"], r["lead_steps"]) for r in result["collapsed"]] == [("seq_tis_c8", 0, 65)]
    assert result["not_collapsed_async_runs"] == 2 and result["false_alarms"] == 1


def test_the_stability_map_puts_sync_on_the_lag_zero_row():
    from vcpo.studies.stability import map_cells

    ones = [1.0] * 100
    rows = [
        _row("sync", 0, 0, 1e-4, {0: 0.2, 100: 0.3}, ones),
        _row("sync", 0, 1, 1e-4, {0: 0.2, 100: 0.9}, ones),  # another seed: not in the seed-0 map
        _row("seq_tis_c8", 12, 0, 1e-4, {0: 0.2, 100: 0.25}, ones),
        _row("vcpo", 12, 0, 1e-4, {0: 0.2, 100: 0.31}, ones),  # another method: not in seq-TIS's map
    ]
    cells = map_cells(rows, "seq_tis_c8")
    assert {key: cell.end for key, cell in cells.items()} == {(1e-4, 0): 0.3, (1e-4, 12): 0.25}


def _write_run(root, method, lag, seed, accuracy, ess, lr=1.5e-4):
    """A finished simulator run as vcpo.sim writes it: config.json, metrics.jsonl, final/eval.json."""
    folder = root / "countdown" / method / f"lag{lag}" / f"seed{seed}"
    (folder / "final").mkdir(parents=True)
    lines = _run(accuracy, ess)
    for line in lines[:-1]:
        line |= {"critic/score/mean": 0.2, "actor/grad_norm": 0.5, "rollout_corr/kl": 0.01}
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (folder / "final" / "eval.json").write_text(json.dumps(lines[-1]))
    (folder / "config.json").write_text(json.dumps({
        "task": "countdown", "method": method, "lag": lag, "seed": seed, "reference_lr": lr, "model_size": "tiny",
        "steps": max(accuracy), "config_file": "regime.yaml",
    }))


def test_the_regime_report_judges_every_run_and_names_the_regime(tmp_path):
    from vcpo.studies.regime_report import report

    regime = tmp_path / "regime.yaml"
    regime.write_text("task: countdown\nlag: 24\nlr: 1.5e-4\n")
    runs = tmp_path / "runs"
    alarm = [1.0] * 10 + [0.05] * 90
    for seed in (0, 1, 2):
        _write_run(runs, "sync", 0, seed, {0: 0.2, 50: 0.3, 100: 0.3}, [1.0] * 100)
        _write_run(runs, "seq_tis_c8", 24, seed, {0: 0.2, 50: 0.3, 75: 0.1, 100: 0.05 + seed / 100}, alarm)
        _write_run(runs, "vcpo", 24, seed, {0: 0.2, 50: 0.3, 100: 0.28}, alarm)
    _write_run(runs, "seq_tis_c8", 8, 0, {0: 0.2, 100: 0.3}, [0.5] * 100)  # the lag sweep
    written = report(runs, regime, tmp_path / "out")
    outcomes = json.loads((tmp_path / "out" / "outcomes.json").read_text())
    verdicts = {(r["method"], r["lag"], r["seed"]): (r["holds"], r["collapsed"]) for r in outcomes["runs"]}
    assert verdicts[("sync", 0, 1)] == (True, False) and verdicts[("seq_tis_c8", 24, 2)] == (False, True)
    assert verdicts[("vcpo", 24, 0)] == (True, False) and verdicts[("seq_tis_c8", 8, 0)] == (True, False)
    predictor = outcomes["ess_predictor_at_regime_lag"]
    assert [(r["seed"], r["lead_steps"]) for r in predictor["collapsed"]] == [(0, 65), (1, 65), (2, 65)]
    assert predictor["not_collapsed_async_runs"] == 3 and predictor["false_alarms"] == 3  # VCPO: alarm, no fall
    assert outcomes["regime"] == str(regime)
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert f"`{regime}`" in summary and "| vcpo | 24 | 3 | 0.200 | 0.280 (0.280-0.280)" in summary
    assert {path.name for path in written} >= {"core.png", "ablation.png", "methods.png", "lag_sweep.png"}


def test_a_config_file_carries_notes_that_runs_record(base, tmp_path, capsys):
    regime = tmp_path / "regime.yaml"
    regime.write_text("reference_lr: 2.0e-4\nextra:\n  label: closest candidate\n")
    assert load_config_file(regime).extra == {"label": "closest candidate"}
    out = tmp_path / "run"
    assert sim_main(["train", "--config", str(regime), "--method", "seq_tis_c8", "--lag", "1", "--steps", "2",
                     "--out", str(out), f"base={base}", *SHORT]) == 0
    assert json.loads((out / "config.json").read_text())["extra"] == {"label": "closest candidate"}
    assert sim_main(["train", "--out", str(tmp_path / "other"), "extra=x"]) == 2
    assert "set only as a mapping in a --config file" in capsys.readouterr().err
    regime.write_text("extra: [1, 2]\n")
    with pytest.raises(ConfigError, match="'extra' must be a mapping"):
        load_config_file(regime)


def test_an_archived_run_recorded_before_lag_stood_alone_is_judged_at_its_lag():
    """A run folder of the studies also recorded the lag as ``effective_lag`` (always equal to ``lag``); the
    rows read ``lag``, which every recorded config.json holds."""
    from pathlib import Path

    from vcpo.studies.stability import judge_root

    archived = Path(__file__).resolve().parents[1] / "tables/across_lags/runs/countdown/seq_tis_k12/seed0"
    config = json.loads((archived / "config.json").read_text())
    assert config["effective_lag"] == config["lag"] == 12
    assert [row["lag"] for row in judge_root(archived)] == [12]
