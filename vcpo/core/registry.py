"""Named policy losses of ``vcpo.core``: the names verl and the simulator look losses up by.

Each entry binds a core function to the structural choices that define the method and lists the
hyper-parameters a method preset (``recipes/methods/*.yaml``) must state; their values live only in
the presets, never here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from vcpo.core import losses


@dataclass(frozen=True)
class PolicyLoss:
    name: str
    fn: Callable[..., losses.LossOutput]
    params: tuple[str, ...]
    weight: str  # the weight / mask it applies, one line for `python -m vcpo.methods list`
    # The loss also takes the proximal log-probs l^prox (keyword ``prox_log_prob``, (B, T)): the policy
    # at the start of the optimizer epoch. verl passes them as ``old_log_prob`` (see vcpo.verl_plugin).
    needs_prox: bool = False
    # An importance-sampling loss whose whole weight is ``importance_weights(level, bound, lo, hi)``
    # (the plain TIS / MIS losses; None for every other loss): what OPOB's coefficients reuse.
    level: str | None = None
    bound: str | None = None


def _is_loss(name: str, level: str, bound: str, ratio: str) -> PolicyLoss:
    verb = "truncated to" if bound == "truncate" else "masked outside"
    return PolicyLoss(
        name=name,
        fn=partial(losses.reinforce_is_loss, level=level, bound=bound),
        params=("lo", "hi"),
        weight=f"{ratio} {verb} [lo, hi]",
        level=level,
        bound=bound,
    )


_LOSSES = [
    _is_loss("seq_tis", "sequence", "truncate", "sequence ratio exp(s_i)"),
    _is_loss("token_tis", "token", "truncate", "token ratio exp(r_t)"),
    _is_loss("geo_tis", "geometric", "truncate", "geometric ratio exp(s_i/T_i)"),
    _is_loss("seq_mis", "sequence", "mask", "sequence ratio exp(s_i)"),
    _is_loss("token_mis", "token", "mask", "token ratio exp(r_t)"),
    _is_loss("geo_mis", "geometric", "mask", "geometric ratio exp(s_i/T_i)"),
    PolicyLoss(
        "dsv32_mis",
        partial(losses.reinforce_is_loss, level="geometric", bound="mask"),
        ("lo", "hi", "negative_delta"),
        "geometric ratio masked outside [lo, hi]; drop A_i<0 sequences with mean(l^mu - l^theta) > delta",
    ),
    PolicyLoss("m2po", losses.m2po_loss, ("threshold",), "token ratio on the largest token set with mean r^2 <= threshold"),
    PolicyLoss(
        "vespo",
        losses.vespo_loss,
        ("k_pos", "lam_pos", "k_neg", "lam_neg", "log_w_clamp"),
        "VESPO kernel W^k exp(lam(1-W)) of the sequence ratio, (k, lam) by sign of A",
    ),
    PolicyLoss("p3o", losses.p3o_loss, ("kl_log_clamp",), "token ratio capped at the token ESS e_B, plus (1-e_B) KL"),
    PolicyLoss(
        "p3o_two_anchor",
        losses.p3o_two_anchor_loss,
        ("kl_log_clamp",),
        "token ratio capped at e_mix = min(e_b, e_prox), plus (1-e_mix) KL to the ESS mixture of pi_b, pi_prox",
        needs_prox=True,
    ),
    PolicyLoss("vaco", losses.vaco_loss, ("delta",), "token ratio; TV-increasing tokens detached when TV > delta/2"),
    PolicyLoss("topr", losses.topr_loss, (), "1 for positive sequences, min(w_i, 1) for the others"),
]

POLICY_LOSSES: dict[str, PolicyLoss] = {loss.name: loss for loss in _LOSSES}


def get_policy_loss(name: str) -> PolicyLoss:
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; known: {sorted(POLICY_LOSSES)}")
    return POLICY_LOSSES[name]
