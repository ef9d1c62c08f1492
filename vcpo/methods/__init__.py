"""Method presets: one YAML file per method row in ``recipes/methods`` (schema: ``schema.yaml``).

A preset names the policy loss and its hyper-parameters, the advantage estimator (baseline), the
step-size rule, the learning rate and precision, each with its paper source. A preset may
``extends`` another: every section it lists (``loss``, ``advantage``, ...) overrides the parent's
field by field, and a ``params`` mapping replaces the parent's as a whole. ``default`` is never
inherited: it marks the one preset verl uses for a loss when the config names no method.

``python -m vcpo.methods list`` prints the table.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from vcpo.core.registry import POLICY_LOSSES


@dataclass(frozen=True)
class LossInfo:
    """What a preset needs of a loss: its hyper-parameter names and the weight or mask it applies."""

    params: tuple[str, ...]
    weight: str


# verl's own losses used by presets; their hyper-parameters are verl ActorConfig fields.
VERL_POLICY_LOSSES: dict[str, LossInfo] = {
    "vanilla": LossInfo(("clip_ratio_low", "clip_ratio_high"), "PPO clip of the token ratio to [1-low, 1+high]"),
    "gspo": LossInfo(("clip_ratio_low", "clip_ratio_high"), "geometric sequence ratio, sequence-level PPO clip"),
    "cispo": LossInfo(("clip_ratio_low", "clip_ratio_high"), "token ratio clipped to [1-low, 1+high] as sg weight"),
    "sapo": LossInfo(("tau_pos", "tau_neg"), "sigmoid soft gate of the token ratio"),
}
ADVANTAGE_PARAMS: dict[str, tuple[str, ...]] = {
    "grpo": ("norm_by_std",),
    "opob": ("scope", "variant", "norm_by_std"),
    "optimal_token_baseline": (),
}
NOT_INHERITED = ("default", "extends")


@dataclass(frozen=True)
class Method:
    """A resolved, validated preset (``spec`` is the merged YAML mapping)."""

    name: str
    spec: dict[str, Any]

    @property
    def loss_name(self) -> str:
        return self.spec["loss"]["name"]

    @property
    def loss_params(self) -> dict[str, Any]:
        return dict(self.spec["loss"]["params"])

    @property
    def is_default(self) -> bool:
        return bool(self.spec.get("default", False))


def recipes_dir() -> Path:
    """``recipes/`` of the checkout, or the copy a wheel carries as ``vcpo/_recipes``."""
    here = Path(__file__).resolve()
    for candidate in (here.parents[1] / "_recipes", here.parents[2] / "recipes"):
        if (candidate / "methods").is_dir():
            return candidate
    raise FileNotFoundError(f"no recipes/methods folder beside the vcpo package ({here.parents[2]})")


def _read_yaml(path: Path) -> dict[str, Any]:
    with open(path) as f:
        data = yaml.safe_load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a method preset must be a mapping")
    return data


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
        raise ValueError(f"method presets extend each other in a cycle: {' -> '.join((*chain, name))}")
    spec = raw[name]
    parent = spec.get("extends")
    if parent is None:
        return spec
    if parent not in raw:
        raise ValueError(f"{name}.yaml extends unknown method {parent!r}")
    return _merge(_resolve(parent, raw, (*chain, name)), spec)


def loss_info(name: str) -> LossInfo:
    """Parameters and weight description of a loss, from the core registry or verl's table."""
    if name in POLICY_LOSSES:
        return LossInfo(POLICY_LOSSES[name].params, POLICY_LOSSES[name].weight)
    if name in VERL_POLICY_LOSSES:
        return VERL_POLICY_LOSSES[name]
    raise ValueError(f"unknown loss {name!r}; known: {sorted({*POLICY_LOSSES, *VERL_POLICY_LOSSES})}")


def _check_params(where: str, given: dict[str, Any], expected: tuple[str, ...]) -> None:
    missing, unknown = set(expected) - set(given), set(given) - set(expected)
    if missing or unknown:
        raise ValueError(f"{where}: missing parameters {sorted(missing)}, unknown parameters {sorted(unknown)}")


def _validate(spec: dict[str, Any], schema: dict[str, Any], path: Path) -> None:
    try:
        jsonschema.validate(spec, schema)
    except jsonschema.ValidationError as error:
        location = "/".join(str(part) for part in error.absolute_path) or "<top>"
        raise ValueError(f"{path}: {location}: {error.message}") from None
    loss = spec["loss"]
    try:
        info = loss_info(loss["name"])
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None
    _check_params(f"{path}: loss {loss['name']}", loss["params"], info.params)
    advantage = spec["advantage"]
    _check_params(f"{path}: advantage {advantage['estimator']}", advantage["params"], ADVANTAGE_PARAMS[advantage["estimator"]])


def load_methods(directory: Path | None = None) -> dict[str, Method]:
    """Read, resolve and validate every preset in ``directory`` (default: ``recipes/methods``)."""
    directory = Path(directory) if directory is not None else recipes_dir() / "methods"
    schema = _read_yaml(directory / "schema.yaml")
    paths = {path.stem: path for path in sorted(directory.glob("*.yaml")) if path.stem != "schema"}
    raw = {stem: _read_yaml(path) for stem, path in paths.items()}
    methods = {}
    for stem, path in paths.items():
        if raw[stem].get("name") != stem:
            raise ValueError(f"{path}: name {raw[stem].get('name')!r} must equal the file name {stem!r}")
        spec = _resolve(stem, raw)
        _validate(spec, schema, path)
        methods[stem] = Method(stem, spec)
    _check_defaults(methods)
    return methods


def _check_defaults(methods: dict[str, Method]) -> None:
    for loss in POLICY_LOSSES:
        defaults = [m.name for m in methods.values() if m.loss_name == loss and m.is_default]
        if len(defaults) != 1:
            raise ValueError(f"loss {loss!r} needs exactly one preset with `default: true`, found {defaults}")


@functools.cache
def _methods() -> dict[str, Method]:
    return load_methods()


def get_method(name: str) -> Method:
    methods = _methods()
    if name not in methods:
        raise ValueError(f"unknown method {name!r}; known: {sorted(methods)}")
    return methods[name]


def default_method(loss_name: str) -> Method:
    """The preset whose values a loss uses when the config names no method."""
    for method in _methods().values():
        if method.loss_name == loss_name and method.is_default:
            return method
    raise ValueError(f"no default preset for loss {loss_name!r}; losses with presets: {sorted(POLICY_LOSSES)}")


def list_methods() -> list[Method]:
    return list(_methods().values())
