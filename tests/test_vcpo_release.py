"""This project's VCPO arithmetic against the authors' release, ported in tests/vcpo_release.py.

Random inputs across log-ratio spreads 0.1-100, groups of 4 and 16. Where the two agree they agree to
float64 rounding; every intended difference is a test of its own below (docs/ALGORITHMS.md §12 lists them).
"""

from __future__ import annotations

import math

import pytest
import torch
import vcpo_release as release

from vcpo.core.baselines import baseline_advantages, group_reward_std, opob_baseline
from vcpo.core.ess import ess_ratio, ess_step_scale

SPREADS = (0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0)
GROUP_SIZES = (4, 16)
TIS_CAP = 8.0


def random_batch(spread: float, group_size: int, seed: int, groups: int = 3) -> dict:
    """s_i, rewards in {0, 1}, squared norms of ∇ mean_t (the engines' measure), response lengths."""
    generator = torch.Generator().manual_seed(seed)
    batch = groups * group_size
    return {
        "s": spread * torch.randn(batch, generator=generator, dtype=torch.float64),
        "rewards": torch.randint(0, 2, (batch,), generator=generator).double(),
        "sq_norms": torch.rand(batch, generator=generator, dtype=torch.float64) * 50 + 0.1,
        "lengths": torch.randint(1, 400, (batch,), generator=generator),
        "groups": torch.arange(groups).repeat_interleave(group_size),
    }


def records(batch: dict, dtype=torch.float64) -> list[release.TrajRecord]:
    """The release's records from the same inputs: its norm is that of ∇ Σ_t, L_i x ours."""
    minibatch = batch["s"].shape[0]
    out = []
    for i in range(minibatch):
        s, length = float(batch["s"][i]), int(batch["lengths"][i])
        token_sum_norm = length * math.sqrt(float(batch["sq_norms"][i]))
        out.append(release.TrajRecord(
            group_uid=int(batch["groups"][i]),
            reward_scalar=float(batch["rewards"][i]),
            response_length=length,
            rollout_seq_is=release.seq_is(s, dtype),
            grad_norm_unscaled=release.grad_norm_unscaled(token_sum_norm, s, length, minibatch, dtype),
        ))
    return out


def official_baseline(batch: dict) -> torch.Tensor:
    return opob_baseline(
        batch["rewards"], batch["sq_norms"], batch["s"], batch["groups"],
        variant="official", tis_cap=TIS_CAP, lengths=batch["lengths"],
    )


@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("spread", SPREADS)
def test_official_baseline_is_the_release_baseline(spread, group_size):
    compared = 0
    for seed in range(5):
        batch = random_batch(spread, group_size, seed)
        ours = official_baseline(batch)
        recs = records(batch)
        for i, group in enumerate(batch["groups"].tolist()):
            theirs = release.compute_opob_baseline(recs, group)
            if not math.isfinite(theirs):
                continue  # w_i² overflows there (s_i > ~355 in float64): nothing to compare
            compared += 1
            assert float(ours[i]) == pytest.approx(theirs, rel=1e-9, abs=1e-300)
    assert compared > 0 or spread == 100.0
    if spread <= 30.0:
        assert compared == 5 * 3 * group_size


@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("spread", SPREADS)
def test_ess_ratio_and_step_are_the_release_values(spread, group_size):
    """Equal up to the release's ε in (Σw)² / (Σw² + 1e-8): its relative effect is 1e-8 / Σw², named below."""
    for seed in range(5):
        batch = random_batch(spread, group_size, seed)
        recs = records(batch)
        sum_sq = sum(r.rollout_seq_is**2 for r in recs)
        theirs = release.ess_ratio(recs)
        if not (math.isfinite(theirs) and sum_sq > 1e2):
            continue  # the ε's effect exceeds 1e-10 relative, or w overflows: the differences below
        ours = float(ess_ratio(batch["s"]))
        assert ours == pytest.approx(theirs, rel=1e-9)
        for rho_on in (1.0, 0.55):
            assert ess_step_scale(ours, rho_on) == pytest.approx(release.lr_scale(theirs, rho_on), rel=1e-9)


