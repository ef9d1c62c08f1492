"""Accuracy metrics over n sampled completions per problem.

mean@n (also written avg@n): the mean accuracy over all n samples of all problems.
pass@k: the probability that at least one of k samples is correct, estimated without bias from
n >= k samples of which c are correct (Chen et al., 2021, "Evaluating Large Language Models Trained
on Code"): pass@k = 1 - C(n-c, k) / C(n, k), averaged over problems.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with ``c`` correct samples out of ``n``.

    C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i), a product of c factors in [0, 1] that
    never forms the (huge) binomial coefficients themselves.
    """
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:  # every k-subset contains a correct sample
        return 1.0
    all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        all_wrong *= 1.0 - k / i
    return 1.0 - all_wrong


def default_ks(n: int) -> list[int]:
    """The k reported for n samples: powers of two below n, and n itself."""
    ks = {n}
    k = 1
    while k < n:
        ks.add(k)
        k *= 2
    return sorted(ks)


def mean_at_n(correct: Sequence[Sequence[bool]]) -> float:
    """Mean accuracy over every sample of every problem (``correct[problem][sample]``)."""
    samples = [bool(value) for problem in correct for value in problem]
    if not samples:
        raise ValueError("mean_at_n: no samples")
    return sum(samples) / len(samples)


def benchmark_pass_at_k(correct: Sequence[Sequence[bool]], ks: Sequence[int]) -> dict[int, float]:
    """pass@k for each k, averaged over problems (``correct[problem][sample]``)."""
    if not correct:
        raise ValueError("benchmark_pass_at_k: no problems")
    return {
        k: sum(pass_at_k(len(problem), sum(map(bool, problem)), k) for problem in correct) / len(correct) for k in ks
    }


def per_problem_means(records: Iterable[dict], value: Callable[[dict], float]) -> list[float]:
    """Each problem's mean of ``value(record)`` over its samples (records carry ``problem_id``), in problem order:
    the per-problem scores a bootstrap over problems resamples."""
    values: dict = {}
    for record in records:
        values.setdefault(record["problem_id"], []).append(float(value(record)))
    return [sum(scores) / len(scores) for _, scores in sorted(values.items())]
