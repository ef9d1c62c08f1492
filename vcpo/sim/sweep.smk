# python -m vcpo.sim sweep's runs: vcpo.sim.sweep.run_sweep writes the config (each run folder with its training's
# settings) and runs this file; see its docstring.
from pathlib import Path

from vcpo.runs import FINAL_EVAL
from vcpo.sim.sweep import train

RUNS = config["runs"]


rule all:
    input:
        [f"{folder}/{FINAL_EVAL}" for folder in RUNS],


rule train:
    output:
        f"{{folder}}/{FINAL_EVAL}",
    threads: 1
    run:
        train(Path(wildcards.folder), RUNS[wildcards.folder])
