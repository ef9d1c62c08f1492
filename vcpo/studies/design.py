"""A study's design (arms, seeds, settings per task, read from a YAML file) and what it makes of one run:
its folder (``RUNS/<task>/<arm>/seed<s>``), its settings and command, and its archived record. The
studies (``evidence``, ``across_lags``) and the runner read it."""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vcpo.locks import write_atomic
from vcpo.recipes import run_path
from vcpo.reporting.run_data import read_metrics
from vcpo.runs import (
    CONFIG_FILE,
    EFFECTIVE_LR,
    FINAL_DIR,
    FINAL_EVAL,
    LR_SCALE,
    METRICS_FILE,
    SEQ_ESS_RATIO,
    TEST_ACCURACY,
    VAL_ACCURACY,
    MetricsProblem,
    is_finished,
    missing_steps,
    read_json,
)
from vcpo.sim.config import load_config_file

# Every finished run's config, final evaluation and these metrics are archived (committed, in the runs' own
# layout): a study's rows are computed from the archive, and runs that read other runs read them there.
ARCHIVED_METRICS = ("step", VAL_ACCURACY, TEST_ACCURACY, SEQ_ESS_RATIO, "rollout_corr/kl", LR_SCALE, EFFECTIVE_LR, "actor/grad_norm", "critic/score/mean",
                    "tool/calls_per_response", "tool/error_frac")


@dataclass(frozen=True)
class Arm:
    task: str  # the design's task key
    name: str
    method: str
    phase: int
    reference_lr: float | None = None  # None: the task config's (vcpo.sim.config.SimConfig.reference_lr)
    lag: int | None = None  # None: the task config's (sync: 0)
    lr_scale_from: str | None = None  # an arm of the same task: replay its run of the same seed
    lr_from_mean_scale_of: str | None = None  # an arm of the same task: its reference_lr x the mean actor/lr_scale of its runs


@dataclass(frozen=True)
class Design:
    seeds: list[int]
    configs: dict[str, str]  # task key -> config file
    settings: dict[str, dict]  # task key -> key=value settings over the config file
    arms: list[Arm]
    task_seeds: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # a task's own seeds, where it has them

    def seeds_of(self, task: str) -> list[int]:
        return self.task_seeds.get(task, self.seeds)

    def arm(self, task: str, name: str) -> Arm:
        return next(arm for arm in self.arms if arm.task == task and arm.name == name)


def load_design(path: str | Path) -> Design:
    import yaml

    raw = yaml.safe_load(Path(path).read_text())
    arms = []
    for task, spec in raw["tasks"].items():
        for name, fields in spec["arms"].items():
            unknown = set(fields) - {f.name for f in dataclasses.fields(Arm)}
            if unknown:
                raise ValueError(f"{path}: arm {task}/{name}: unknown keys {sorted(unknown)}")
            arms.append(Arm(task=task, name=name, **fields))
    design = Design(
        seeds=list(raw["seeds"]),
        configs={task: spec["config"] for task, spec in raw["tasks"].items()},
        settings={task: dict(spec.get("settings", {})) for task, spec in raw["tasks"].items()},
        arms=arms,
        task_seeds={task: list(spec["seeds"]) for task, spec in raw["tasks"].items() if "seeds" in spec},
    )
    for arm in arms:
        for source in (arm.lr_scale_from, arm.lr_from_mean_scale_of):
            if source is not None and source not in {a.name for a in arms if a.task == arm.task}:
                raise ValueError(f"{path}: arm {arm.task}/{arm.name} refers to unknown arm {source!r}")
    return design


def run_folder(root: Path, arm: Arm, seed: int) -> Path:
    return Path(root) / run_path(arm.task, arm.name, None, seed)


def archive_run(folder: Path, target: Path) -> None:
    """A finished run's record as the study keeps it in the repository: its config, its final evaluation and
    the metrics the rows and the controls read (ARCHIVED_METRICS) of every line, in the run's own layout."""
    (target / FINAL_DIR).mkdir(parents=True, exist_ok=True)
    write_atomic(target / CONFIG_FILE, (folder / CONFIG_FILE).read_text())
    lines = [{key: line[key] for key in ARCHIVED_METRICS if key in line} for line in read_metrics(folder)]
    write_atomic(target / METRICS_FILE, "".join(json.dumps(line) + "\n" for line in lines))
    write_atomic(target / FINAL_EVAL, (folder / FINAL_EVAL).read_text())


