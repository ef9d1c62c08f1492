"""Recipes as data: folders of YAML files, each validated by the folder's ``schema.yaml``.

A recipe may ``extends`` another of its folder: every mapping it lists overrides the parent's field by
field (one level deep), any other value replaces the parent's. ``default`` and ``extends`` are never
inherited. A recipe with ``alias_of`` (and only ``name``, ``title``, ``source`` beside it) is another
name for a recipe of its folder: it resolves to that recipe, under that recipe's name. ``recipes/methods`` (`vcpo.methods`) and ``recipes/tasks`` (`load_tasks`, read by the launcher, the
data builder and the workflow) are read this way. ``run_path`` is the one layout of run folders.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import yaml

NOT_INHERITED = ("default", "extends")
ALIAS_KEYS = {"name", "alias_of", "title", "source"}


def recipes_dir() -> Path:
    """``recipes/`` of the checkout, or the copy a wheel carries as ``vcpo/_recipes``."""
    here = Path(__file__).resolve()
    for candidate in (here.parent / "_recipes", here.parents[1] / "recipes"):
        if (candidate / "methods").is_dir():
            return candidate
    raise FileNotFoundError(f"no recipes/methods folder beside the vcpo package ({here.parents[1]})")


def read_yaml(path: Path) -> dict[str, Any]:
    with open(path) as f:
        data = yaml.safe_load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a recipe must be a mapping")
    return data


@functools.cache
def optimizer_table() -> dict[str, Any]:
    """VCPO Table 2 (``recipes/optimizer.yaml``): the optimizer settings both backends train with."""
    return read_yaml(recipes_dir() / "optimizer.yaml")


def hydra_value(value: Any) -> str:
    """A recipe value as a Hydra override value: lists and dicts in Hydra's grammar, None as null."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_value(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{key}:{hydra_value(item)}" for key, item in value.items()) + "}"
    return str(value)


def megatron_local_layers() -> dict[str, Any]:
    """What OPOB trains with on Megatron (``recipes/megatron.yaml``, ``local_layers``): megatron keys, transformer-config
    keys and other verl settings."""
    return read_yaml(recipes_dir() / "megatron.yaml")["local_layers"]


def megatron_local_layer_overrides() -> list[str]:
    """`megatron_local_layers` as verl Hydra overrides (the transformer-config keys are new to verl's struct: ``++``)."""
    recipe, megatron = megatron_local_layers(), "actor_rollout_ref.actor.megatron"
    return [*(f"{megatron}.{key}={hydra_value(value)}" for key, value in recipe["megatron"].items()),
            *(f"++{megatron}.override_transformer_config.{key}={hydra_value(value)}"
              for key, value in recipe["override_transformer_config"].items()),
            *(f"{key}={hydra_value(value)}" for key, value in recipe["settings"].items())]


def _merge(parent: dict[str, Any], child: dict[str, Any]) -> dict[str, Any]:
    merged = {key: value for key, value in parent.items() if key not in NOT_INHERITED}
    for key, value in child.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def _resolve(name: str, raw: dict[str, dict[str, Any]], chain: tuple[str, ...] = ()) -> dict[str, Any]:
    if name in chain:
        raise ValueError(f"recipes extend each other in a cycle: {' -> '.join((*chain, name))}")
    spec = raw[name]
    parent = spec.get("extends")
    if parent is None:
        return spec
    if parent not in raw:
        raise ValueError(f"{name}.yaml extends unknown recipe {parent!r}")
    return _merge(_resolve(parent, raw, (*chain, name)), spec)


def validate(spec: dict[str, Any], schema: dict[str, Any], path: Path) -> None:
    """jsonschema validation with the failing key path in the message."""
    try:
        jsonschema.validate(spec, schema)
    except jsonschema.ValidationError as error:
        location = "/".join(str(part) for part in error.absolute_path) or "<top>"
        raise ValueError(f"{path}: {location}: {error.message}") from None


