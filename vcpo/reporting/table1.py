"""VCPO Table 1 from run outputs: base, sync (k = 0) and async VCPO accuracy, steps and compute hours.

Each number is the mean and min-max over seeds, beside the paper's published value
(``paper_results.yaml``). Every accuracy comes from ``vcpo.evaluation``'s harness: at paper scale
``python -m vcpo.evaluation`` of the final checkpoints and of the base model (``<task>/base/eval``); at smoke scale
the simulator's evaluations, the base row being its step-0 evaluation of the SFT base (verl's own
step-0 validation samples at other settings, so a verl run has no base row without the base evaluation). Compute: at smoke scale CPU-hours = the logged ``timing_s/step`` +
``timing_s/testing`` of one process / 3600 (not comparable to the paper's GPU-hours); at paper scale
GPU-hours = those wall-clock hours x the GPUs of the run's ``launch.json`` (unknown if it does not say).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from vcpo.recipes import base_path
from vcpo.reporting.figures import SCALES
from vcpo.reporting.runs import (
    compute_hours,
    evaluated_accuracy,
    final_accuracy,
    is_verl_run,
    last_step,
    read_metrics,
    run_dirs,
    run_gpus,
    start_accuracy,
)
from vcpo.reporting.specs import paper_results

HOURS = {"smoke": "CPU-hours", "paper": "GPU-hours"}


def spread(values: list[float | None]) -> dict[str, Any] | None:
    """Mean, min, max and count of the known values; None when there are none."""
    known = [v for v in values if v is not None]
    if not known:
        return None
    return {"mean": float(np.mean(known)), "min": float(min(known)), "max": float(max(known)), "n": len(known)}


def run_numbers(run_dir: Path, scale: str, benchmark: str | None) -> dict[str, float | None]:
    """One run's base and final accuracy (fractions), steps and compute hours."""
    lines = read_metrics(run_dir)
    hours = compute_hours(lines)
    if scale == "paper":
        gpus = run_gpus(run_dir)
        hours = None if gpus is None else hours * gpus
    return {
        "base": None if is_verl_run(run_dir) else start_accuracy(lines),
        "accuracy": final_accuracy(run_dir, lines, benchmark),
        "steps": last_step(run_dir, lines),
        "hours": hours,
    }


def row_numbers(root: Path, task: str, method: str, lag: int, scale: str, benchmark: str | None) -> dict[str, Any]:
    """Per quantity the spread over the seeds of (task, method, lag), and the seeds read."""
    dirs = run_dirs(root, task, method, lag)
    per_run = [run_numbers(d, scale, benchmark) for d in dirs]
    keys = ("base", "accuracy", "steps", "hours")
    return {"task": task, "method": method, "lag": lag, "seeds": [d.name for d in dirs]} | {
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
    from vcpo.launch import paper_lag  # the lag lives in the task recipes (the launcher imports this package)

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
        k = (lag_map or {}).get(paper_lag(paper_task), paper_lag(paper_task)) if lag is None else lag
        sync = row_numbers(root, run_task, "sync", 0, scale, paper["benchmark"])
        data["tasks"][paper_task] = {
            "label": paper["label"],
            "run_task": run_task,
            "paper": paper,
            "paper_lag": paper_lag(paper_task),
            "base": base_accuracy(root, run_task, paper["benchmark"]) or sync["base"],
            "sync": sync,
            "async": row_numbers(root, run_task, "vcpo", k, scale, paper["benchmark"]),
        }
    return data


def cell(value: dict | None, percent: bool = False, form: str = ".1f") -> str:
    """``mean (min-max)`` over seeds, or "missing"."""
    if value is None:
        return "missing"
    scale = 100 if percent else 1
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


def table1_markdown(data: dict[str, Any]) -> str:
    """The paper's layout, one block per task, ours beside the published numbers."""
    hours = data["hours"]
    note = (
        "CPU-hours: the wall-clock seconds the runs logged (timing_s/step + timing_s/testing) / 3600; "
        "not comparable to the paper's GPU-hours."
        if data["scale"] == "smoke"
        else "GPU-hours: logged wall-clock hours (timing_s/step + timing_s/testing) x the run's GPUs (launch.json)."
    )
    lines = [
        f"# {data['reference']}",
        "",
        f"**{data['scale_label']}.** Ours: mean (min-max) over seeds. {note}",
        "",
    ]
    hours_form = ".1f" if data["scale"] == "paper" else ".3g"  # smoke runs take minutes: significant digits
    for paper_task, row in data["tasks"].items():
        paper = row["paper"]
        lines += [
            f"| Method ({paper_task} runs: {row['run_task']}) | {ours_label(row, data['scale'])} (ours) | {row['label']} (paper) | "
            f"Steps (ours) | Steps (paper) | {hours} (ours) | GPU hours (paper) | Seeds |",
            "|---|---:|---:|---:|---:|---:|---:|---|",
            f"| Base | {cell(row['base'], percent=True)} | {paper['base']}% | | | | | {len(row['sync']['seeds'])} |",
        ]
        for key, name, their_lag in (("sync", "Sync (k=0)", 0), ("async", f"Async VCPO (k={row['async']['lag']})", row["paper_lag"])):
            ours, theirs = row[key], paper[key]
            lines.append(
                f"| {name} [paper k={their_lag}] | {cell(ours['accuracy'], percent=True)} | {theirs['accuracy']}% | "
                f"{cell(ours['steps'], form='.0f')} | {theirs['steps']} | {cell(ours['hours'], form=hours_form)} | "
                f"{theirs['gpu_hours']} | {', '.join(ours['seeds']) or 'none'} |"
            )
        lines.append("")
    return "\n".join(lines)


def write_table1(
    root: Path, scale: str, out: Path, tasks: dict[str, str] | None = None, lag: int | None = None,
    lag_map: dict[int, int] | None = None,
) -> Path:
    """Write the markdown to ``out`` and the same numbers as JSON beside it (``out`` with ``.json``)."""
    data = table1_data(root, scale, tasks, lag, lag_map)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(table1_markdown(data))
    out.with_suffix(".json").write_text(json.dumps(data, indent=2) + "\n")
    return out
