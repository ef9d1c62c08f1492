"""Drawing the figures of ``figures.yaml`` from run outputs, one function per figure kind.

Every figure carries its scale ("smoke scale" / "paper scale") and its paper reference, and names the
runs it could not find instead of failing: a partial study still gives a readable figure, and a figure
with no data at all is a PNG that says so (the workflow always gets the file it asked for).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import numpy as np

from vcpo.methods import is_synchronous
from vcpo.reporting.run_data import ACCURACY, read_metrics, run_dirs, seed_band, seed_of, series, summary_rows
from vcpo.reporting.specs import figure_specs, paper_results, runs_needed, spec_lags, spec_tasks
from vcpo.runs import CONFIG_FILE, EFFECTIVE_LR, LR_SCALE, SEQ_ESS_RATIO

SCALES = {"smoke": "smoke scale (CPU)", "paper": "paper scale (verl)"}
PANEL_NAMES = {
    ACCURACY: "held-out accuracy",
    "critic/score/mean": "train reward",
    SEQ_ESS_RATIO: "ESS ratio (ESS / B)",
    "rollout_corr/kl": "KL(behaviour || learner)",
    "actor/grad_norm": "gradient norm (before clipping)",
    EFFECTIVE_LR: "effective learning rate",
    "actor/kept_token_frac": "trusted-token fraction",
}
# Figure kinds drawn from a measurement file (--measured), not from run metrics.
MEASURED_KINDS = ("overhead", "grad_norm_proxy")
X_LABELS = {"step": "optimizer step", "wall_clock": "wall-clock hours (training + evaluation)"}


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display on CPU machines and in the workflow)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def method_label(method: str, seeds: int) -> str:
    lag = " (k=0)" if is_synchronous(method) else ""
    return f"{method}{lag}, {seeds} seed{'s' if seeds != 1 else ''}"


def draw_method(
    ax, runs: list[list[dict]], key: str, label: str, window: int = 1, wall_clock: bool = False, color=None
) -> bool:
    """One method's mean line and min-max band over seeds on ``ax``; False when no run logged ``key``."""
    x, mean, low, high = seed_band(runs, key, window, wall_clock)
    if not x.size:
        return False
    marker = "o" if key.startswith("val") else None
    (line,) = ax.plot(x, mean, label=label, marker=marker, markersize=3, color=color)
    if len(runs) > 1:
        ax.fill_between(x, low, high, color=line.get_color(), alpha=0.15)
    return True


def method_colors(methods: list[str]) -> dict[str, tuple]:
    """A distinct colour per method, the same in every panel (tab20 beyond matplotlib's 10 cycle colours)."""
    cmap = pyplot().get_cmap("tab10" if len(methods) <= 10 else "tab20")
    return {method: cmap(i % cmap.N) for i, method in enumerate(methods)}


def style_panel(ax, key: str, xlabel: str, log: bool = False) -> None:
    """Title, grid and y scale of a metric panel: KL is symlog (the estimate can be slightly negative),
    gradient norms and the figure's ``log_panels`` are log."""
    ax.set_title(PANEL_NAMES.get(key, key), fontsize=10)
    ax.set_xlabel(xlabel)
    ax.grid(alpha=0.3)
    if key == "rollout_corr/kl":
        ax.set_yscale("symlog", linthresh=1e-4)
    elif log or key == "actor/grad_norm":
        ax.set_yscale("log")


def label_figure(fig, title: str, paper: str, scale: str, notes: list[str], sources: list[str] = ()) -> None:
    """Title with the paper reference, the scale and the config files the runs came from; ``notes``
    (missing runs, ...) along the bottom."""
    source = f"  |  runs from {', '.join(sources)}" if sources else ""
    fig.suptitle(f"{title}\n{paper}  |  {SCALES[scale]}{source}", fontsize=11)
    if notes:
        text = "\n".join(textwrap.fill(note, 150) for note in notes)
        fig.text(0.01, 0.0, text, fontsize=8, va="top", ha="left", color="firebrick")


