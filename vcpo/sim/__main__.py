"""Command line of the simulator.

    python -m vcpo.sim train --task countdown --method vcpo --lag 12 --seed 0 --steps 200 --out runs/x [key=value ...]
    python -m vcpo.sim sweep --task countdown --methods sync,seq_tis_c8,vcpo --lags 12 --seeds 0,1,2 --out runs [--jobs 2]
    python -m vcpo.sim train --config recipes/sim/regime.yaml --method vcpo --seed 0 --out runs/x [key=value ...]
    python -m vcpo.sim keys        # every configuration key with its default

Trailing ``key=value`` arguments set any field of ``vcpo.sim.config.SimConfig`` (``lag_model=fixed``,
``max_turns=3``, ``rollout_dtype=preset``, ...). ``--config FILE`` reads a YAML mapping of the same keys
first; flags and ``key=value`` arguments override it, and the run's ``config.json`` records the file
(``config_file``). Every configuration is checked before any work starts.
A sweep (``vcpo.sim.sweep``) writes each run to ``OUT/<task>/<method>/lag<k>/seed<s>/``, skips runs that
finished, and has Snakemake run the others, ``--jobs`` at a time.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from vcpo.cli import output_folder_problem, snakemake_state_problem
from vcpo.lifetimes import die_with_the_named_runner
from vcpo.locks import FolderInUse
from vcpo.runs import TRAIN_LOG
from vcpo.sim.config import ConfigError, SimConfig, apply_overrides, start_config
from vcpo.sim.sweep import run_sweep, sweep_configs
from vcpo.sim.validation import check_settings, default_lag

COMMON = ("task", "method", "lag", "seed", "steps", "lag_model", "out")


def _config(args: argparse.Namespace, overrides: list[str]) -> SimConfig:
    given = {key: getattr(args, key) for key in COMMON if getattr(args, key, None) is not None}
    config = apply_overrides(apply_overrides(start_config(args.config), given), overrides)
    lag_given = "lag" in given or any(item.split("=", 1)[0] == "lag" for item in overrides)
    # a config file's lag is for the lagged methods; a preset that fixes its lag (sync) keeps its own,
    # and a lag asked for on the command line that it cannot honour is refused; what the settings name on the
    # disk is checked (and read) once, by the trainer's validation.resolve
    return check_settings(config if lag_given else dataclasses.replace(config, lag=default_lag(config.method, config.lag)))


def _csv(kind):
    return lambda text: [kind(item) for item in text.split(",") if item]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vcpo.sim", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="one run")
    train.add_argument("--task")
    train.add_argument("--method")
    train.add_argument("--lag", type=int)
    train.add_argument("--lag-model", dest="lag_model")
    train.add_argument("--seed", type=int)
    train.add_argument("--steps", type=int)
    train.add_argument("--out")
    train.add_argument("--config", help="YAML file of configuration keys (flags and key=value override it)")
    sweep = commands.add_parser("sweep", help="methods x lags x seeds")
    sweep.add_argument("--config", help="YAML file of configuration keys (flags and key=value override it)")
    sweep.add_argument("--task")
    sweep.add_argument("--methods", type=_csv(str), required=True)
    sweep.add_argument("--lags", type=_csv(int), required=True)
    sweep.add_argument("--seeds", type=_csv(int), default=[0])
    sweep.add_argument("--lag-model", dest="lag_model")
    sweep.add_argument("--steps", type=int)
    sweep.add_argument("--out", type=Path, required=True)
    sweep.add_argument("--jobs", type=int, default=1, help="runs in parallel (each with the config's threads, default one)")
    commands.add_parser("keys", help="list configuration keys and defaults")
    args, overrides = parser.parse_known_args(argv)
    unknown_flags = [item for item in overrides if item.startswith("--")]
    if unknown_flags:
        parser.error(f"unknown option(s) {unknown_flags}; configuration keys are set as key=value")

    try:
        if args.command == "keys":
            for field in dataclasses.fields(SimConfig):
                print(f"{field.name:24s} {getattr(SimConfig(), field.name)!r}")
            return 0
        if args.command == "train":
            # the trainer (transformers, the generator process) only for a run: keys and sweep start at once
            from vcpo.sim.concurrent import GeneratorDied
            from vcpo.sim.train import Trainer

            die_with_the_named_runner()  # a study's runner, however many processes lie between
            trainer = Trainer(_config(args, overrides))
            try:
                print(trainer.run())
            except KeyboardInterrupt:
                print(f"interrupted at step {trainer.step} of {trainer.config.steps} (last checkpoint: step "
                      f"{trainer.folder.checkpointed_step}); the same command resumes it", file=sys.stderr)
                return 130
            except GeneratorDied as died:
                print(f"error: {died} (last checkpoint: step {trainer.folder.checkpointed_step}); the same command resumes it",
                      file=sys.stderr)
                return 1
            return 0
        if args.jobs < 1:
            parser.error(f"--jobs {args.jobs}: must be >= 1")
        if problem := output_folder_problem(args.out):
            raise ConfigError(f"--out {args.out}: {problem}")
        if problem := snakemake_state_problem():
            raise ConfigError(problem)
        configs = sweep_configs(args.config, overrides, args.methods, args.lags, args.seeds, args.out,
                                task=args.task, lag_model=args.lag_model, steps=args.steps)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        failed = run_sweep(configs, args.out, args.jobs)
    except FolderInUse as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for out in failed:
        print(f"failed: {out} (see {out / TRAIN_LOG})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
