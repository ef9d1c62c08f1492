"""Reduction of a per-token loss matrix to the scalar loss, with verl's ``loss_agg_mode`` semantics.

The aggregations and the global-batch normalisers (dp_size, batch_num_tokens, global_batch_size,
loss_scale_factor) follow ``verl.trainer.ppo.core_algos.agg_loss`` exactly (a test compares the two),
so a loss gives the same value in the CPU simulator and in verl. One difference is deliberate: a
batch with no valid token reduces to an exact zero that keeps the autograd graph, never NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOSS_AGGREGATIONS = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# Aggregations the single-backward OPOB update supports: the loss is Σ_i c_i l_i with one batch-wide
# normaliser (the valid tokens for token-mean, the valid sequences for seq-mean-token-mean) inside c_i.
OPOB_AGGREGATIONS = ("token-mean", "seq-mean-token-mean")


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ values over ``mask``; ``where`` rather than a product, so inf/NaN at padding cannot leak."""
    selected = torch.where(mask, values, torch.zeros_like(values))
    return selected.sum() if dim is None else selected.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over ``mask``; 0 when the mask is empty."""
    return masked_sum(values, mask) / mask.sum().clamp_min(1)


def masked_row_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of each row over its ``mask``, shape (B,); 0 for a row without valid entries."""
    return masked_sum(values, mask, dim=-1) / mask.sum(-1).clamp_min(1)


def opob_sequence_scores(log_prob: torch.Tensor, mask: torch.Tensor, agg: str) -> torch.Tensor:
    """l_i = Σ_t u_{i,t} l^θ_{i,t}, the per-sequence log-likelihood whose gradient OPOB weighs: token
    weights u = 1 under token-mean, 1/T_i under seq-mean-token-mean (the batch normaliser is applied
    through the coefficients). Shape (B,)."""
    if agg == "token-mean":
        return masked_sum(log_prob, mask, dim=-1)
    if agg == "seq-mean-token-mean":
        return masked_row_mean(log_prob, mask)
    raise ValueError(f"OPOB supports the loss aggregations {OPOB_AGGREGATIONS}, got {agg!r}")


def opob_normaliser(agg: str, valid_tokens: int, valid_sequences: int) -> float:
    """N, the batch-wide normaliser OPOB's coefficients carry: the valid tokens under token-mean, the
    valid sequences under seq-mean-token-mean; at least 1 (an all-masked batch has zero coefficients)."""
    if agg not in OPOB_AGGREGATIONS:
        raise ValueError(f"OPOB supports the loss aggregations {OPOB_AGGREGATIONS}, got {agg!r}")
    return float(max(1, valid_tokens if agg == "token-mean" else valid_sequences))


def masked_extreme(values: torch.Tensor, mask: torch.Tensor, reduce) -> torch.Tensor:
    """``reduce`` (torch.amax / torch.amin) over ``mask``; 0 when the mask is empty."""
    selected = values[mask.expand_as(values)]
    return reduce(selected) if selected.numel() else torch.zeros((), dtype=values.dtype, device=values.device)


@dataclass(frozen=True)
class LossAggregation:
    """How a (B, T) loss matrix becomes the scalar that is backpropagated.

    ``dp_size``, ``batch_num_tokens`` and ``global_batch_size`` describe the global batch when a
    minibatch is split over data-parallel ranks and micro-batches (verl's ``global_batch_info``);
    left ``None`` they default to this micro-batch's own counts.
    """

    agg: str = "token-mean"  # verl's loss_agg_mode
    dp_size: int = 1
    batch_num_tokens: int | None = None
    global_batch_size: int | None = None
    loss_scale_factor: float | None = None

    def __post_init__(self):
        if self.agg not in LOSS_AGGREGATIONS:
            raise ValueError(f"loss_agg_mode must be one of {LOSS_AGGREGATIONS}, got {self.agg!r}")
        if self.dp_size > 1 and self.agg == "token-mean" and self.batch_num_tokens is None:
            raise ValueError("batch_num_tokens (global) is required for token-mean when dp_size > 1")
        if self.dp_size > 1 and self.agg.startswith("seq-mean") and self.global_batch_size is None:
            raise ValueError("global_batch_size is required for the seq-mean aggregations when dp_size > 1")

    def __call__(self, loss_mat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.agg == "token-mean":
            tokens = mask.sum() if self.batch_num_tokens is None else self.batch_num_tokens
            return masked_sum(loss_mat, mask) / _at_least_one(tokens) * self.dp_size
        if self.agg == "token-sum":
            return masked_sum(loss_mat, mask) * self.dp_size
        token_counts = mask.sum(-1)
        seq_losses = masked_sum(loss_mat, mask, dim=-1)
        if self.agg == "seq-mean-token-mean":
            seq_losses = seq_losses / token_counts.clamp_min(1)
        has_tokens = token_counts > 0
        sequences = has_tokens.sum() if self.global_batch_size is None else self.global_batch_size
        loss = masked_sum(seq_losses, has_tokens) / _at_least_one(sequences) * self.dp_size
        if self.agg == "seq-mean-token-sum-norm":
            loss = loss / (mask.shape[-1] if self.loss_scale_factor is None else self.loss_scale_factor)
        return loss


def _at_least_one(count: torch.Tensor | int) -> torch.Tensor | int:
    """An empty batch has a zero numerator; dividing by 1 keeps the loss an exact, finite zero."""
    return count.clamp_min(1) if isinstance(count, torch.Tensor) else max(count, 1)
