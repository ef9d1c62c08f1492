"""Cheap proxies for per-sequence gradient norms that VCPO compares with the exact ones (App. E, Fig. 14).

- ``logit_energy_proxy``: OTB's logit "energy" (Li et al. 2025; VCPO App. E Eq. 14), as verl's
  ``compute_optimal_token_baseline_advantage`` forms it from ``old_log_probs`` and ``sum_pi_squared``.
"""

from __future__ import annotations

import torch


def logit_energy_proxy(logits: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """OTB's proxy for ||∇_θ Σ_t log π(y_t)||²: W_i = Σ_t m_{i,t} (1 − 2 π_t(y_t) + Σ_v π_t(v)²), shape (B,) float64.

    Per token, 1 − 2 π(y) + ||π||² is the squared norm of the score's gradient with respect to the
    logits, ||∇_z log softmax(z)_y||² = ||e_y − π||² (VCPO App. E Eq. 14, the "OTB" paragraph; verl's
    ``compute_optimal_token_baseline_advantage``: ``w_per_timestep = 1 - 2 * pi_t + sum_pi_squared``,
    summed over the response as its W_T without rollout-IS weights). It is formed here as
    (1 − π(y))² + Σ_{v≠y} π(v)², a sum of non-negative terms, so there is no cancellation when π(y) ≈ 1.

    Args:
        logits: (B, T, V) logits of the distribution the tokens are scored under (temperature already
            applied); the softmax runs in float32, or float64 for float64 logits. -inf entries are fine.
        tokens: (B, T) token ids y_t.
        mask: (B, T) bool or float weights m_{i,t}; positions with m = 0 (padding, tool output) add
            nothing, whatever their logits (all -inf included) and ids.
    """
    if logits.dim() != 3 or tokens.shape != logits.shape[:2] or mask.shape != tokens.shape:
        raise ValueError(
            f"logit_energy_proxy: need logits (B, T, V), tokens and mask (B, T); got {tuple(logits.shape)}, "
            f"{tuple(tokens.shape)}, {tuple(mask.shape)}"
        )
    keep = mask != 0
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logits = torch.where(keep.unsqueeze(-1), logits, torch.zeros((), dtype=logits.dtype, device=logits.device))
    tokens = torch.where(keep, tokens, torch.zeros_like(tokens)).unsqueeze(-1)
    log_probs = torch.log_softmax(logits, dim=-1)
    chosen = log_probs.gather(-1, tokens).squeeze(-1)
    others = torch.exp(2.0 * log_probs).scatter(-1, tokens, 0.0).sum(-1)  # Σ_{v≠y} π(v)²
    energy = torch.expm1(chosen).square().to(torch.float64) + others.to(torch.float64)  # (1 − π(y))² + ...
    return (energy * mask.to(torch.float64)).sum(-1)
