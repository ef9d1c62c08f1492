"""VCPO Table 1 from run outputs: base, sync (k = 0) and async VCPO accuracy, steps and time.

Each number is the mean and min-max over seeds, beside the paper's published value
(``paper_results.yaml``). Every accuracy comes from ``vcpo.evaluation``'s harness: at paper scale
``python -m vcpo.evaluation`` of the final checkpoints and of the base model (``<task>/base/eval``); at smoke scale
the simulator's evaluations, the base row being its step-0 evaluation of the SFT base (verl's own
step-0 validation samples at other settings, so a verl run has no base row without the base evaluation).

Time (``vcpo.reporting.run_data.line_seconds``): wall-clock hours = the logged step times (each with the evaluation at
its start) and the final evaluation, start-up not included. Compute = wall-clock hours x what the run held:
a simulator run its CPU cores (``cores`` of its ``config.json``: 2 for a concurrent run on one thread per
process), a verl run its GPUs (its ``launch.json``; on CPU, the worker slots that stand for them). Time to sync's accuracy: the wall-clock hours until
the run's held-out accuracy first reached the mean final accuracy of the sync runs (at an evaluation; the
final one included), over the seeds that reached it. Where the time went: the logged generation, update,
evaluation and (concurrent runs) learner-waiting seconds, summed over the steps.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from vcpo.cli import shrink_problem
from vcpo.provenance import output_record, utc_now
from vcpo.recipes import base_path, load_tasks
from vcpo.reporting.figures import SCALES
from vcpo.reporting.run_data import (
    evaluated_accuracy,
    final_accuracy,
    hours_to_accuracy,
    is_verl_run,
    last_step,
    read_metrics,
    run_cores,
    run_cpu,
    run_dirs,
    run_gpus,
    run_provenance,
    start_accuracy,
    wall_clock_hours,
)
from vcpo.reporting.specs import paper_results

HOURS = {"smoke": "Core-hours", "paper": "GPU-hours"}
# Where a run's time went: the logged seconds of each part, summed over its steps (a concurrent simulator
# run logs its generator's work beside the learner's; the learner's wait for batches is its own key).
BREAKDOWN = {"generation": "timing_s/gen", "update": "timing_s/update_actor", "evaluation": "timing_s/testing",
             "learner waiting": "timing_s/wait_gen"}  # fmt: skip
# The unit the markdown shows times in (the data keeps hours): smoke runs take minutes.
TIME_UNITS = {"smoke": ("minutes", 60.0), "paper": ("hours", 1.0)}


def spread(values: list[float | None]) -> dict[str, Any] | None:
    """Mean, min, max and count of the known values; None when there are none."""
    known = [v for v in values if v is not None]
    if not known:
        return None
    return {"mean": float(np.mean(known)), "min": float(min(known)), "max": float(max(known)), "n": len(known)}


def run_numbers(run_dir: Path, scale: str, benchmark: str | None, target: float | None = None) -> dict[str, float | None]:
    """One run's base and final accuracy (fractions), steps, wall-clock and compute hours, and the hours it
    took to reach ``target`` accuracy (None: not reached, or no target)."""
    lines = read_metrics(run_dir)
    wall = wall_clock_hours(lines)
    held = run_gpus(run_dir) if is_verl_run(run_dir) else run_cores(run_dir)
    return {
        "base": None if is_verl_run(run_dir) else start_accuracy(lines),
        "accuracy": final_accuracy(run_dir, lines, benchmark),
        "steps": last_step(run_dir, lines),
        "wall_hours": wall,
        "hours": None if held is None else wall * held,
        "hours_to_target": None if target is None else hours_to_accuracy(lines, target),
        **{part: sum(float(line.get(key, 0.0)) for line in lines) / 3600 for part, key in BREAKDOWN.items()},
    }


def row_numbers(root: Path, task: str, method: str, lag: int, scale: str, benchmark: str | None,
                target: float | None = None) -> dict[str, Any]:
    """Per quantity the spread over the seeds of (task, method, lag), the seeds read and the CPUs they ran on."""
    dirs = run_dirs(root, task, method, lag)
    per_run = [run_numbers(d, scale, benchmark, target) for d in dirs]
    keys = ("base", "accuracy", "steps", "wall_hours", "hours", "hours_to_target", *BREAKDOWN)
    return {"task": task, "method": method, "lag": lag, "seeds": [d.name for d in dirs],
            "runs": [{"seed": d.name, "provenance": run_provenance(d)} for d in dirs],
            "reached": sum(numbers["hours_to_target"] is not None for numbers in per_run),
            "cpus": sorted({cpu for d in dirs if (cpu := run_cpu(d))})} | {  # fmt: skip
        key: spread([numbers[key] for numbers in per_run]) for key in keys
    }


def base_accuracy(root: Path, task: str, benchmark: str | None) -> dict[str, Any] | None:
    """The evaluation of the task's base model, when there is one (paper scale)."""
    return spread([evaluated_accuracy(root / base_path(task), benchmark)])


