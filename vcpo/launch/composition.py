"""A run's overrides resolved by verl's own Hydra config, kept in the cache under the overrides and verl's
config files; the launch record a started run leaves."""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

from vcpo.launch.checks import gpus_needed
from vcpo.launch.run import LaunchError, Run, config_name
from vcpo.launch.verl_overrides import overrides
from vcpo.locks import cache_dir, write_atomic


def write_launch_record(run: Run, run_dir: Path, config, verl_command: list[str], environment: dict[str, str]) -> None:
    """``run_dir/launch.json``: what started the run, with the GPUs its composed config holds (the tables
    cost runs by them, and read a run with this file as a verl run)."""
    record = {"task": run.task.name, "method": run.method.name, "lag": run.lag, "seed": run.seed}
    record |= {"gpus": gpus_needed(config), "command": verl_command, "env": environment}
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / "launch.json").write_text(json.dumps(record, indent=2))


def verl_config_dir() -> Path:
    import verl

    return Path(verl.__file__).parent / "trainer" / "config"


def compose(run: Run, extra: list[str] | tuple[str, ...] = ()):
    """The fully resolved verl config (an OmegaConf DictConfig, struct mode, as Hydra returns it) of the run,
    from verl's own Hydra config. Hydra reads some 30 YAML files per composition (2-3 s); a workflow's plan
    composes every run, so each composition is kept in the cache under its overrides and verl's config files."""
    from omegaconf import OmegaConf

    requested = overrides(run, extra)
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


