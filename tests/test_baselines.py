"""OPOB (VCPO Eq. 7): identities from the paper, exact variance optimality, and OPO as a special case."""

import itertools
import math

import numpy as np
import pytest
import torch
from verl.trainer.ppo.core_algos import compute_opo_outcome_advantage

from vcpo.core.baselines import baseline_advantages, opob_baseline


def test_equal_weights_and_norms_give_the_group_mean():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    groups = torch.tensor([7, 7, 7, 7, 3, 3, 3])
    baseline = opob_baseline(rewards, torch.full((7,), 2.5, dtype=torch.float64), torch.full((7,), -40.0, dtype=torch.float64), groups)
    torch.testing.assert_close(baseline, torch.tensor([0.5] * 4 + [2 / 3] * 3, dtype=torch.float64))


def test_on_policy_is_the_norm_weighted_baseline():
    rewards = torch.tensor([1.0, 0.0, 3.0], dtype=torch.float64)
    norms = torch.tensor([1.0, 2.0, 5.0], dtype=torch.float64)
    expected = (1 * 1 + 0 * 2 + 3 * 5) / 8
    torch.testing.assert_close(opob_baseline(rewards, norms), torch.full((3,), expected, dtype=torch.float64))
    torch.testing.assert_close(opob_baseline(rewards, norms, torch.zeros(3, dtype=torch.float64)), opob_baseline(rewards, norms))


def test_matches_the_direct_formula_per_group():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(12, generator=g, dtype=torch.float64)
    norms = torch.rand(12, generator=g, dtype=torch.float64) * 10
    s = torch.randn(12, generator=g, dtype=torch.float64)
    groups = torch.tensor([0, 1, 2] * 4)
    baseline = opob_baseline(rewards, norms, s, groups)
    for i in range(12):
        members = [j for j in range(12) if groups[j] == groups[i]]
        c = {j: math.exp(s[j].item()) ** 2 * norms[j].item() for j in members}
        assert baseline[i].item() == pytest.approx(sum(c[j] * rewards[j].item() for j in members) / sum(c.values()), rel=1e-12)


def test_official_variant_multiplies_by_the_truncated_weight_and_length_squared():
    rewards = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
    norms = torch.tensor([1.0, 1.0, 4.0], dtype=torch.float64)
    s = torch.log(torch.tensor([10.0, 1.0, 0.5], dtype=torch.float64))
    lengths = torch.tensor([2, 1, 3])
    token_mean = [(length / (length + 1e-8)) ** 2 for length in (2, 1, 3)]  # the release's L / (L + 1e-8)
    coef = [100 * 64 * 1 * 4 * token_mean[0], 1 * 1 * 1 * 1 * token_mean[1], 0.25 * 0.25 * 4 * 9 * token_mean[2]]
    expected = coef[0] / (sum(coef) + 1e-8)  # w² · min(w, 8)² · ||g||² · L², over D + ε
    official = opob_baseline(rewards, norms, s, variant="official", tis_cap=8.0, lengths=lengths)
    assert official[0].item() == pytest.approx(expected, rel=1e-12)
    assert opob_baseline(rewards, norms, s)[0].item() == pytest.approx(100 / (100 + 1 + 1), rel=1e-12)


def test_extreme_log_weights_and_zero_norms():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25])
    s = torch.tensor([1e4, -1e4, 50.0, 0.0])
    baseline = opob_baseline(rewards, torch.ones(4), s)
    assert torch.isfinite(baseline).all() and baseline[0].item() == pytest.approx(1.0)
    zero = opob_baseline(rewards, torch.tensor([0.0, 0.0, 1.0, 1.0]), s, torch.tensor([0, 0, 1, 1]))
    assert zero[:2].tolist() == [0.0, 0.0]  # N/(D+ε) with D = 0
    assert zero[2].item() == pytest.approx(0.5)


