"""Importance weights and masks, M2PO and VESPO identities, and the off-policy diagnostics vs verl."""

import math

import pytest
import torch
from verl.trainer.ppo.rollout_corr_helper import compute_offpolicy_metrics, compute_rollout_correction_weights

from vcpo.core.losses import m2po_keep_mask, vespo_log_kernel
from vcpo.core.ratios import bounded_weight, importance_weights, offpolicy_diagnostics, token_log_ratio

import reference as ref


def test_bounded_weight_truncates_and_masks_in_log_space():
    log_ratio = torch.tensor([-1e4, math.log(0.1), 0.0, math.log(3.0), 1e4])
    weight, in_bounds = bounded_weight(log_ratio, 0.5, 2.0, "truncate")
    torch.testing.assert_close(weight, torch.tensor([0.5, 0.5, 1.0, 2.0, 2.0]))
    assert in_bounds.tolist() == [False, False, True, False, False]
    weight, _ = bounded_weight(log_ratio, 0.0, 2.0, "mask")
    torch.testing.assert_close(weight, torch.tensor([0.0, 0.1, 1.0, 0.0, 0.0]))


@pytest.mark.parametrize("lo,hi", [(1.0, 0.5), (-1.0, 2.0), (0.0, math.inf)])
def test_bad_bounds_raise(lo, hi):
    with pytest.raises(ValueError, match="lo|hi"):
        bounded_weight(torch.zeros(2), lo, hi, "truncate")


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", [2.0, "0.5_2.0"])
def test_weights_equal_verl_rollout_correction_weights(level, threshold):
    """verl clamps log-ratios at ±20 before exp; with moderate ratios the two must agree exactly."""
    log_prob, behav, _, mask = ref.random_batch(seed=11)
    r = token_log_ratio(log_prob, behav, mask)
    if isinstance(threshold, str):
        lo, hi = map(float, threshold.split("_"))
        ours = importance_weights(r, mask, level=level, bound="mask", lo=lo, hi=hi)
    else:
        ours = importance_weights(r, mask, level=level, bound="truncate", lo=0.0, hi=threshold)
    theirs, _ = compute_rollout_correction_weights(r, mask.double(), rollout_is=level, rollout_is_threshold=threshold)
    torch.testing.assert_close(ours.weight, theirs)


def test_sequence_statistics_count_sequences():
    log_prob, behav, _, mask = ref.random_batch(seed=12)
    r = token_log_ratio(log_prob, behav, mask)
    s = torch.where(mask, r, 0.0).sum(-1)
    valid = mask.any(-1)
    weights = importance_weights(r, mask, level="sequence", bound="mask", lo=0.8, hi=1.25)
    outside = ((s < math.log(0.8)) | (s > math.log(1.25)))[valid].double().mean()
    assert weights.metrics["actor/is_out_of_bounds_frac"].item() == pytest.approx(outside.item())
    kept = torch.exp(s)[valid & ~((s < math.log(0.8)) | (s > math.log(1.25)))]
    assert weights.metrics["actor/is_weight_max"].item() == pytest.approx(kept.max().item())


def test_diagnostics_equal_verl_offpolicy_metrics():
    log_prob, behav, _, mask = ref.random_batch(seed=13)
    rows = mask.any(-1)  # verl would average a sequence without tokens into its per-sequence means
    log_prob, behav, mask = log_prob.detach()[rows], behav[rows], mask[rows]
    ours = offpolicy_diagnostics(log_prob, behav, token_log_ratio(log_prob, behav, mask), mask)
    theirs = compute_offpolicy_metrics(
        torch.where(mask, log_prob.detach(), 0.0), torch.where(mask, behav, 0.0), mask.double()
    )
    for key in ["kl", "k3_kl", "chi2_token", "chi2_seq", "training_ppl", "rollout_ppl", "log_ppl_diff", "ppl_ratio"]:
        # rel 1e-7: verl divides by (count + 1e-8)
        assert ours[f"rollout_corr/{key}"].item() == pytest.approx(theirs[key], rel=1e-7), key


def test_sequence_chi2_is_exact_beyond_verl_clamp():
    mask = torch.ones(2, 3, dtype=torch.bool)
    behav = torch.zeros(2, 3)
    log_prob = torch.tensor([[10.0, 10.0, 10.0], [0.0, 0.0, 0.0]])  # s = 30 and 0
    metrics = offpolicy_diagnostics(log_prob, behav, token_log_ratio(log_prob, behav, mask), mask)
    expected_log = math.log((math.exp(60.0) + 1.0) / 2.0)
    assert metrics["rollout_corr/log_seq_second_moment"].item() == pytest.approx(expected_log, rel=1e-6)
    assert metrics["rollout_corr/seq_ess_ratio"].item() == pytest.approx((math.exp(30) + 1) ** 2 / (math.exp(60) + 1) / 2, rel=1e-6)


def test_m2po_kept_set_meets_the_threshold_and_is_the_largest():
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        r = torch.randn(4, 12, generator=g) * (0.05 + 0.1 * trial)
        mask = torch.rand(4, 12, generator=g) < 0.8
        keep = m2po_keep_mask(r, mask, 0.04)
        assert not (keep & ~mask).any()
        q = r[mask].double() ** 2
        kept_q = r[keep].double() ** 2
        if kept_q.numel():
            assert kept_q.mean() <= 0.04 + 1e-12
        # every dropped token has q >= every kept token (masking goes in decreasing q) ...
        dropped_q = r[mask & ~keep].double() ** 2
        if kept_q.numel() and dropped_q.numel():
            assert dropped_q.min() >= kept_q.max()
        # ... and keeping the next one back would break the threshold
        if dropped_q.numel():
            grown = torch.cat([kept_q, dropped_q.min().reshape(1)])
            assert grown.mean() > 0.04
        assert keep.sum() <= q.numel()


def test_m2po_all_or_nothing():
    r = torch.tensor([[0.1, -0.1, 0.15]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    assert m2po_keep_mask(r, mask, 1.0).all()
    assert not m2po_keep_mask(r + 5.0, mask, 0.04).any()


@pytest.mark.parametrize("k,lam", [(2.0, 3.0), (3.0, 2.0), (1.0, 0.5)])
def test_vespo_kernel_is_one_at_one_and_bounded(k, lam):
    assert vespo_log_kernel(torch.tensor(0.0, dtype=torch.float64), k, lam).item() == 0.0  # φ(1) = 1
    log_w = torch.linspace(-20, 20, 40001, dtype=torch.float64)
    phi = torch.exp(vespo_log_kernel(log_w, k, lam))
    bound = (k / lam) ** k * math.exp(lam - k)  # VESPO Prop. C.1, attained at W = k/λ
    assert phi.max().item() <= bound * (1 + 1e-12)
    assert phi.max().item() == pytest.approx(bound, rel=1e-6)
    assert torch.exp(vespo_log_kernel(torch.tensor(math.log(k / lam), dtype=torch.float64), k, lam)).item() == pytest.approx(bound)
