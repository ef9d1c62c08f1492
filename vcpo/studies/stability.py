"""Did a run hold or collapse? The pre-registered criteria of the regime search, applied to a run's metrics.

Held-out accuracy is ``val/accuracy`` at the evaluation steps (step 0 is the SFT base) and at the final
evaluation. With ``best`` the highest of these values and ``end`` the final one:

- a synchronous run *holds* when ``end >= base + SYNC_MIN_GAIN`` and ``end >= SYNC_KEEP * best``;
- a run *collapses* when ``end <= COLLAPSE_FRACTION * best`` and its ``rollout_corr/seq_ess_ratio``
  reaches ``ESS_ALARM`` or below at some step.

The same rules classify every cell of the stability map. ``ess_lead`` measures ESS as a predictor: the
steps from the first ESS ratio at or below ``ESS_ALARM`` to the first evaluation, after the best one,
at or below half the best accuracy (positive: the alarm came first).

    python -m vcpo.studies.stability RUNS_ROOT [--task countdown]      # one markdown row per run below the root
    python -m vcpo.studies.stability RUNS_ROOT --map OUT.png --task countdown --method seq_tis_c8 [--mark LR,K]
    python -m vcpo.studies.stability RUNS_ROOT [RUNS_ROOT ...] --candidates    # the closest-candidate ranking

``--map`` draws the stability map of one method: final held-out accuracy over learning rate x lag (sync
as the lag-0 row), each cell marked with the criterion it meets (collapsed, or held for sync).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from vcpo.methods import is_synchronous
from vcpo.reporting.run_data import ACCURACY, read_metrics, series
from vcpo.runs import FINAL_EVAL, SEQ_ESS_RATIO
from vcpo.sim.config import read_recorded

SYNC_MIN_GAIN = 0.05
SYNC_KEEP = 0.8
COLLAPSE_FRACTION = 0.5
ESS_ALARM = 0.1
ESS = SEQ_ESS_RATIO


@dataclass(frozen=True)
class Outcome:
    base: float  # step-0 held-out accuracy
    best: float
    best_step: int
    end: float
    ess_min: float
    ess_alarm_step: int | None  # first step with ESS ratio <= ESS_ALARM
    fall_step: int | None  # first evaluation after the best one at <= half the best accuracy

    @property
    def holds(self) -> bool:
        return self.end >= self.base + SYNC_MIN_GAIN and self.end >= SYNC_KEEP * self.best

    @property
    def collapsed(self) -> bool:
        return self.end <= COLLAPSE_FRACTION * self.best and self.ess_alarm_step is not None

    @property
    def ess_lead(self) -> int | None:
        """Steps from the ESS alarm to the accuracy's fall (None unless both happened)."""
        if self.ess_alarm_step is None or self.fall_step is None:
            return None
        return self.fall_step - self.ess_alarm_step


def outcome(lines: list[dict]) -> Outcome:
    """The criteria's inputs from one run's metrics (``read_metrics``); the final evaluation is the last
    ``val/accuracy`` line (``vcpo.sim`` logs it at step ``steps``)."""
    steps, accuracy = series(lines, ACCURACY)
    if not steps.size or steps[0] != 0:
        raise ValueError("a run needs a step-0 held-out evaluation (eval_every > 0) to be judged")
    ess_steps, ess = series(lines, ESS)
    best_index = int(accuracy.argmax())
    best = float(accuracy[best_index])
    alarms = ess_steps[ess <= ESS_ALARM]
    falls = [int(s) for s, a in zip(steps[best_index:], accuracy[best_index:], strict=True) if a <= COLLAPSE_FRACTION * best]
    return Outcome(
        base=float(accuracy[0]),
        best=best,
        best_step=int(steps[best_index]),
        end=float(accuracy[-1]),
        ess_min=float(ess.min()) if ess.size else float("nan"),
        ess_alarm_step=int(alarms[0]) if alarms.size else None,
        fall_step=falls[0] if falls else None,
    )


