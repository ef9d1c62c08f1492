# Evaluation. Smoke scale: the simulator evaluates every run on its held-out split during training and
# at the end (final/eval.json, written by the train rule); python -m eval would ask the simulator's tiny
# models prompts in another format. Paper scale: python -m eval on the Hugging Face weights of the final
# checkpoint and of the intermediate ones at `evaluation.intermediate_steps`, with the paper's sampling
# settings (eval/benchmarks.yaml), for the benchmarks the config lists per task.

if config["backend"] == "verl":
    from vcpo.launch import get_task

    def paper_task(scale_task):
        return next(paper for paper, task in config["tasks"].items() if task == scale_task)

    def intermediate_steps(task):
        """The configured steps at which the task's runs save a checkpoint (task recipe: save_freq)."""
        recipe = get_task(task)
        save_freq = recipe.chosen.get("trainer.save_freq", 1)
        steps = config["evaluation"].get("intermediate_steps", [])
        return [step for step in steps if step < recipe.paper["training_steps"] and step % save_freq == 0]

    rule evaluate:
        input:
            f"{RUN}/training.done",
        output:
            f"{RUN}/eval/{{checkpoint}}/summary.json",
        wildcard_constraints:
            checkpoint=r"final|step\d+",
        params:
            checkpoints=lambda wildcards: f"{run_dir(wildcards)}/checkpoints",
            step=lambda wildcards: wildcards.checkpoint.removeprefix("step"),
            benchmarks=lambda wildcards: ",".join(config["evaluation"]["benchmarks"][paper_task(wildcards.task)]),
            source=lambda wildcards: (
                f"--source-dir {shlex.quote(config['data']['source_dir'])}" if config["data"].get("source_dir") else ""
            ),
            args=" ".join(config["evaluation"].get("args", [])),
        resources:
            gpu=1,
        log:
            f"{R}/logs/eval/{{task}}-{{method}}-lag{{lag}}-seed{{seed}}-{{checkpoint}}.log",
        shell:
            # final: the latest checkpoint verl saved (with its Hugging Face weights: recipes/verl.yaml)
            "step={params.step}; [ $step = final ] && step=$(cat {params.checkpoints:q}/latest_checkpointed_iteration.txt);"
            " python -m eval --model {params.checkpoints:q}/global_step_$step/actor/huggingface"
            ' --benchmarks {params.benchmarks} --out "$(dirname {output:q})" {params.source} {params.args} > {log:q} 2>&1'


def run_outputs(runs):
    """What a table or figure reads of each run: its evaluated final state (and intermediate checkpoints)."""
    if config["backend"] == "sim":
        return [f"{R}/runs/{run.path}/final/eval.json" for run in runs]
    return [
        f"{R}/runs/{run.path}/eval/{checkpoint}/summary.json"
        for run in runs
        for checkpoint in ["final", *(f"step{step}" for step in intermediate_steps(run.task))]
    ]
