"""Policy losses of every off-policy correction, as pure functions (docs/ALGORITHMS.md §1, §5-§10).

Each loss takes the learner log-probs ``log_prob`` (with grad), the behaviour log-probs
``behav_log_prob`` recorded at generation (l^μ; in verl's bypass mode this is ``old_log_prob``),
token-level ``advantages`` and the response ``mask``, all (B, T); ``agg`` reduces the per-token loss
matrix to a scalar (a :class:`~vcpo.core.aggregation.LossAggregation` or any callable with its
signature, such as verl's ``agg_loss`` bound to the global batch). It returns ``(loss, metrics)``,
the metrics being detached 0-d tensors under verl-style names.

Weights multiply the REINFORCE term as constants, −sg(weight)·A·l^θ, so the gradient is
weight·A·∇l^θ with no ∇weight term. Tokens a method drops (MIS, DeepSeek-V3.2, M2PO) leave the loss
mask; a batch left without any token gives an exact zero loss (graph kept) and ``actor/all_masked`` = 1.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vcpo.core.aggregation import masked_extreme, masked_mean, masked_sum
from vcpo.core.ratios import (
    TOKEN_LOG_RATIO_CLAMP,
    compute_dtype,
    geometric_log_ratio,
    importance_weights,
    level_log_ratio,
    negative_advantage_mask,
    offpolicy_diagnostics,
    sequence_advantages,
    sequence_log_ratio,
    token_log_ratio,
)
from vcpo.core.validation import check_sequence_inputs, check_token_inputs

Aggregation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
LossOutput = tuple[torch.Tensor, dict[str, torch.Tensor]]


class _Batch:
    """Validated inputs: bool mask, detached token log-ratio, and padding-safe log-probs/advantages."""

    def __init__(self, log_prob, behav_log_prob, advantages, mask):
        self.mask = check_token_inputs(mask, log_prob=log_prob, behav_log_prob=behav_log_prob, advantages=advantages)
        self.r = token_log_ratio(log_prob, behav_log_prob, self.mask)
        dtype = compute_dtype(log_prob.dtype)
        # Padding may hold -inf or garbage; zeroing it with ``where`` also zeroes its gradient.
        self.log_prob = torch.where(self.mask, log_prob, torch.zeros_like(log_prob)).to(dtype)
        self.advantages = torch.where(self.mask, advantages.detach(), torch.zeros_like(advantages)).to(dtype)
        self.metrics = offpolicy_diagnostics(log_prob, behav_log_prob, self.r, self.mask)

    def anchor(self, anchor_log_prob: torch.Tensor) -> torch.Tensor:
        """A reference log-prob (behaviour, proximal) as a constant: detached, compute dtype, 0 at padding."""
        return torch.where(self.mask, anchor_log_prob.detach().to(self.r.dtype), 0.0)

    def reinforce(self, weight: torch.Tensor) -> torch.Tensor:
        """Per-token REINFORCE term −sg(weight)·A·l^θ."""
        return -weight.detach() * self.advantages * self.log_prob

    def reduce(self, loss_mat: torch.Tensor, keep: torch.Tensor, agg: Aggregation, metrics: dict) -> LossOutput:
        metrics = {**self.metrics, **metrics}
        any_kept = bool(keep.any())
        valid_tokens = self.mask.sum().clamp_min(1)
        metrics["actor/kept_token_frac"] = (keep.sum() / valid_tokens).to(self.r.dtype)
        metrics["actor/all_masked"] = torch.tensor(float(not any_kept), device=self.r.device)
        # Without a kept token every aggregation would divide 0 by 0: return an exact zero instead.
        loss = agg(loss_mat, keep) if any_kept else masked_sum(loss_mat, keep)
        metrics["actor/pg_loss"] = loss.detach()
        return loss, metrics


def reinforce_is_loss(
    log_prob: torch.Tensor,
    behav_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    agg: Aggregation,
    level: str,
    bound: str,
    lo: float,
    hi: float,
    negative_delta: float | None = None,
) -> LossOutput:
    """REINFORCE with a truncated (TIS) or masked (MIS) importance weight (ALGORITHMS §1).

    loss term −sg(w)·A·l^θ with w the token, sequence or geometric ratio bounded to [lo, hi].
    Sequence TIS with (lo, hi) = (0, 8) and OPOB advantages is the VCPO loss (VCPO Eq. 9).
    ``negative_delta`` adds DeepSeek-V3.2 masking: a sequence with A_i < 0 and −a_i > δ drops out.
    """
    batch = _Batch(log_prob, behav_log_prob, advantages, mask)
    weights = importance_weights(batch.r, batch.mask, level=level, bound=bound, lo=lo, hi=hi)
    keep = weights.keep
    if negative_delta is not None:
        seq_keep = negative_advantage_mask(
            sequence_advantages(batch.advantages, batch.mask), geometric_log_ratio(batch.r, batch.mask), negative_delta
        )
        keep = keep & seq_keep.unsqueeze(-1)
    return batch.reduce(batch.reinforce(weights.weight), keep, agg, weights.metrics)


def m2po_keep_mask(r: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """M2PO second-moment masking (VCPO App. E.2; M2PO threshold 0.04).

    With q_t = r_t² over the valid tokens, mask tokens in decreasing order of q_t until the mean of q
    over the remaining tokens is <= threshold. Ascending q, the mean of the k smallest is
    non-decreasing in k, so the kept set is the longest prefix whose running mean is <= threshold.
    Ties are broken by position (stable sort), which fixes "its ordering".
    """
    if not threshold >= 0:
        raise ValueError(f"threshold must be non-negative, got {threshold}")
    q = r[mask].double() ** 2
    order = torch.argsort(q, stable=True)
    running_mean = torch.cumsum(q[order], 0) / torch.arange(1, q.numel() + 1, device=q.device, dtype=q.dtype)
    within = (running_mean <= threshold).nonzero()
    kept_count = int(within[-1]) + 1 if within.numel() else 0
    keep_valid = torch.zeros_like(q, dtype=torch.bool)
    keep_valid[order[:kept_count]] = True
    keep = torch.zeros_like(mask)
    keep[mask] = keep_valid
    return keep


def m2po_loss(
    log_prob: torch.Tensor,
    behav_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    agg: Aggregation,
    threshold: float,
) -> LossOutput:
    """M2PO: token-level IS REINFORCE, −sg(ρ_t)·A·l^θ, on the tokens kept by :func:`m2po_keep_mask`.

    The kept ("trusted") token fraction is ``actor/kept_token_frac``.
    """
    batch = _Batch(log_prob, behav_log_prob, advantages, mask)
    keep = m2po_keep_mask(batch.r, batch.mask, threshold)
    ratio = torch.exp(torch.clamp(batch.r, max=TOKEN_LOG_RATIO_CLAMP))
    metrics = {"actor/m2po_kept_second_moment": masked_mean(batch.r**2, keep)}
    return batch.reduce(batch.reinforce(ratio), keep, agg, metrics)


def vespo_log_kernel(log_w: torch.Tensor, k: torch.Tensor | float, lam: torch.Tensor | float) -> torch.Tensor:
    """log φ(W) = k·log W + λ·(1 − W), the VESPO kernel shifted so that φ(1) = 1 (VESPO §3.3).

    φ is bounded for λ > 0: its maximum (k/λ)^k·e^{λ−k} is attained at W = k/λ (VESPO Prop. C.1).
    """
    return k * log_w + lam * (1.0 - torch.exp(log_w))


def vespo_loss(
    log_prob: torch.Tensor,
    behav_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    agg: Aggregation,
    k_pos: float,
    lam_pos: float,
    k_neg: float,
    lam_neg: float,
    log_w_clamp: float,
) -> LossOutput:
    """VESPO: −sg(φ(W_i))·A_i·l^θ with W_i the sequence ratio (no length normalisation), log W_i
    clamped to ±log_w_clamp, and (k, λ) chosen by the sign of A_i (VESPO §3.5, Eq. 20)."""
    batch = _Batch(log_prob, behav_log_prob, advantages, mask)
    log_w = torch.clamp(sequence_log_ratio(batch.r, batch.mask), -log_w_clamp, log_w_clamp)
    positive = sequence_advantages(batch.advantages, batch.mask) >= 0
    k = torch.where(positive, k_pos, k_neg).to(log_w.dtype)
    lam = torch.where(positive, lam_pos, lam_neg).to(log_w.dtype)
    phi = torch.exp(vespo_log_kernel(log_w, k, lam))
    valid_seq = batch.mask.any(-1)
    metrics = {
        "actor/vespo_weight_mean": masked_mean(phi, valid_seq),
        "actor/vespo_weight_max": masked_extreme(phi, valid_seq, torch.amax),
    }
    return batch.reduce(batch.reinforce(phi.unsqueeze(-1)), batch.mask, agg, metrics)


def log_token_ess(r: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log e_B, e_B = (Σ ρ_t)² / (|B| Σ ρ_t²) over the valid tokens, ρ_t = exp(r_t) (P3O Eq. 11).

    Detached, float64, 0-d. The largest log-ratio is subtracted before exponentiating (the
    log-sum-exp shift: log Σ ρ_t = max r + log Σ exp(r_t − max r)), so no exp overflows, and the
    ratio is formed in one division, so a constant ratio (on-policy) gives exactly e_B = 1. e_B ≤ 1
    by Cauchy-Schwarz; rounding above it is clamped. A batch without valid token has e_B = 1.
    """
    r_valid = r.detach()[mask].double()
    if not r_valid.numel():
        return torch.zeros((), dtype=torch.float64, device=r.device)
    shifted = r_valid - r_valid.max()
    first, second = torch.exp(shifted).sum(), torch.exp(2.0 * shifted).sum()
    return torch.log((first * first / (r_valid.numel() * second)).clamp(max=1.0))