def load_folder(directory: Path) -> dict[str, tuple[Path, dict[str, Any]]]:
    """Every ``<name>.yaml`` of ``directory`` resolved and schema-checked: name -> (path, spec)."""
    schema = read_yaml(directory / "schema.yaml")
    paths = {path.stem: path for path in sorted(directory.glob("*.yaml")) if path.stem != "schema"}
    raw = {stem: read_yaml(path) for stem, path in paths.items()}
    resolved = {}
    for stem, path in paths.items():
        if raw[stem].get("name") != stem:
            raise ValueError(f"{path}: name {raw[stem].get('name')!r} must equal the file name {stem!r}")
        if "alias_of" in raw[stem]:
            continue
        spec = _resolve(stem, raw)
        validate(spec, schema, path)
        resolved[stem] = (path, spec)
    for stem, path in paths.items():
        target = raw[stem].get("alias_of")
        if target is None:
            continue
        if set(raw[stem]) - ALIAS_KEYS:
            raise ValueError(f"{path}: an alias holds only {sorted(ALIAS_KEYS)}, not {sorted(set(raw[stem]) - ALIAS_KEYS)}")
        if target not in resolved:
            raise ValueError(f"{path}: alias_of {target!r} is not a recipe of {directory} (nor may it be an alias)")
        resolved[stem] = resolved[target]
    return resolved


@dataclass(frozen=True)
class TaskRecipe:
    """A resolved, schema-checked task recipe (``spec`` is the merged YAML mapping)."""

    name: str
    path: Path
    spec: dict[str, Any]

    @property
    def paper(self) -> dict[str, Any]:
        return self.spec["paper"]

    @property
    def chosen(self) -> dict[str, Any]:
        return {key: entry["value"] for key, entry in self.spec["chosen"].items()}

    @property
    def paper_lag(self) -> int:
        """The paper's policy lag k of the task (``paper.max_lag``: Tables 3-5, Table 1's async row)."""
        return int(self.paper["max_lag"])

    @property
    def multi_turn(self) -> bool:
        return "max_turns" in self.paper

    @property
    def benchmarks(self) -> list[str]:
        """The benchmarks (``recipes/benchmarks.yaml``) the paper scores the task's final checkpoints on."""
        return list(self.spec["benchmarks"])

    def stand_in(self, where: str) -> str:
        """The task that trains in this one's place ``where``: ``sim`` (a ``vcpo.sim`` task) or ``verl_cpu`` (a task
        recipe whose data builds offline, for verl's trainer on CPU)."""
        try:
            return self.spec["stand_in"][where]
        except KeyError:
            known = ", ".join(f"{key}: {value}" for key, value in self.spec["stand_in"].items())
            raise ValueError(f"task {self.name!r} has no {where} stand-in ({self.path.name} stand_in: {known})") from None


@functools.cache
def load_tasks() -> dict[str, TaskRecipe]:
    """Every task recipe of ``recipes/tasks``, by name."""
    return {name: TaskRecipe(name, path, spec) for name, (path, spec) in load_folder(recipes_dir() / "tasks").items()}


def run_path(task: str, method: str, lag: int | str | None, seed: int | str) -> Path:
    """A run's folder below a runs root, the one layout of every runner: ``<task>/<method>/lag<k>/seed<s>`` for
    vcpo.sim sweeps, vcpo.launch and the workflow; a study's arm (a method with settings of its own, such as a rate
    and a lag, named for them) stands in place of the method and its lag: ``<task>/<arm>/seed<s>`` (``lag=None``).
    String arguments make patterns: ``"*"`` a glob, ``"{seed}"`` a Snakemake wildcard."""
    return Path(task) / method / (f"lag{lag}" if lag is not None else "") / f"seed{seed}"


def base_path(task: str) -> Path:
    """Where a task's base-model evaluation lives below a runs root (``<base_path>/eval/summary.json``,
    python -m vcpo.evaluation's layout): beside the task's methods, a folder no method is named after."""
    return Path(task) / "base"
