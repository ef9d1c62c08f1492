"""Every core loss against the independent float64 references of tests/reference.py:
loss value and gradient w.r.t. the learner log-probs, random inputs with padding and mixed lengths."""

import pytest
import torch

from vcpo.core import losses
from vcpo.core.aggregation import LOSS_AGGREGATIONS, LossAggregation
from vcpo.core.baselines import baseline_advantages, opob_baseline

import reference as ref


def run(fn, batch, mode, **params):
    log_prob, behav, advantages, mask = batch
    loss, metrics = fn(log_prob, behav, advantages, mask, agg=LossAggregation(mode), **params)
    (grad,) = torch.autograd.grad(loss, log_prob)
    return loss, grad, metrics


def assert_matches(loss, grad, ref_loss, ref_grad, rtol=1e-9):
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(loss, torch.tensor(ref_loss, dtype=loss.dtype), rtol=rtol, atol=1e-12)
    torch.testing.assert_close(grad, torch.tensor(ref_grad, dtype=grad.dtype), rtol=rtol, atol=1e-12)


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("bound,lo,hi", [("truncate", 0.0, 2.0), ("truncate", 0.3, 1.5), ("mask", 0.5, 2.0), ("mask", 0.8, 1.25)])
def test_reinforce_is_matches_reference(mode, level, bound, lo, hi):
    batch = ref.random_batch(seed=1)
    params = dict(level=level, bound=bound, lo=lo, hi=hi)
    loss, grad, metrics = run(losses.reinforce_is_loss, batch, mode, **params)
    assert_matches(loss, grad, *ref.reinforce_is(ref.Inputs(*batch), mode=mode, **params))


def test_bounds_actually_bind_in_the_reference_cases():
    """The cases above are only meaningful if some ratios fall outside the bounds."""
    batch = ref.random_batch(seed=1)
    _, _, metrics = run(losses.reinforce_is_loss, batch, "token-mean", level="sequence", bound="mask", lo=0.8, hi=1.25)
    assert 0.0 < metrics["actor/is_out_of_bounds_frac"] < 1.0
    assert 0.0 < metrics["actor/kept_token_frac"] < 1.0


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_deepseek_v32_masking_matches_reference(mode):
    batch = ref.random_batch(seed=2, scale=0.05)
    params = dict(level="geometric", bound="mask", lo=0.0, hi=8.0, negative_delta=0.01)
    loss, grad, metrics = run(losses.reinforce_is_loss, batch, mode, **params)
    assert 0.0 < metrics["actor/kept_token_frac"] < 1.0
    assert_matches(loss, grad, *ref.reinforce_is(ref.Inputs(*batch), mode=mode, **params))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("threshold", [0.0, 0.04, 0.1, 10.0])
def test_m2po_matches_reference(mode, threshold):
    batch = ref.random_batch(seed=3)
    loss, grad, _ = run(losses.m2po_loss, batch, mode, threshold=threshold)
    assert_matches(loss, grad, *ref.m2po(ref.Inputs(*batch), threshold=threshold, mode=mode))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "token-sum"])
def test_vespo_matches_reference(mode):
    batch = ref.random_batch(seed=4)
    params = dict(k_pos=2.0, lam_pos=3.0, k_neg=3.0, lam_neg=2.0)
    loss, grad, _ = run(losses.vespo_loss, batch, mode, log_w_clamp=20.0, **params)
    assert_matches(loss, grad, *ref.vespo(ref.Inputs(*batch), mode=mode, **params))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_p3o_matches_reference(mode):
    batch = ref.random_batch(seed=5)
    loss, grad, metrics = run(losses.p3o_loss, batch, mode, kl_log_clamp=10.0)
    ref_loss, ref_grad, ref_ess = ref.p3o(ref.Inputs(*batch), mode=mode)
    assert 0.0 < ref_ess < 1.0
    assert metrics["actor/p3o_token_ess"].item() == pytest.approx(ref_ess, rel=1e-12)
    assert_matches(loss, grad, ref_loss, ref_grad)