@pytest.mark.parametrize("spread", (0.1, 1.0, 10.0))
@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_update_coefficients_are_the_release_coefficients(spread, group_size):
    """Σ_i (c^R_i − b_i c^S_i) ∇ mean_t against the release's (R_i − b_g)/σ_g · G_i, per trajectory.

    Named differences within the tolerance: the release's σ_g is a float32 std and its token mean divides
    by L_i + 1e-8 (relative 1e-7 at most together); inputs keep s_i above −20 (its clamp, tested below).
    """
    for seed in range(3):
        batch = random_batch(spread, group_size, seed)
        batch["s"] = batch["s"].clamp(min=-19.0)
        minibatch = batch["s"].shape[0]
        baseline = official_baseline(batch)
        truncated = batch["s"].exp().clamp(max=TIS_CAP)
        ours = -truncated * baseline_advantages(batch["rewards"], baseline, batch["groups"], norm_by_std=True) / minibatch
        recs = records(batch)
        for i, rec in enumerate(recs):
            members = [r.reward_scalar for r in recs if r.group_uid == rec.group_uid]
            theirs = release.update_coefficient(
                rec, release.compute_opob_baseline(recs, rec.group_uid), release.population_std(members),
                float(batch["s"][i]), minibatch,
            )
            assert float(ours[i]) == pytest.approx(theirs, rel=1e-6, abs=1e-12)


# ----------------------------------------------------------------------------------------------
# The intended differences, one test each.
# ----------------------------------------------------------------------------------------------


def test_paper_variant_weighs_by_the_ratio_once_and_without_length():
    """Default variant: c_i = w_i² ||g_i||² (Eq. 7) with the norm of the gradient that enters the update;
    the release's c_i = w_i² w̃_i² L_i² ||g_i||². Hand-computed: w = (2, 1), L = (1, 10), R = (1, 0)."""
    rewards, norms = torch.tensor([1.0, 0.0], dtype=torch.float64), torch.ones(2, dtype=torch.float64)
    s, lengths = torch.log(torch.tensor([2.0, 1.0], dtype=torch.float64)), torch.tensor([1, 10])
    assert float(opob_baseline(rewards, norms, s)[0]) == pytest.approx(4 / 5, rel=1e-12)
    token_mean = [(length / (length + 1e-8)) ** 2 for length in (1, 10)]  # the release's L / (L + 1e-8)
    release_coefficients = [4 * 4 * 1 * token_mean[0], 1 * 1 * 100 * token_mean[1]]
    expected = release_coefficients[0] / (sum(release_coefficients) + 1e-8)
    assert float(opob_baseline(rewards, norms, s, variant="official", tis_cap=TIS_CAP, lengths=lengths)[0]) == pytest.approx(expected, rel=1e-12)


def test_paper_variant_has_no_epsilon():
    """N/D: scale-free. The release's N/(D + 1e-8) moves toward 0 when every coefficient is tiny
    (log-ratios near −9 with norms near 100), and leaves R − b ≠ 0 in a group whose rewards are all 1."""
    rewards = torch.ones(4, dtype=torch.float64)
    norms = torch.full((4,), 100.0, dtype=torch.float64)
    s = torch.tensor([-9.0, -9.5, -10.0, -8.5], dtype=torch.float64)
    lengths = torch.ones(4, dtype=torch.long)
    assert opob_baseline(rewards, norms, s).tolist() == pytest.approx([1.0] * 4, rel=1e-12)
    assert opob_baseline(rewards, norms * 1e-12, s).tolist() == pytest.approx([1.0] * 4, rel=1e-12)
    official = float(opob_baseline(rewards, norms, s, variant="official", tis_cap=TIS_CAP, lengths=lengths)[0])
    batch = {"s": s, "rewards": rewards, "sq_norms": norms, "lengths": lengths, "groups": torch.zeros(4, dtype=torch.long)}
    assert official == pytest.approx(release.compute_opob_baseline(records(batch), 0), rel=1e-9)
    assert official < 0.5  # the release's ε dominates: R − b stays above 0.5 although every reward is 1


