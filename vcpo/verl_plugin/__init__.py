"""verl plugin: every ``vcpo.core`` policy loss in verl's policy-loss registry.

Loaded through the ``verl.plugins`` entry point, so a plain ``import verl`` makes
``verl.trainer.ppo.core_algos.get_policy_loss_fn(name)`` return our losses under the names of
``vcpo.core.registry.POLICY_LOSSES`` (seq_tis, token_tis, geo_tis, seq_mis, token_mis, geo_mis,
dsv32_mis, m2po, vespo, p3o, p3o_two_anchor, vaco, topr), with verl's ``PolicyLossFn`` signature
and ``loss_agg_mode`` / global-batch semantics. ``old_log_prob`` is the behaviour log-prob l^μ (bypass
mode: old = rollout log-probs), and decoupled-mode ``rollout_is_weights`` multiply the per-token loss.

Losses that also need the proximal log-probs l^prox (``PolicyLoss.needs_prox``: p3o_two_anchor)
use verl's decoupled mode instead, since verl's loss signature has no slot for a third log-prob:
``old_log_prob`` is the proximal log-prob l^prox (recomputed by the actor at the start of the
optimizer epoch) and ``rollout_is_weights`` carries the UNtruncated token ratio exp(l^prox − l^b)
(``algorithm.rollout_correction.rollout_is=token`` with a ``rollout_is_threshold`` above e^20, so
only verl's ±20 log-ratio safety clamp applies). The loss recovers l^b = l^prox − log(rollout_is_weights)
on the valid tokens and does not multiply the loss by the weights; without weights it raises.

Hyper-parameters come from a method preset (``recipes/methods``): the one named by
``policy_loss.method``, else the loss's default preset; ``policy_loss.params`` overrides single
values. Both need the config class below, e.g. as Hydra overrides::

    actor_rollout_ref.actor.policy_loss._target_=vcpo.verl_plugin.VcpoPolicyLossConfig
    actor_rollout_ref.actor.policy_loss.loss_mode=seq_tis
    +actor_rollout_ref.actor.policy_loss.method=seq_tis_c2
    +actor_rollout_ref.actor.policy_loss.params.hi=4.0

Methods with the ESS step size or OPOB also need the engine of ``vcpo.verl_plugin.engine``, loaded with
``VERL_USE_EXTERNAL_MODULES`` (not from here: importing verl's engines asks verl's platform for the
device, which must not happen while ``import verl`` loads its plugins). Their loss raises when it is
called outside the engine (any strategy, any trainer) rather than silently training plain TIS.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from verl.trainer.ppo.core_algos import agg_loss, register_policy_loss
from verl.workers.config import PolicyLossConfig

from vcpo.core.registry import POLICY_LOSSES, PolicyLoss
from vcpo.methods import check_loss_mode, default_method, get_method
from vcpo.verl_contract import check_step_rule_applied, metrics_to_floats


@dataclass
class VcpoPolicyLossConfig(PolicyLossConfig):
    """verl's policy-loss config plus the vcpo method preset and parameter overrides."""

    method: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    # the ESS step size's on-policy ratio when the experiment sets its own (0.55 multi-turn, VCPO Table 5)
    rho_on: float | None = None
    # OPOB's mode in the vcpo engine: auto (by the memory model), single or two_pass
    # (vcpo.actor_memory)
    opob_mode: str = "auto"


def resolve_params(loss_name: str, policy_loss_config: Any) -> dict[str, Any]:
    """Preset values for ``loss_name``, overridden by ``policy_loss.params``; bad names raise."""
    get = getattr(policy_loss_config, "get", None)
    method_name = get("method", None) if get else None
    method = get_method(method_name) if method_name else default_method(loss_name)
    check_loss_mode(method.name, loss_name)
    params = method.loss_params
    overrides = dict(get("params", None) or {}) if get else {}
    unknown = sorted(set(overrides) - set(params))
    if unknown:
        raise ValueError(f"policy_loss.params has unknown keys {unknown} for loss {loss_name!r}; it takes {sorted(params)}")
    params.update(overrides)
    return params


def behaviour_from_proximal(
    prox_log_prob: torch.Tensor, rollout_is_weights: torch.Tensor | None, response_mask: torch.Tensor, loss_name: str
) -> torch.Tensor:
    """l^b = l^prox − log(rollout_is_weights) on the valid tokens (l^prox at padding, where verl's weights are 0)."""
    if rollout_is_weights is None:
        raise ValueError(
            f"policy loss {loss_name!r} needs the proximal log-probs: run verl in decoupled mode, where old_log_prob is "
            "the proximal log-prob l^prox and rollout_is_weights the untruncated token ratio exp(l^prox - l^b) "
            "(algorithm.rollout_correction.rollout_is=token with a rollout_is_threshold above e^20); got rollout_is_weights=None"
        )
    log_weights = torch.log(rollout_is_weights.detach().to(prox_log_prob.dtype))
    return torch.where(response_mask.bool(), prox_log_prob.detach() - log_weights, prox_log_prob.detach())


def _as_verl_loss(loss: PolicyLoss):
    def policy_loss_fn(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        config=None,
        rollout_is_weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        policy_config = config.get("policy_loss", None) if config is not None else None
        batch_info = dict(config.get("global_batch_info", None) or {}) if config is not None else {}

        params = resolve_params(loss.name, policy_config)
        method = policy_config.get("method", None) if policy_config is not None else None
        check_step_rule_applied(method)
        behav_log_prob, is_weights = old_log_prob, rollout_is_weights
        if loss.needs_prox:
            behav_log_prob = behaviour_from_proximal(old_log_prob, rollout_is_weights, response_mask, loss.name)
            params["prox_log_prob"], is_weights = old_log_prob, None

        def aggregate(loss_mat: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
            # verl's convention: decoupled-mode rollout IS weights multiply the per-token loss.
            if is_weights is not None:
                loss_mat = loss_mat * is_weights
            return agg_loss(loss_mat=loss_mat, loss_mask=keep, loss_agg_mode=loss_agg_mode, **batch_info)

        value, metrics = loss.fn(log_prob, behav_log_prob, advantages, response_mask, agg=aggregate, **params)
        return value, metrics_to_floats(metrics)

    policy_loss_fn.__name__ = policy_loss_fn.__qualname__ = f"vcpo_{loss.name}"
    core_fn = getattr(loss.fn, "func", loss.fn)  # unwrap the registry's functools.partial
    policy_loss_fn.__doc__ = f"vcpo policy loss {loss.name!r}: {loss.weight}. Math: vcpo.core.losses.{core_fn.__name__}."
    return policy_loss_fn


for _loss in POLICY_LOSSES.values():
    register_policy_loss(_loss.name)(_as_verl_loss(_loss))
