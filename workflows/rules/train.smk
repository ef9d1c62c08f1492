# Training. Smoke scale: python -m vcpo.sim from a cached tiny SFT base. Paper scale: data parquet files
# built by python -m vcpo.data, then python -m vcpo.launch (stock verl). A run's only declared output is
# its completion marker, so an interrupted run keeps its checkpoint and resumes from it when re-run
# (Snakemake deletes the declared outputs of an incomplete job, nothing else).


def run_dir(wildcards):
    return RUN.format(**dict(wildcards.items()))


def planned(wildcards):
    return PLAN.find(wildcards.task, wildcards.method, int(wildcards.lag), int(wildcards.seed))


def training_priority(wildcards):
    """Long runs first (the core study and full-length sweeps before the brief ones), so that the last
    jobs running are short ones and no core waits long on a single job at the end."""
    run = planned(wildcards)
    return int(run.core or run.full_length)


if config["backend"] == "sim":

    rule sft_base:
        output:
            f"{R}/bases/{{task}}.txt",
        log:
            f"{R}/logs/sft_base/{{task}}.log",
        # Every training waits for its base; a base trains on one thread (vcpo.sim.base.SFT_THREADS: the
        # same base whatever the cores), so the bases are built side by side.
        threads: 1
        shell:
            f"{PYTHON} -m vcpo.sim.base --task {{wildcards.task}} {sim_base_args(config)}"
            " > {output:q} 2> {log:q}"

    rule train:
        input:
            base=f"{R}/bases/{{task}}.txt",
            sim_config=config.get("sim_config", []),
        output:
            f"{RUN}/{FINAL_EVAL}",
        params:
            out=run_dir,
            sim_config=lambda wildcards, input: f"--config {shlex.quote(input.sim_config)}" if input.sim_config else "",
            steps=lambda wildcards: PLAN.steps(planned(wildcards)),
            settings=lambda wildcards: " ".join(
                shlex.quote(f"{key}={value}") for key, value in sim_settings(config, wildcards.task, wildcards.method, int(wildcards.lag)).items()
            ),
        log:
            f"{R}/logs/train/{{task}}-{{method}}-lag{{lag}}-seed{{seed}}.log",
        # the cores the run holds (a concurrent run: its learner and its generator process), so that runs side
        # by side never share a core and a run's wall-clock time is its own
        threads: lambda wildcards: sim_cores(config, wildcards.task, wildcards.method, int(wildcards.lag))
        priority: training_priority
        shell:
            "{PYTHON} -m vcpo.sim train {params.sim_config} --task {wildcards.task} --method {wildcards.method}"
            " --lag {wildcards.lag} --seed {wildcards.seed} --steps {params.steps} --out {params.out:q}"
            ' base="$(head -n 1 {input.base:q})" {params.settings} > {log:q} 2>&1'

else:
    from vcpo.launch import make_run

    DATA = config["data"]["dir"]

    rule build_data:
        output:
            f"{DATA}/{{dataset}}/{{split}}.parquet",
        params:
            source=lambda wildcards: (
                f"--source {shlex.quote(config['data']['source_dir'])}" if config["data"].get("source_dir") else ""
            ),
        log:
            f"{R}/logs/data/{{dataset}}-{{split}}.log",
        shell:
            "{PYTHON} -m vcpo.data build {wildcards.dataset} --out {DATA:q} --split {wildcards.split}"
            " {params.source} > {log:q} 2>&1"

    def all_data_files():
        """Every data file a planned run reads (the provenance lists their build manifests)."""
        return sorted({str(path) for run in PLAN.runs for which in ("train", "val")
                       for path in make_run(run.task, run.method, run.lag, run.seed, data_dir=DATA).data_files(which)})

    def launcher_run(wildcards):
        """The run as vcpo.launch composes it: its data files and GPUs come from there."""
        return make_run(wildcards.task, wildcards.method, int(wildcards.lag), int(wildcards.seed), data_dir=DATA)

    def check_launch_args():
        """Every planned run as vcpo.launch composes it with the config's launch.args, given every check of
        its --dry-run, before any job starts (seeds share their checks)."""
        from vcpo.launch import LaunchError
        from vcpo.launch.__main__ import composed_config

        for task, method, lag in sorted({(run.task, run.method, run.lag) for run in PLAN.runs}):
            argv = ["--task", task, "--method", method, "--lag", str(lag), "--data-dir", DATA, *LAUNCH_ARGS]
            try:
                composed_config(argv, checked=True)
            except LaunchError as error:
                raise WorkflowError(f"workflow config launch.args {LAUNCH_ARGS}: {task}/{method}/lag{lag}: {error}") from None

    LAUNCH_ARGS = config.get("launch", {}).get("args", [])
    if workflow.is_main_process:
        check_launch_args()

    # launch.cpu_steps: every run goes through python -m vcpo.launch.cpu instead, verl's own trainer on
    # this CPU with the small sizes of vcpo.verl_plugin.cpu.recipe, for that many steps, from one random model
    # (CPU_MODEL) in place of the recipe's: the paper workflow's rules executed without a GPU.
    CPU_STEPS = config.get("launch", {}).get("cpu_steps")
    CPU_MODEL = f"{DATA}/random_model"

    if CPU_STEPS:

        rule random_model:
            output:
                f"{CPU_MODEL}/config.json",
            log:
                f"{R}/logs/random_model.log",
            shell:
                "{PYTHON} -m vcpo.local_models {CPU_MODEL:q} > {log:q} 2>&1"

    def launch_command(wildcards):
        """The run's command line: vcpo.launch on GPUs, or vcpo.launch.cpu (absolute paths: it runs
        verl from the run's folder; --overwrite: a job run again, after a failure or for newer inputs, starts
        its run over, as verl does not resume a CPU run; a GPU run's folder is verl's to resume)."""
        q = shlex.quote
        run = [f"--task {wildcards.task} --method {wildcards.method} --lag {wildcards.lag} --seed {wildcards.seed}"]
        args = " ".join(q(arg) for arg in LAUNCH_ARGS)
        if not CPU_STEPS:
            return " ".join([f"{PYTHON} -m vcpo.launch", *run, f"--data-dir {q(DATA)} --output-dir {q(R + '/runs')}", args])
        files = launcher_run(wildcards)
        train, val = (str(Path(files.data_files(which)[0]).resolve()) for which in ("train", "val"))
        return " ".join(
            [f"{PYTHON} -m vcpo.launch.cpu", *run, f"--out {q(run_dir(wildcards))} --steps {CPU_STEPS} --overwrite",
             f"--model {q(str(Path(CPU_MODEL).resolve()))} --train {q(train)} --val {q(val)} --", args]
        )  # fmt: skip

    rule train:
        input:
            lambda wildcards: [str(path) for which in ("train", "val") for path in launcher_run(wildcards).data_files(which)],
            [f"{CPU_MODEL}/config.json"] if CPU_STEPS else [],
        output:
            f"{RUN}/training.done",
        params:
            command=launch_command,
        resources:
            gpu=lambda wildcards: launcher_run(wildcards).gpus,
        log:
            f"{R}/logs/train/{{task}}-{{method}}-lag{{lag}}-seed{{seed}}.log",
        priority: training_priority
        shell:
            "{params.command} > {log:q} 2>&1 && touch {output:q}"