def categorical_problem(seed, K=6):
    """A softmax policy π_θ over K actions, a behaviour policy μ and rewards: the score of action a
    is g_a = ∇_θ log π(a) = e_a − π, so E_μ[w g] = Σ_a π(a) g_a = 0 exactly."""
    rng = np.random.default_rng(seed)
    pi = rng.dirichlet(np.ones(K))
    mu = rng.dirichlet(np.ones(K))
    rewards = rng.normal(size=K) + 2.0
    scores = np.eye(K) - pi
    return pi, mu, rewards, scores


def exact_variance(b, pi, mu, rewards, scores):
    """Var_{a~μ} of the single-sample estimator w(a)(R(a) − b) g_a, by enumeration."""
    w = pi / mu
    contributions = (w * (rewards - b))[:, None] * scores
    mean = mu @ contributions
    return float(mu @ (contributions**2).sum(1) - mean @ mean)


@pytest.mark.parametrize("seed", range(5))
def test_opob_minimises_the_exact_variance(seed):
    pi, mu, rewards, scores = categorical_problem(seed)
    w, sq_norms = pi / mu, (scores**2).sum(1)
    # Eq. 12 as an expectation under μ: b* = E_μ[w²||g||²R] / E_μ[w²||g||²]; OPOB's weighted mean with
    # the sampling probabilities folded into the norms is the same quantity.
    b_star = opob_baseline(
        torch.tensor(rewards), torch.tensor(mu * sq_norms), torch.tensor(np.log(w))
    )[0].item()
    best = exact_variance(b_star, pi, mu, rewards, scores)
    candidates = [mu @ rewards, pi @ rewards, 0.0, *np.linspace(rewards.min() - 1, rewards.max() + 1, 201)]
    for b in candidates:
        assert best <= exact_variance(b, pi, mu, rewards, scores) + 1e-12


def test_plug_in_baseline_minimises_the_batch_estimator_variance():
    """On a sampled batch with per-sample gradients whose weighted sum is zero (the score identity),
    the empirical variance of Ĝ(b) is minimal at the plug-in b* of Eq. 13."""
    rng = np.random.default_rng(0)
    B, D = 16, 40
    grads = rng.normal(size=(B, D)) * rng.uniform(0.1, 3.0, size=(B, 1))
    s = rng.normal(size=B)
    w = np.exp(s)
    grads -= (w @ grads) / w.sum()  # Σ w_i g_i = 0
    rewards = rng.integers(0, 2, size=B).astype(float)

    def empirical_variance(b):
        terms = (w * (rewards - b))[:, None] * grads
        return float(((terms - terms.mean(0)) ** 2).sum(1).mean())

    b_star = opob_baseline(torch.tensor(rewards), torch.tensor((grads**2).sum(1)), torch.tensor(s))[0].item()
    for b in [rewards.mean(), *np.linspace(-1, 2, 301)]:
        assert empirical_variance(b_star) <= empirical_variance(b) + 1e-12


def test_length_weighted_special_case_equals_verl_opo():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0])
    lengths = torch.tensor([5, 2, 7, 3, 1, 4])
    index = np.array(["a", "a", "a", "b", "b", "b"], dtype=object)
    mask = (torch.arange(8).unsqueeze(0) < lengths.unsqueeze(1)).float()
    token_rewards = torch.zeros(6, 8)
    token_rewards[torch.arange(6), lengths - 1] = rewards
    verl_adv, _ = compute_opo_outcome_advantage(token_rewards, mask, index)
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    ours = baseline_advantages(rewards, opob_baseline(rewards, lengths.float(), groups=groups), groups)
    torch.testing.assert_close(ours, verl_adv[:, 0])


