"""``python -m vcpo.sim sweep``: methods x lags x seeds, each run a job of Snakemake (``sweep.smk`` beside this file),
as the reproduction's and the studies' runs are.

Every configuration is checked before any work starts; runs that finished are skipped. Each run is
``python -m vcpo.sim train`` with its settings, in ``OUT/<task>/<method>/lag<k>/seed<s>/`` with its log there
(``vcpo.runs.TRAIN_LOG``); ``--jobs`` runs at a time, and every one of them dies with the sweep.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from vcpo.lifetimes import run_jobs_with_snakemake
from vcpo.locks import run_folder_lock, write_atomic
from vcpo.recipes import run_path
from vcpo.runs import is_finished, train_logged
from vcpo.sim.config import SimConfig, apply_overrides, as_override_text, start_config
from vcpo.sim.validation import default_lag, validate

SNAKEFILE = Path(__file__).with_name("sweep.smk")
PLAN_FILE = ".sweep.json"  # in the sweep's output folder: the runs handed to Snakemake, by folder


def run_dir(root: Path, config: SimConfig) -> Path:
    return Path(root) / run_path(config.task, config.method, config.lag, config.seed)


def sweep_configs(config_file: str | None, overrides: list[str], methods: list[str], lags: list[int],
                  seeds: list[int], out: Path, **flags) -> list[SimConfig]:
    """Each run's checked configuration: ``config_file``, then ``overrides``, then the flags given (``task``,
    ``lag_model``, ``steps``; None: not given), then the run's method, lag and seed. A preset that fixes its
    lag (sync) runs once, at its own lag."""
    base = apply_overrides(start_config(config_file), overrides)
    given = {key: value for key, value in flags.items() if value is not None}
    configs = []
    for method in methods:
        for lag in dict.fromkeys(default_lag(method, lag) for lag in lags):
            for seed in seeds:
                config = dataclasses.replace(base, method=method, lag=lag, seed=seed, **given)
                configs.append(validate(dataclasses.replace(config, out=str(run_dir(out, config)))))
    return configs


def train_arguments(config: SimConfig) -> list[str]:
    """``python -m vcpo.sim train`` arguments that make ``config``: every setting that is not the default."""
    default = SimConfig()
    return [f"{field.name}={as_override_text(getattr(config, field.name))}" for field in dataclasses.fields(config)
            if field.name != "extra" and getattr(config, field.name) != getattr(default, field.name)]


def train(out: Path, arguments: list[str]) -> None:
    """One run (the Snakemake job): its training, its output appended to ``out/train.log``."""
    out.mkdir(parents=True, exist_ok=True)
    train_logged([sys.executable, "-m", "vcpo.sim", "train", *arguments, "progress=false"], out)


def run_sweep(configs: list[SimConfig], out: Path, jobs: int) -> list[Path]:
    """The runs of ``configs`` not finished yet, ``jobs`` at a time; returns the folders of those that did not finish.
    A second sweep into ``out`` while this one runs is refused (`FolderInUse`), where its runs would each fail on
    their folder's lock."""
    with run_folder_lock(out):
        todo = {str(Path(config.out).resolve()): train_arguments(config) for config in configs if not is_finished(Path(config.out))}
        print(f"sweep: {len(configs)} runs, {len(configs) - len(todo)} already finished, {len(todo)} to run, {jobs} at a time")
        if todo:
            plan = Path(out) / PLAN_FILE
            write_atomic(plan, json.dumps({"runs": todo}))
            run_jobs_with_snakemake(SNAKEFILE, plan, jobs)
        return [Path(folder) for folder in todo if not is_finished(folder)]
