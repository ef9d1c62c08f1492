"""Off-policy optimal baseline, OPOB (VCPO §3.3, App. B, Eq. 7 / 13).

For Ĝ(b) = (1/B) Σ_i w_i (R_i − b) g_i the variance-minimising scalar baseline is

    b* = Σ_i w_i² ||g_i||² R_i / Σ_i w_i² ||g_i||²                      (Eq. 7)

i.e. a weighted mean of the rewards with weights c_i = w_i² ||g_i||². The weights are formed in log
space (log c_i = 2 s_i + log ||g_i||²) and normalised with a softmax, so a sequence log-ratio of
hundreds neither overflows nor underflows the baseline. With ||g_i||² replaced by the response length
and w ≡ 1 the same formula is OPO's length-weighted baseline b = Σ L_i R_i / Σ L_i.

The ``official`` variant is the authors' release's arithmetic instead (mit-han-lab/vcpo at c7f030f0,
`compute_opob_baseline` in recipe/fully_async_policy/staleness_utils.py, the norm from
`_compute_grad_norms` in verl/workers/actor/megatron_actor.py; docs/ALGORITHMS.md §12 lists every
difference). Their norm is that of the truncated-IS loss with advantage 1, token means undone by the
response length, so their coefficient is c_i = w_i² · w̃_i² · ||∇ Σ_t l^θ||² · (L_i / (L_i + 1e-8))² with
w̃_i = min(exp(clip(s_i, ±20)), c), and their baseline is N / (D + 1e-8).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vcpo.core.ratios import ImportanceWeights, importance_weights, token_log_ratio
from vcpo.core.validation import check_float, check_sequence_inputs

OPOB_VARIANTS = ("paper", "official")
# The release's constants (mit-han-lab/vcpo c7f030f0): the ε of get_weighted_mean's N / (D + ε)
# (staleness_utils.py:418, 491), the ±20 clamp on s_i before the loss's truncation
# (rollout_corr_helper.py:79, 380), and the ε of the token mean L_i / (L_i + ε) (core_algos.py:815).
OFFICIAL_BASELINE_EPS, OFFICIAL_LOG_RATIO_BOUND, OFFICIAL_TOKEN_MEAN_EPS = 1e-8, 20.0, 1e-8
# The loss aggregation whose per-sequence norm the release defines the length factor for (its scripts' mode).
OFFICIAL_OPOB_AGG = "seq-mean-token-mean"
# Weight levels with one weight per sequence: what Σ_i c_i ∇l_i can carry (docs/ALGORITHMS.md §4).
OPOB_WEIGHT_LEVELS = ("sequence", "geometric")


def group_index(groups: torch.Tensor | None, batch_size: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """Map arbitrary group labels to 0..G-1; ``None`` puts the whole batch in one group."""
    if groups is None:
        return torch.zeros(batch_size, dtype=torch.long, device=device), 1
    check_sequence_inputs(batch_size, groups=groups)
    if groups.is_floating_point():
        raise ValueError(f"groups must hold integer labels, got dtype {groups.dtype}")
    labels, index = torch.unique(groups, return_inverse=True)
    return index.to(device), labels.numel()


def group_softmax(logits: torch.Tensor, index: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Softmax of ``logits`` within each group; a group whose logits are all -inf gets all zeros."""
    group_max = torch.full((num_groups,), -torch.inf, dtype=logits.dtype, device=logits.device)
    group_max = group_max.scatter_reduce(0, index, logits, reduce="amax")
    shifted = logits - group_max[index]
    weights = torch.where(torch.isfinite(shifted), torch.exp(shifted), torch.zeros_like(shifted))
    totals = torch.zeros(num_groups, dtype=logits.dtype, device=logits.device).index_add(0, index, weights)
    return torch.where(totals[index] > 0, weights / totals[index].clamp_min(torch.finfo(logits.dtype).tiny), 0.0)


