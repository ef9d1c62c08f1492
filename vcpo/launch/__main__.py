"""``python -m vcpo.launch --task T --method M [--lag K] [--seed S] [--dry-run | --show-config] [overrides]``.

Composes the run with verl's Hydra config, validates it (GPUs, tensor parallelism, batch divisibility,
data and model paths, every config dataclass, and, launching, the packages of its attention, cross-entropy and weight
sync), then starts ``python -m verl.trainer.main_ppo``.
``--dry-run`` prints the exact command instead; ``--show-config`` prints the resolved verl config as
YAML under verl's own key paths. Trailing ``key=value`` arguments are Hydra overrides that win over
the recipes (e.g. ``trainer.total_training_steps=10``).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import subprocess
import sys

from vcpo.actor_memory import GB, OPOB_MODES
from vcpo.launch import (
    OVERWRITE_HELP,
    LaunchError,
    check,
    check_added_keys,
    command,
    compose,
    launch_record,
    launching_into,
    load_tasks,
    make_run,
    run_environment,
    shell_command,
    strategy_of,
    write_launch_record,
)
from vcpo.launch.gpu_packages import check_gpu_packages
from vcpo.launch.memory import DEFAULT_GPU_MEMORY_GB, gpu_memory_gb, projection


def visible_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # a torch without CUDA support
        return 0


def composed_config(argv: list[str], checked: bool = False):
    """The verl config of ``python -m vcpo.launch ARGV`` (what ``--show-config`` prints, here unchecked):
    what a workflow reads of a run without launching it. ``checked``: also every check of ``--dry-run``
    (not the files, not the GPUs), after the overrides of ARGV; a `LaunchError` names the key at fault."""
    args = _parser().parse_args(argv)
    run, config = _composed(args)
    if checked:
        check(run, config, available_gpus=None, check_paths=False)
    return config


def _composed(args: argparse.Namespace):
    """The run of the parsed arguments and its composed verl config, the user's overrides applied last."""
    run = make_run(args.task, args.method, args.lag, args.seed, args.data_dir, args.output_dir, strategy=strategy_of(args.overrides))
    return run, compose(run, args.overrides)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.memory_table:
        print(recipe_table())
        return 0
    if args.list:
        for task in load_tasks().values():
            print(f"{task.name:<10} {task.spec['table']:<14} k={task.paper_lag:<3} {task.spec['title']}")
        return 0
    if not (args.task and args.method):
        print("error: --task and --method are required (or --list)", file=sys.stderr)
        return 2
    try:
        run, config = _composed(args)
        check_added_keys(config, args.overrides)
        launching = not (args.dry_run or args.show_config)
        gpus = args.gpus if args.gpus is not None else (visible_gpus() if launching else None)
        check(run, config, available_gpus=gpus, check_paths=launching or args.check_paths, gpu_memory=args.gpu_memory_gb)
        if launching:
            check_gpu_packages(config)
    except LaunchError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.show_config:
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(config, resolve=True), end="")
        return 0
    if args.dry_run:
        print(shell_command(run, args.overrides))
        capacity = gpu_memory_gb(run.task.paper, args.gpu_memory_gb)
        with contextlib.suppress(KeyError):  # no architecture known for the model: check() warned
            print("\n".join(projection(config, capacity).report(capacity)))
        return 0
    verl_command, environment = command(run, args.overrides), run_environment(run)
    try:
        with launching_into(run.run_dir, launch_record(run, config, verl_command, environment), config, args.overwrite):
            write_launch_record(run, run.run_dir, config, verl_command, environment)
            print(f"launching {run.name} -> {run.run_dir}", flush=True)
            return subprocess.call(verl_command, env={**os.environ, **environment})
    except LaunchError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


def recipe_table(method: str = "vcpo") -> str:
    """Markdown: the projection of every task recipe × actor strategy for ``method``, on the task's GPU."""
    lines = ["| task | strategy | trainer GPUs (layout) | GPU | plain step | OPOB single | OPOB two_pass | auto runs | fits |",
             "|---|---|---|---|---:|---:|---:|---|---|"]
    for task in load_tasks():
        for strategy in ("fsdp2", "megatron"):
            run = make_run(task, method, strategy=strategy)
            capacity = gpu_memory_gb(run.task.paper)
            projected = projection(compose(run), capacity)
            layout, memory, plain = projected.layout, projected.memory, projected.memory.peak("plain")
            shape = f"TP {layout.tensor_parallel} x PP {layout.pipeline_parallel} x DP {layout.data_parallel}" \
                if strategy == "megatron" else f"FSDP2 over {layout.data_parallel}"
            cells = [f"{memory.peak(mode) / GB:.1f} GB ({memory.peak(mode) / plain:.2f}x)" for mode in OPOB_MODES]
            fits = "yes" if projected.peak() <= capacity * GB else "**no**"
            lines.append(f"| {task} | {strategy} | {shape} | {run.task.paper.get('gpu', '-')} ({capacity:g} GB) | "
                         f"{plain / GB:.1f} GB | {' | '.join(cells)} | {projected.mode} | {fits} |")
    return "\n".join(lines)


def positive(kind: type):
    """An argparse type: a finite number of ``kind`` above 0."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"{text!r}: must be above 0")
        return value

    return parse


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m vcpo.launch", description=__doc__.split("\n\n")[1])
    parser.add_argument("--task", help="a recipes/tasks name (--list shows them)")
    parser.add_argument("--method", help="a recipes/methods name (python -m vcpo.methods list)")
    parser.add_argument("--lag", type=int, help="max policy lag k (default: the task's paper value)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", default="data", help="folder of vcpo.data parquet files (<task>/<split>.parquet)")
    parser.add_argument("--output-dir", default="results/verl", help="runs go to OUT/<task>/<method>/lag<k>/seed<s>")
    parser.add_argument("--gpus", type=positive(int), help="GPUs available (default: those torch sees)")
    parser.add_argument("--gpu-memory-gb", type=positive(float),
                        help="memory of one trainer GPU: a run whose projected actor step exceeds it is refused "
                             f"(default: the task's paper GPU, else {DEFAULT_GPU_MEMORY_GB:g})")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="print the exact command, do not start verl")
    mode.add_argument("--show-config", action="store_true", help="print the resolved verl config as YAML")
    mode.add_argument("--list", action="store_true", help="list the tasks")
    mode.add_argument("--memory-table", action="store_true",
                      help="the projected actor memory per trainer GPU of every task recipe x strategy for vcpo, as markdown")
    parser.add_argument(
        "--check-paths", action="store_true", help="with --dry-run/--show-config: also require data and model files"
    )
    parser.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides (key=value), applied last")
    return parser


if __name__ == "__main__":
    sys.exit(main())