def test_std_normalisation_uses_population_std_and_skips_constant_groups():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    baseline = torch.tensor([0.25] * 4 + [1.0] * 2, dtype=torch.float64)
    advantages = baseline_advantages(rewards, baseline, groups, norm_by_std=True)
    std = math.sqrt(0.1875)  # population std of (1, 0, 0, 0)
    torch.testing.assert_close(advantages, torch.tensor([0.75 / std] + [-0.25 / std] * 3 + [0.0, 0.0], dtype=torch.float64))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(rewards=torch.ones(3), grad_sq_norms=torch.ones(4)), "grad_sq_norms"),
        (dict(rewards=torch.ones(3), grad_sq_norms=-torch.ones(3)), "grad_sq_norms"),
        (dict(rewards=torch.ones(3), grad_sq_norms=torch.ones(3), seq_log_weights=torch.ones(2)), "seq_log_weights"),
        (dict(rewards=torch.ones(3), grad_sq_norms=torch.ones(3), groups=torch.ones(3)), "groups"),
        (dict(rewards=torch.ones(3), grad_sq_norms=torch.ones(3), variant="mine"), "variant"),
        (dict(rewards=torch.ones(3), grad_sq_norms=torch.ones(3), variant="official"), "tis_cap"),
        (dict(rewards=torch.ones(3), grad_sq_norms=torch.ones(3), variant="official", tis_cap=8.0), "lengths"),
        (dict(rewards=torch.ones(3), grad_sq_norms=torch.ones(3), lengths=torch.ones(3)), "official"),
        (dict(rewards=torch.ones(3, 1), grad_sq_norms=torch.ones(3)), "rewards"),
    ],
)
def test_bad_input_names_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        opob_baseline(**kwargs)


def test_permutation_invariance_within_groups():
    g = torch.Generator().manual_seed(3)
    rewards, norms, s = (torch.rand(6, generator=g, dtype=torch.float64) for _ in range(3))
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    reference = opob_baseline(rewards, norms, s, groups)
    for perm in itertools.islice(itertools.permutations(range(6)), 0, 720, 97):
        p = torch.tensor(perm)
        torch.testing.assert_close(opob_baseline(rewards[p], norms[p], s[p], groups[p]), reference[p])


def test_opob_coefficients_by_hand():
    """Two sequences, truncated sequence weights: c^S_i = -min(e^{s_i}, c) / (σ_i N), c^R_i = c^S_i R_i."""
    from vcpo.core import opob_coefficients, opob_normaliser

    log_prob = torch.tensor([[-0.5, -1.0, 0.0], [-2.0, -0.1, -0.3]], dtype=torch.float64)
    behav = torch.tensor([[-1.0, -1.5, 0.0], [-0.1, -0.1, -0.2]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    rewards = torch.tensor([1.0, 0.0], dtype=torch.float64)
    std = torch.tensor([0.5, 2.0], dtype=torch.float64)
    normaliser = opob_normaliser("seq-mean-token-mean", valid_tokens=5, valid_sequences=2)
    assert normaliser == 2.0 and opob_normaliser("token-mean", 5, 2) == 5.0 and opob_normaliser("token-mean", 0, 0) == 1.0
    c = opob_coefficients(log_prob, behav, mask, rewards, std, normaliser, level="sequence", bound="truncate", lo=0.0, hi=2.0)
    # s_1 = 0.5 + 0.5 = 1 -> min(e, 2) = 2; s_2 = -1.9 + 0 - 0.1 = -2 -> e^-2
    expected_score = torch.tensor([-2.0 / (0.5 * 2.0), -math.exp(-2.0) / (2.0 * 2.0)], dtype=torch.float64)
    assert torch.allclose(c.score, expected_score, rtol=1e-12)
    assert torch.allclose(c.reward, torch.tensor([expected_score[0], 0.0], dtype=torch.float64), rtol=1e-12)
    masked = opob_coefficients(log_prob, behav, mask, rewards, std, normaliser, level="sequence", bound="mask", lo=0.0, hi=2.0)
    assert masked.score[0] == 0.0 and masked.score[1] == expected_score[1]  # e^1 > 2: masked, not truncated
    with pytest.raises(ValueError, match="one weight per sequence"):
        opob_coefficients(log_prob, behav, mask, rewards, std, normaliser, level="token", bound="truncate", lo=0.0, hi=2.0)
