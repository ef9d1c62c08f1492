"""Reading run outputs of either backend into one shape, and the per-run numbers tables and figures use.

Runs live at ``RUNS/<task>/<method>/lag<k>/seed<s>/``; a sync run is always read at lag 0. Two layouts:
  simulator (``python -m vcpo.sim``): ``metrics.jsonl`` of flat objects, ``final/eval.json`` when finished;
  verl (``python -m vcpo.launch``): ``metrics.jsonl`` of ``{"step", "data": {...}}`` objects from verl's
  file logger, ``eval/summary.json`` from ``python -m vcpo.evaluation``, ``launch.json`` (settings).
Both become a list of flat dicts ``{"step": int, **metrics}``, so every consumer is backend-agnostic.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import numpy as np

from vcpo.methods import run_lag
from vcpo.recipes import run_path
from vcpo.runs import FINAL_EVAL, METRICS_FILE, SEQ_ESS_RATIO, VAL_ACCURACY, flat_record, metric_records

LOG = logging.getLogger(__name__)
ACCURACY = VAL_ACCURACY
def read_metrics(run_dir: Path) -> list[dict]:
    """``run_dir/metrics.jsonl`` of either backend as flat dicts ``{"step": int, **metrics}``, by
    ``vcpo.runs.metric_records``'s rule; what it leaves out is logged as a warning naming the run, once per
    process (a report reads a run's file several times)."""
    return [flat_record(record) for _, record in metric_records(run_dir, report=_warn_once)]


@functools.cache
def _warn_once(message: str) -> None:
    LOG.warning(message)


def run_dirs(root: Path, task: str, method: str, lag: int) -> list[Path]:
    """The seed folders holding metrics of one (task, method, lag); a preset that fixes its lag (sync: 0)
    is read at that lag whatever ``lag``."""
    lag = run_lag(method, default=lag)
    return sorted(p.parent for p in Path(root).glob(f"{run_path(task, method, lag, '*')}/{METRICS_FILE}"))


def seed_of(run_dir: Path) -> int:
    return int(Path(run_dir).name.removeprefix("seed"))


def series(lines: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of the lines carrying a number under ``key``."""
    points = [(line["step"], line[key]) for line in lines if isinstance(line.get(key), int | float)]
    if not points:
        return np.empty(0), np.empty(0)
    steps, values = zip(*points, strict=True)
    return np.asarray(steps), np.asarray(values, dtype=float)


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average (the first values are padded with the first one, so no lag at the start)."""
    if window <= 1 or values.size < window:
        return values
    kernel = np.ones(window) / window
    padded = np.concatenate([np.full(window - 1, values[0]), values])
    return np.convolve(padded, kernel, mode="valid")


def line_seconds(line: dict) -> float:
    """The wall-clock seconds one metrics line accounts for: its step's (both backends time the evaluation at
    the start of a step inside the step), or for a line without a step time (the simulator's final
    evaluation) its evaluation's."""
    if "timing_s/step" in line:
        return float(line["timing_s/step"])
    return float(line.get("timing_s/testing", 0.0))


def elapsed_hours(lines: list[dict]) -> dict[int, float]:
    """Step -> hours of training and evaluation spent before that step began (the wall-clock x axis)."""
    per_step: dict[int, float] = {}
    for line in lines:
        per_step[line["step"]] = per_step.get(line["step"], 0.0) + line_seconds(line)
    elapsed, total = {}, 0.0
    for step in sorted(per_step):
        elapsed[step] = total / 3600
        total += per_step[step]
    return elapsed


def seed_band(
    runs: list[list[dict]], key: str, window: int = 1, wall_clock: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """x at the steps common to all seeds, and the mean, min and max over seeds there.

    Held-out accuracy is never smoothed (few points); train-side metrics use a ``window``-step average.
    With ``wall_clock`` x is the mean over seeds of the hours spent before each step, else the step.
    """
    curves = [(lines, *series(lines, key)) for lines in runs]
    curves = [(lines, s, v) for lines, s, v in curves if s.size]
    if not curves:
        return (np.empty(0),) * 4
    common = sorted(set.intersection(*(set(s.tolist()) for _, s, _ in curves)))
    stacked, hours = [], []
    for lines, steps, values in curves:
        values = values if key.startswith("val") else smooth(values, window)
        lookup = dict(zip(steps.tolist(), values.tolist(), strict=True))
        stacked.append([lookup[s] for s in common])
        if wall_clock:
            elapsed = elapsed_hours(lines)
            hours.append([elapsed[s] for s in common])
    stacked = np.asarray(stacked)
    x = np.asarray(hours).mean(0) if wall_clock else np.asarray(common)
    return x, stacked.mean(0), stacked.min(0), stacked.max(0)


def summary_rows(root: Path, task: str, lag: int, methods: list[str]) -> list[dict]:
    """Per method with runs: seeds, held-out accuracy at the start and the end (mean and min-max over
    seeds), the best accuracy along the run, the mean train reward of the last 20 steps, the lowest
    ESS ratio and the largest gradient norm seen (methods without runs are left out)."""
    rows = []
    for method in methods:
        runs = [read_metrics(d) for d in run_dirs(root, task, method, lag)]
        if not runs:
            continue
        accuracy = [a for a in (series(lines, ACCURACY)[1] for lines in runs) if a.size]
        rewards = [series(lines, "critic/score/mean")[1] for lines in runs]
        ess = [e for e in (series(lines, SEQ_ESS_RATIO)[1] for lines in runs) if e.size]
        grad = [g for g in (series(lines, "actor/grad_norm")[1] for lines in runs) if g.size]
        final = np.array([a[-1] for a in accuracy]) if accuracy else np.array([np.nan])
        rows.append(
            {
                "method": method,
                "lag": run_lag(method, default=lag),
                "seeds": len(runs),
                "steps": max(int(series(lines, "critic/score/mean")[0].max(initial=-1)) + 1 for lines in runs),
                "acc_start": float(np.mean([a[0] for a in accuracy])) if accuracy else float("nan"),
                "acc_end": float(final.mean()),
                "acc_end_min": float(final.min()),
                "acc_end_max": float(final.max()),
                "acc_best": float(np.mean([a.max() for a in accuracy])) if accuracy else float("nan"),
                "reward_last20": float(np.mean([r[-20:].mean() for r in rewards if r.size] or [np.nan])),
                "ess_min": float(min(e.min() for e in ess)) if ess else float("nan"),
                "ess_mean": float(np.mean([e.mean() for e in ess])) if ess else float("nan"),
                "grad_norm_max": float(max(g.max() for g in grad)) if grad else float("nan"),
            }
        )
    return rows


def evaluated_accuracy(run_dir: Path, benchmark: str | None) -> float | None:
    """``mean_at_n`` of ``benchmark`` in ``run_dir/eval/summary.json`` (python -m vcpo.evaluation), if evaluated."""
    summary = Path(run_dir) / "eval" / "summary.json"
    if benchmark is None or not summary.exists():
        return None
    result = json.loads(summary.read_text()).get("results", {}).get(benchmark)
    return None if result is None else float(result["mean_at_n"])


def is_verl_run(run_dir: Path) -> bool:
    """A run python -m vcpo.launch started (it writes launch.json); the simulator's runs have none."""
    return (Path(run_dir) / "launch.json").exists()


def final_accuracy(run_dir: Path, lines: list[dict], benchmark: str | None = None) -> float | None:
    """Held-out accuracy at the end: the offline evaluation of ``benchmark`` if there is one, else the
    simulator's ``final/eval.json``, else the last ``val/accuracy`` logged."""
    evaluated = evaluated_accuracy(run_dir, benchmark)
    if evaluated is not None:
        return evaluated
    final = Path(run_dir) / FINAL_EVAL
    if final.exists():
        return float(json.loads(final.read_text())[ACCURACY])
    values = series(lines, ACCURACY)[1]
    return float(values[-1]) if values.size else None


def start_accuracy(lines: list[dict]) -> float | None:
    """The step-0 held-out accuracy: the base model's, evaluated before the first update."""
    steps, values = series(lines, ACCURACY)
    return float(values[0]) if steps.size and steps[0] == 0 else None


def last_step(run_dir: Path, lines: list[dict]) -> int:
    """Optimizer steps done: the step of ``final/eval.json`` when finished, else the last step logged."""
    final = Path(run_dir) / FINAL_EVAL
    if final.exists():
        return int(json.loads(final.read_text())["step"])
    return max((line["step"] for line in lines), default=0)


def wall_clock_hours(lines: list[dict]) -> float:
    """Hours of training and evaluation, summed over the logged lines (start-up not included)."""
    return sum(line_seconds(line) for line in lines) / 3600


def hours_to_accuracy(lines: list[dict], target: float) -> float | None:
    """Wall-clock hours until the held-out accuracy first reached ``target``: the hours before the step whose
    evaluation reached it, plus that evaluation's; None when no evaluation reached it."""
    before = 0.0
    for line in sorted(lines, key=lambda line: line["step"]):
        accuracy = line.get(ACCURACY)
        if isinstance(accuracy, int | float) and accuracy >= target:
            return (before + float(line.get("timing_s/testing", 0.0))) / 3600
        before += line_seconds(line)
    return None


def recorded(run_dir: Path, file: str, key: str, kind: type):
    """``key`` of a JSON record the run wrote (``config.json``, ``launch.json``) when it is a ``kind``, else None."""
    path = Path(run_dir) / file
    value = json.loads(path.read_text()).get(key) if path.exists() else None
    return value if isinstance(value, kind) else None


def run_cores(run_dir: Path) -> int | None:
    """CPU cores a simulator run held (``cores`` of its ``config.json``: threads per process x processes);
    None for a run that did not record them."""
    return recorded(run_dir, "config.json", "cores", int)


def run_cpu(run_dir: Path) -> str | None:
    return recorded(run_dir, "config.json", "cpu", str)


def run_provenance(run_dir: Path) -> dict:
    """What produced a run, as its ``config.json`` recorded it (None where it did not): the code's commit and whether
    the tree differed from it, its first start and its end (UTC), the CPU."""
    path = Path(run_dir) / "config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    return {key: config.get(key) for key in ("commit", "dirty", "started", "finished", "cpu")}


def run_gpus(run_dir: Path) -> int | None:
    """GPUs a verl run held: the ``gpus`` ``vcpo.launch`` wrote into its ``launch.json`` (computed from
    the composed config it launched); None for a run without one."""
    return recorded(run_dir, "launch.json", "gpus", int)