def table1_data(
    root: Path, scale: str, tasks: dict[str, str] | None = None, lag: int | None = None, lag_map: dict[int, int] | None = None
) -> dict[str, Any]:
    """Table 1 as data: paper task -> base, sync and async rows (ours) and the paper's row.

    ``tasks`` maps each paper task to the task its runs were trained on (default: all paper tasks, same
    name); ``lag`` replaces each task's published async lag, ``lag_map`` maps published lags to this
    scale's (the smoke workflow's ``lags``: 10 -> 48 for Countdown, SimpleTIR's 2 kept).
    """
    published = paper_results()["table1"]
    tasks = tasks or {name: name for name in published["tasks"]}
    unknown = sorted(set(tasks) - set(published["tasks"]))
    if unknown:
        raise ValueError(f"Table 1 has no rows for {unknown}; its tasks: {sorted(published['tasks'])}")
    data = {
        "reference": published["reference"],
        "scale": scale,
        "scale_label": SCALES[scale],
        "hours": HOURS[scale],
        "tasks": {},
    }
    for paper_task, run_task in tasks.items():
        paper = published["tasks"][paper_task]
        paper_lag = load_tasks()[paper_task].paper_lag
        k = (lag_map or {}).get(paper_lag, paper_lag) if lag is None else lag
        sync = row_numbers(root, run_task, "sync", 0, scale, paper["benchmark"])
        target = None if sync["accuracy"] is None else sync["accuracy"]["mean"]
        if target is not None:
            sync = row_numbers(root, run_task, "sync", 0, scale, paper["benchmark"], target)
        data["tasks"][paper_task] = {
            "label": paper["label"],
            "run_task": run_task,
            "paper": paper,
            "paper_lag": paper_lag,
            "base": base_accuracy(root, run_task, paper["benchmark"]) or sync["base"],
            "target": target,
            "sync": sync,
            "async": row_numbers(root, run_task, "vcpo", k, scale, paper["benchmark"], target),
        }
    return data


def cell(value: dict | None, percent: bool = False, form: str = ".1f", factor: float = 1.0) -> str:
    """``mean (min-max)`` over seeds (times ``factor``), or "missing"."""
    if value is None:
        return "missing"
    scale = 100 if percent else factor
    unit = "%" if percent else ""
    text = f"{value['mean'] * scale:{form}}{unit}"
    if value["min"] != value["max"]:
        text += f" ({value['min'] * scale:{form}}-{value['max'] * scale:{form}})"
    return text


def ours_label(row: dict[str, Any], scale: str) -> str:
    """What our accuracy column measures: the paper's benchmark, or at smoke scale the held-out split of
    the simulator task that stands for it (e.g. ``tir`` for SimpleTIR's AIME 2025)."""
    if scale == "smoke" and row["run_task"] != row["paper"]["benchmark"]:
        return f"{row['run_task']} held-out"
    return row["label"]


def reached(row: dict[str, Any], form: str, factor: float) -> str:
    """Time to sync's accuracy over the seeds that reached it, and how many did."""
    if not row["seeds"]:
        return "missing"
    time = cell(row["hours_to_target"], form=form, factor=factor) if row["reached"] else "not reached"
    return f"{time} [{row['reached']}/{len(row['seeds'])}]"


def ratio(numerator: dict | None, denominator: dict | None) -> str:
    if numerator is None or denominator is None:
        return "missing"
    return f"{numerator['mean'] / denominator['mean']:.2f}"


