"""The preset's step rule as verl hands it to the engine (the method named in the actor's policy-loss
config), and the checks that refuse a configuration whose step the engine would not take as written."""

from __future__ import annotations

from vcpo.methods import StepRule, check_loss_mode, step_rule


def rule_from_loss_function(loss_function) -> StepRule | None:
    """The rule of ``policy_loss.method`` in the actor config bound to verl's ``ppo_loss`` partial."""
    config = (getattr(loss_function, "keywords", None) or {}).get("config")
    if config is None:
        return None
    policy_loss = config.get("policy_loss", None) if hasattr(config, "get") else getattr(config, "policy_loss", None)
    getter = getattr(policy_loss, "get", None)
    name = getter("method", None) if getter else None
    if not name:
        return None
    rule = step_rule(name).with_rho_on(getter("rho_on", None))
    if rule.active:
        check_loss_mode(name, getter("loss_mode", None))
        agg = config.get("loss_agg_mode", None) if hasattr(config, "get") else None
        if agg is not None and agg != rule.agg:
            raise ValueError(
                f"actor.loss_agg_mode={agg!r} but method {name!r} uses {rule.agg!r}: set "
                f"actor_rollout_ref.actor.loss_agg_mode={rule.agg}"
            )
    return rule


def opob_mode_from_loss_function(loss_function) -> str:
    """``policy_loss.opob_mode`` of the actor config bound to verl's ``ppo_loss`` (auto when unset)."""
    config = (getattr(loss_function, "keywords", None) or {}).get("config")
    policy_loss = config.get("policy_loss", None) if hasattr(config, "get") else getattr(config, "policy_loss", None)
    getter = getattr(policy_loss, "get", None)
    return (getter("opob_mode", None) if getter else None) or "auto"


def check_opob_loss(loss_function) -> None:
    """OPOB replaces verl's ppo_loss by its own per-sequence update: refuse what that would drop."""
    from verl.workers.utils.losses import ppo_loss

    if getattr(loss_function, "func", None) is not ppo_loss:
        raise NotImplementedError(
            f"OPOB in the vcpo engine replaces verl's ppo_loss; got loss function {loss_function!r}"
        )
    config = loss_function.keywords["config"]
    if config.get("use_kl_loss", False) or config.get("entropy_coeff", 0.0):
        raise NotImplementedError(
            "OPOB in the vcpo engine forms the policy-gradient update only: set actor.use_kl_loss=False and "
            "actor.entropy_coeff=0 (VCPO uses neither), or use a method without OPOB"
        )
