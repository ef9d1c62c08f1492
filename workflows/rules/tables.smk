# Tables, figures and the provenance, each marked for the report (snakemake --report).


# Figures drawn from a measurement file instead of run metrics, and that file.
MEASUREMENTS = {"overhead": f"{R}/benchmarks/opob_overhead.json", "grad_norm_proxy": f"{R}/measurements/{{figure}}.json"}


def measurement(figure):
    return MEASUREMENTS[figure.kind].format(figure=figure.name)


def figure_inputs(wildcards):
    figure = PLAN.figures[wildcards.figure]
    return [measurement(figure)] if figure.kind in MEASUREMENTS else run_outputs(figure.runs)


def figure_args(wildcards):
    figure = PLAN.figures[wildcards.figure]
    args = [f"--task {task}" for task in figure.tasks]
    if figure.lag is not None:
        args.append(f"--lag {figure.lag}")
    if figure.kind in MEASUREMENTS:
        args.append(f"--measured {shlex.quote(measurement(figure))}")
    return " ".join(args)


rule grad_norm_measurement:
    input:
        lambda wildcards: run_outputs(PLAN.figures[wildcards.figure].runs),
    output:
        f"{R}/measurements/{{figure}}.json",
    params:
        task=lambda wildcards: PLAN.figures[wildcards.figure].tasks[0],
    log:
        f"{R}/logs/measurements/{{figure}}.log",
    threads: 1
    shell:
        "{PYTHON} -m vcpo.studies.grad_norms --runs {R:q}/runs --task {params.task} --out {output:q} > {log:q} 2>&1"


rule figure:
    input:
        figure_inputs,
    output:
        report(
            f"{R}/figures/{{figure}}.png",
            caption="../report/figure.rst",
            category="Figures",
            labels={"figure": "{figure}", "scale": SCALE},
        ),
    params:
        args=figure_args,
    log:
        f"{R}/logs/figures/{{figure}}.log",
    shell:
        "{PYTHON} -m vcpo.reporting figure {wildcards.figure} --runs {R:q}/runs --scale {SCALE} {params.args}"
        " --out {output:q} > {log:q} 2>&1"


rule overhead_benchmark:
    output:
        f"{R}/benchmarks/opob_overhead.json",
    params:
        args=" ".join(config.get("benchmark", {}).get("overhead_args", [])),
    log:
        f"{R}/logs/benchmarks/opob_overhead.log",
    threads: 2
    shell:
        "{PYTHON} benchmarks/opob_overhead.py {params.args} --json {output:q} > {log:q} 2>&1"


def table1_args():
    """Each paper task beside the task it trains on here, and the config's lag mapping (the async row is
    VCPO at the task's published lag as this scale maps it)."""
    args = [f"--task {paper}={trained_task(config, paper)}" for paper in config.get("table1_tasks", [])]
    args += [f"--lag-map {paper}={scaled}" for paper, scaled in config.get("lags", {}).items()]
    return " ".join(args)


rule table1:
    input:
        run_outputs(PLAN.table1),
        base_outputs(PLAN.table1),
    output:
        report(f"{R}/tables/table1.md", caption="../report/table1.rst", category="Tables", labels={"table": "1"}),
    params:
        args=table1_args(),
    log:
        f"{R}/logs/tables/table1.log",
    shell:
        "{PYTHON} -m vcpo.reporting table1 --runs {R:q}/runs --scale {SCALE} {params.args} --out {output:q} > {log:q} 2>&1"


rule hyperparameters:
    input:
        "recipes/optimizer.yaml",
        expand("recipes/tasks/{task}.yaml", task=["gsm8k", "math", "countdown", "simpletir"]),
    output:
        report(
            expand(f"{R}/tables/table{{number}}.md", number=[2, 3, 4, 5]),
            caption="../report/hyperparameters.rst",
            category="Tables",
            labels={"table": "2-5"},
        ),
    log:
        f"{R}/logs/tables/hyperparameters.log",
    shell:
        "{PYTHON} -m vcpo.reporting hyperparams --out {R:q}/tables > {log:q} 2>&1"


rule provenance:
    input:
        # at paper scale the data files, whose build manifests it lists
        all_data_files() if config["backend"] == "verl" else [],
    output:
        report(f"{R}/provenance.md", caption="../report/provenance.rst", category="Provenance"),
    run:
        from vcpo.workflow_plan import provenance

        Path(output[0]).write_text(provenance(config, REPO))