def judge_root(root: Path, task: str | None = None) -> list[dict]:
    """One row per finished run at any depth below ``root`` (of ``task`` only, if given)."""
    rows = []
    for final in sorted(Path(root).rglob(FINAL_EVAL)):
        run = final.parent.parent
        config = read_recorded(run)
        if task is not None and config["task"] != task:
            continue
        result = outcome(read_metrics(run))
        rows.append(
            {
                "task": config["task"],
                "method": config["method"],
                "lag": config["lag"],
                "seed": config["seed"],
                "lr": config["reference_lr"],
                "model_size": config["model_size"],
                "steps": config["steps"],
                "outcome": result,
            }
        )
    return rows


@dataclass(frozen=True)
class Candidate:
    task: str
    model_size: str
    lr: float
    lag: int
    collapses: int  # seeds (of 3) in which seq-TIS collapsed
    mean_end_over_best: float  # seq-TIS end / best, averaged over the 3 seeds


CANDIDATE_SEEDS = (0, 1, 2)


def rank_candidates(rows: list[dict], method: str = "seq_tis_c8") -> list[Candidate]:
    """The registered closest-candidate rule (recipes/sim/regime_search.md), for when no cell meets the
    criteria in all three seeds. A cell (task, size, lr, lag) is eligible when ``method`` finished all
    three seeds there (the search ran seeds 1-2 only where seed 0 met both criteria) and sync at the same
    task, size and lr holds in all three seeds. Eligible cells rank by the number of seeds in which
    ``method`` collapsed (more first), then by its mean end / best accuracy (lower first), then lr and lag
    ascending (the registered order)."""
    by_cell: dict[tuple, dict[int, Outcome]] = {}
    sync: dict[tuple, dict[int, Outcome]] = {}
    for row in rows:
        family = (row["task"], row["model_size"], row["lr"])
        if is_synchronous(row["method"]):
            sync.setdefault(family, {})[row["seed"]] = row["outcome"]
        elif row["method"] == method:
            by_cell.setdefault((*family, row["lag"]), {})[row["seed"]] = row["outcome"]
    candidates = []
    for (task, size, lr, lag), seeds in by_cell.items():
        references = sync.get((task, size, lr), {})
        if not all(seed in seeds and seed in references and references[seed].holds for seed in CANDIDATE_SEEDS):
            continue
        results = [seeds[seed] for seed in CANDIDATE_SEEDS]
        candidates.append(Candidate(task, size, lr, lag, sum(r.collapsed for r in results),
                                    sum(r.end / r.best for r in results) / len(results)))
    return sorted(candidates, key=lambda c: (-c.collapses, c.mean_end_over_best, c.lr, c.lag))