def opob_baseline(
    rewards: torch.Tensor,
    grad_sq_norms: torch.Tensor,
    seq_log_weights: torch.Tensor | None = None,
    groups: torch.Tensor | None = None,
    *,
    variant: str = "paper",
    tis_cap: float | None = None,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-sequence OPOB baseline b*_{g(i)} (VCPO Eq. 7), shape (B,).

    Args:
        rewards: R_i, shape (B,).
        grad_sq_norms: ||g_i||² of the per-sequence gradient that actually enters the update
            (e.g. of mean_t l^θ when the loss averages tokens per sequence), shape (B,), >= 0.
        seq_log_weights: s_i = Σ_t (l^θ − l^μ), the log of the UNCLIPPED sequence ratio; ``None``
            means on-policy (w ≡ 1), which gives the gradient-norm-weighted on-policy baseline.
        groups: prompt-group label per sequence; ``None`` = one baseline for the whole batch
            (scope "batch"); labels = one baseline per group (scope "group", the official default).
        variant: "paper": c_i = w_i² ||g_i||², b = N / D, as in Eq. 7. "official": the authors' release
            (module docstring): c_i = w_i² · w̃_i² · ||g_i||² · L_i² · (L_i / (L_i + 1e-8))², b = N / (D + 1e-8),
            where ``grad_sq_norms`` must be those of ∇ mean_t l^θ (seq-mean-token-mean, the release's
            scripts), so that ||g_i||² · L_i² is their token-sum norm; it needs ``tis_cap`` = c and ``lengths``.
        tis_cap: c, the truncation of the loss's weight w̃_i (``official`` only).
        lengths: L_i, the response tokens of each sequence, shape (B,) (``official`` only; an empty response
            has a zero gradient and coefficient).

    Paper variant: a group whose coefficients are all zero (every norm zero) gets b = 0, the ε → 0 limit
    of N/(D+ε) in Algorithm 1; its sequences contribute no gradient whatever the baseline. No ε enters
    otherwise, so the baseline does not depend on the scale of the norms.
    """
    check_float(rewards, "rewards")
    check_float(grad_sq_norms, "grad_sq_norms")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (one reward per sequence), got {tuple(rewards.shape)}")
    batch_size = rewards.shape[0]
    check_sequence_inputs(batch_size, grad_sq_norms=grad_sq_norms, seq_log_weights=seq_log_weights)
    if bool((grad_sq_norms < 0).any()) or not bool(torch.isfinite(grad_sq_norms).all()):
        raise ValueError("grad_sq_norms must be finite and non-negative")
    if variant not in OPOB_VARIANTS:
        raise ValueError(f"variant must be one of {OPOB_VARIANTS}, got {variant!r}")
    if variant == "official":
        if not (tis_cap is not None and tis_cap > 0):
            raise ValueError("variant='official' needs tis_cap > 0 (the TIS truncation c carried by the gradient norm)")
        if lengths is None:
            raise ValueError("variant='official' needs lengths (the release multiplies the norm by the response length)")
        check_sequence_inputs(batch_size, lengths=lengths)
        if not bool((lengths >= 0).all()):
            raise ValueError("lengths must be non-negative")
    elif lengths is not None:
        raise ValueError("lengths are used by variant='official' only; the paper's baseline weighs by the norms alone")

    dtype = torch.float64
    log_coef = torch.log(grad_sq_norms.detach().to(dtype))
    s = None if seq_log_weights is None else seq_log_weights.detach().to(dtype)
    if s is not None:
        log_coef = log_coef + 2.0 * s
    index, num_groups = group_index(groups, batch_size, rewards.device)
    values = rewards.detach().to(dtype)
    if variant == "official":
        # the release's norm carries the loss's weight w̃_i = min(exp(clip(s_i, ±20)), c) (1 on-policy) and
        # the token sum's length factor
        if s is not None:
            bounded = torch.clamp(s, -OFFICIAL_LOG_RATIO_BOUND, OFFICIAL_LOG_RATIO_BOUND)
            log_coef = log_coef + 2.0 * torch.clamp(bounded, max=math.log(tis_cap))
        length = lengths.detach().to(dtype=dtype, device=log_coef.device)
        log_coef = log_coef + 4.0 * torch.log(length) - 2.0 * torch.log(length + OFFICIAL_TOKEN_MEAN_EPS)
        # N / (D + ε) as one more member of every group, with coefficient ε and value 0.
        log_coef = torch.cat([log_coef, torch.full((num_groups,), math.log(OFFICIAL_BASELINE_EPS), dtype=dtype)])
        values = torch.cat([values, torch.zeros(num_groups, dtype=dtype, device=values.device)])
        index = torch.cat([index, torch.arange(num_groups, device=index.device)])
    weights = group_softmax(log_coef, index, num_groups)
    baseline = torch.zeros(num_groups, dtype=dtype, device=rewards.device)
    baseline = baseline.index_add(0, index, weights * values)
    return baseline[index[:batch_size]].to(rewards.dtype)


def baseline_advantages(
    rewards: torch.Tensor,
    baseline: torch.Tensor,
    groups: torch.Tensor | None = None,
    *,
    norm_by_std: bool = False,
    eps: float = 1e-6,
) -> torch.Tensor:
    """A_i = (R_i − b_i), divided by the group's population reward std σ_g when ``norm_by_std``.

    Mirrors the official VCPO update Σ_i (R_i − b_g)/σ_g · g_i; a group with σ_g <= eps (all rewards
    equal) is not divided (its R_i − b_g is already zero when b_g is a weighted mean of its rewards).
    """
    check_float(rewards, "rewards")
    check_sequence_inputs(rewards.shape[0], baseline=baseline)
    advantages = rewards - baseline
    if not norm_by_std:
        return advantages
    return advantages / group_reward_std(rewards, groups, eps).to(advantages.dtype)


def group_reward_std(rewards: torch.Tensor, groups: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """σ_g(i): the population std of the rewards of each sequence's group, shape (B,), float64;
    1 where σ_g <= eps (a group whose rewards are all equal is not divided)."""
    index, num_groups = group_index(groups, rewards.shape[0], rewards.device)
    r = rewards.detach().to(torch.float64)
    counts = torch.zeros(num_groups, dtype=torch.float64, device=r.device).index_add(0, index, torch.ones_like(r))
    mean = torch.zeros_like(counts).index_add(0, index, r) / counts
    var = torch.zeros_like(counts).index_add(0, index, (r - mean[index]) ** 2) / counts
    std = var.sqrt()[index]
    return torch.where(std > eps, std, torch.ones_like(std))


@dataclass(frozen=True)
class OpobCoefficients:
    """The per-sequence coefficients of the single-backward OPOB update (docs/ALGORITHMS.md §4), float64."""

    reward: torch.Tensor  # c^R_i = c^S_i R_i, the coefficient of g_i in the buffer G_R
    score: torch.Tensor  # c^S_i = -w_i / (σ_i N), the coefficient of g_i in the buffer G_S
    weights: ImportanceWeights  # the loss's bounded weights (w_i = their per-sequence value)
    log_ratio: torch.Tensor  # r_{i,t} = l^θ - l^μ, 0 at padding


def opob_coefficients(
    log_prob: torch.Tensor,
    behav_log_prob: torch.Tensor,
    mask: torch.Tensor,
    rewards: torch.Tensor,
    reward_std: torch.Tensor,
    normaliser: float,
    *,
    level: str,
    bound: str,
    lo: float,
    hi: float,
) -> OpobCoefficients:
    """c^R and c^S such that Σ_i (c^R_i - b_i c^S_i) ∇l_i = -(1/N) Σ_i w_i (R_i - b_i)/σ_i ∇l_i, the
    gradient of the bounded-IS loss with A_i = (R_i - b_i)/σ_i (docs/ALGORITHMS.md §3-§4).

    w_i is the loss's one weight per sequence (``level`` "sequence" or "geometric", truncated or
    masked to [lo, hi]); σ_i the reward scale of i's group (1 without norm_by_std); N the aggregation's
    normaliser (``vcpo.core.aggregation.opob_normaliser``). Shapes: log-probs and mask (B, T), the rest (B,).
    """
    if level not in OPOB_WEIGHT_LEVELS:
        raise ValueError(f"OPOB needs one weight per sequence (level {' or '.join(OPOB_WEIGHT_LEVELS)}), got level {level!r}")
    r = token_log_ratio(log_prob, behav_log_prob, mask)
    weights = importance_weights(r, mask, level=level, bound=bound, lo=lo, hi=hi)
    score = -weights.weight.amax(-1).detach().double() / (reward_std.double() * normaliser)
    return OpobCoefficients(reward=score * rewards.double(), score=score, weights=weights, log_ratio=r)
