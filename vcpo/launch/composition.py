"""A run's overrides resolved by verl's own Hydra config, kept in the cache under the overrides and verl's
config files; the launch record a started run leaves, and the run folder a launch holds."""

from __future__ import annotations

import contextlib
import difflib
import functools
import hashlib
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

from vcpo.launch.checks import gpus_needed
from vcpo.launch.run import LaunchError, Run, config_name
from vcpo.launch.verl_overrides import overrides
from vcpo.locks import FolderInUse, cache_dir, run_folder_lock, write_atomic
from vcpo.runs import (
    METRICS_BEFORE_RESUME,
    METRICS_FILE,
    join_resumed_metrics,
    set_metrics_aside_for_resume,
    verl_checkpointed_step,
)

LAUNCH_RECORD = "launch.json"
# What a launched run leaves in its folder: its launch record, verl's metrics and its checkpoints.
RUN_FILES = (LAUNCH_RECORD, METRICS_FILE, "checkpoints")
OVERWRITE_HELP = ("start over in a folder that holds a run (its launch record, metrics and checkpoints are removed "
                  "first); without it, such a folder is refused unless this launch resumes its run")


def overwriting(command: list[str]) -> list[str]:
    """A ``python -m vcpo.launch.cpu`` command (its Hydra overrides after ``--``) that starts its run over in a folder
    that holds an earlier one: what a benchmark that measures a fresh run, or a driver that trains a killed run again
    from its start, launches."""
    cut = command.index("--") if "--" in command else len(command)
    return [*command[:cut], "--overwrite", *command[cut:]]


def launch_record(run: Run, config, verl_command: list[str], environment: dict[str, str]) -> dict:
    """What starts the run, with the GPUs its composed config holds (the tables cost runs by them, and read a run with
    this record as a verl run). ``task`` is the task that trains; a run whose task is not its recipe's (a pretrained
    model's registered task on CPU) names its task recipe in ``recipe`` (records before it have no ``recipe``)."""
    record = {"task": run.trained_task, **({"recipe": run.task.name} if run.trains else {}), "method": run.method.name,
              "lag": run.lag, "seed": run.seed}
    return record | {"gpus": gpus_needed(config), "command": verl_command, "env": environment}


def write_launch_record(run: Run, run_dir: Path, config, verl_command: list[str], environment: dict[str, str]) -> None:
    """``run_dir/launch.json``: the run's `launch_record`."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    write_atomic(Path(run_dir) / LAUNCH_RECORD, json.dumps(launch_record(run, config, verl_command, environment), indent=2))


@contextlib.contextmanager
def launching_into(run_dir: Path, record: dict, config, overwrite: bool) -> Iterator[int | None]:
    """Hold ``run_dir``'s lock (one launch per folder) for the block, in which the run is launched. A folder that holds
    a run (`RUN_FILES`) is refused in a LaunchError naming it and the remedy, unless it is this ``record``'s run and
    verl resumes it (``config``'s ``trainer.resume_mode`` is not ``disable``): then the metrics of the steps verl does
    not redo are set aside for the block and joined back to the relaunch's after it (`vcpo.runs`); or ``overwrite``:
    then that run's files are removed first. Yields the step of the checkpoint verl resumes from (0: it finds none,
    and starts over), None when the launch starts a run."""
    run_dir = Path(run_dir)
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(run_folder_lock(run_dir))
        except FolderInUse as error:
            raise LaunchError(str(error)) from None
        held = [run_dir / name for name in (*RUN_FILES, METRICS_BEFORE_RESUME) if (run_dir / name).exists()]
        if held and not overwrite and (problem := _not_resumed(run_dir, record, config)) is not None:
            raise LaunchError(f"{run_dir} holds {problem}: pass --overwrite to remove its "
                              f"{', '.join(path.name for path in held)} and start over, or use another folder")
        for path in held if overwrite else []:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
        resumes_from = None
        if held and not overwrite:  # verl resumes the run: the metrics of the steps it does not redo are kept
            resumes_from = resumed_step(config)
            set_metrics_aside_for_resume(run_dir, resumes_from)
            stack.callback(join_resumed_metrics, run_dir)
        yield resumes_from


def resumed_step(config) -> int:
    """The step of the checkpoint verl resumes from under ``config`` (0: none, verl starts over): with
    ``trainer.resume_mode=resume_path`` the one ``trainer.resume_from_path`` names, else the latest in
    ``trainer.default_local_dir``."""
    if config.trainer.resume_mode == "resume_path":
        named = re.search(r"global_step_(\d+)", str(config.trainer.resume_from_path or ""))
        return int(named.group(1)) if named else 0
    return verl_checkpointed_step(config.trainer.default_local_dir)


def _not_resumed(run_dir: Path, record: dict, config) -> str | None:
    """Why launching ``record`` would not resume the run ``run_dir`` holds (None: verl resumes it)."""
    record_file = run_dir / LAUNCH_RECORD
    try:
        earlier = json.loads(record_file.read_text())
    except (OSError, ValueError):  # none, or cut short: whose run it is cannot be told
        earlier = None
    if not isinstance(earlier, dict):
        return "a run without a readable launch record"
    identity = ("task", "method", "lag", "seed")
    if [earlier.get(key) for key in identity] != [record[key] for key in identity]:
        return f"another run ({earlier.get('task')}, {earlier.get('method')} at lag {earlier.get('lag')}, seed {earlier.get('seed')})"
    if earlier != record:
        return "this run launched with other settings"
    if config.trainer.resume_mode == "disable":
        return "this run, which verl would start over (trainer.resume_mode=disable), not resume"
    return None


def verl_config_dir() -> Path:
    import verl

    return Path(verl.__file__).parent / "trainer" / "config"


def compose(run: Run, extra: list[str] | tuple[str, ...] = ()):
    """The fully resolved verl config (an OmegaConf DictConfig, struct mode, as Hydra returns it) of the run,
    from verl's own Hydra config. Hydra reads some 30 YAML files per composition (2-3 s); a workflow's plan
    composes every run, so each composition is kept in the cache under its overrides and verl's config files."""

    requested = overrides(run, extra)
    return _composed(run, requested)