def table1_markdown(data: dict[str, Any]) -> str:
    """The paper's layout, one block per task, ours beside the published numbers."""
    unit, factor = TIME_UNITS[data["scale"]]
    compute = data["hours"].replace("hours", unit)
    held = "CPU cores (2 for a concurrent run, one per process, and for a run on two threads)" if data["scale"] == "smoke" else "GPUs (launch.json)"
    lines = [
        f"# {data['reference']}",
        "",
        f"**{data['scale_label']}.** Ours: mean (min-max) over seeds. Wall-clock {unit}: the logged step times (each with "
        f"the evaluation at its start) and the final evaluation, start-up not included. {compute}: wall-clock {unit} x the "
        f"{held} the run held. Time to sync's accuracy: wall-clock {unit} until the run's held-out accuracy first reached "
        "the mean final accuracy of the sync runs (at one of its evaluations, the final one included), mean (min-max) "
        "over the seeds that reached it [seeds that reached it / seeds].",
        "",
    ]
    form = ".1f" if data["scale"] == "paper" else ".2f"
    for paper_task, row in data["tasks"].items():
        paper = row["paper"]
        cpus = sorted(set(row["sync"]["cpus"]) | set(row["async"]["cpus"]))
        lines += [
            f"| Method ({paper_task} runs: {row['run_task']}) | {ours_label(row, data['scale'])} (ours) | {row['label']} (paper) | "
            f"Steps (ours) | Steps (paper) | Wall-clock {unit} (ours) | {compute} (ours) | GPU hours (paper) | "
            f"Time to sync's accuracy, {unit} (ours) | Seeds |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
            f"| Base | {cell(row['base'], percent=True)} | {paper['base']}% | | | | | | | {len(row['sync']['seeds'])} |",
        ]
        for key, name, their_lag in (("sync", "Sync (k=0)", 0), ("async", f"Async VCPO (k={row['async']['lag']})", row["paper_lag"])):
            ours, theirs = row[key], paper[key]
            lines.append(
                f"| {name} [paper k={their_lag}] | {cell(ours['accuracy'], percent=True)} | {theirs['accuracy']}% | "
                f"{cell(ours['steps'], form='.0f')} | {theirs['steps']} | {cell(ours['wall_hours'], form=form, factor=factor)} | "
                f"{cell(ours['hours'], form=form, factor=factor)} | {theirs['gpu_hours']} | {reached(ours, form, factor)} | "
                f"{', '.join(ours['seeds']) or 'none'} |"
            )
        for key, name in (("sync", "sync"), ("async", "async VCPO")):
            parts = [f"{part} {cell(row[key][part], form=form, factor=factor)}" for part in BREAKDOWN
                     if row[key][part] is not None and row[key][part]["max"] > 0]  # fmt: skip
            beside = " (a concurrent run's generation runs in its own process, beside the rest)" if row[key]["learner waiting"] and row[key]["learner waiting"]["max"] > 0 else ""
            lines += ["", f"Where {name}'s time went{beside}, wall-clock {unit} summed over its steps: {', '.join(parts) or 'missing'}."]
        paper_ratio = paper["async"]["gpu_hours"] / paper["sync"]["gpu_hours"]
        target = "missing" if row["target"] is None else f"{row['target'] * 100:.1f}%"
        lines += [
            "",
            f"Async VCPO / sync: wall-clock {ratio(row['async']['wall_hours'], row['sync']['wall_hours'])}, "
            f"{compute.lower()} {ratio(row['async']['hours'], row['sync']['hours'])} (paper, GPU-hours: {paper_ratio:.2f}); "
            f"sync's accuracy (the target): {target}. Machine: {', '.join(cpus) or 'not recorded'}.",
            "",
        ]
    return "\n".join(lines)


def arm_seeds(data: dict) -> dict[str, int]:
    """Each task's sync and async arms with the seeds they hold, as Table 1's JSON lists them."""
    return {f"{task} {arm}": len(row[arm]["seeds"]) for task, row in data["tasks"].items() for arm in ("sync", "async")}


def write_table1(
    root: Path, scale: str, out: Path, tasks: dict[str, str] | None = None, lag: int | None = None,
    lag_map: dict[int, int] | None = None,
) -> Path:
    """Write the markdown to ``out`` and the same numbers as JSON beside it (``out`` with ``.json``); SystemExit in one
    line, nothing written, where that JSON holds an arm this table lacks or one over more seeds."""
    started = utc_now()
    data = table1_data(root, scale, tasks, lag, lag_map)
    out = Path(out)
    earlier = out.with_suffix(".json")
    if earlier.exists() and (problem := shrink_problem(earlier, arm_seeds(json.loads(earlier.read_text())), arm_seeds(data),
                                                       "pass --out for a file of your own", rows="arms", unit="seeds")):
        raise SystemExit(f"error: {problem}")
    data["provenance"] = output_record(started)  # the table's writing; each run's own is in its row's "runs"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table1_markdown(data))
    out.with_suffix(".json").write_text(json.dumps(data, indent=2) + "\n")
    return out