def prox_batch(seed, drift, dtype=torch.float64):
    """A random batch plus proximal log-probs l^prox = l^θ − drift·N(0, 1), garbage (NaN) at padding."""
    log_prob, behav, advantages, mask = ref.random_batch(seed=seed, dtype=dtype)
    g = torch.Generator().manual_seed(seed + 1000)
    noise = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    prox = torch.where(mask, log_prob.detach().double() - drift * noise, torch.nan).to(dtype)
    return (log_prob, behav, advantages, mask), prox


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
@pytest.mark.parametrize("drift", [0.05, 1.0])  # e_prox > e_b, then e_prox < e_b
def test_p3o_two_anchor_matches_reference(mode, drift):
    batch, prox = prox_batch(seed=11, drift=drift)
    loss, grad, metrics = run(losses.p3o_two_anchor_loss, batch, mode, kl_log_clamp=10.0, prox_log_prob=prox)
    ref_loss, ref_grad, ess, ess_b, ess_prox = ref.p3o_two_anchor(ref.Inputs(*batch), prox.tolist(), mode=mode)
    assert 0.0 < ess_b < 1.0 and 0.0 < ess_prox < 1.0 and (ess_prox > ess_b) == (drift < 0.3)
    for key, value in [("", ess), ("_behav", ess_b), ("_prox", ess_prox)]:
        assert metrics[f"actor/p3o_token_ess{key}"].item() == pytest.approx(value, rel=1e-12)
    assert_matches(loss, grad, ref_loss, ref_grad)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_p3o_two_anchor_with_one_on_policy_anchor_matches_reference(mode):
    """π_b = π_θ (e_b = 1): the behaviour anchor drops out and the KL pulls towards π_prox alone;
    both anchors on-policy: the coefficient 1 − e_mix is 0 and the loss is plain REINFORCE."""
    batch, prox = prox_batch(seed=12, drift=0.5)
    log_prob, _, advantages, mask = batch
    on_policy = log_prob.detach().clone()
    for prox_log_prob in (prox, on_policy):
        loss, grad, metrics = run(
            losses.p3o_two_anchor_loss, (log_prob, on_policy, advantages, mask), mode, kl_log_clamp=10.0, prox_log_prob=prox_log_prob
        )
        ref_loss, ref_grad, ess, ess_b, _ = ref.p3o_two_anchor(
            ref.Inputs(log_prob, on_policy, advantages, mask), prox_log_prob.tolist(), mode=mode
        )
        assert ess_b == 1.0 and metrics["actor/p3o_token_ess_behav"].item() == 1.0
        assert_matches(loss, grad, ref_loss, ref_grad)
    assert ess == 1.0 and metrics["actor/p3o_kl"].item() == 0.0


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
@pytest.mark.parametrize("prox", ["current", "behaviour", "none"])
def test_p3o_two_anchor_reduces_to_p3o(mode, prox):
    """π_prox = π_θ (r_prox ≡ 1, e_prox = 1; also the ``None`` default) or π_prox = π_b: P3O exactly."""
    log_prob, behav, advantages, mask = batch = ref.random_batch(seed=5)
    prox_log_prob = {"current": log_prob.detach().clone(), "behaviour": behav, "none": None}[prox]
    loss, grad, metrics = run(losses.p3o_two_anchor_loss, batch, mode, kl_log_clamp=10.0, prox_log_prob=prox_log_prob)
    p3o_loss, p3o_grad, p3o_metrics = run(losses.p3o_loss, batch, mode, kl_log_clamp=10.0)
    assert torch.equal(loss, p3o_loss) and torch.equal(grad, p3o_grad)
    for key in ("actor/p3o_token_ess", "actor/p3o_kl", "actor/pg_loss"):
        assert torch.equal(metrics[key], p3o_metrics[key]), key
    assert metrics["actor/p3o_token_ess_prox"].item() == (1.0 if prox != "behaviour" else p3o_metrics["actor/p3o_token_ess"].item())


