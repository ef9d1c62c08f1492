"""Importance ratios in log space, their truncation (TIS) and masking (MIS), and off-policy diagnostics.

docs/ALGORITHMS.md §1 (VCPO §2.2-2.3, App. E.2; ROLLOUT-CORR §3.3-3.5, §4). Notation, per sequence i and
valid token t: token log-ratio r_{i,t} = l^θ − l^μ, sequence log-ratio s_i = Σ_t r_{i,t}, geometric
log-ratio a_i = s_i / T_i. A ratio is only exponentiated once it is bounded: truncation and masking
compare log-ratios with log-bounds first, so a sequence log-ratio of ±1e4 is harmless.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vcpo.core.aggregation import masked_extreme, masked_mean, masked_row_mean, masked_sum
from vcpo.core.ess import ess_ratio
from vcpo.core.validation import check_bounds

# the metric name (verl's) of the sequence-level ESS ratio, which every backend logs and the studies read
SEQ_ESS_RATIO = "rollout_corr/seq_ess_ratio"

LEVELS = ("token", "sequence", "geometric")
BOUND_MODES = ("truncate", "mask")

# exp() of a token-level log-ratio beyond this is clamped where a method exponentiates unbounded
# per-token ratios (P3O, VACO, M2PO, diagnostics); it is verl's rollout-correction SAFETY_BOUND.
TOKEN_LOG_RATIO_CLAMP = 20.0


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Ratios are summed over up to tens of thousands of tokens: never in 16-bit precision."""
    return torch.promote_types(dtype, torch.float32)


