"""The VCPO release's arithmetic, ported to plain Python: the reference that tests/test_vcpo_release.py holds
this project's functions against.

Written from mit-han-lab/vcpo at c7f030f0b77237cfb0e75e720669e2917a1bb56e, on the path its VCPO scripts
take (recipe/fully_async_policy/shell/vcpo/*: sequence IS truncated at 8, skip_recompute_old_log_prob,
one trajectory per micro-batch, seq-mean-token-mean, ESS step "sqrt", OPOB scope "group" with
norm_by_std). Each function names the file and lines it follows. Sums run in Python floats (float64) as
there; the release computes exp(s_i) in the log-probs' dtype (float32), which ``dtype`` chooses here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SAFETY_BOUND = 20.0  # verl/trainer/ppo/rollout_corr_helper.py:79
TOKEN_MEAN_EPS = 1e-8  # verl/trainer/ppo/core_algos.py:815
EPS = 1e-8  # staleness_utils.py:272 (ESS), :418 (baseline)
STD_EPS = 1e-8  # verl/workers/actor/megatron_actor.py:810


def loss_weight(log_ratio_sum: float, threshold: float = 8.0, dtype=torch.float64) -> float:
    """w̃_i = min(exp(clip(s_i, ±20)), threshold): rollout_corr_helper.py:375-403 (sequence level)."""
    safe = torch.clamp(torch.tensor(log_ratio_sum, dtype=dtype), min=-SAFETY_BOUND, max=SAFETY_BOUND)
    return float(torch.exp(safe).clamp(max=threshold))


def seq_is(log_ratio_sum: float, dtype=torch.float64) -> float:
    """record.rollout_seq_is = exp(s_i), no clamp: staleness_utils.py:255-267 (compute_is_info)."""
    return float(torch.exp(torch.tensor(log_ratio_sum, dtype=dtype)))


def grad_norm_unscaled(token_sum_grad_norm: float, log_ratio_sum: float, length: int, minibatch: int, dtype=torch.float64) -> float:
    """||g_i||: the norm of one trajectory's gradient of the truncated-IS loss with advantage 1
    (megatron_actor.py:1003), token mean over L_i + 1e-8 (core_algos.py:815), loss multiplier 1/N
    (megatron_actor.py:976, 591-593), then × L_i and ÷ (1/N) (megatron_actor.py:778-785)."""
    microbatch_loss_scale = 1 / minibatch
    gradient_norm = microbatch_loss_scale * loss_weight(log_ratio_sum, dtype=dtype) / (length + TOKEN_MEAN_EPS) * token_sum_grad_norm
    unscaled = gradient_norm * length
    return unscaled / microbatch_loss_scale


@dataclass
class TrajRecord:
    """The fields of staleness_utils.py:10-50 that the arithmetic reads."""

    group_uid: int
    reward_scalar: float
    response_length: int
    rollout_seq_is: float | None
    grad_norm_unscaled: float


def get_weighted_mean(values: list[float], weights: list[float], eps: float = EPS) -> float:
    """staleness_utils.py:476-491."""
    if not values:
        return 0.0
    numer, denom = 0.0, 0.0
    for value, weight in zip(values, weights):
        numer += float(value) * float(weight)
        denom += float(weight)
    return numer / (denom + eps)


def compute_opob_baseline(records: list[TrajRecord], group_uid: int, normalize_by_length: bool = False, eps: float = EPS) -> float:
    """staleness_utils.py:415-473, scope "group", use_is_weights=True, use_clipped_is_ratios=False."""
    values, weights = [], []
    for rec in records:
        if rec.group_uid != group_uid:
            continue
        weight = rec.grad_norm_unscaled**2
        weight *= rec.rollout_seq_is**2
        if normalize_by_length:
            weight = weight / (rec.response_length**2)
        values.append(rec.reward_scalar)
        weights.append(weight)
    return get_weighted_mean(values, weights, eps=eps)


def ess_ratio(records: list[TrajRecord], eps: float = EPS) -> float:
    """ESS / N from the unclipped weights: staleness_utils.py:296-320 (compute_ess_info)."""
    total, total_sq, count = 0.0, 0.0, 0
    for rec in records:
        if rec.rollout_seq_is is None:
            continue
        total += float(rec.rollout_seq_is)
        total_sq += float(rec.rollout_seq_is) ** 2
        count += 1
    if count == 0:
        return 0.0
    return total**2 / (total_sq + eps) / count


def lr_scale(ess_ratio_value: float, base_ess_ratio: float = 1.0) -> float:
    """lr / lr_base, rule "sqrt": megatron_actor.py:880-887. Python's min keeps 1.0 against a NaN."""
    base = max(float(base_ess_ratio), 1e-8)
    scale = min(1.0, float(ess_ratio_value) / base)
    return scale**0.5


def population_std(rewards: list[float]) -> float:
    """σ_g: torch.std(unbiased=False) in float32, staleness_utils.py:395-396."""
    return float(torch.std(torch.tensor(rewards, dtype=torch.float32), unbiased=False))


def update_coefficient(record: TrajRecord, baseline: float, reward_std: float, log_ratio_sum: float, minibatch: int) -> float:
    """The coefficient of ∇ mean_t log π_θ of trajectory i in the minibatch gradient: the release adds
    (R_i / σ_g) G_i and subtracts b_g (1/σ_g) G_i (megatron_actor.py:805-836, divided by σ_g only when
    σ_g > 1e-8), with G_i = −(1/N) w̃_i / (L_i + 1e-8) ∇ Σ_t log π_θ = −(1/N) w̃_i L_i / (L_i + 1e-8) ∇ mean_t."""
    scale_reward, scale_baseline = record.reward_scalar, 1.0
    if reward_std > STD_EPS:
        scale_reward, scale_baseline = record.reward_scalar / reward_std, 1.0 / reward_std
    length = record.response_length
    per_mean_gradient = -(1 / minibatch) * loss_weight(log_ratio_sum) * length / (length + TOKEN_MEAN_EPS)
    return (scale_reward - baseline * scale_baseline) * per_mean_gradient


def is_finite(value: float) -> bool:
    return math.isfinite(value)
