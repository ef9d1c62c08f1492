"""What a preset's optimizer step needs beyond ``loss.backward()`` (``StepRule``): the ESS step size and the
single-backward OPOB update, derived from the preset alone."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from vcpo.core import OpobCoefficients, ess_step_scale, group_reward_std, opob_baseline, opob_coefficients
from vcpo.core.baselines import OFFICIAL_OPOB_AGG
from vcpo.core.ess import DEFAULT_CLAMP, DEFAULT_RHO_ON, DEFAULT_STEP_SIZE_RULE
from vcpo.core.registry import POLICY_LOSSES
from vcpo.methods.presets import Method, get_method


@dataclass(frozen=True)
class StepRule:
    """What a preset's optimizer step needs beyond ``loss.backward()``, for every backend: the ESS step
    size (docs/ALGORITHMS.md §2) and the single-backward OPOB update (§3-§4). Derived from the preset
    only (``step_rule``); a backend calls these methods and keeps its own plumbing."""

    method: str
    loss_name: str
    agg: str
    loss_params: dict[str, Any]
    ess: bool = False
    rho_on: float = DEFAULT_RHO_ON
    form: str = DEFAULT_STEP_SIZE_RULE
    clamp: bool = DEFAULT_CLAMP
    opob: bool = False
    scope: str = "group"
    variant: str = "paper"
    norm_by_std: bool = True

    def __post_init__(self):
        if self.opob and self.variant == "official" and self.agg != OFFICIAL_OPOB_AGG:
            raise ValueError(
                f"method {self.method!r}: the official OPOB variant reproduces the release's norm, which is defined "
                f"for loss_agg_mode {OFFICIAL_OPOB_AGG!r} (its scripts' mode), not for {self.agg!r}"
            )

    @property
    def active(self) -> bool:
        """The step differs from a plain optimizer step on the loss's gradient."""
        return self.ess or self.opob

    @property
    def strategies(self) -> tuple[str, ...]:
        """verl actor strategies on which the vcpo engine applies this rule, the first the one vcpo.launch
        sets: OPOB writes each module's per-sequence gradient into its parameter's gradient, which FSDP1's
        flat parameters do not expose (fsdp2 and megatron); the ESS step size touches only log-probs and the
        learning rate (every strategy)."""
        return ("fsdp2", "megatron") if self.opob else ("fsdp2", "fsdp", "megatron")

    @property
    def needs(self) -> str:
        """What the step needs beyond a backward pass, in words (for error messages)."""
        return " and ".join(name for name, used in (("the ESS step size", self.ess), ("OPOB", self.opob)) if used)

    def with_rho_on(self, rho_on: float | None) -> StepRule:
        """The rule with a task's ρ_on (multi-turn tasks set their own, VCPO Table 5); None keeps the preset's.
        ρ_on is an ESS ratio at which the step is full size: it must be a positive number (ValueError)."""
        if rho_on is None:
            return self
        if isinstance(rho_on, bool) or not isinstance(rho_on, (int, float)) or not rho_on > 0 or rho_on == float("inf"):
            raise ValueError(f"rho_on must be a positive finite number (an ESS ratio), got {rho_on!r}")
        return dataclasses.replace(self, rho_on=float(rho_on))

    def lr_scale(self, ess_ratio: float) -> float:
        """The learning-rate multiplier of this step: the ESS rule's, 1 for a constant step size."""
        return ess_step_scale(ess_ratio, self.rho_on, self.form, self.clamp) if self.ess else 1.0

    def reward_std(self, rewards: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        """σ_i dividing R_i - b_i: the group's reward std under norm_by_std, else 1 (float64)."""
        if self.norm_by_std:
            return group_reward_std(rewards, groups)
        return torch.ones(rewards.shape[0], dtype=torch.float64, device=rewards.device)

    def coefficients(self, log_prob, behav_log_prob, mask, rewards, reward_std, normaliser: float) -> OpobCoefficients:
        """OPOB's c^R and c^S for these sequences, with the loss's own weight (``vcpo.core.opob_coefficients``)."""
        loss = POLICY_LOSSES[self.loss_name]
        return opob_coefficients(
            log_prob, behav_log_prob, mask, rewards, reward_std, normaliser,
            level=loss.level, bound=loss.bound, lo=self.loss_params["lo"], hi=self.loss_params["hi"],
        )

    def baseline(self, rewards, grad_sq_norms, seq_log_weights, groups, lengths) -> torch.Tensor:
        """b* (VCPO Eq. 7) per group (scope group: pass the labels) or over the batch (groups None);
        ``lengths`` (response tokens per sequence) enter the official variant only."""
        official = self.variant == "official"
        return opob_baseline(
            rewards.double(), grad_sq_norms, seq_log_weights.double(), groups,
            variant=self.variant, tis_cap=self.loss_params.get("hi") if official else None,
            lengths=lengths if official else None,
        )


def step_rule(method: Method | str) -> StepRule:
    """The optimizer-step rule a preset asks for (its OPOB admissibility is checked when presets load)."""
    method = get_method(method) if isinstance(method, str) else method
    spec = method.spec
    step, advantage = spec["step_size"], spec["advantage"]
    step_params, adv_params = step.get("params", {}) or {}, advantage["params"]
    given = {key: step_params[key] for key in ("rho_on", "form", "clamp") if key in step_params}
    given |= {key: adv_params[key] for key in ("scope", "variant", "norm_by_std") if key in adv_params}
    return StepRule(  # what the preset does not state takes StepRule's defaults
        method=method.name,
        loss_name=method.loss_name,
        agg=spec["loss"]["agg"],
        loss_params=method.loss_params,
        ess=step["rule"] == "ess",
        opob=advantage["estimator"] == "opob",
        **given,
    )


def run_rho_on(explicit: float | None, task_paper: dict[str, Any]) -> float | None:
    """The on-policy ESS ratio a run gives its ESS rule over its preset's (None: the preset's own): an
    explicit setting, else its task's paper value (VCPO Table 5: 0.55 for multi-turn)."""
    return explicit if explicit is not None else task_paper.get("rho_on")
