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

from vcpo.core.aggregation import OPOB_AGG_MODES
from vcpo.core.registry import POLICY_LOSSES
from vcpo.recipes import load_folder, recipes_dir


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


def _check_method(spec: dict[str, Any], path: Path) -> None:
    loss = spec["loss"]
    try:
        info = loss_info(loss["name"])
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None
    _check_params(f"{path}: loss {loss['name']}", loss["params"], info.params)
    advantage = spec["advantage"]
    _check_params(f"{path}: advantage {advantage['estimator']}", advantage["params"], ADVANTAGE_PARAMS[advantage["estimator"]])
    if advantage["estimator"] == "opob" and loss["agg"] not in OPOB_AGG_MODES:
        raise ValueError(f"{path}: OPOB supports the loss aggregations {OPOB_AGG_MODES}, got agg {loss['agg']!r}")


def load_methods(directory: Path | None = None) -> dict[str, Method]:
    """Read, resolve and validate every preset in ``directory`` (default: ``recipes/methods``)."""
    directory = Path(directory) if directory is not None else recipes_dir() / "methods"
    methods: dict[str, Method] = {}
    folder = load_folder(directory)
    for name, (path, spec) in folder.items():
        if spec["name"] == name:
            _check_method(spec, path)
            methods[name] = Method(name, spec)
    _check_defaults(methods)
    # an alias (alias_of) names the same Method: the same runs, whichever name trains them
    return {name: methods[spec["name"]] for name, (_, spec) in folder.items()}


def aliases() -> dict[str, str]:
    """Alias name -> the preset it names."""
    return {name: method.name for name, method in _methods().items() if name != method.name}


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


def filed_lag(method: str, lag: int) -> int:
    """The policy lag a run of ``method`` has and is filed under: the one its preset fixes (``max_lag``:
    0 for the synchronous preset), else ``lag``."""
    fixed = get_method(method).spec.get("max_lag")
    return lag if fixed is None else fixed


def is_synchronous(method: str) -> bool:
    """A preset that fixes the policy lag to 0 (the synchronous oracle), whatever its name."""
    return get_method(method).spec.get("max_lag") == 0


def default_method(loss_name: str) -> Method:
    """The preset whose values a loss uses when the config names no method."""
    for method in _methods().values():
        if method.loss_name == loss_name and method.is_default:
            return method
    raise ValueError(f"no default preset for loss {loss_name!r}; losses with presets: {sorted(POLICY_LOSSES)}")


def list_methods() -> list[Method]:
    """Every preset once (aliases not repeated)."""
    return [method for name, method in _methods().items() if name == method.name]
