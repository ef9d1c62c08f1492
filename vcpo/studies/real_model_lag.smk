# The real model's lag study: one job per verl run. vcpo.studies.real_model_lag.run_study writes the config (the run
# the registration asks for next) and runs this file, run after run; each job takes every core. A job
# runs in a process of its own: Snakemake puts this folder first on sys.path, where statistics.py would shadow the
# standard library's for what the run imports.
import os
import shlex
import sys

PYTHON = shlex.quote(sys.executable)  # the interpreter vcpo is installed in, not the shell's first `python`
WORK = config["work"]


rule all:
    input:
        [f"{WORK}/runs/{run['name']}.done" for run in config["runs"]],


rule train:
    output:
        f"{WORK}/runs/{{name}}.done",
    threads: os.cpu_count() or 1
    params:
        plan=shlex.quote(config["plan"]),
    shell:
        "{PYTHON} -m vcpo.studies.real_model_lag run-one --plan {params.plan} --name {wildcards.name} && touch {output:q}"
