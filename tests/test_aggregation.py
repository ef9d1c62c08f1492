"""LossAggregation equals verl's agg_loss in every mode, and an empty batch is an exact, finite zero."""

import pytest
import torch
from verl.trainer.ppo.core_algos import agg_loss

from vcpo.core.aggregation import LOSS_AGGREGATIONS, OPOB_AGGREGATIONS, LossAggregation, opob_sequence_scores


def random_loss(seed, B=5, T=7):
    g = torch.Generator().manual_seed(seed)
    loss_mat = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) < 0.6
    mask[2] = False  # a sequence without tokens
    return loss_mat, mask


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
@pytest.mark.parametrize(
    "global_info",
    [{}, {"dp_size": 4, "batch_num_tokens": 57, "global_batch_size": 19}, {"loss_scale_factor": 3}],
)
def test_matches_verl_agg_loss(mode, global_info):
    loss_mat, mask = random_loss(seed=len(mode))
    ours = LossAggregation(mode, **global_info)(loss_mat, mask)
    theirs = agg_loss(loss_mat=loss_mat, loss_mask=mask, loss_agg_mode=mode, **global_info)
    torch.testing.assert_close(ours, theirs.to(ours.dtype), rtol=1e-7, atol=0)


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
def test_empty_mask_gives_zero_loss_and_zero_gradient(mode):
    loss_mat = torch.full((3, 4), -torch.inf).requires_grad_(True)  # padding garbage must not leak
    loss = LossAggregation(mode)(loss_mat, torch.zeros(3, 4, dtype=torch.bool))
    (grad,) = torch.autograd.grad(loss, loss_mat)
    assert loss.item() == 0.0
    assert torch.equal(grad, torch.zeros_like(grad))


def test_distributed_modes_require_global_counts():
    with pytest.raises(ValueError, match="batch_num_tokens"):
        LossAggregation("token-mean", dp_size=2)
    with pytest.raises(ValueError, match="global_batch_size"):
        LossAggregation("seq-mean-token-mean", dp_size=2)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        LossAggregation("mean")


@pytest.mark.parametrize("mode", OPOB_AGGREGATIONS)
def test_opob_scores_over_the_batch_normaliser_are_verls_aggregated_loss(mode):
    # The single-backward OPOB loss Σ_i c_i l_i with c_i = 1/N must be verl's aggregation of the
    # token matrix: N = the valid tokens (token-mean) or the valid sequences (seq-mean-token-mean).
    loss_mat, mask = random_loss(seed=3)
    mask[2, 0] = True  # every sequence has a token
    normaliser = mask.sum() if mode == "token-mean" else mask.any(-1).sum()
    ours = opob_sequence_scores(loss_mat, mask, mode).sum() / normaliser
    theirs = agg_loss(loss_mat=loss_mat, loss_mask=mask, loss_agg_mode=mode)
    torch.testing.assert_close(ours, theirs.to(ours.dtype), rtol=1e-12, atol=0)


def test_opob_scores_by_hand_and_unsupported_modes():
    log_prob = torch.tensor([[-1.0, -2.0, 5.0], [-4.0, 7.0, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert opob_sequence_scores(log_prob, mask, "token-mean").tolist() == [-3.0, -4.0]
    assert opob_sequence_scores(log_prob, mask, "seq-mean-token-mean").tolist() == [-1.5, -4.0]
    with pytest.raises(ValueError, match="OPOB supports"):
        opob_sequence_scores(log_prob, mask, "token-sum")
