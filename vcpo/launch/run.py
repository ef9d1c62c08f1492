"""The run model: a paper run as task × method × lag × seed × strategy, resolved from the recipes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vcpo.methods import Method, get_method, run_lag, step_rule
from vcpo.recipes import (
    TaskRecipe,
    load_tasks,
    run_path,
)
from vcpo.verl_contract import (
    last_override,
)

STRATEGIES = ("fsdp2", "fsdp", "megatron")  # the actor strategies vcpo.launch composes (verl also has others)


class LaunchError(ValueError):
    """A run that cannot launch; the message names the recipe key or verl key at fault."""


def get_task_recipe(name: str) -> TaskRecipe:
    """The task recipe of ``--task`` (a LaunchError naming the flag if there is none)."""
    tasks = load_tasks()
    if name not in tasks:
        raise LaunchError(f"unknown task {name!r} (--task); known: {sorted(tasks)}")
    return tasks[name]


@dataclass(frozen=True)
class Run:
    """One training run: what `overrides` composes."""

    task: TaskRecipe
    method: Method
    lag: int
    seed: int = 0
    data_dir: Path = Path("data")
    output_dir: Path = Path("results/verl")
    strategy: str | None = None  # the actor's verl strategy; None: the method's (StepRule.strategies[0]), else fsdp2
    # the data task that trains in the recipe's place (a pretrained model's registered task on CPU); None: the recipe's
    trains: str | None = None

    @property
    def trained_task(self) -> str:
        """The task whose prompts and reward the run trains on: what its name and launch record say."""
        return self.trains or self.task.name

    @property
    def name(self) -> str:
        return f"{self.trained_task}-{self.method.name}-lag{self.lag}-seed{self.seed}"

    @property
    def run_dir(self) -> Path:
        return self.output_dir / run_path(self.task.name, self.method.name, self.lag, self.seed)

    def data_files(self, which: str) -> list[Path]:
        return [self.data_dir / f"{split}.parquet" for split in self.task.spec["data"][which]]

    @property
    def gpus(self) -> int:
        """GPUs of the recipe's layout: the sync trainer colocates on, and separate_async splits, the
        task's sampler + trainer GPUs (what ``gpus_needed`` finds in the composed config)."""
        return self.task.paper["sampler_gpus"] + self.task.paper["trainer_gpus"]


def make_run(
    task: str,
    method: str,
    lag: int | None = None,
    seed: int = 0,
    data_dir: Path | str = "data",
    output_dir: Path | str = "results/verl",
    default_lag: int | None = None,
    strategy: str | None = None,
) -> Run:
    """The run for ``--task --method [--lag] [--seed]``; the lag defaults to ``default_lag``, else the task's
    (paper) value (``vcpo.methods.run_lag``: a method that fixes its lag refuses another ``--lag``)."""
    task_recipe = get_task_recipe(task)
    try:
        method_preset = get_method(method)
    except ValueError as error:
        raise LaunchError(f"{error} (--method)") from None
    try:
        default = task_recipe.paper_lag if default_lag is None else default_lag
        resolved_lag = run_lag(method, lag, default, task_recipe.paper["training_steps"])
    except ValueError as error:
        raise LaunchError(f"--lag: {error} (task {task!r})") from None
    if strategy is not None and strategy not in STRATEGIES:
        raise LaunchError(f"actor_rollout_ref.actor.strategy={strategy}: vcpo.launch composes {'|'.join(STRATEGIES)}")
    return Run(task_recipe, method_preset, resolved_lag, seed, Path(data_dir), Path(output_dir), strategy)


def strategy_of(extra: list[str] | tuple[str, ...]) -> str | None:
    """The actor strategy the user's overrides set (the last wins, as in Hydra), or None."""
    return last_override(extra, "actor_rollout_ref.actor.strategy")


def actor_strategy(run: Run) -> str:
    return run.strategy or step_rule(run.method).strategies[0]


def config_name(run: Run) -> str:
    """verl's top-level config: its Megatron trainer's for the Megatron strategy."""
    return "ppo_megatron_trainer" if actor_strategy(run) == "megatron" else "ppo_trainer"