def sampled_kl(log_prob: torch.Tensor, anchor_log_prob: torch.Tensor, kl_log_clamp: float) -> torch.Tensor:
    """KL_t = (l^θ − l^a) + exp(l^a − l^θ) − 1, the sampled-token KL(π_θ‖π_a) of P3O Eq. 12.

    The anchor l^a is a constant (detached); the exponent is clamped to ±kl_log_clamp.
    """
    reverse_log_ratio = torch.clamp(anchor_log_prob - log_prob, -kl_log_clamp, kl_log_clamp)
    return (log_prob - anchor_log_prob) + torch.exp(reverse_log_ratio) - 1.0


def mixture_log_prob(
    behav_log_prob: torch.Tensor, prox_log_prob: torch.Tensor, behav_weight: torch.Tensor, prox_weight: torch.Tensor
) -> torch.Tensor:
    """log of the anchor mixture (w_b·π_b + w_prox·π_prox) / (w_b + w_prox) of P3O Eq. 15, in log space:

        l^mix = l^b + LSE(log λ_b, log λ_prox + l^prox − l^b),   λ = w / (w_b + w_prox).

    The 0-d weights are w = 1 − e ≥ 0. A zero weight drops its anchor exactly (λ_prox = 0 gives
    l^mix = l^b bit for bit); with both weights 0 the mixture is taken to be π_b.
    """
    total = behav_weight + prox_weight
    positive = total > 0
    behav_share = torch.where(positive, behav_weight / torch.where(positive, total, 1.0), 1.0)
    prox_share = torch.where(positive, prox_weight / torch.where(positive, total, 1.0), 0.0)
    dtype = behav_log_prob.dtype
    log_shares = torch.stack([
        torch.log(behav_share).to(dtype).expand_as(behav_log_prob),
        torch.log(prox_share).to(dtype) + (prox_log_prob - behav_log_prob),
    ])
    return behav_log_prob + torch.logsumexp(log_shares, 0)