def markdown(rows: list[dict]) -> str:
    lines = [
        "| task | method | lag | lr | size | seed | base | best (step) | end | ESS min | ESS <= 0.1 at | sync holds | collapsed |",
        "|---|---|---:|---:|---|---:|---:|---|---:|---:|---:|---|---|",
    ]
    for row in rows:
        o = row["outcome"]
        alarm = "-" if o.ess_alarm_step is None else str(o.ess_alarm_step)
        lines.append(
            f"| {row['task']} | {row['method']} | {row['lag']} | {row['lr']:g} | {row['model_size']} | {row['seed']} | "
            f"{o.base:.3f} | {o.best:.3f} ({o.best_step}) | {o.end:.3f} | {o.ess_min:.3f} | {alarm} | "
            f"{'yes' if o.holds else 'no'} | {'yes' if o.collapsed else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def map_cells(rows: list[dict], method: str, seed: int = 0) -> dict[tuple[float, int], Outcome]:
    """(lr, lag) -> outcome of ``method``'s runs of ``seed``, with the sync runs as lag 0."""
    return {(row["lr"], row["lag"]): row["outcome"] for row in rows
            if row["seed"] == seed and (row["method"] == method or is_synchronous(row["method"]))}


def draw_map(rows: list[dict], method: str, out: Path, title: str, mark: tuple[float, int] | None = None) -> Path:
    """Heat map of the final held-out accuracy over learning rate (x) and lag (y), one seed per cell."""
    # matplotlib only for the figure
    from vcpo.reporting.figures import pyplot, save

    cells = map_cells(rows, method)
    lrs, lags = sorted({lr for lr, _ in cells}), sorted({lag for _, lag in cells})
    grid = [[cells[(lr, lag)].end if (lr, lag) in cells else float("nan") for lr in lrs] for lag in lags]
    fig, ax = pyplot().subplots(figsize=(1.6 * len(lrs) + 2.5, 1.0 * len(lags) + 1.8), layout="constrained")
    image = ax.imshow(grid, cmap="viridis", origin="lower", aspect="auto", vmin=0.0)
    for y, lag in enumerate(lags):
        for x, lr in enumerate(lrs):
            result = cells.get((lr, lag))
            if result is None:
                ax.text(x, y, "no finished run", ha="center", va="center", color="grey", fontsize=8)
                continue
            verdict = ("holds" if result.holds else "does not hold") if lag == 0 else ("COLLAPSED" if result.collapsed else "stable")
            ax.text(x, y, f"{result.end:.2f} (best {result.best:.2f})\n{verdict}\nESS min {result.ess_min:.2f}",
                    ha="center", va="center", fontsize=7, color="white" if result.end < 0.6 * max(map(max, grid)) else "black")
    if mark in cells:
        ax.add_patch(pyplot().Rectangle((lrs.index(mark[0]) - 0.5, lags.index(mark[1]) - 0.5), 1, 1, fill=False,
                                        edgecolor="red", linewidth=2.5))
    ax.set_xticks(range(len(lrs)), [f"{lr:g}" for lr in lrs])
    ax.set_yticks(range(len(lags)), [f"{lag}" + (" (sync)" if lag == 0 else "") for lag in lags])
    ax.set_xlabel("learning rate (vcpo.sim lr)")
    ax.set_ylabel("max policy lag k")
    fig.colorbar(image, ax=ax, label="final held-out accuracy")
    ax.set_title(title, fontsize=10)
    return save(fig, out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vcpo.studies.stability", description=__doc__.split("\n\n")[0])
    parser.add_argument("roots", type=Path, nargs="+")
    parser.add_argument("--task")
    parser.add_argument("--map", type=Path, help="draw the stability map of --method into this PNG")
    parser.add_argument("--method", default="seq_tis_c8")
    parser.add_argument("--mark", help="LR,K: the cell to outline (the regime)")
    parser.add_argument("--title", default="")
    parser.add_argument("--candidates", action="store_true", help="rank the cells by the closest-candidate rule")
    args = parser.parse_args(argv)
    rows = [row for root in args.roots for row in judge_root(root, args.task)]
    if not rows:
        parser.error(f"no finished run below {' '.join(map(str, args.roots))}")
    if args.candidates:
        print("| rank | task | size | lr | lag | seq-TIS collapses (of 3) | mean end / best |\n|---:|---|---|---:|---:|---:|---:|")
        for rank, c in enumerate(rank_candidates(rows, args.method), 1):
            print(f"| {rank} | {c.task} | {c.model_size} | {c.lr:g} | {c.lag} | {c.collapses} | {c.mean_end_over_best:.2f} |")
        return
    if args.map:
        mark = None
        if args.mark:
            lr, lag = args.mark.split(",")
            mark = (float(lr), int(lag))
        title = args.title or f"stability map: {args.method} on {args.task or 'every task'}, one seed per cell"
        print(draw_map(rows, args.method, args.map, title, mark))
        return
    print(markdown(rows), end="")


if __name__ == "__main__":
    main()
