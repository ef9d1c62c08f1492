"""Summaries and figures of a sweep, from hand-made metrics files with known answers."""

import json

import pytest

from vcpo.studies.plots import plot_sweep, seed_band, smooth, summary_markdown, summary_rows


def write_run(root, method, lag, seed, accuracy, rewards, ess):
    folder = root / "countdown" / method / f"lag{lag}" / f"seed{seed}"
    folder.mkdir(parents=True)
    lines = []
    for step, (reward, e) in enumerate(zip(rewards, ess, strict=True)):
        line = {"step": step, "critic/score/mean": reward, "rollout_corr/seq_ess_ratio": e, "actor/grad_norm": 1.0 + step,
                "rollout_corr/kl": 0.01, "actor/effective_lr": 1e-4}
        if step in accuracy:
            line["val/accuracy"] = accuracy[step]
        lines.append(line)
    lines.append({"step": len(rewards), "val/accuracy": accuracy[len(rewards)]})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


@pytest.fixture
def sweep(tmp_path):
    write_run(tmp_path, "sync", 0, 0, {0: 0.2, 2: 0.3, 4: 0.5}, [0.1, 0.2, 0.3, 0.4], [1.0] * 4)
    write_run(tmp_path, "sync", 0, 1, {0: 0.2, 2: 0.4, 4: 0.3}, [0.2, 0.2, 0.2, 0.2], [1.0] * 4)
    write_run(tmp_path, "vcpo", 8, 0, {0: 0.2, 2: 0.1, 4: 0.25}, [0.0, 0.1, 0.0, 0.1], [0.9, 0.5, 0.2, 0.6])
    return tmp_path


def test_summary_rows_have_the_known_values(sweep):
    rows = {row["method"]: row for row in summary_rows(sweep, "countdown", 8, ["sync", "vcpo", "m2po"])}
    assert set(rows) == {"sync", "vcpo"}  # methods without runs are left out
    sync, vcpo = rows["sync"], rows["vcpo"]
    assert (sync["lag"], sync["seeds"], sync["steps"]) == (0, 2, 4)
    assert sync["acc_end"] == pytest.approx(0.4) and (sync["acc_end_min"], sync["acc_end_max"]) == (0.3, 0.5)
    assert sync["acc_best"] == pytest.approx((0.5 + 0.4) / 2)
    assert sync["reward_last20"] == pytest.approx((0.25 + 0.2) / 2)
    assert vcpo["ess_min"] == 0.2 and vcpo["ess_mean"] == pytest.approx(0.55) and vcpo["grad_norm_max"] == 4.0
    table = summary_markdown([sync, vcpo])
    assert "| sync | 0 | 2 | 0.200 | 0.400 (0.300-0.500) | 0.450 |" in table


def test_seed_band_and_smoothing(sweep):
    from vcpo.studies.plots import read_metrics, run_dirs

    runs = [read_metrics(d) for d in run_dirs(sweep, "countdown", "sync", 99)]
    steps, mean, low, high = seed_band(runs, "val/accuracy", window=10)
    assert steps.tolist() == [0, 2, 4]
    assert mean.tolist() == pytest.approx([0.2, 0.35, 0.4]) and low.tolist() == [0.2, 0.3, 0.3]
    assert smooth(__import__("numpy").array([1.0, 3.0, 5.0]), 2).tolist() == [1.0, 2.0, 4.0]


def test_the_sweep_figure_draws_each_methods_seed_mean_in_every_panel(sweep, monkeypatch):
    """Each panel holds, per method, the mean over its seeds (seed_band) of that panel's metric, titled by it."""
    import vcpo.studies.plots as plots

    figures = []
    monkeypatch.setattr(plots, "save", lambda fig, out: figures.append(fig) or out)
    plot_sweep(sweep, "countdown", 8, ["sync", "vcpo"], sweep / "figure.png", window=2)
    (figure,) = figures
    runs = {method: [plots.read_metrics(d) for d in plots.run_dirs(sweep, "countdown", method, 8)] for method in ("sync", "vcpo")}
    for axis, (key, title) in zip(figure.axes, plots.PANELS, strict=True):
        assert axis.get_title() == title
        lines = axis.get_lines()
        assert len(lines) == 2  # one per method, sync (read at lag 0) first
        for line, method in zip(lines, ("sync", "vcpo"), strict=True):
            x, mean, _, _ = seed_band(runs[method], key, 2)
            assert line.get_xdata().tolist() == x.tolist() and line.get_ydata().tolist() == pytest.approx(mean.tolist())
    accuracy = figure.axes[0].get_lines()[0]
    assert accuracy.get_ydata().tolist() == pytest.approx([0.2, 0.35, 0.4])  # sync's two seeds, by hand
