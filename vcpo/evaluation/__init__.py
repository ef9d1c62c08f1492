"""Evaluation: sample n completions per benchmark problem, score them, report mean@n and pass@k.

Every sample is scored under both answer formats (``strict``, ``lenient``); see ``vcpo.evaluation.harness``
for the record and summary layout.

``python -m vcpo.evaluation`` (``__main__.py``) is the command-line entry point over ``run_evaluation``.
"""

from vcpo.evaluation.generation import BACKENDS, Completion, HFGenerator, SamplingParams, make_generator
from vcpo.evaluation.harness import Benchmark, evaluate_benchmark, evaluate_rows, load_benchmarks, run_evaluation
from vcpo.evaluation.metrics import benchmark_pass_at_k, default_ks, mean_at_n, pass_at_k

__all__ = [
    "BACKENDS",
    "Benchmark",
    "Completion",
    "HFGenerator",
    "SamplingParams",
    "benchmark_pass_at_k",
    "default_ks",
    "evaluate_benchmark",
    "evaluate_rows",
    "load_benchmarks",
    "make_generator",
    "mean_at_n",
    "pass_at_k",
    "run_evaluation",
]