def test_p3o_two_anchor_is_finite_with_large_log_ratios_in_float32():
    """Token log-ratios of ±60 to both anchors and anchors ±100 apart stay finite in float32."""
    (log_prob, behav, advantages, mask), prox = prox_batch(seed=13, drift=60.0, dtype=torch.float32)
    far = torch.where(mask, behav + 40.0 * torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)), behav)
    log_prob = far.clone().requires_grad_(True)
    prox = torch.where(mask, prox - 100.0, prox)
    for mode in LOSS_AGGREGATIONS:
        loss, grad, metrics = run(losses.p3o_two_anchor_loss, (log_prob, behav, advantages, mask), mode, kl_log_clamp=10.0, prox_log_prob=prox)
        assert torch.isfinite(loss) and torch.isfinite(grad).all() and grad.abs().sum() > 0
        assert all(torch.isfinite(value) for value in metrics.values())
        assert 0.0 < metrics["actor/p3o_token_ess"].item() < 0.5


def test_p3o_two_anchor_all_masked_batch_is_a_zero():
    log_prob = torch.randn(3, 5, requires_grad=True)
    mask = torch.zeros(3, 5, dtype=torch.bool)
    garbage = torch.full((3, 5), -torch.inf)
    loss, metrics = losses.p3o_two_anchor_loss(
        log_prob, garbage, torch.full((3, 5), torch.nan), mask, agg=LossAggregation(), kl_log_clamp=10.0, prox_log_prob=garbage
    )
    (grad,) = torch.autograd.grad(loss, log_prob)
    assert loss.item() == 0.0 and torch.equal(grad, torch.zeros_like(grad))
    assert metrics["actor/all_masked"].item() == 1.0 and metrics["actor/p3o_token_ess"].item() == 1.0
    assert all(torch.isfinite(value) for value in metrics.values())


def test_p3o_two_anchor_rejects_a_misshapen_proximal_input():
    log_prob, behav, advantages, mask = ref.random_batch(seed=14)
    with pytest.raises(ValueError, match="prox_log_prob"):
        losses.p3o_two_anchor_loss(log_prob, behav, advantages, mask, agg=LossAggregation(), kl_log_clamp=10.0, prox_log_prob=behav[:, :-1])


@pytest.mark.parametrize("delta", [0.0, 0.05, 100.0])
def test_vaco_matches_reference(delta):
    batch = ref.random_batch(seed=6)
    loss, grad, metrics = run(losses.vaco_loss, batch, "token-mean", delta=delta)
    ref_loss, ref_grad, ref_tv = ref.vaco(ref.Inputs(*batch), delta=delta, mode="token-mean")
    assert metrics["actor/vaco_tv"].item() == pytest.approx(ref_tv, rel=1e-12)
    assert metrics["actor/vaco_filter_active"].item() == float(ref_tv > delta / 2)
    assert (metrics["actor/vaco_filtered_frac"].item() > 0) == (ref_tv > delta / 2)
    assert_matches(loss, grad, ref_loss, ref_grad)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
def test_topr_matches_reference(mode):
    batch = ref.random_batch(seed=7)
    loss, grad, _ = run(losses.topr_loss, batch, mode)
    assert_matches(loss, grad, *ref.topr(ref.Inputs(*batch), mode=mode))


def test_topr_uses_rewards_when_given():
    log_prob, behav, advantages, mask = ref.random_batch(seed=8)
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    positive_adv = torch.where(mask, rewards.unsqueeze(-1) - 0.5, torch.nan)
    by_reward, _ = losses.topr_loss(log_prob, behav, advantages, mask, agg=LossAggregation(), rewards=rewards)
    by_sign, _ = losses.topr_loss(log_prob, behav, advantages, mask, agg=LossAggregation())
    assert not torch.allclose(by_reward, by_sign)
    same_split, _ = losses.topr_loss(log_prob, behav, positive_adv, mask, agg=LossAggregation())
    by_reward_same_adv, _ = losses.topr_loss(log_prob, behav, positive_adv, mask, agg=LossAggregation(), rewards=rewards)
    torch.testing.assert_close(same_split, by_reward_same_adv)