def check_added_keys(config, user_overrides: list[str] | tuple[str, ...]) -> None:
    """A user's ``+key=value`` override adds a key, so a typo of an existing one would run silently unused: one whose
    name is within a typo of a key beside it in the composed ``config`` is refused, naming the key it resembles (the
    project's own added keys, such as ``+ray_kwargs.ray_init.num_gpus``, are not the user's)."""
    from omegaconf import OmegaConf

    for override in user_overrides:
        if not override.startswith("+") or override.startswith("++") or "=" not in override:
            continue
        parent, _, leaf = override[1:].split("=", 1)[0].rpartition(".")
        node = OmegaConf.select(config, parent) if parent else config
        if not OmegaConf.is_dict(node):
            continue
        near = difflib.get_close_matches(leaf, [key for key in node if key != leaf], n=1, cutoff=ADDED_KEY_CUTOFF)
        if near:
            raise LaunchError(f"{override.split('=', 1)[0]}: verl has no such key, but has {parent + '.' if parent else ''}"
                              f"{near[0]} (a '+' adds a new key, which verl would not read)")


ADDED_KEY_CUTOFF = 0.85  # difflib's ratio: total_trainng_steps / total_training_steps is 0.97


def _composed(run: Run, requested: list[str]):
    from omegaconf import OmegaConf  # with verl's Hydra config, where a run is composed

    cached = composed_cache_file([config_name(run), *requested])
    if cached.exists():
        try:
            config = OmegaConf.create(json.loads(cached.read_text()))
        except ValueError:  # a damaged cache entry (a truncated write by hand, a full disk): composed again below
            pass
        else:
            OmegaConf.set_struct(config, True)
            return config
    config = _hydra_compose(requested, config_name(run))
    cached.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(cached, json.dumps(OmegaConf.to_container(config, resolve=False)))
    return config


def composed_cache_file(requested: list[str]) -> Path:
    """Where the composition of ``requested`` is kept: named by the overrides and by verl's version and config
    files (path, size, modification time), so that a changed verl composes anew."""
    key = hashlib.sha256(json.dumps([verl_configs_fingerprint(verl_config_dir()), requested]).encode()).hexdigest()[:32]
    return cache_dir() / "verl-configs" / f"{key}.json"


@functools.lru_cache(maxsize=4)
def verl_configs_fingerprint(folder: Path) -> list:
    import verl

    return [verl.__version__, sorted((str(path.relative_to(folder)), path.stat().st_size, path.stat().st_mtime_ns)
                                     for path in folder.rglob("*.yaml"))]


def _hydra_compose(requested: list[str], name: str):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(verl_config_dir()), version_base=None):
            return hydra_compose(config_name=name, overrides=requested)
    except (HydraException, OmegaConfBaseException) as error:
        raise LaunchError(f"verl's Hydra config rejects the overrides: {error}") from None


