"""The figure specifications (``figures.yaml``) and the paper's published numbers (``paper_results.yaml``).

The workflow derives its run list from ``runs_needed``, so a typo in a method name must fail here,
naming the figure, rather than silently dropping a line from a plot.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import yaml

from vcpo.methods import list_methods, run_lag

HERE = Path(__file__).resolve().parent
KINDS = ("curves", "lag_sweep", "overhead", "grad_norm_proxy")
X_AXES = ("step", "wall_clock")
# Keys a kind needs; the rest (title, paper, kind) every figure needs.
REQUIRED = {
    "curves": ("methods", "panels", "lag"),
    "lag_sweep": ("methods", "lags", "task"),
    "overhead": (),
    "grad_norm_proxy": ("methods", "task", "lag"),
}


def _read(name: str) -> dict[str, Any]:
    with open(HERE / name) as f:
        return yaml.safe_load(f)


def validate_spec(figure_id: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Check one figure's keys and method names against ``vcpo.methods``; return it with its id."""
    missing = [key for key in ("title", "paper", "kind") if key not in spec]
    if missing:
        raise ValueError(f"figure {figure_id}: missing {missing}")
    if spec["kind"] not in KINDS:
        raise ValueError(f"figure {figure_id}: unknown kind {spec['kind']!r}; known: {KINDS}")
    missing = [key for key in REQUIRED[spec["kind"]] if key not in spec]
    if spec["kind"] == "curves" and not ("task" in spec or "tasks" in spec):
        missing.append("task or tasks")
    if missing:
        raise ValueError(f"figure {figure_id}: kind {spec['kind']} needs {missing}")
    stray = sorted(set(spec.get("panel_x", {})) - set(spec.get("panels", [])))
    if stray:
        raise ValueError(f"figure {figure_id}: panel_x names {stray}, which are not among its panels")
    axes = {spec.get("x", "step"), *spec.get("panel_x", {}).values()}
    if not axes <= set(X_AXES):
        raise ValueError(f"figure {figure_id}: x axes {sorted(axes - set(X_AXES))} unknown; known: {X_AXES}")
    known = {method.name for method in list_methods()}
    unknown = [m for m in spec.get("methods", []) if m not in known]
    if unknown:
        raise ValueError(f"figure {figure_id}: unknown method(s) {unknown}; known: {sorted(known)}")
    return {**spec, "id": figure_id}


@functools.cache
def _figure_specs() -> dict[str, dict[str, Any]]:
    return {fid: validate_spec(fid, spec) for fid, spec in _read("figures.yaml")["figures"].items()}


def figure_specs() -> dict[str, dict[str, Any]]:
    """``figures.yaml`` parsed and validated: figure id -> spec (with ``id``); a copy the caller may change."""
    return {fid: dict(spec) for fid, spec in _figure_specs().items()}


@functools.cache
def paper_results() -> dict[str, Any]:
    """``paper_results.yaml``: the paper's published numbers, each with its table or figure reference."""
    return _read("paper_results.yaml")


def spec_tasks(spec: dict[str, Any], task: str | list[str] | None = None) -> list[str]:
    """The tasks of a figure: ``task`` (one name, a list, or comma-separated) overrides the spec's."""
    if task is None:
        return list(spec["tasks"]) if "tasks" in spec else [spec["task"]]
    names = [task] if isinstance(task, str) else list(task)
    return [name for entry in names for name in entry.split(",") if name]


def spec_lags(spec: dict[str, Any], lag: int | None = None) -> list[int]:
    """The lags of a figure: ``lag`` overrides its ``lag``. A lag sweep draws its ``lags`` and its ``lag``
    (the study's high lag, so the sweep reaches the lag the other figures train at, whatever the scale)."""
    high = spec.get("lag") if lag is None else lag
    if spec["kind"] == "lag_sweep":
        return sorted({*spec["lags"], *([] if high is None else [high])})
    return [high]


def runs_needed(
    spec: dict[str, Any], task: str | list[str] | None = None, lag: int | None = None
) -> list[tuple[str, str, int]]:
    """(task, method, lag) of every run a figure draws, sync at lag 0; a lag sweep's lag 0 is the sync run.

    ``task``/``lag`` override the figure's paper task and lag (the smoke workflow trains on simulator
    tasks and may lower the lag). Overhead figures need no training run.
    """
    if spec["kind"] == "overhead":
        return []
    needed = []
    for name in spec_tasks(spec, task):
        for k in spec_lags(spec, lag):
            for method in spec["methods"]:
                run = (name, "sync", 0) if k == 0 else (name, method, run_lag(method, default=k))
                if run not in needed:
                    needed.append(run)
    return needed
