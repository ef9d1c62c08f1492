"""Method presets: one YAML file per method row in ``recipes/methods`` (schema: ``schema.yaml``).

A preset names the policy loss and its hyper-parameters, the advantage estimator (baseline), the
step-size rule, the learning rate and precision, each with its paper source. A preset may
``extends`` another: every section it lists (``loss``, ``advantage``, ...) overrides the parent's
field by field, and a ``params`` mapping replaces the parent's as a whole. ``default`` is never
inherited: it marks the one preset verl uses for a loss when the config names no method.

``python -m vcpo.methods list`` prints the table.
"""

from vcpo.methods.presets import (
    ADVANTAGE_ESTIMATORS,
    PRECISION_DTYPES,
    VERL_POLICY_LOSSES,
    LossInfo,
    Method,
    aliases,
    check_loss_mode,
    default_method,
    fixed_lag,
    get_method,
    is_synchronous,
    list_methods,
    load_methods,
    loss_info,
    run_lag,
)
from vcpo.methods.step import StepRule, run_rho_on, step_rule

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "PRECISION_DTYPES",
    "VERL_POLICY_LOSSES",
    "LossInfo",
    "Method",
    "StepRule",
    "aliases",
    "check_loss_mode",
    "default_method",
    "fixed_lag",
    "get_method",
    "is_synchronous",
    "list_methods",
    "load_methods",
    "loss_info",
    "run_lag",
    "run_rho_on",
    "step_rule",
]
