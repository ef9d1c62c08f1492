"""The math of every method, as pure PyTorch functions (no framework import).

- ratios: log-space token / sequence / geometric ratios, TIS / MIS bounds, DeepSeek-V3.2 masking,
  off-policy diagnostics (docs/ALGORITHMS.md §1)
- ess: effective sample size and the ESS step-size rule (§2)
- baselines: the off-policy optimal baseline OPOB (§3)
- per_sequence_grads: exact per-sequence gradient norms and the single-backward two-buffer update (§4)
- proxies: OTB's logit-energy proxy for per-sequence gradient norms (App. E, Figure 14)
- losses, registry: every policy loss, by name (§1, §5-§10); aggregation: verl's loss_agg_mode
"""

from vcpo.core.aggregation import (
    LOSS_AGGREGATIONS,
    OPOB_AGGREGATIONS,
    LossAggregation,
    opob_normaliser,
    opob_sequence_scores,
)
from vcpo.core.baselines import (
    OpobCoefficients,
    baseline_advantages,
    group_reward_std,
    opob_baseline,
    opob_coefficients,
)
from vcpo.core.ess import (
    ess_ratio,
    ess_ratio_over_ranks,
    ess_step_scale,
    log_effective_sample_size,
    scaled_learning_rate,
)
from vcpo.core.losses import (
    kl_in_reward,
    m2po_loss,
    p3o_loss,
    p3o_two_anchor_loss,
    reinforce_is_loss,
    topr_loss,
    vaco_loss,
    vespo_loss,
)
from vcpo.core.per_sequence_grads.gradients import PerSequenceGradients
from vcpo.core.proxies import logit_energy_proxy
from vcpo.core.ratios import importance_weights, offpolicy_diagnostics, sequence_log_ratio, token_log_ratio
from vcpo.core.registry import POLICY_LOSSES, get_policy_loss

__all__ = [
    "LOSS_AGGREGATIONS",
    "POLICY_LOSSES",
    "LossAggregation",
    "OPOB_AGGREGATIONS",
    "OpobCoefficients",
    "PerSequenceGradients",
    "baseline_advantages",
    "ess_ratio",
    "ess_ratio_over_ranks",
    "ess_step_scale",
    "get_policy_loss",
    "group_reward_std",
    "importance_weights",
    "kl_in_reward",
    "log_effective_sample_size",
    "logit_energy_proxy",
    "m2po_loss",
    "offpolicy_diagnostics",
    "opob_baseline",
    "opob_coefficients",
    "opob_normaliser",
    "opob_sequence_scores",
    "p3o_loss",
    "p3o_two_anchor_loss",
    "reinforce_is_loss",
    "scaled_learning_rate",
    "sequence_log_ratio",
    "token_log_ratio",
    "topr_loss",
    "vaco_loss",
    "vespo_loss",
]
