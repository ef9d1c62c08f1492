# The real model's lag study: one job per verl run. vcpo.studies.real_model_lag.run_study writes the config (the runs
# the registration asks for next) and runs this file; each job takes every core, so the runs go one at a time.
import os
from pathlib import Path

from vcpo.studies.real_model_lag import Run, run_one

WORK, TABLES, COMMIT = Path(config["work"]), Path(config["tables"]), config["commit"]
RUNS = {run.name: run for run in (Run(**fields) for fields in config["runs"])}


rule all:
    input:
        [f"{WORK}/runs/{name}.done" for name in RUNS],


rule train:
    output:
        f"{WORK}/runs/{{name}}.done",
    threads: os.cpu_count() or 1
    run:
        run_one(RUNS[wildcards.name], WORK, TABLES, COMMIT)
        Path(output[0]).touch()
