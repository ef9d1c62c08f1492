"""The reproduction's plan: which trainings, evaluations, tables and figures a workflow config asks for.

``workflows/Snakefile`` turns the plan into rules. It lives here, as plain Python, so that the whole
run list is unit-tested and so that a broken config (an unknown figure, method or task, a lag the
schema refuses, a missing data folder) fails when the DAG is built, with a message naming the
config key, not hours into a run.

A figure of ``vcpo/reporting/figures.yaml`` names paper tasks and lags. The config lists the paper tasks
this scale trains (``tasks``); each trains as its recipe's stand-in where the paper's cannot run
(``trained_task``) and each paper lag as this scale's (``lags``). Runs are keyed by (task, method, lag, seed); a run
that a ``core_figures`` figure needs gets the core seeds and step count, a run of a
``full_length_figures`` figure the core step count, every other run the default ones (smoke: "every
method briefly, the core study fully").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vcpo.recipes import load_tasks, run_path
from vcpo.sim.tasks import SIM_TASKS


class WorkflowConfigError(ValueError):
    """A workflow config that cannot run; the message starts with the config key at fault."""


@dataclass(frozen=True, order=True)
class PlannedRun:
    task: str
    method: str
    lag: int
    seed: int
    core: bool = False  # core seeds and steps
    full_length: bool = False  # core steps (default seeds)

    @property
    def path(self) -> str:
        """The run folder below ``<results>/runs`` (the layout of vcpo.sim sweeps and vcpo.launch)."""
        return str(run_path(self.task, self.method, self.lag, self.seed))


@dataclass(frozen=True)
class PlannedFigure:
    name: str
    kind: str
    tasks: tuple[str, ...]
    lag: int | None
    runs: tuple[PlannedRun, ...]


@dataclass(frozen=True)
class Plan:
    config: dict[str, Any]
    figures: dict[str, PlannedFigure]
    runs: tuple[PlannedRun, ...]
    table1: tuple[PlannedRun, ...]

    def steps(self, run: PlannedRun) -> int:
        return steps_of(self.config, run)

    def find(self, task: str, method: str, lag: int, seed: int) -> PlannedRun:
        for run in self.runs:
            if (run.task, run.method, run.lag, run.seed) == (task, method, int(lag), int(seed)):
                return run
        raise KeyError(f"no planned run {task}/{method}/lag{lag}/seed{seed}")


def _scale_lag(config: dict[str, Any], lag: int | None) -> int | None:
    if lag is None:
        return None
    return int(config.get("lags", {}).get(str(lag), lag))


def trained_task(config: dict[str, Any], paper_task: str) -> str:
    """The task ``paper_task`` trains as at this scale: its recipe's ``stand_in.sim`` on the simulator, its
    ``stand_in.verl_cpu`` on verl's trainer on CPU (``launch.cpu_steps``), else itself."""
    recipe = load_tasks()[paper_task]
    if config["backend"] == "sim":
        return recipe.stand_in("sim")
    if config.get("launch", {}).get("cpu_steps"):
        return recipe.stand_in("verl_cpu")
    return paper_task