def save(fig, out: Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    pyplot().close(fig)
    return out


def message_figure(out: Path, spec: dict[str, Any], scale: str, message: str) -> Path:
    """A PNG holding only the figure's labels and ``message``: the figure could not be drawn."""
    fig = pyplot().figure(figsize=(10, 3))
    fig.text(0.5, 0.45, textwrap.fill(message, 110), ha="center", va="center", fontsize=11, wrap=True)
    label_figure(fig, spec["title"], spec["paper"], scale, [])
    return save(fig, out)


def missing_note(missing: list[tuple[str, str, int]]) -> list[str]:
    if not missing:
        return []
    return ["Missing runs (not drawn): " + ", ".join(f"{t}/{m}/lag{k}" for t, m, k in missing)]


def config_files(root: Path, needed: list[tuple[str, str, int]]) -> list[str]:
    """The ``--config`` files (``config_file`` of each run's config.json) the needed runs were started from."""
    files = set()
    for run in needed:
        for folder in run_dirs(root, *run):
            config = Path(folder) / CONFIG_FILE
            if config.exists():
                files.add(json.loads(config.read_text()).get("config_file"))
    return sorted(files - {None})


def load_runs(
    root: Path, needed: list[tuple[str, str, int]], seeds: str
) -> dict[tuple[str, str, int], list[list[dict]]]:
    """Metrics of every needed run that exists. ``seeds="core"`` keeps only the seeds every found
    (task, method, lag) has, so that methods are compared on the same seeds; ``"all"`` keeps all."""
    dirs = {run: run_dirs(root, *run) for run in needed}
    dirs = {run: found for run, found in dirs.items() if found}
    if seeds == "core" and dirs:
        common = set.intersection(*({seed_of(d) for d in found} for found in dirs.values()))
        dirs = {run: [d for d in found if seed_of(d) in common] for run, found in dirs.items()}
    return {run: [read_metrics(d) for d in found] for run, found in dirs.items() if found}


def draw_curves(
    spec, root: Path, scale: str, out: Path, task=None, lag=None, seeds: str = "all", window: int = 10
) -> Path:
    """Kind ``curves``: a row per task, a panel per metric, a line (mean, min-max band) per method."""
    needed = runs_needed(spec, task, lag)
    runs = load_runs(root, needed, seeds)
    missing = [run for run in needed if run not in runs]
    if not runs:
        return message_figure(out, spec, scale, "No data: none of the runs exist. " + missing_note(missing)[0])
    tasks, panels = spec_tasks(spec, task), spec["panels"]
    x = {key: spec.get("panel_x", {}).get(key, spec.get("x", "step")) for key in panels}
    fig, axes = pyplot().subplots(
        len(tasks), len(panels), figsize=(max(4.6 * len(panels), 7.5), 3.6 * len(tasks)), squeeze=False, layout="constrained"
    )
    colors = method_colors(list(dict.fromkeys(run[1] for run in needed)))
    for row, name in zip(axes, tasks, strict=True):
        for run in [r for r in needed if r[0] == name and r in runs]:
            label = method_label(run[1], len(runs[run]))
            for ax, key in zip(row, panels, strict=True):
                draw_method(ax, runs[run], key, label, window, x[key] == "wall_clock", colors[run[1]])
        for ax, key in zip(row, panels, strict=True):
            style_panel(ax, key, X_LABELS[x[key]], key in spec.get("log_panels", ()))
            if not ax.lines:
                empty = f"no {key} logged" if any(r[0] == name for r in runs) else f"no runs of {name}"
                ax.text(0.5, 0.5, empty, transform=ax.transAxes, ha="center", color="grey")
        k = lag if lag is not None else spec["lag"]
        row[0].set_ylabel(f"{name}, k = {k}")
    handles = {h.get_label(): h for ax in axes.flat for h in ax.get_legend_handles_labels()[0]}
    fig.legend(handles.values(), handles.keys(), loc="outside lower center", ncols=min(len(handles), 4), fontsize=8)
    label_figure(fig, spec["title"], spec["paper"], scale, missing_note(missing), config_files(root, needed))
    return save(fig, out)


def draw_lag_sweep_axes(left, right, rows: list[dict], method: str) -> None:
    """Held-out accuracy (start, best, end) and ESS ratio (mean, min) of ``rows`` against their lag."""
    x = [r["lag"] for r in rows]
    left.plot(x, [r["acc_end"] for r in rows], "o-", label="end of run")
    left.plot(x, [r["acc_best"] for r in rows], "s--", label="best along the run")
    left.plot(x, [r["acc_start"] for r in rows], ":", color="grey", label="base (step 0)")
    left.set_title(f"{method}: held-out accuracy vs policy lag")
    right.plot(x, [r["ess_mean"] for r in rows], "o-", label="mean over steps")
    right.plot(x, [r["ess_min"] for r in rows], "s--", label="minimum")
    right.set_title("ESS ratio vs policy lag")
    for ax in (left, right):
        ax.set_xlabel("max policy lag k (0 = sync)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)


def lag_sweep_rows(root: Path, task: str, method: str, lags: list[int]) -> list[dict]:
    """One summary row per lag that has runs; lag 0 is read from the sync runs."""
    rows = []
    for lag in lags:
        found = summary_rows(root, task, lag, ["sync" if lag == 0 else method])
        rows.extend({**row, "lag": lag} for row in found)
    return rows


def draw_lag_sweep(spec, root: Path, scale: str, out: Path, task=None, lag: int | None = None) -> Path:
    """Kind ``lag_sweep``: final accuracy and the ESS ratio against the lag, one method."""
    name, method = spec_tasks(spec, task)[0], spec["methods"][0]
    rows = lag_sweep_rows(root, name, method, spec_lags(spec, lag))
    found = {row["lag"] for row in rows}
    missing = [run for run in runs_needed(spec, name, lag) if run[2] not in found]
    if not rows:
        return message_figure(out, spec, scale, "No data: none of the runs exist. " + missing_note(missing)[0])
    fig, (left, right) = pyplot().subplots(1, 2, figsize=(11, 4), layout="constrained")
    draw_lag_sweep_axes(left, right, rows, method)
    needed = runs_needed(spec, name, lag)
    label_figure(fig, spec["title"], spec["paper"], scale, [f"task {name}"] + missing_note(missing), config_files(root, needed))
    return save(fig, out)


def draw_overhead(spec, measured: Path | None, scale: str, out: Path) -> Path:
    """Kind ``overhead``: step-time and peak-memory ratios to the plain update, measured by
    ``benchmarks/opob_overhead.py --json`` beside the ratios the paper states for Figure 3."""
    if measured is None or not Path(measured).exists():
        return message_figure(out, spec, scale, f"No data: no benchmarks/opob_overhead.py --json output at {measured}.")
    result = json.loads(Path(measured).read_text())
    paper = paper_results()["figures"][spec["id"]]
    fig, axes = pyplot().subplots(1, 2, figsize=(11, 4), layout="constrained")
    for ax, key, title in zip(
        axes, ("step_time_ratio", "memory_ratio"), ("step time / plain", "peak memory / plain"), strict=True
    ):
        ours = result["ratios"].get(key, {})
        if not ours:
            ax.text(0.5, 0.5, "not measured (--no-memory)", transform=ax.transAxes, ha="center", color="grey")
        variants = list(ours)
        x = np.arange(len(variants))
        ax.bar(x - 0.2, [ours[v] for v in variants], 0.4, label=f"measured ({result['setting']})")
        published = [paper[key].get(v, np.nan) for v in variants]
        ax.bar(x + 0.2, published, 0.4, label=f"paper ({paper['reference']}; no bar: not stated)")
        ax.set_xticks(x, variants)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(title)
        ax.grid(alpha=0.3, axis="y")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=2, fontsize=8)
    label_figure(fig, spec["title"], spec["paper"], scale, [])
    return save(fig, out)


def draw_grad_norm_proxy(spec, measured: Path | None, scale: str, out: Path) -> Path:
    """Kind ``grad_norm_proxy``: exact per-sequence squared gradient norms against OTB's proxy (and OPO's,
    the response length), as ``python -m vcpo.studies.grad_norms`` measured them (its JSON)."""
    if scale == "paper":
        reason = (
            "not produced at paper scale: this generator samples with the CPU simulator's rollout code and "
            "task prompts; GSM8K prompts from verl's parquet data with 4096-token responses from the verl "
            "checkpoint (checkpoints/global_step_N/actor/huggingface) would need a GPU generation harness."
        )
        return message_figure(out, spec, scale, reason)
    if measured is None or not Path(measured).exists():
        return message_figure(out, spec, scale, f"No data: no measurement {measured} (python -m vcpo.studies.grad_norms).")
    result = json.loads(Path(measured).read_text())
    if "missing" in result:
        return message_figure(out, spec, scale, f"No data: {result['missing']}.")
    exact, proxy, lengths = (np.array(result[key]) for key in ("exact_sq_norms", "logit_energy_proxy", "response_tokens"))
    otb, opo = result["otb_proxy"], result["opo_length"]
    fig, ax = pyplot().subplots(figsize=(7, 5.2), layout="constrained")
    points = ax.scatter(proxy, exact, c=lengths, cmap="viridis", s=22)
    fig.colorbar(points, ax=ax, label="response tokens (OPO's proxy)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("OTB logit-energy proxy  Σ_t (1 − 2π(y_t) + Σ_v π_v²)")
    ax.set_ylabel("exact ||∇_θ Σ_t log π(y_t)||²")
    ax.grid(alpha=0.3, which="both")
    ax.set_title(
        f"OTB proxy: Pearson {otb['pearson']:.2f} (log-log {otb['pearson_log']:.2f}), Spearman {otb['spearman']:.2f}\n"
        f"length: Pearson {opo['pearson']:.2f}, Spearman {opo['spearman']:.2f}",
        fontsize=9,
    )
    note = f"{len(exact)} held-out {result['task']} prompts, one response each (T = {result['temperature']}), {result['run']}"
    label_figure(fig, spec["title"], spec["paper"], scale, [note])
    return save(fig, out)


def draw_figure(
    figure_id: str,
    runs: Path,
    scale: str,
    out: Path,
    task: str | list[str] | None = None,
    lag: int | None = None,
    seeds: str = "all",
    measured: Path | None = None,
) -> Path:
    """Figure ``figure_id`` of figures.yaml from the runs below ``runs``; returns the PNG written."""
    specs = figure_specs()
    if figure_id not in specs:
        raise ValueError(f"unknown figure {figure_id!r}; known: {sorted(specs)}")
    spec = specs[figure_id]
    if spec["kind"] == "curves":
        return draw_curves(spec, runs, scale, out, task, lag, seeds)
    if spec["kind"] == "lag_sweep":
        return draw_lag_sweep(spec, runs, scale, out, task, lag)
    if spec["kind"] == "overhead":
        return draw_overhead(spec, measured, scale, out)
    return draw_grad_norm_proxy(spec, measured, scale, out)


# A run's own curves (python -m vcpo.reporting curves; the real model's lag study): verl's names, flattened
STALENESS_MAX = "training/off_policy/trajectory_staleness/max"
RUN_PANELS = (("critic/score/mean", "training reward"), (ACCURACY, "held-out accuracy (greedy)"),
              (SEQ_ESS_RATIO, "sequence ESS ratio"), (LR_SCALE, "lr scale (VCPO's ESS step size)"), (STALENESS_MAX, "staleness (verl, max)"),
              ("rollout_corr/kl", "KL(behaviour || learner)"))


def draw_runs(groups: dict[str, list[list[dict]]], out: Path, title: str) -> Path:
    """One panel per metric of RUN_PANELS; per group of runs (flat metric lines, ``run_data.read_metrics``), each run
    faint and the mean over its runs bold (at the steps every run logged)."""
    figure, axes = pyplot().subplots(2, 3, figsize=(14, 7.5))
    colors = method_colors(list(groups))
    for axis, (key, label) in zip(axes.flat, RUN_PANELS, strict=True):
        drawn = False
        for name, runs in groups.items():
            curves = [series(lines, key) for lines in runs]
            curves = [(steps, values) for steps, values in curves if steps.size]
            drawn = drawn or bool(curves)
            for steps, values in curves:
                axis.plot(steps, values, color=colors[name], alpha=0.25 if len(runs) > 1 else 0.9, linewidth=0.8,
                          marker="o" if key == ACCURACY else None, markersize=2)
            if len(curves) > 1:
                common = sorted(set.intersection(*(set(steps.tolist()) for steps, _ in curves)))
                mean = [np.mean([values[steps.tolist().index(step)] for steps, values in curves]) for step in common]
                axis.plot(common, mean, color=colors[name], linewidth=2.2, marker="o" if key == ACCURACY else None,
                          markersize=3)
            if curves:
                axis.plot([], [], color=colors[name], linewidth=2.2, label=f"{name} ({len(curves)})")
        if not drawn:  # an empty panel would read as a failed plot
            axis.text(0.5, 0.5, "no run here logs it", transform=axis.transAxes, ha="center", va="center", color="0.4")
        axis.set_title(label, fontsize=10)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    return save(figure, out)
