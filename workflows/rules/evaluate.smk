# Evaluation. Smoke scale: the simulator evaluates every run on its held-out split during training and
# at the end (final/eval.json, written by the train rule) through vcpo.evaluation, the harness behind
# python -m vcpo.evaluation; python -m vcpo.evaluation itself would ask the simulator's tiny models prompts in another format.
# Paper scale: python -m vcpo.evaluation, with the paper's sampling settings (recipes/benchmarks.yaml) and the
# benchmarks the task recipe lists, on the Hugging Face weights of each run's final checkpoint and
# on the base model the runs start from (Table 1's base row). Accuracy against step comes from verl's
# own validation (trainer.test_freq), so intermediate checkpoints are not evaluated.

if config["backend"] == "verl":
    import functools

    from vcpo.evaluation.tool_use import tool_use_options
    from vcpo.launch.__main__ import composed_config
    from vcpo.recipes import base_path, load_tasks

    def eval_params(wildcards):
        """python -m vcpo.evaluation options shared by the run and base evaluations: the task's benchmarks, and its
        rollouts' multi-turn tool settings (SimpleTIR), so that a checkpoint is measured as it was trained."""
        source = config["data"].get("source_dir")
        return " ".join(
            [
                "--benchmarks " + ",".join(load_tasks()[wildcards.task].benchmarks),
                f"--source-dir {shlex.quote(source)}" if source else "",
                *(shlex.quote(arg) for arg in tool_use_options(task_config(wildcards.task).actor_rollout_ref.rollout.multi_turn)),
                *(shlex.quote(arg) for arg in config.get("evaluation", {}).get("args", [])),
            ]
        )

    @functools.cache
    def task_config(task):
        """The verl config vcpo.launch composes for the task's runs (with the config's launch.args), once
        per task for all its evaluations."""
        return composed_config(["--task", task, "--method", "sync", "--data-dir", DATA, *LAUNCH_ARGS])

    def base_model(wildcards):
        """The model the task's runs start from, or on CPU (launch.cpu_steps) the random model every run
        starts from."""
        return CPU_MODEL if CPU_STEPS else task_config(wildcards.task).actor_rollout_ref.model.path

    rule evaluate:
        input:
            f"{RUN}/training.done",
        output:
            f"{RUN}/eval/summary.json",
        params:
            checkpoints=lambda wildcards: f"{run_dir(wildcards)}/checkpoints",
            options=eval_params,
        resources:
            gpu=1,
        log:
            f"{R}/logs/eval/{{task}}-{{method}}-lag{{lag}}-seed{{seed}}.log",
        shell:
            # the latest checkpoint verl saved (with its Hugging Face weights: recipes/verl.yaml)
            "step=$(cat {params.checkpoints:q}/latest_checkpointed_iteration.txt);"
            " {PYTHON} -m vcpo.evaluation --model {params.checkpoints:q}/global_step_$step/actor/huggingface"
            ' --out "$(dirname {output:q})" {params.options} > {log:q} 2>&1'

    rule evaluate_base:
        input:
            [f"{CPU_MODEL}/config.json"] if CPU_STEPS else [],
        output:
            f"{R}/runs/{base_path('{task}')}/eval/summary.json",
        params:
            model=base_model,
            options=eval_params,
        resources:
            gpu=1,
        log:
            f"{R}/logs/eval/{{task}}-base.log",
        shell:
            '{PYTHON} -m vcpo.evaluation --model {params.model:q} --out "$(dirname {output:q})" {params.options} > {log:q} 2>&1'


def run_outputs(runs):
    """What a table or figure reads of each run: its evaluated final state."""
    if config["backend"] == "sim":
        return [f"{R}/runs/{run.path}/{FINAL_EVAL}" for run in runs]
    return [f"{R}/runs/{run.path}/eval/summary.json" for run in runs]


def base_outputs(runs):
    """The base-model evaluations of the runs' tasks (paper scale; the simulator's step-0 evaluation is
    its base row)."""
    if config["backend"] == "sim":
        return []
    return sorted({f"{R}/runs/{base_path(run.task)}/eval/summary.json" for run in runs})