def test_weight_is_stop_gradient():
    """∇loss = −w·A·∇l^θ / N with w held constant: equal to the gradient with w precomputed."""
    log_prob, behav, advantages, mask = ref.random_batch(seed=9)
    loss, _ = losses.reinforce_is_loss(
        log_prob, behav, advantages, mask, agg=LossAggregation("token-sum"), level="sequence", bound="truncate", lo=0.0, hi=1e6
    )
    (grad,) = torch.autograd.grad(loss, log_prob)
    s = torch.where(mask, log_prob.detach() - behav, 0.0).sum(-1, keepdim=True)
    expected = torch.where(mask, -torch.exp(s) * advantages, 0.0)
    torch.testing.assert_close(grad, expected)
    # the gradient of the un-detached surrogate −w(θ)·A·l would carry an extra ∇w term:
    assert not torch.allclose(grad, expected * (1 + torch.where(mask, log_prob.detach(), 0.0).sum(-1, keepdim=True)))


def test_kl_in_reward_subtracts_the_sequence_kl():
    log_prob, behav, _, mask = ref.random_batch(seed=10)
    rewards = torch.ones(len(ref.LENGTHS), dtype=torch.float64)
    shaped = losses.kl_in_reward(rewards, log_prob, behav, mask, beta=0.001)
    x = ref.Inputs(log_prob, behav, torch.zeros_like(behav), mask)
    expected = [1.0 - 0.001 * sum(x.r(i, t) for t in x.valid[i]) for i in range(x.B)]
    torch.testing.assert_close(shaped, torch.tensor(expected, dtype=torch.float64))
    assert not shaped.requires_grad


def test_vcpo_loss_with_group_opob_matches_reference():
    """VCPO Eq. 9 end to end: per-group OPOB (Eq. 7, from the unclipped weights) feeding the
    sequence-TIS REINFORCE loss, against explicit float64 loops over groups and sequences."""
    log_prob, behav, _, mask = ref.random_batch(seed=30)
    groups = torch.tensor([0, 0, 1, 1, 1, 0])
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    sq_norms = torch.tensor([2.0, 0.5, 1.0, 3.0, 0.0, 1.5], dtype=torch.float64)
    x = ref.Inputs(log_prob, behav, torch.zeros_like(behav), mask)
    baseline = {}
    for g in (0, 1):
        members = [i for i in range(6) if groups[i] == g]
        coef = {i: x.seq_ratio(i) ** 2 * sq_norms[i].item() for i in members}
        baseline[g] = sum(coef[i] * rewards[i].item() for i in members) / sum(coef.values())
    advantages_ref = [rewards[i].item() - baseline[groups[i].item()] for i in range(6)]
    x.adv = [[advantages_ref[i]] * x.T for i in range(6)]
    ref_loss, ref_grad = ref.reinforce_is(x, level="sequence", bound="truncate", lo=0.0, hi=8.0, mode="seq-mean-token-mean")

    s = torch.where(mask, log_prob.detach() - behav, 0.0).sum(-1)
    advantages = baseline_advantages(rewards, opob_baseline(rewards, sq_norms, s, groups), groups)
    loss, _ = losses.reinforce_is_loss(
        log_prob, behav, advantages.unsqueeze(-1).expand_as(behav), mask,
        agg=LossAggregation("seq-mean-token-mean"), level="sequence", bound="truncate", lo=0.0, hi=8.0,
    )
    (grad,) = torch.autograd.grad(loss, log_prob)
    assert_matches(loss, grad, ref_loss, ref_grad)
