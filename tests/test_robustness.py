"""Numerics and bad input for every registered loss: extreme log-ratios and long sequences stay finite,
malformed input raises a ValueError naming the argument, an all-masked batch is a logged zero."""

import math

import pytest
import torch

from vcpo.core.aggregation import LossAggregation
from vcpo.core.ess import ess_ratio
from vcpo.core.registry import POLICY_LOSSES, get_policy_loss
from vcpo.methods import default_method

LOSS_NAMES = sorted(POLICY_LOSSES)


def call(name, log_prob, behav, advantages, mask, mode="seq-mean-token-mean"):
    loss = get_policy_loss(name)
    params = default_method(name).loss_params
    return loss.fn(log_prob, behav, advantages, mask, agg=LossAggregation(mode), **params)


def extreme_batch(dtype, T=32768):
    """Sequence log-ratio sums of +1e4 and -1e4 over 32k tokens, one of +1e4 over 100 tokens
    (token log-ratios of 100), and a short ordinary sequence; advantages of both signs."""
    mask = torch.zeros(4, T, dtype=torch.bool)
    mask[:2] = True
    mask[2, :100] = True
    mask[3, :37] = True
    r = torch.zeros(4, T)
    r[0], r[1], r[2, :100] = 1e4 / T, -1e4 / T, 100.0
    r[3] = torch.linspace(-2, 2, T)
    behav = -torch.rand(4, T, generator=torch.Generator().manual_seed(0)) * 5
    log_prob = (behav + r).to(dtype).requires_grad_(True)
    advantages = torch.tensor([[1.0], [-1.0], [-0.5], [0.7]]).expand(4, T).to(dtype)
    return log_prob, behav.to(dtype), advantages, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", LOSS_NAMES)
def test_extreme_ratios_and_long_sequences_stay_finite(name, dtype):
    log_prob, behav, advantages, mask = extreme_batch(dtype)
    loss, metrics = call(name, log_prob, behav, advantages, mask)
    (grad,) = torch.autograd.grad(loss, log_prob)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert grad.dtype == dtype
    for key, value in metrics.items():
        assert torch.isfinite(value).all(), key
    s = torch.where(mask, log_prob.detach().float() - behav.float(), 0.0).sum(-1)
    assert s.abs().max() > 9000  # the batch really carries sums near ±1e4
    assert 0.0 < metrics["rollout_corr/seq_ess_ratio"].item() <= 1.0
    assert torch.isfinite(ess_ratio(s))


@pytest.mark.parametrize("name", LOSS_NAMES)
def test_all_masked_batch_is_a_logged_zero(name):
    log_prob = torch.randn(3, 5, requires_grad=True)
    mask = torch.zeros(3, 5, dtype=torch.bool)
    loss, metrics = call(name, log_prob, torch.full((3, 5), -torch.inf), torch.full((3, 5), torch.nan), mask)
    (grad,) = torch.autograd.grad(loss, log_prob)
    assert loss.item() == 0.0 and torch.equal(grad, torch.zeros_like(grad))
    assert metrics["actor/all_masked"].item() == 1.0
    assert all(torch.isfinite(value).all() for value in metrics.values())


def test_masking_every_sequence_is_a_logged_zero():
    """Geometric MIS masking every sequence (VCPO Fig. 4: "masks all sequences and has no loss")."""
    log_prob = torch.zeros(2, 4, requires_grad=True)
    behav = torch.full((2, 4), -3.0)  # geometric ratio e^3, above hi = 2
    loss, metrics = call("geo_mis", log_prob, behav, torch.ones(2, 4), torch.ones(2, 4, dtype=torch.bool))
    assert loss.item() == 0.0 and metrics["actor/all_masked"].item() == 1.0
    assert metrics["actor/kept_token_frac"].item() == 0.0


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda lp, mu, a, m: (lp[:, :-1], mu, a, m), "log_prob"),
        (lambda lp, mu, a, m: (lp, mu[:1], a, m), "behav_log_prob"),
        (lambda lp, mu, a, m: (lp, mu, a.long(), m), "advantages"),
        (lambda lp, mu, a, m: (lp, mu, a, m.float() * 2), "mask"),
        (lambda lp, mu, a, m: (lp, mu, a, m[0]), "mask"),
        (lambda lp, mu, a, m: (lp, mu, a, "mask"), "mask"),
    ],
)
@pytest.mark.parametrize("name", ["seq_tis", "m2po", "vespo", "p3o", "vaco", "topr"])
def test_malformed_input_names_the_argument(name, change, match):
    inputs = (torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=match):
        call(name, *change(*inputs))


def test_unknown_names_raise():
    with pytest.raises(ValueError, match="unknown policy loss 'seq_tiss'"):
        get_policy_loss("seq_tiss")
    with pytest.raises(ValueError, match="no default preset for loss 'gspo'"):
        default_method("gspo")


def test_bad_hyper_parameters_raise():
    inputs = (torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="lo"):
        get_policy_loss("seq_tis").fn(*inputs, agg=LossAggregation(), lo=3.0, hi=2.0)
    with pytest.raises(ValueError, match="hi must be finite"):
        get_policy_loss("token_mis").fn(*inputs, agg=LossAggregation(), lo=0.5, hi=math.inf)
    with pytest.raises(ValueError, match="threshold"):
        get_policy_loss("m2po").fn(*inputs, agg=LossAggregation(), threshold=-1.0)
    with pytest.raises(ValueError, match="delta"):
        get_policy_loss("dsv32_mis").fn(*inputs, agg=LossAggregation(), lo=0.0, hi=8.0, negative_delta=-1.0)
