"""Curves of a sweep, like VCPO Figures 4-6: one panel per metric, one line per method, mean ± spread over seeds.

    python -m vcpo.sim.plots RUNS_ROOT --task countdown --lag 12 --out figures/ [--methods sync,seq_tis_c8,vcpo]

Reads ``RUNS_ROOT/<task>/<method>/lag<k>/seed<s>/metrics.jsonl`` (the layout of ``python -m vcpo.sim
sweep``); sync runs are read at lag 0 whatever ``--lag`` is. Train-side metrics are smoothed with a
moving average over ``--smooth`` steps (held-out accuracy is not). The shaded band is the min-max
over seeds, the line their mean.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

PANELS = (
    ("val/accuracy", "held-out accuracy"),
    ("critic/score/mean", "train reward"),
    ("rollout_corr/seq_ess_ratio", "ESS ratio (ESS / B)"),
    ("rollout_corr/kl", "KL(behaviour || learner)"),
    ("actor/grad_norm", "gradient norm (before clipping)"),
    ("actor/effective_lr", "effective learning rate"),
)


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def series(lines: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    points = [(line["step"], line[key]) for line in lines if isinstance(line.get(key), int | float)]
    if not points:
        return np.empty(0), np.empty(0)
    steps, values = zip(*points, strict=True)
    return np.asarray(steps), np.asarray(values, dtype=float)


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    if window <= 1 or values.size < window:
        return values
    kernel = np.ones(window) / window
    padded = np.concatenate([np.full(window - 1, values[0]), values])
    return np.convolve(padded, kernel, mode="valid")


def run_dirs(root: Path, task: str, method: str, lag: int) -> list[Path]:
    lag = 0 if method == "sync" else lag
    return sorted(p.parent for p in (root / task / method / f"lag{lag}").glob("seed*/metrics.jsonl"))


def seed_band(runs: list[list[dict]], key: str, window: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Steps common to all seeds, and the mean, min and max over seeds at those steps."""
    curves = [series(lines, key) for lines in runs]
    curves = [(s, v) for s, v in curves if s.size]
    if not curves:
        return (np.empty(0),) * 4
    common = sorted(set.intersection(*(set(s.tolist()) for s, _ in curves)))
    stacked = []
    for steps, values in curves:
        values = values if key.startswith("val") else smooth(values, window)
        lookup = dict(zip(steps.tolist(), values.tolist(), strict=True))
        stacked.append([lookup[s] for s in common])
    stacked = np.asarray(stacked)
    return np.asarray(common), stacked.mean(0), stacked.min(0), stacked.max(0)


def plot_sweep(root: Path, task: str, lag: int, methods: list[str], out: Path, window: int = 10, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for method in methods:
        runs = [read_metrics(d / "metrics.jsonl") for d in run_dirs(root, task, method, lag)]
        if not runs:
            continue
        label = f"{method} (k=0)" if method == "sync" else method
        label += f", {len(runs)} seed{'s' if len(runs) > 1 else ''}"
        for ax, (key, _) in zip(axes.flat, PANELS, strict=True):
            steps, mean, low, high = seed_band(runs, key, window)
            if not steps.size:
                continue
            (line,) = ax.plot(steps, mean, label=label, marker="o" if key.startswith("val") else None, markersize=3)
            if len(runs) > 1:
                ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.15)
    for ax, (key, name) in zip(axes.flat, PANELS, strict=True):
        ax.set_title(name)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        if key == "actor/grad_norm":
            ax.set_yscale("log")
        if key == "rollout_corr/kl":  # an estimate: slightly negative values occur
            ax.set_yscale("symlog", linthresh=1e-4)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(title or f"{task}, policy lag k = {lag} (simulated PipelineRL-k, CPU scale)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def summary_rows(root: Path, task: str, lag: int, methods: list[str]) -> list[dict]:
    """Per method: seeds, held-out accuracy at the start and the end (mean and min-max over seeds),
    the best accuracy along the run, the mean train reward of the last 20 steps, the lowest ESS ratio
    and the largest gradient norm seen."""
    rows = []
    for method in methods:
        runs = [read_metrics(d / "metrics.jsonl") for d in run_dirs(root, task, method, lag)]
        if not runs:
            continue
        accuracy = [series(lines, "val/accuracy")[1] for lines in runs]
        rewards = [series(lines, "critic/score/mean")[1] for lines in runs]
        ess = [series(lines, "rollout_corr/seq_ess_ratio")[1] for lines in runs]
        grad = [series(lines, "actor/grad_norm")[1] for lines in runs]
        final = np.array([a[-1] for a in accuracy if a.size])
        rows.append(
            {
                "method": method,
                "lag": 0 if method == "sync" else lag,
                "seeds": len(runs),
                "steps": max(int(series(lines, "critic/score/mean")[0].max()) + 1 for lines in runs),
                "acc_start": float(np.mean([a[0] for a in accuracy if a.size])),
                "acc_end": float(final.mean()),
                "acc_end_min": float(final.min()),
                "acc_end_max": float(final.max()),
                "acc_best": float(np.mean([a.max() for a in accuracy if a.size])),
                "reward_last20": float(np.mean([r[-20:].mean() for r in rewards])),
                "ess_min": float(min(e.min() for e in ess)),
                "ess_mean": float(np.mean([e.mean() for e in ess])),
                "grad_norm_max": float(max(g.max() for g in grad)),
            }
        )
    return rows


def plot_lag_sweep(root: Path, task: str, method: str, lags: list[int], out: Path) -> Path:
    """Held-out accuracy (start, best, end) and ESS ratio (mean, min) against the policy lag k;
    lag 0 is read from the sync runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = []
    for lag in lags:
        found = summary_rows(root, task, lag, ["sync" if lag == 0 else method])
        if found:
            rows.append({**found[0], "lag": lag})
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    x = [r["lag"] for r in rows]
    left.plot(x, [r["acc_end"] for r in rows], "o-", label="end of run")
    left.plot(x, [r["acc_best"] for r in rows], "s--", label="best along the run")
    left.plot(x, [r["acc_start"] for r in rows], ":", color="grey", label="SFT base")
    left.set_title(f"{method}: held-out accuracy vs policy lag")
    right.plot(x, [r["ess_mean"] for r in rows], "o-", label="mean over steps")
    right.plot(x, [r["ess_min"] for r in rows], "s--", label="minimum")
    right.set_title("ESS ratio vs policy lag")
    for ax in (left, right):
        ax.set_xlabel("max policy lag k (0 = sync)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vcpo.sim.plots", description=__doc__.split("\n\n")[0])
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
    if args.lags:
        lags = [int(lag) for lag in args.lags.split(",")]
        print(plot_lag_sweep(args.root, args.task, methods[0], lags, args.out))
        if args.table:
            rows = [{**row, "lag": lag} for lag in lags for row in summary_rows(args.root, args.task, lag, ["sync" if lag == 0 else methods[0]])]
            args.table.write_text(summary_markdown(rows))
        return
    if args.lag is None:
        parser.error("--lag or --lags is required")
    print(plot_sweep(args.root, args.task, args.lag, methods, args.out, args.smooth, args.title))
    if args.table:
        args.table.parent.mkdir(parents=True, exist_ok=True)
        args.table.write_text(summary_markdown(summary_rows(args.root, args.task, args.lag, methods)))
        print(args.table)


if __name__ == "__main__":
    main()
