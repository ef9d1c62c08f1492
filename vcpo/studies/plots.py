"""Curves of a sweep, like VCPO Figures 4-6: one panel per metric, one line per method, mean ± spread over seeds.

    python -m vcpo.studies.plots RUNS_ROOT --task countdown --lag 12 --out figures/ [--methods sync,seq_tis_c8,vcpo]

Reads ``RUNS_ROOT/<task>/<method>/lag<k>/seed<s>/metrics.jsonl`` (the layout of ``python -m vcpo.sim
sweep``); sync runs are read at lag 0 whatever ``--lag`` is. Train-side metrics are smoothed with a
moving average over ``--smooth`` steps (held-out accuracy is not). The shaded band is the min-max
over seeds, the line their mean.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vcpo.cli import shrink_problem
from vcpo.locks import write_atomic
from vcpo.reporting.figures import (
    PANEL_NAMES,
    draw_lag_sweep_axes,
    draw_method,
    lag_sweep_rows,
    method_label,
    pyplot,
    save,
    style_panel,
)
from vcpo.reporting.run_data import read_metrics, run_dirs, seed_band, series, smooth, summary_rows
from vcpo.runs import EFFECTIVE_LR, SEQ_ESS_RATIO, VAL_ACCURACY

# The shared readers and drawing live in vcpo.reporting; they are re-exported here for this CLI's users.
__all__ = ["plot_lag_sweep", "plot_sweep", "read_metrics", "run_dirs", "seed_band", "series", "smooth", "summary_rows"]

PANELS = tuple((name, PANEL_NAMES[name]) for name in
               (VAL_ACCURACY, "critic/score/mean", SEQ_ESS_RATIO, "rollout_corr/kl", "actor/grad_norm", EFFECTIVE_LR))


def plot_sweep(
    root: Path, task: str, lag: int, methods: list[str], out: Path, window: int = 10, title: str = ""
) -> Path:
    fig, axes = pyplot().subplots(2, 3, figsize=(15, 8))
    for method in methods:
        runs = [read_metrics(d) for d in run_dirs(root, task, method, lag)]
        for ax, (key, _) in zip(axes.flat, PANELS, strict=True):
            if runs:
                draw_method(ax, runs, key, method_label(method, len(runs)), window)
    for ax, (key, _) in zip(axes.flat, PANELS, strict=True):
        style_panel(ax, key, "optimizer step")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(title or f"{task}, policy lag k = {lag} (simulated PipelineRL-k, CPU scale)")
    fig.tight_layout()
    return save(fig, out)


def plot_lag_sweep(root: Path, task: str, method: str, lags: list[int], out: Path) -> Path:
    """Held-out accuracy (start, best, end) and ESS ratio (mean, min) against the policy lag k;
    lag 0 is read from the sync runs."""
    fig, (left, right) = pyplot().subplots(1, 2, figsize=(11, 4))
    draw_lag_sweep_axes(left, right, lag_sweep_rows(root, task, method, lags), method)
    fig.tight_layout()
    return save(fig, out)


def summary_markdown(rows: list[dict]) -> str:
    lines = [
        "| method | lag | seeds | held-out acc. start | end: mean (min-max) | best | train reward, last 20 | ESS ratio mean / min | max grad norm |",
        "|---|---:|---:|---:|---|---:|---:|---|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['lag']} | {r['seeds']} | {r['acc_start']:.3f} | {r['acc_end']:.3f} "
            f"({r['acc_end_min']:.3f}-{r['acc_end_max']:.3f}) | {r['acc_best']:.3f} | {r['reward_last20']:.3f} | "
            f"{r['ess_mean']:.3f} / {r['ess_min']:.3f} | {r['grad_norm_max']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def summary_table_rows(markdown: str) -> list[dict]:
    """The method, lag and seeds of each row of a `summary_markdown` table."""
    cells = [line.strip("|").split("|") for line in markdown.splitlines()[2:] if line.startswith("|")]
    return [{"method": row[0].strip(), "lag": int(row[1]), "seeds": int(row[2])} for row in cells]


def seeds_by_row(rows: list[dict]) -> dict[str, int]:
    return {f"{row['method']} at lag {row['lag']}": row["seeds"] for row in rows}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vcpo.studies.plots", description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--task", default="countdown")
    parser.add_argument("--lag", type=int, help="the lag of the curves (not with --lags)")
    parser.add_argument("--lags", help="comma-separated lags: plot the first method against the lag instead")
    parser.add_argument("--methods", default="sync,seq_tis_c8,vcpo")
    parser.add_argument("--out", type=Path, required=True, help="PNG file")
    parser.add_argument("--smooth", type=int, default=10)
    parser.add_argument("--title", default="")
    parser.add_argument("--table", type=Path, help="also write a markdown summary table here")
    args = parser.parse_args(argv)
    methods = args.methods.split(",")
    lags = [int(lag) for lag in args.lags.split(",")] if args.lags else None
    if lags is None and args.lag is None:
        parser.error("--lag or --lags is required")
    if args.table:
        rows = lag_sweep_rows(args.root, args.task, methods[0], lags) if lags else summary_rows(args.root, args.task, args.lag, methods)
        recorded = seeds_by_row(summary_table_rows(args.table.read_text())) if args.table.exists() else {}
        if problem := shrink_problem(args.table, recorded, seeds_by_row(rows), "pass --table and --out for files of your own",
                                     unit="seeds"):
            sys.exit(f"error: {problem}")
    if lags:
        print(plot_lag_sweep(args.root, args.task, methods[0], lags, args.out))
    else:
        print(plot_sweep(args.root, args.task, args.lag, methods, args.out, args.smooth, args.title))
    if args.table:
        args.table.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(args.table, summary_markdown(rows))
        print(args.table)


if __name__ == "__main__":
    main()