def token_log_ratio(log_prob: torch.Tensor, behav_log_prob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """r_{i,t} = l^θ − l^μ, detached, in at least float32, exactly 0 at padding."""
    dtype = compute_dtype(log_prob.dtype)
    r = log_prob.detach().to(dtype) - behav_log_prob.detach().to(dtype)
    return torch.where(mask, r, torch.zeros_like(r))


def sequence_log_ratio(r: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """s_i = Σ_t r_{i,t}, shape (B,)."""
    return masked_sum(r, mask, dim=-1)


def geometric_log_ratio(r: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """a_i = s_i / T_i, shape (B,); 0 for a sequence without valid tokens."""
    return masked_row_mean(r, mask)


def level_log_ratio(r: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """The log-ratio of a level, broadcast to (B, T): r, s_i or a_i."""
    if level == "token":
        return r
    if level == "sequence":
        return sequence_log_ratio(r, mask).unsqueeze(-1).expand_as(r)
    if level == "geometric":
        return geometric_log_ratio(r, mask).unsqueeze(-1).expand_as(r)
    raise ValueError(f"level must be one of {LEVELS}, got {level!r}")


def bounded_weight(log_ratio: torch.Tensor, lo: float, hi: float, bound: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Bound ρ = exp(log_ratio) to [lo, hi]; return (weight, in_bounds).

    truncate (TIS): weight = clip(ρ, lo, hi); classic TIS is lo = 0, hi = c.
    mask (MIS): weight = ρ if lo <= ρ <= hi else 0.
    The comparison is made on log-ratios, so ρ itself is never formed unbounded.
    """
    check_bounds(lo, hi)
    if bound not in BOUND_MODES:
        raise ValueError(f"bound must be one of {BOUND_MODES}, got {bound!r}")
    log_lo = math.log(lo) if lo > 0 else -math.inf
    log_hi = math.log(hi)
    in_bounds = (log_ratio >= log_lo) & (log_ratio <= log_hi)
    weight = torch.exp(torch.clamp(log_ratio, min=log_lo, max=log_hi))
    if bound == "mask":
        weight = torch.where(in_bounds, weight, torch.zeros_like(weight))
    return weight, in_bounds


@dataclass
class ImportanceWeights:
    """Detached per-token weights, the tokens they keep, and their statistics."""

    weight: torch.Tensor  # (B, T), 0 where a token is masked out or padding
    keep: torch.Tensor  # (B, T) bool: valid and not masked
    metrics: dict[str, torch.Tensor]


def importance_weights(
    r: torch.Tensor, mask: torch.Tensor, *, level: str, bound: str, lo: float, hi: float
) -> ImportanceWeights:
    """Token, sequence or geometric ratio, truncated or masked to [lo, hi] (ALGORITHMS §1).

    Statistics are per unit of the level (tokens for "token", sequences otherwise):
    the fraction of units outside [lo, hi] (clipped for TIS, dropped for MIS) and the applied weights.
    """
    log_ratio = level_log_ratio(r, mask, level)
    weight, in_bounds = bounded_weight(log_ratio, lo, hi, bound)
    keep = mask & in_bounds if bound == "mask" else mask
    weight = torch.where(keep, weight, torch.zeros_like(weight))

    units = mask if level == "token" else mask.any(-1, keepdim=True)
    unit_weight = weight if level == "token" else weight.amax(-1, keepdim=True)
    unit_in_bounds = in_bounds if level == "token" else in_bounds[:, :1]
    kept_units = units & unit_in_bounds if bound == "mask" else units
    metrics = {
        "actor/is_out_of_bounds_frac": masked_mean((~unit_in_bounds).to(r.dtype), units),
        "actor/is_weight_mean": masked_mean(unit_weight, kept_units),
        "actor/is_weight_max": masked_extreme(unit_weight, kept_units, torch.amax),
        "actor/is_weight_min": masked_extreme(unit_weight, kept_units, torch.amin),
    }
    return ImportanceWeights(weight=weight, keep=keep, metrics=metrics)


def negative_advantage_mask(seq_advantages: torch.Tensor, geo_log_ratio: torch.Tensor, delta: float) -> torch.Tensor:
    """DeepSeek-V3.2 off-policy sequence masking (VCPO App. E.2): keep sequence i unless
    A_i < 0 and −a_i = mean_t(l^μ − l^θ) > δ. Returns a (B,) bool keep mask."""
    if not delta >= 0:
        raise ValueError(f"delta must be non-negative, got {delta}")
    return ~((seq_advantages < 0) & (-geo_log_ratio > delta))


def sequence_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence advantage A_i as the mean over its valid tokens (exact for outcome advantages)."""
    return masked_row_mean(advantages, mask)


def offpolicy_diagnostics(
    log_prob: torch.Tensor, behav_log_prob: torch.Tensor, r: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Learner-vs-behaviour diagnostics (ROLLOUT-CORR §4), under verl's ``rollout_corr/`` names.

    kl ≈ mean(l^μ − l^θ); k3_kl = mean(e^r − r − 1); chi2_token = mean(ρ_t²) − 1;
    chi2_seq = mean_i(w_i²) − 1 from log mean(w²) = LSE(2s) − log B (exact in log space: no clamp on s);
    ppl_ratio = mean_i exp(−a_i); seq_ess_ratio = ESS/B from the unclipped sequence weights.
    Token-level exponentials use verl's ±20 clamp, so the token metrics equal verl's.
    """
    valid_seq = mask.any(-1)
    dtype = r.dtype
    r_safe = torch.clamp(r, -TOKEN_LOG_RATIO_CLAMP, TOKEN_LOG_RATIO_CLAMP)
    s = sequence_log_ratio(r, mask)
    a = geometric_log_ratio(r, mask)
    num_seqs = valid_seq.sum().clamp_min(1).to(torch.float64)
    log_second_moment = torch.logsumexp(torch.where(valid_seq, 2.0 * s, -torch.inf).double(), 0) - num_seqs.log()
    log_second_moment = torch.where(valid_seq.any(), log_second_moment, 0.0)  # empty batch: w ≡ 1 by convention
    mean_logp = masked_row_mean(log_prob.detach().to(dtype), mask)
    mean_behav_logp = masked_row_mean(behav_log_prob.detach().to(dtype), mask)
    return {
        "rollout_corr/kl": masked_mean(-r, mask),
        "rollout_corr/k3_kl": masked_mean(torch.exp(r_safe) - r_safe - 1.0, mask),
        "rollout_corr/chi2_token": masked_mean(torch.exp(2.0 * r_safe), mask) - 1.0,
        # capped at e^80 so it stays finite in float32; the exact value is log_seq_second_moment
        "rollout_corr/chi2_seq": torch.expm1(log_second_moment.clamp(max=80.0)).to(dtype),
        "rollout_corr/log_seq_second_moment": log_second_moment.to(dtype),
        "rollout_corr/training_ppl": masked_mean(torch.exp(-mean_logp), valid_seq),
        "rollout_corr/rollout_ppl": masked_mean(torch.exp(-mean_behav_logp), valid_seq),
        "rollout_corr/log_ppl_diff": masked_mean(-a, valid_seq),
        "rollout_corr/ppl_ratio": masked_mean(torch.exp(torch.clamp(-a, max=TOKEN_LOG_RATIO_CLAMP)), valid_seq),
        SEQ_ESS_RATIO: ess_ratio(s, valid_seq).to(dtype),
    }