def test_ess_step_is_reduced_not_disabled_at_a_log_ratio_of_95():
    """The release's w = exp(s) in float32 overflows above s ≈ 88.7: its ESS is NaN, and Python's
    min(1.0, nan) returns 1.0, so that step runs at the full rate. Here the ESS is computed in log space."""
    s = torch.tensor([95.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    batch = {"s": s, "rewards": torch.zeros(4, dtype=torch.float64), "sq_norms": torch.ones(4, dtype=torch.float64),
             "lengths": torch.ones(4, dtype=torch.long), "groups": torch.zeros(4, dtype=torch.long)}
    theirs = release.ess_ratio(records(batch, dtype=torch.float32))
    assert math.isnan(theirs) and release.lr_scale(theirs) == 1.0
    ours = float(ess_ratio(s))
    assert ours == pytest.approx(0.25, rel=1e-12)
    assert ess_step_scale(ours) == pytest.approx(0.5, rel=1e-12)


def test_ess_is_scale_free_where_the_release_underflows():
    """Very negative log-ratios: the release's (Σw)² / (Σw² + 1e-8) goes to 0 and so does its learning
    rate (float32 w underflows to 0 below s ≈ −103); the ESS ratio depends only on the spread of s."""
    s = torch.tensor([-30.0, -31.0, -30.5, -29.0], dtype=torch.float64)
    batch = {"s": s, "rewards": torch.zeros(4, dtype=torch.float64), "sq_norms": torch.ones(4, dtype=torch.float64),
             "lengths": torch.ones(4, dtype=torch.long), "groups": torch.zeros(4, dtype=torch.long)}
    assert release.lr_scale(release.ess_ratio(records(batch))) < 1e-8
    assert float(ess_ratio(s)) == pytest.approx(float(ess_ratio(s + 30.0)), rel=1e-12)
    assert ess_step_scale(float(ess_ratio(s))) > 0.75


def test_empty_response_is_left_out_of_the_ess():
    """The release counts a trajectory without response tokens with w = exp(0) = 1 (compute_is_info
    sums nothing); here the ESS runs over sequences with at least one valid token."""
    s = torch.tensor([1.5, -0.5, 0.3, 0.0], dtype=torch.float64)
    valid = torch.tensor([True, True, True, False])
    batch = {"s": s, "rewards": torch.zeros(4, dtype=torch.float64), "sq_norms": torch.ones(4, dtype=torch.float64),
             "lengths": torch.ones(4, dtype=torch.long), "groups": torch.zeros(4, dtype=torch.long)}
    theirs = release.ess_ratio(records(batch))  # the fourth record has w = 1, as an empty response there
    assert float(ess_ratio(s)) == pytest.approx(theirs, rel=1e-9)
    assert float(ess_ratio(s, valid)) == pytest.approx(float(ess_ratio(s[:3])), rel=1e-12)
    assert float(ess_ratio(s, valid)) != pytest.approx(theirs, rel=1e-3)


def test_official_loss_weight_clamps_the_log_ratio_at_minus_20():
    """The release bounds s_i to ±20 before truncating (rollout_corr_helper.py:380): below −20 its weight
    is e^−20, not e^s. The official variant's coefficient follows; the default loss weight does not clamp."""
    batch = {"s": torch.tensor([-25.0, 0.5], dtype=torch.float64), "rewards": torch.tensor([1.0, 0.0], dtype=torch.float64),
             "sq_norms": torch.tensor([1e40, 1.0], dtype=torch.float64), "lengths": torch.tensor([3, 3]),
             "groups": torch.zeros(2, dtype=torch.long)}
    assert release.loss_weight(-25.0) == pytest.approx(math.exp(-20.0), rel=1e-12)
    theirs = release.compute_opob_baseline(records(batch), 0)
    assert float(official_baseline(batch)[0]) == pytest.approx(theirs, rel=1e-9)
    unclamped = math.exp(-50.0) * math.exp(-50.0) * 1e40  # w² · w̃² · norm without the clamp
    clamped = math.exp(-50.0) * math.exp(-40.0) * 1e40
    assert theirs == pytest.approx(clamped / (clamped + math.exp(1.0) * math.exp(1.0)), rel=1e-6)
    assert theirs != pytest.approx(unclamped / (unclamped + math.exp(1.0) * math.exp(1.0)), rel=1e-3)


def test_reward_std_threshold_and_population_std():
    """Both divide R − b by the population std of the group's rewards; a group whose rewards are all equal
    is not divided. The thresholds differ (release 1e-8, here 1e-6): no reward set of {0, 1} falls between."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    std = group_reward_std(rewards, groups)
    assert float(std[0]) == pytest.approx(release.population_std([1.0, 0.0, 0.0, 1.0]), rel=1e-7)
    assert float(std[4]) == 1.0 and release.population_std([1.0] * 4) <= release.STD_EPS


def test_official_step_rule_passes_lengths_and_needs_the_scripts_aggregation():
    """A preset with variant official gets the release's baseline from every backend's step rule, which
    hands it the response lengths; under another loss aggregation it fails when the rule is built."""
    import dataclasses

    from vcpo.methods import step_rule

    rule = step_rule("vcpo")
    assert rule.agg == "seq-mean-token-mean"
    official = dataclasses.replace(rule, variant="official")
    batch = random_batch(3.0, 4, seed=0)
    expected = official_baseline(batch)
    got = official.baseline(batch["rewards"], batch["sq_norms"], batch["s"], batch["groups"], batch["lengths"])
    assert torch.equal(got, expected)
    paper = rule.baseline(batch["rewards"], batch["sq_norms"], batch["s"], batch["groups"], batch["lengths"])
    assert torch.equal(paper, opob_baseline(batch["rewards"], batch["sq_norms"], batch["s"], batch["groups"]))
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        dataclasses.replace(rule, variant="official", agg="token-mean")
