"""The method presets: one YAML file per method row in ``recipes/methods`` (schema: ``schema.yaml``), read,
resolved and checked (``get_method``, ``list_methods``), and the policy lag a preset fixes (``run_lag``)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vcpo.core.aggregation import OPOB_AGGREGATIONS
from vcpo.core.baselines import OPOB_WEIGHT_LEVELS
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
    if advantage["estimator"] == "opob":
        _check_opob(spec, path)


OPOB_SCOPES = ("group", "batch")


def _check_opob(spec: dict[str, Any], path: Path) -> None:
    """What the single-backward OPOB update can form (docs/ALGORITHMS.md §4): Σ_i c_i ∇l_i needs one weight
    per sequence from a plain TIS / MIS loss and a loss aggregation with one batch-wide normaliser."""
    loss, scope = spec["loss"], spec["advantage"]["params"]["scope"]
    registered = POLICY_LOSSES.get(loss["name"])
    if registered is None or registered.level not in OPOB_WEIGHT_LEVELS:
        admitted = sorted(name for name, entry in POLICY_LOSSES.items() if entry.level in OPOB_WEIGHT_LEVELS)
        raise ValueError(
            f"{path}: OPOB combines per-sequence gradients with one weight per sequence; loss {loss['name']!r} "
            f"does not give one. OPOB losses: {admitted}"
        )
    if loss["agg"] not in OPOB_AGGREGATIONS:
        raise ValueError(f"{path}: OPOB supports the loss aggregations {OPOB_AGGREGATIONS}, got agg {loss['agg']!r}")
    if scope not in OPOB_SCOPES:
        raise ValueError(f"{path}: OPOB scope must be one of {OPOB_SCOPES}, got {scope!r}")


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


# A preset's ``precision`` (recipes/methods/schema.yaml) as a torch dtype name.
PRECISION_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
# A preset's ``advantage.estimator`` (schema.yaml): verl's GRPO and OTB estimators, or OPOB (vcpo.core).
ADVANTAGE_ESTIMATORS = ("grpo", "opob", "optimal_token_baseline")


def fixed_lag(method: str) -> int | None:
    """The policy lag ``method``'s preset fixes (``max_lag``: 0 for the synchronous oracle), else None."""
    return get_method(method).spec.get("max_lag")


def run_lag(method: str, asked: int | None = None, default: int = 0, steps: int | None = None) -> int:
    """The policy lag a run of ``method`` has and is filed under (every backend's rule): the lag its preset fixes,
    which refuses any other lag asked for explicitly; else ``asked``; else ``default`` (a config file's, a
    task's, a study's). Raises ValueError for a lag below 0, or above ``steps`` (when given), which a run of that
    length cannot reach."""
    fixed = fixed_lag(method)
    if fixed is not None and asked is not None and asked != fixed:
        raise ValueError(f"method {method!r} fixes the policy lag to {fixed} (max_lag in its preset), got {asked}")
    lag = fixed if fixed is not None else (default if asked is None else asked)
    if lag < 0:
        raise ValueError(f"the policy lag must be >= 0, got {lag}")
    if steps is not None and lag > steps:
        raise ValueError(f"a lag of {lag} cannot be reached in a run of {steps} steps (the bound: lag <= steps)")
    return lag


def is_synchronous(method: str) -> bool:
    """A preset that fixes the policy lag to 0 (the synchronous oracle), whatever its name."""
    return fixed_lag(method) == 0


def check_loss_mode(method: str, loss_mode: str) -> None:
    """A preset names the loss it parameterises: pairing it with another ``loss_mode`` would train another
    method under its name. Raises ValueError."""
    loss_name = get_method(method).loss_name
    if loss_mode != loss_name:
        raise ValueError(f"policy_loss.method={method!r} is a preset of loss {loss_name!r}, not of loss_mode {loss_mode!r}")


def default_method(loss_name: str) -> Method:
    """The preset whose values a loss uses when the config names no method."""
    for method in _methods().values():
        if method.loss_name == loss_name and method.is_default:
            return method
    raise ValueError(f"no default preset for loss {loss_name!r}; losses with presets: {sorted(POLICY_LOSSES)}")


def list_methods() -> list[Method]:
    """Every preset once (aliases not repeated)."""
    return [method for name, method in _methods().items() if name == method.name]
