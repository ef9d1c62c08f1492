"""Effective sample size and the ESS step-size rule (VCPO §2.2, §3.2, Eq. 4-5).

ESS = (Σ_i w_i)² / Σ_i w_i² over the B sequences of an optimizer minibatch, from the UNCLIPPED
sequence weights w_i = exp(s_i). Sequence log-ratios s_i reach hundreds on stale data, so the ESS is
computed from s_i in log space: log ESS = 2·LSE(s) − LSE(2s).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

from vcpo.core.collectives import broadcast_here, gather_objects
from vcpo.core.validation import as_bool_mask, check_float, check_sequence_inputs

STEP_SIZE_RULES = ("sqrt", "linear")
# The ESS step size as VCPO states it (Eq. 5): square-root form, on-policy ratio 1, capped at the base rate.
DEFAULT_RHO_ON, DEFAULT_STEP_SIZE_RULE, DEFAULT_CLAMP = 1.0, "sqrt", True


def log_effective_sample_size(seq_log_weights: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """log ESS = 2·LSE(s) − LSE(2s) over the valid sequences (VCPO §2.2).

    Computed in float64 (it is B scalars): exact for |s| up to ~1e300 and free of overflow.
    Returns -inf when no sequence is valid.
    """
    check_float(seq_log_weights, "seq_log_weights")
    if seq_log_weights.dim() != 1:
        raise ValueError(f"seq_log_weights must be 1-D (one log-weight per sequence), got {tuple(seq_log_weights.shape)}")
    s = seq_log_weights.detach().double()
    if valid is not None:
        check_sequence_inputs(s.shape[0], valid=valid)
        s = s.masked_fill(~as_bool_mask(valid, "valid"), -math.inf)
    if not bool(torch.isfinite(s).any()):
        return torch.tensor(-math.inf, dtype=torch.float64, device=s.device)
    return 2.0 * torch.logsumexp(s, 0) - torch.logsumexp(2.0 * s, 0)


def ess_ratio(seq_log_weights: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """ρ_ess = ESS / B ∈ [1/B, 1] (VCPO Eq. 4); B counts the valid sequences, 0 if there are none."""
    count = seq_log_weights.shape[0] if valid is None else int(as_bool_mask(valid, "valid").sum())
    if count == 0:
        return torch.zeros((), dtype=torch.float64, device=seq_log_weights.device)
    return torch.exp(log_effective_sample_size(seq_log_weights, valid) - math.log(count))


def ess_ratio_over_ranks(seq_log_weights: torch.Tensor, valid: torch.Tensor, dp_group=None, pp_group=None) -> float:
    """ρ_ess of a mini-batch split over data-parallel ranks: every rank's s_i and validity all-gathered over
    ``dp_group`` (ranks hold different numbers of sequences; None: the default group, as torch.distributed takes it). Under pipeline parallelism only the last stage has
    log-probs (``seq_log_weights`` is ignored elsewhere): its ratio is broadcast over ``pp_group``, so that every
    stage scales its step alike. The same number on every rank."""
    import torch.distributed as dist

    last_stage = pp_group is None or dist.get_rank(pp_group) == dist.get_world_size(pp_group) - 1
    ratio = torch.zeros((), dtype=torch.float64)
    if last_stage:
        parts = gather_objects((seq_log_weights.detach().double().cpu(), as_bool_mask(valid, "valid").cpu()), dp_group)
        ratio = ess_ratio(torch.cat([s for s, _ in parts]), torch.cat([v for _, v in parts]))
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        ratio = broadcast_here(ratio, src=dist.get_process_group_ranks(pp_group)[-1], group=pp_group)
    return float(ratio)


def ess_step_scale(
    ess_ratio_value: float | torch.Tensor,
    rho_on: float = DEFAULT_RHO_ON,
    rule: str = DEFAULT_STEP_SIZE_RULE,
    clamp: bool = DEFAULT_CLAMP,
) -> float:
    """Learning-rate multiplier η_eff/η for one optimizer step (VCPO Eq. 5).

    rule "sqrt": sqrt(ρ_ess/ρ_on) (the paper); "linear": ρ_ess/ρ_on (offered by the official code).
    ``clamp`` caps the multiplier at 1 as the official code does (η_eff never exceeds η).
    ρ_on is the on-policy reference ESS ratio: 1.0 for GSM8K/MATH/Countdown, 0.55 for multi-turn.
    """
    if rule not in STEP_SIZE_RULES:
        raise ValueError(f"rule must be one of {STEP_SIZE_RULES}, got {rule!r}")
    if not rho_on > 0:
        raise ValueError(f"rho_on must be positive, got {rho_on}")
    relative = float(ess_ratio_value) / rho_on
    if not relative >= 0:  # also rejects NaN
        raise ValueError(f"ess_ratio must be a non-negative number, got {float(ess_ratio_value)}")
    if clamp:
        relative = min(relative, 1.0)
    return math.sqrt(relative) if rule == "sqrt" else relative


@contextlib.contextmanager
def scaled_learning_rate(optimizer: torch.optim.Optimizer, scale: float) -> Iterator[None]:
    """Multiply every param group's learning rate by ``scale`` inside the block, then restore it.

    The ESS rule changes the step size, not the loss: Adam-type optimizers normalise the gradient,
    so scaling the loss would cancel out (docs/ALGORITHMS.md §2). Use around ``optimizer.step()``.
    """
    if not (math.isfinite(scale) and scale >= 0):
        raise ValueError(f"scale must be a finite non-negative number, got {scale}")
    saved = [group["lr"] for group in optimizer.param_groups]
    try:
        for group, lr in zip(optimizer.param_groups, saved, strict=True):
            group["lr"] = lr * scale
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, saved, strict=True):
            group["lr"] = lr
