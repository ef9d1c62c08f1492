# A study's runs: the SFT bases, the trainings, the archive. vcpo.studies.runner.run_all writes the config
# (the design, the study and archive folders, the runs to do) and runs this file; see its docstring.
import shlex
import sys
from pathlib import Path

from vcpo.runs import FINAL_EVAL
from vcpo.studies.design import archive_run, run_folder
from vcpo.studies.runner import base_marker, design_from_plan, sources, train

DESIGN = design_from_plan(config)
RUNS, ARCHIVE = Path(config["runs"]), Path(config["archive"])
PYTHON = shlex.quote(sys.executable)  # the interpreter vcpo is installed in, not the shell's first `python`
PENDING = [(DESIGN.arm(task, name), seed) for task, name, seed in config["pending"]]
PRIORITY = {(arm.task, arm.name, seed): len(PENDING) - index for index, (arm, seed) in enumerate(PENDING)}
# a base is built when the first run that needs it comes up, not before (Snakemake gives dependencies no priority)
BASE_PRIORITY = {}
for (arm, seed) in PENDING:
    marker = base_marker(DESIGN, arm, seed, RUNS)
    if marker is not None:
        BASE_PRIORITY.setdefault(marker.name, PRIORITY[(arm.task, arm.name, seed)])


def run_of(wildcards):
    return DESIGN.arm(wildcards.task, wildcards.arm), int(wildcards.seed)


def train_inputs(wildcards):
    arm, seed = run_of(wildcards)
    base = base_marker(DESIGN, arm, seed, RUNS)
    return [ancient(str(path)) for path in ([base] if base else []) + sources(DESIGN, arm, seed, ARCHIVE)]


wildcard_constraints:
    task="[^/]+",
    arm="[^/]+",
    seed=r"\d+",


rule all:
    input:
        [str(run_folder(ARCHIVE, arm, seed) / FINAL_EVAL) for arm, seed in PENDING],


rule sft_base:
    output:
        f"{RUNS}/bases/{{sim_task}}-seed{{seed}}.txt",
    log:
        f"{RUNS}/bases/{{sim_task}}-seed{{seed}}.log",
    threads: 1
    priority: lambda wildcards: BASE_PRIORITY.get(f"{wildcards.sim_task}-seed{wildcards.seed}.txt", 0)
    shell:
        "{PYTHON} -m vcpo.sim.base --task {wildcards.sim_task} --seed {wildcards.seed} > {output:q}.tmp 2> {log:q} && mv {output:q}.tmp {output:q}"


rule train:
    input:
        train_inputs,
    output:
        f"{RUNS}/{{task}}/{{arm}}/seed{{seed}}/{FINAL_EVAL}",
    threads: 1
    priority: lambda wildcards: PRIORITY.get((wildcards.task, wildcards.arm, int(wildcards.seed)), 0)
    run:
        train(DESIGN, *run_of(wildcards), RUNS, ARCHIVE)


rule archive:
    input:
        f"{RUNS}/{{task}}/{{arm}}/seed{{seed}}/{FINAL_EVAL}",
    output:
        f"{ARCHIVE}/{{task}}/{{arm}}/seed{{seed}}/{FINAL_EVAL}",
    priority: lambda wildcards: PRIORITY.get((wildcards.task, wildcards.arm, int(wildcards.seed)), 0) + len(PENDING)
    run:
        archive_run(Path(input[0]).parents[1], Path(output[0]).parents[1])
