"""Did a run hold or collapse? The pre-registered criteria of the regime search, applied to a run's metrics.

Held-out accuracy is ``val/accuracy`` at the evaluation steps (step 0 is the SFT base) and at the final
evaluation. With ``best`` the highest of these values and ``end`` the final one:

- a synchronous run *holds* when ``end >= base + SYNC_MIN_GAIN`` and ``end >= SYNC_KEEP * best``;
- a run *collapses* when ``end <= COLLAPSE_FRACTION * best`` and its ``rollout_corr/seq_ess_ratio``
  reaches ``ESS_ALARM`` or below at some step.

The same rules classify every cell of the stability map. ``ess_lead`` measures ESS as a predictor: the
steps from the first ESS ratio at or below ``ESS_ALARM`` to the first evaluation, after the best one,
at or below half the best accuracy (positive: the alarm came first).

    python -m vcpo.sim.stability RUNS_ROOT [--task countdown]      # one markdown row per run below the root
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from vcpo.tables.runs import ACCURACY, read_metrics, series

SYNC_MIN_GAIN = 0.05
SYNC_KEEP = 0.8
COLLAPSE_FRACTION = 0.5
ESS_ALARM = 0.1
ESS = "rollout_corr/seq_ess_ratio"


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
    for final in sorted(Path(root).rglob("final/eval.json")):
        run = final.parent.parent
        config = json.loads((run / "config.json").read_text())
        if task is not None and config["task"] != task:
            continue
        result = outcome(read_metrics(run))
        rows.append(
            {
                "task": config["task"],
                "method": config["method"],
                "lag": config["effective_lag"],
                "seed": config["seed"],
                "lr": config["lr"],
                "model_size": config["model_size"],
                "steps": config["steps"],
                "outcome": result,
            }
        )
    return rows


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vcpo.sim.stability", description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--task")
    args = parser.parse_args(argv)
    rows = judge_root(args.root, args.task)
    if not rows:
        parser.error(f"no finished run below {args.root}")
    print(markdown(rows), end="")


if __name__ == "__main__":
    main()