def _scale_tasks(config: dict[str, Any], paper_tasks: list[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(trained_task(config, task) for task in paper_tasks if task in config["tasks"]))


def _check_known(config: dict[str, Any], specs: dict[str, dict]) -> None:
    """Figures, figure groups and tasks the config names exist (figure_specs checks the figures' methods)."""
    unknown = sorted(set(config["figures"]) - set(specs))
    if unknown:
        raise WorkflowConfigError(f"figures: unknown figure(s) {unknown}; known: {sorted(specs)}")
    for key in ("core_figures", "full_length_figures"):
        unknown = sorted(set(config.get(key, [])) - set(config["figures"]))
        if unknown:
            raise WorkflowConfigError(f"{key}: {unknown} are not in figures")
    paper_tasks = set(load_tasks())
    unknown = sorted(set(config["tasks"]) - paper_tasks)
    if unknown:
        raise WorkflowConfigError(f"tasks: {unknown} are not paper tasks; known: {sorted(paper_tasks)}")
    known_tasks = _backend_tasks(config["backend"])
    for paper_task in config["tasks"]:
        try:
            task = trained_task(config, paper_task)
        except ValueError as error:
            raise WorkflowConfigError(f"tasks: {error}") from None
        if task not in known_tasks:
            raise WorkflowConfigError(
                f"tasks: {paper_task} trains as {task!r}, not a task of the {config['backend']} backend; known: {sorted(known_tasks)}"
            )
    for key, named in (("sim_tasks", config.get("sim_tasks") or {}), ("steps.tasks", config["steps"].get("tasks") or {})):
        unknown = sorted(set(named) - known_tasks)
        if unknown:
            raise WorkflowConfigError(f"{key}: {unknown} are not tasks of the {config['backend']} backend; known: {sorted(known_tasks)}")
    from vcpo.methods import get_method  # imports torch: Snakemake reads this module for every command

    paper_lags = {str(spec["lag"]) for spec in specs.values() if spec.get("lag") is not None}
    paper_lags |= {str(task.paper_lag) for task in load_tasks().values()}
    unknown = sorted(set(config.get("lags", {})) - paper_lags, key=str)
    if unknown:
        raise WorkflowConfigError(f"lags: {unknown} are not lags of the paper's figures or tasks; known: {sorted(paper_lags, key=int)}")
    for method in config.get("sim_methods", {}):
        try:
            get_method(method)
        except ValueError as error:
            raise WorkflowConfigError(f"sim_methods: {error}") from None
    if config["backend"] == "sim":
        _check_sim_entries(config)


def _check_sim_entries(config: dict[str, Any]) -> None:
    """Every ``sim_tasks`` / ``sim_sync`` / ``sim_async`` / ``sim_methods`` entry has known keys with readable values, whether or
    not a planned run uses it, and none picks the SFT base (one per task: ``sim`` sets it for all runs)."""
    from vcpo.sim.config import apply_overrides  # imports torch (the simulator's modules)

    entries = [(f"{key}.{name}", settings) for key in ("sim_tasks", "sim_methods") for name, settings in (config.get(key) or {}).items()]
    entries += [(key, config[key]) for key in ("sim_sync", "sim_async") if config.get(key)]
    for where, settings in entries:
        base_keys = sorted(set(settings) & set(SIM_BASE_KEYS))
        if base_keys:
            raise WorkflowConfigError(f"{where}: {base_keys} pick the SFT base every run of a task starts from; set them in sim")
        try:
            apply_overrides(sim_start(config), {item: str(value) for item, value in settings.items()})
        except ValueError as error:
            raise WorkflowConfigError(f"{where}: {error}") from None


def _backend_tasks(backend: str) -> set[str]:
    return set(SIM_TASKS) if backend == "sim" else set(load_tasks())


def steps_of(config: dict[str, Any], run: PlannedRun) -> int:
    """``steps.tasks.<task>`` where the config gives the task its own length, else core or default."""
    by_task = config["steps"].get("tasks") or {}
    if run.task in by_task:
        return by_task[run.task]
    return config["steps"]["core" if run.core or run.full_length else "default"]


def _check_runs(config: dict[str, Any], runs: list[PlannedRun]) -> None:
    """Each run through its backend's own validation (sim settings, lags, presets) before any job starts."""
    for run in runs:
        where = f"run {run.path}"
        try:
            if config["backend"] == "sim":
                # each backend's validation only for its runs: Snakemake imports this module for every command
                from vcpo.sim.validation import validate

                given = {"task": run.task, "method": run.method, "lag": run.lag, "seed": run.seed, "steps": steps_of(config, run)}
                validate(sim_run_config(config, run.task, run.method, run.lag, given))
            else:
                # the launcher (Hydra, verl's config tree) only for the verl backend
                from vcpo.launch import make_run, strategy_of

                make_run(run.task, run.method, run.lag, run.seed, strategy=strategy_of(config.get("launch", {}).get("args", [])))
        except ValueError as error:
            key = "sim" if config["backend"] == "sim" else "lags"
            raise WorkflowConfigError(f"{key}: {where}: {error}") from None


def sim_start(config: dict[str, Any]):
    """The ``vcpo.sim`` configuration every run starts from: the ``sim_config`` file, else the defaults."""
    from vcpo.sim.config import start_config  # imports torch (the simulator's modules)

    return start_config(config.get("sim_config"))


# Settings that pick the SFT base every run of a task starts from (one base per task, built by the
# workflow's sft_base rule), so they are shared by all runs: ``sim`` or the sim_config file, never per task
# or method.
SIM_BASE_KEYS = ("model_size", "base_seed")


def sim_base_args(config: dict[str, Any]) -> str:
    """``python -m vcpo.sim.base`` options building the base the runs start from: the sim_config file's
    model size and base seed, unless ``sim`` sets others."""
    start, shared = sim_start(config), config.get("sim") or {}
    return f"--size {shared.get('model_size', start.model_size)} --seed {shared.get('base_seed', start.base_seed)}"


def sim_settings(config: dict[str, Any], task: str, method: str, lag: int) -> dict[str, Any]:
    """The ``vcpo.sim`` settings of a run: ``sim``, then ``sim_tasks.<task>``, then ``sim_sync`` (lag 0) or
    ``sim_async`` (lag >= 1), then ``sim_methods.<method>``."""
    return {
        **(config.get("sim") or {}),
        **(config.get("sim_tasks") or {}).get(task, {}),
        **(config.get("sim_async" if lag >= 1 else "sim_sync") or {}),
        **(config.get("sim_methods") or {}).get(method, {}),
    }


def sim_run_config(config: dict[str, Any], task: str, method: str, lag: int, given: dict[str, Any] | None = None):
    """The ``vcpo.sim`` configuration a run trains with: the one every run starts from, then ``given`` (the run's
    own task, method, ... as its command line passes them), then its settings."""
    from vcpo.sim.config import apply_overrides  # imports torch (the simulator's modules)

    settings = {key: str(value) for key, value in sim_settings(config, task, method, lag).items()}
    return apply_overrides(apply_overrides(sim_start(config), given or {}), settings)


def sim_cores(config: dict[str, Any], task: str, method: str, lag: int) -> int:
    """The CPU cores a simulator run holds, which the workflow reserves for it: its torch threads per process
    (0: torch's default, all cores) x its processes (2 with ``execution=concurrent``)."""
    import os

    settings = sim_run_config(config, task, method, lag)
    threads = settings.threads or len(os.sched_getaffinity(0))
    return threads * (2 if settings.execution == "concurrent" else 1)


def _check_data(config: dict[str, Any]) -> None:
    source = (config.get("data") or {}).get("source_dir")
    if source and not Path(source).is_dir():
        raise WorkflowConfigError(f"data.source_dir: {source!r} is not a folder (local benchmark files: <benchmark>/<split>.jsonl, see docs/data_rewards_evaluation.md)")


def schema_problem(config: dict[str, Any], schema_path: Path) -> str | None:
    """The config's most relevant violation of the workflow's JSON schema in one line (where, what), or
    None; Snakemake's own message appends the whole schema."""
    import jsonschema
    import yaml

    schema = yaml.safe_load(Path(schema_path).read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    error = jsonschema.exceptions.best_match(validator.iter_errors(config))
    if error is None:
        return None
    where = "/".join(map(str, error.absolute_path)) or "the top level"
    return f"{where}: {error.message}"


def plan(config: dict[str, Any]) -> Plan:
    """Every figure's runs, merged; Table 1's runs; checked against the methods and the backend."""
    from vcpo.reporting import figure_specs, runs_needed  # imports torch and matplotlib

    specs = figure_specs()
    _check_known(config, specs)
    _check_data(config)
    core_figures = set(config.get("core_figures", []))
    full_length_figures = set(config.get("full_length_figures", []))
    wanted: dict[tuple[str, str, int], tuple[bool, bool]] = {}  # (core, full length)
    figures: dict[str, list] = {}
    for name in config["figures"]:
        spec = specs[name]
        paper_tasks = spec.get("tasks") or ([spec["task"]] if "task" in spec else [])
        tasks = _scale_tasks(config, paper_tasks)
        lag = _scale_lag(config, spec.get("lag"))
        if paper_tasks and not tasks:
            continue  # no task of this figure is trained at this scale
        needed = list(dict.fromkeys(run for task in tasks for run in runs_needed(spec, task=task, lag=lag)))
        for key in needed:
            core, full = wanted.get(key, (False, False))
            wanted[key] = (core or name in core_figures, full or name in full_length_figures)
        figures[name] = [spec["kind"], tasks, lag, needed]
    table1 = []
    for paper_task in config.get("table1_tasks", []):
        if paper_task not in config["tasks"]:
            raise WorkflowConfigError(f"table1_tasks: {paper_task!r} is not in tasks")
        task = trained_task(config, paper_task)
        high_lag = _scale_lag(config, load_tasks()[paper_task].paper_lag)
        for key in ((task, "sync", 0), (task, "vcpo", high_lag)):
            wanted[key] = (True, True)  # Table 1 compares final accuracies: the core seeds and steps
            table1.append(key)
    runs = []
    for (task, method, lag), (core, full) in sorted(wanted.items()):
        for seed in config["seeds"]["core" if core else "default"]:
            run = PlannedRun(task, method, lag, seed, core, full)
            runs.append(run)
    _check_runs(config, runs)
    by_key = {}
    for run in runs:
        by_key.setdefault((run.task, run.method, run.lag), []).append(run)
    planned = {}
    for name, (kind, tasks, lag, needed) in figures.items():
        figure_runs = tuple(run for key in needed for run in by_key[key])
        planned[name] = PlannedFigure(name, kind, tasks, lag, figure_runs)
    table1_runs = tuple(run for key in dict.fromkeys(table1) for run in by_key[key])
    return Plan(config, planned, tuple(runs), table1_runs)


@functools.cache
def _git_revision(repo: str) -> str:
    import subprocess

    try:
        return subprocess.run(
            ["git", "-C", repo, "describe", "--always", "--dirty"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


def provenance(config: dict[str, Any], repo: Path) -> str:
    """The report's provenance section: config, git revision and package versions, as markdown."""
    import platform
    from importlib import metadata

    import yaml

    packages = ["vcpo", "torch", "transformers", "verl", "snakemake", "ray", "math-verify", "reasoning-gym"]
    versions = []
    for name in packages:
        try:
            versions.append(f"| {name} | {metadata.version(name)} |")
        except metadata.PackageNotFoundError:
            versions.append(f"| {name} | not installed |")
    return "\n".join(
        [
            f"# Provenance ({config['scale']} scale)",
            "",
            f"- git revision: `{_git_revision(str(repo))}`",
            f"- Python {platform.python_version()} on {platform.platform()}",
            "",
            "| package | version |",
            "|---|---|",
            *versions,
            "",
            "## Workflow configuration",
            "",
            "```yaml",
            yaml.safe_dump(config, sort_keys=False).rstrip(),
            "```",
            "",
            *_data_sources(config),
        ]
    )


def _data_sources(config: dict[str, Any]) -> list[str]:
    """Where each data file the runs trained and validated on came from (its build manifest): a split
    built from a file named after another split shows here."""
    import json

    if config["backend"] != "verl":
        return []
    lines = ["## Data", "", "| file | source |", "|---|---|"]
    for manifest in sorted(Path(config["data"]["dir"]).glob("*/*.manifest.json")):
        recorded = json.loads(manifest.read_text())
        source = recorded.get("source", "?")
        subset = f" (subset {recorded['subset']})" if recorded.get("subset") else ""
        lines.append(f"| `{manifest.with_name(manifest.name.replace('.manifest.json', '.parquet'))}` | {source}{subset} |")
    return [*lines, ""]