def _p3o_loss_matrix(
    batch: _Batch, log_ess: torch.Tensor, anchor_log_prob: torch.Tensor, kl_log_clamp: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """−sg(min(ρ_t, e))·l^θ·A + (1 − e)·KL_t towards ``anchor_log_prob``; returns (loss matrix, e, KL)."""
    ess = log_ess.exp().to(batch.r.dtype)
    capped_ratio = torch.exp(torch.minimum(batch.r, log_ess.to(batch.r.dtype)))
    kl = sampled_kl(batch.log_prob, anchor_log_prob, kl_log_clamp)
    return batch.reinforce(capped_ratio) + (1.0 - ess) * kl, ess, kl


def p3o_loss(
    log_prob: torch.Tensor,
    behav_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    agg: Aggregation,
    kl_log_clamp: float,
) -> LossOutput:
    """P3O (P3O §3, Eq. 11-12, Algorithm 2):

        −sg(min(ρ_t, e_B))·l^θ·A + (1 − e_B)·KL_t,   KL_t = (l^θ − l^b) + exp(l^b − l^θ) − 1

    with e_B = (Σ ρ_t)² / (|B| Σ ρ_t²) the detached token ESS over the valid tokens
    (:func:`log_token_ess`), and the KL exponent clamped to ±kl_log_clamp (:func:`sampled_kl`).
    """
    batch = _Batch(log_prob, behav_log_prob, advantages, mask)
    loss_mat, ess, kl = _p3o_loss_matrix(
        batch, log_token_ess(batch.r, batch.mask), batch.anchor(behav_log_prob), kl_log_clamp
    )
    metrics = {"actor/p3o_token_ess": ess, "actor/p3o_kl": masked_mean(kl.detach(), batch.mask)}
    return batch.reduce(loss_mat, batch.mask, agg, metrics)


def p3o_two_anchor_loss(
    log_prob: torch.Tensor,
    behav_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    agg: Aggregation,
    kl_log_clamp: float,
    prox_log_prob: torch.Tensor | None = None,
) -> LossOutput:
    """P3O two-anchor extension (P3O §3.1, App. B, Eq. 14-15):

        −sg(min(r_b, e_mix))·l^θ·A + (1 − e_mix)·KL_t(π_θ‖π_mix),   e_mix = min(e_b, e_prox),
        π_mix = ((1 − e_b)·π_b + (1 − e_prox)·π_prox) / ((1 − e_b) + (1 − e_prox))

    with r_b = exp(l^θ − l^b), r_prox = exp(l^θ − l^prox), e_b and e_prox their detached token ESS
    (:func:`log_token_ess`), π_mix evaluated at the sampled token in log space
    (:func:`mixture_log_prob`) and KL_t the sampled-token form of :func:`p3o_loss` towards l^mix.
    ``prox_log_prob`` is the proximal snapshot l^prox (the policy at the start of the optimizer
    epoch); ``None`` means the snapshot is the current policy, sg(l^θ). If π_prox = π_θ (e_prox = 1)
    or π_prox = π_b, the loss is :func:`p3o_loss`.
    """
    batch = _Batch(log_prob, behav_log_prob, advantages, mask)
    check_token_inputs(batch.mask, prox_log_prob=prox_log_prob)
    if prox_log_prob is None:
        prox, r_prox = batch.log_prob.detach(), torch.zeros_like(batch.r)
    else:
        prox, r_prox = batch.anchor(prox_log_prob), token_log_ratio(log_prob, prox_log_prob, batch.mask)
    log_ess_behav, log_ess_prox = log_token_ess(batch.r, batch.mask), log_token_ess(r_prox, batch.mask)
    # 1 − e = −expm1(log e): exact near e = 1, and exactly 0 for an on-policy anchor.
    mixture = mixture_log_prob(batch.anchor(behav_log_prob), prox, -torch.expm1(log_ess_behav), -torch.expm1(log_ess_prox))
    loss_mat, ess, kl = _p3o_loss_matrix(batch, torch.minimum(log_ess_behav, log_ess_prox), mixture, kl_log_clamp)
    metrics = {
        "actor/p3o_token_ess": ess,
        "actor/p3o_token_ess_behav": log_ess_behav.exp().to(batch.r.dtype),
        "actor/p3o_token_ess_prox": log_ess_prox.exp().to(batch.r.dtype),
        "actor/p3o_kl": masked_mean(kl.detach(), batch.mask),
    }
    return batch.reduce(loss_mat, batch.mask, agg, metrics)


def vaco_loss(
    log_prob: torch.Tensor,
    behav_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    agg: Aggregation,
    delta: float,
) -> LossOutput:
    """VACO TV filtering (VACO §4.2.2, Eq. 18, Algorithm 1; LLM setting App. C.2).

    ρ_t = π_θ/β; D̄_TV = (1/2N) Σ_t |ρ_t − 1| over the valid tokens. If D̄_TV > δ/2, every token with
    A_t·sgn(ρ_t − 1) > 0 (one that would increase the TV distance) is detached. Loss −(1/N) Σ_t ρ_t A_t
    without clipping; ρ_t is written sg(ρ_t)·exp(l^θ − sg(l^θ)) so that its value stays bounded
    (±20 on the log-ratio) while its gradient is exactly ρ_t·∇l^θ.
    """
    batch = _Batch(log_prob, behav_log_prob, advantages, mask)
    ratio = torch.exp(torch.clamp(batch.r, -TOKEN_LOG_RATIO_CLAMP, TOKEN_LOG_RATIO_CLAMP))
    tv = 0.5 * masked_mean((ratio - 1.0).abs(), batch.mask)
    filter_active = tv > delta / 2
    increases_tv = batch.advantages * torch.sign(ratio - 1.0) > 0
    detached = batch.mask & increases_tv & filter_active
    keeps_gradient = torch.where(detached, 0.0, 1.0).to(ratio.dtype)
    surrogate_ratio = ratio * torch.exp((batch.log_prob - batch.log_prob.detach()) * keeps_gradient)
    metrics = {
        "actor/vaco_tv": tv,
        "actor/vaco_filter_active": filter_active.to(ratio.dtype),
        "actor/vaco_filtered_frac": masked_mean(detached.to(ratio.dtype), batch.mask),
    }
    return batch.reduce(-surrogate_ratio * batch.advantages, batch.mask, agg, metrics)


def topr_loss(
    log_prob: torch.Tensor,
    behav_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    agg: Aggregation,
    rewards: torch.Tensor | None = None,
) -> LossOutput:
    """TOPR (ALGORITHMS §10): sequence weight 1 if R_i > 0 else clamp(w_i, 0, 1) = exp(min(s_i, 0)).

    ``rewards`` (B,) decides which sequences are positive; without it (verl's loss signature carries
    no reward) the sign of the sequence advantage does.
    """
    batch = _Batch(log_prob, behav_log_prob, advantages, mask)
    check_sequence_inputs(batch.mask.shape[0], rewards=rewards)
    score = sequence_advantages(batch.advantages, batch.mask) if rewards is None else rewards
    positive = (score > 0).unsqueeze(-1)
    tapered = torch.exp(torch.clamp(level_log_ratio(batch.r, batch.mask, "sequence"), max=0.0))
    weight = torch.where(positive, torch.ones_like(tapered), tapered)
    metrics = {"actor/topr_negative_weight_mean": masked_mean(weight, batch.mask & ~positive)}
    return batch.reduce(batch.reinforce(weight), batch.mask, agg, metrics)


def kl_in_reward(
    rewards: torch.Tensor, log_prob: torch.Tensor, ref_log_prob: torch.Tensor, mask: torch.Tensor, beta: float
) -> torch.Tensor:
    """R'_i = R_i − β·KL_i with KL_i = Σ_t (l^θ − l^ref), no gradient through the KL (VCPO App. E.3)."""
    mask = check_token_inputs(mask, log_prob=log_prob, ref_log_prob=ref_log_prob)
    check_sequence_inputs(mask.shape[0], rewards=rewards)
    kl = sequence_log_ratio(token_log_ratio(log_prob, ref_log_prob, mask), mask)
    return rewards - beta * kl.to(rewards.dtype)
