"""The statistics the pre-registered studies use: intervals, paired tests, Holm's correction, Wilson
intervals, ROC AUC with its bootstraps, the power of a paired t-test, and equivalence (two one-sided
tests). Small pure functions on arrays of numbers; each says what it computes."""

from __future__ import annotations

import math
import random

import numpy as np

ALPHA = 0.05


def mean_interval(values, confidence: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): the Student-t interval of the mean (n >= 2; n = 1 gives an unbounded interval, n = 0 a nan
    mean: no values, no mean, and no warning from numpy's mean of nothing)."""
    from scipy import stats

    values = np.asarray(values, dtype=np.float64)
    mean = float(values.mean()) if values.size else math.nan
    if values.size < 2:
        return mean, -math.inf, math.inf
    half = float(stats.t.ppf(0.5 + confidence / 2, values.size - 1) * values.std(ddof=1) / math.sqrt(values.size))
    return mean, mean - half, mean + half


def bootstrap_mean_interval(values: list[float], level: float, resamples: int, seed: int) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values`` (one per problem: problems are resampled)."""
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(values, k=len(values))) / len(values) for _ in range(resamples))
    low, high = (1 - level) / 2, 1 - (1 - level) / 2
    return means[int(low * (resamples - 1))], means[int(high * (resamples - 1))]


def paired_difference(a, b) -> dict:
    """a - b paired by seed: the mean difference, its t interval, the two-sided paired t-test's p and the
    differences' SD (nan below two pairs)."""
    from scipy import stats

    differences = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    mean, low, high = mean_interval(differences)
    if differences.size < 2:
        p = math.nan
    elif np.all(differences == differences[0]):
        p = 1.0 if differences[0] == 0 else 0.0
    else:
        p = float(stats.ttest_1samp(differences, 0.0).pvalue)
    sd = float(differences.std(ddof=1)) if differences.size >= 2 else math.nan
    return {"n": int(differences.size), "mean": mean, "low": low, "high": high, "p": p, "sd": sd}


def detectable_difference(sd: float, n: int, alpha: float = ALPHA, power: float = 0.9) -> float:
    """The smallest mean paired difference a two-sided paired t-test at level ``alpha`` detects with
    probability ``power`` from ``n`` pairs whose differences have SD ``sd`` (noncentral t, exact)."""
    from scipy import optimize, stats

    critical = stats.t.ppf(1 - alpha / 2, n - 1)

    def shortfall(effect_size: float) -> float:
        shift = effect_size * math.sqrt(n)
        # P(T > c) + P(T < -c) under the shift; the lower tail as the upper one of the mirrored shift
        return stats.nct.sf(critical, n - 1, shift) + stats.nct.sf(critical, n - 1, -shift) - power

    return float(optimize.brentq(shortfall, 1e-6, 20.0) * sd)


def sign_test(differences) -> dict:
    """The exact two-sided sign test of paired differences: how many are positive of those not zero, and p (nan
    without a nonzero difference). Robust where a few pairs carry a t-test's mean."""
    from scipy import stats

    values = np.asarray(differences, dtype=np.float64)
    positive, nonzero = int((values > 0).sum()), int((values != 0).sum())
    p = float(stats.binomtest(positive, nonzero, 0.5).pvalue) if nonzero else math.nan
    return {"sign_positive": positive, "sign_n": nonzero, "sign_p": p}


def sign_test_above(differences) -> float:
    """The exact one-sided sign test's p that a > b (ties dropped): the paired differences' positive count against
    Binomial(nonzero, 1/2)'s upper tail; nan without a nonzero difference."""
    from scipy import stats

    values = np.asarray(differences, dtype=np.float64)
    positive, nonzero = int((values > 0).sum()), int((values != 0).sum())
    return float(stats.binomtest(positive, nonzero, 0.5, alternative="greater").pvalue) if nonzero else math.nan


def sign_agrees(comparison: dict, alpha: float = ALPHA, sign_p: str = "sign_p") -> bool:
    """A paired comparison's exact sign test rejects (its ``sign_p`` entry < alpha: the two-sided test, or
    ``sign_p_one_sided`` where a study registered the one-sided one) with most nonzero pairs on the side of its mean
    difference: it confirms what the t-test says of the direction."""
    above = comparison["sign_positive"] > comparison["sign_n"] / 2
    return comparison[sign_p] < alpha and above == (comparison["mean"] > 0)


def by_pair(comparisons: list[dict]) -> dict[tuple[str, str], dict]:
    """A report's comparisons (each with arms ``a`` and ``b``) by their (a, b) pair."""
    return {(comparison["a"], comparison["b"]): comparison for comparison in comparisons}


def holm(p_values: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values (family-wise error), in the given order."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    adjusted, running = [0.0] * len(p_values), 0.0
    for rank, index in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[index]))
        adjusted[index] = running
    return adjusted


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of a proportion."""
    from scipy import stats

    if n == 0:
        return 0.0, 1.0
    z = float(stats.norm.ppf(0.5 + confidence / 2))
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def percent_cell(mean: float, low: float, high: float, problems: int) -> str:
    """A mean over problems with its bootstrap interval as a table prints it, '2.6% [0.5, 5.1]'; with no success at
    all, '0.0% [0.0, 0.0], Wilson ≤ 5.6%': a bootstrap over problems none of which succeeds cannot leave zero, so the
    Wilson interval's upper bound over the problems (the unit the bootstrap resamples) says how far zero goes."""
    cell = f"{100 * mean:.1f}% [{100 * low:.1f}, {100 * high:.1f}]"
    return cell + (f", Wilson ≤ {100 * wilson_interval(0, problems)[1]:.1f}%" if mean == 0 else "")