def archive_finished(design: Design, runs: Path, archive: Path) -> int:
    """Archive every run finished below ``runs``; returns how many."""
    kept = [(arm, seed) for arm in design.arms for seed in design.seeds_of(arm.task) if is_finished(run_folder(runs, arm, seed))]
    for arm, seed in kept:
        archive_run(run_folder(runs, arm, seed), run_folder(archive, arm, seed))
    return len(kept)


def archived_metrics(folder: Path) -> list[dict]:
    """A finished run's metrics, refused (MetricsProblem naming the file and the steps) unless they log every step its
    config ran: a cut or damaged archive must not become a number."""
    steps = read_json(folder / CONFIG_FILE, ("steps",))["steps"]
    lines = read_metrics(folder)
    if missing := missing_steps(lines, steps):
        shown = ", ".join(map(str, missing[:5])) + (f", ... ({len(missing)} in all)" if len(missing) > 5 else "")
        raise MetricsProblem(f"{folder / METRICS_FILE} lacks steps {shown} of the {steps} its config ran")
    return lines


def mean_step_scale(folders: list[Path]) -> float:
    """The mean of ``actor/lr_scale`` over every step of ``folders`` (evidence.md: the constant-rate control)."""
    scales = [line[LR_SCALE] for folder in folders for line in archived_metrics(folder) if LR_SCALE in line]
    return float(np.mean(scales))


def run_settings(design: Design, arm: Arm, seed: int, root: Path) -> dict | None:
    """The key=value settings of one run over its task's config file, or None while a run it depends on
    has not finished."""
    settings = {**design.settings[arm.task], "method": arm.method, "seed": seed, "base_seed": seed}
    if arm.lag is not None:
        settings["lag"] = arm.lag
    elif arm.method == "sync":
        settings["lag"] = 0
    if arm.reference_lr is not None:
        settings["reference_lr"] = arm.reference_lr
    if arm.lr_scale_from:
        source = run_folder(root, design.arm(arm.task, arm.lr_scale_from), seed)
        if not is_finished(source):
            return None
        settings["lr_scale_from"] = str(source)
    if arm.lr_from_mean_scale_of:
        source_arm = design.arm(arm.task, arm.lr_from_mean_scale_of)
        folders = [run_folder(root, source_arm, s) for s in design.seeds_of(arm.task)]
        if not all(is_finished(folder) for folder in folders):
            return None
        nominal = source_arm.reference_lr if source_arm.reference_lr is not None else load_config_file(design.configs[arm.task]).reference_lr
        settings["reference_lr"] = float(f"{nominal * mean_step_scale(folders):.4g}")
    return settings


# how the runner runs every study run: one torch thread (two at a time on two cores), no progress bar in its log
RUNNER_SETTINGS = ("threads=1", "progress=false")


def command_line(design: Design, arm: Arm, settings: dict, out: str, runner_settings: tuple[str, ...] = RUNNER_SETTINGS) -> list[str]:
    """The run's command; ``runner_settings``: those that change how it runs, not what it computes."""
    overrides = [f"{key}={value}" for key, value in settings.items() if key not in ("method", "seed")]
    return [sys.executable, "-m", "vcpo.sim", "train", "--config", design.configs[arm.task], "--method", arm.method,
            "--seed", str(settings["seed"]), "--out", out, *overrides, *runner_settings]


# -- running ------------------------------------------------------------------------------------------
def sim_task(design: Design, arm: Arm) -> str:
    return design.settings[arm.task].get("task") or load_config_file(design.configs[arm.task]).task


def analysis_code_commit() -> str | None:
    """The last commit that changed the studies' analysis code (vcpo/studies), or None outside a git checkout."""
    import subprocess

    folder = Path(__file__).parent
    try:
        done = subprocess.run(["git", "-C", str(folder), "log", "-1", "--format=%H", "--", "."], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def analysis_commit_problem(registration: dict, current: str | None) -> str | None:
    """Why a report must not run from this analysis code: the registration names the commit of its analysis code
    (``analysis_commit``) and the code has changed since. None where they agree, or where the registration predates
    the rule (it names none)."""
    registered = registration.get("analysis_commit")
    if registered is None or current == registered:
        return None
    return (f"the registration names analysis code at commit {registered[:12]}, but vcpo/studies is at "
            f"{(current or 'an unknown commit')[:12]}: check out the registered analysis, or pass --any-analysis-commit "
            "to run this one (and say so where its numbers are quoted)")