def roc_auc(scores, labels) -> float:
    """P(score of a positive > score of a negative), ties counted half (Mann-Whitney); nan without both classes."""
    scores, labels = np.asarray(scores, dtype=np.float64), np.asarray(labels, dtype=bool)
    positives, negatives = scores[labels], scores[~labels]
    if not positives.size or not negatives.size:
        return math.nan
    greater = (positives[:, None] > negatives[None, :]).sum()
    ties = (positives[:, None] == negatives[None, :]).sum()
    return float((greater + 0.5 * ties) / (positives.size * negatives.size))


def bootstrap_auc_interval(scores, labels, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of the AUC, resampling positives and negatives separately."""
    scores, labels = np.asarray(scores, dtype=np.float64), np.asarray(labels, dtype=bool)
    positives, negatives = scores[labels], scores[~labels]
    if not positives.size or not negatives.size:
        return math.nan, math.nan
    generator = np.random.default_rng(seed)
    values = []
    for _ in range(resamples):
        p = generator.choice(positives, positives.size)
        n = generator.choice(negatives, negatives.size)
        values.append(roc_auc(np.concatenate([p, n]), np.concatenate([np.ones(p.size, bool), np.zeros(n.size, bool)])))
    return float(np.percentile(values, 2.5)), float(np.percentile(values, 97.5))


def base_bootstrap_auc_interval(rows: list[dict], resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of the predictor's AUC, resampling SFT bases (all runs of a drawn base
    together): runs on one base are not independent. Resamples without both classes are skipped."""
    bases = sorted({row["base_seed"] for row in rows})
    by_base = {base: [row for row in rows if row["base_seed"] == base] for base in bases}
    generator = np.random.default_rng(seed)
    values = []
    for _ in range(resamples):
        drawn = [row for base in generator.choice(bases, len(bases)) for row in by_base[base]]
        auc = roc_auc([-row["ess_predictor"] for row in drawn], [row["collapsed"] for row in drawn])
        if math.isfinite(auc):
            values.append(auc)
    if not values:
        return math.nan, math.nan
    return float(np.percentile(values, 2.5)), float(np.percentile(values, 97.5))


def equivalence(a, b, margin: float) -> dict:
    """a - b paired: the two one-sided tests against [-margin, +margin]: their larger p, and the 90% interval."""
    from scipy import stats

    differences = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    n = differences.size
    mean = float(differences.mean()) if n else math.nan
    if n < 2:
        return {"n": int(n), "mean": mean, "low90": math.nan, "high90": math.nan, "p": math.nan, "margin": margin}
    error = float(differences.std(ddof=1) / math.sqrt(n))
    if error == 0:
        p = 0.0 if abs(mean) < margin else 1.0
    else:
        p = float(max(stats.t.sf((mean + margin) / error, n - 1), stats.t.cdf((mean - margin) / error, n - 1)))
    _, low, high = mean_interval(differences, confidence=0.90)
    return {"n": int(n), "mean": mean, "low90": low, "high90": high, "p": p, "margin": margin}
