"""Held-out accuracy of a model in memory on a simulator task, through ``vcpo.evaluation``'s harness
(the code that evaluates paper-scale checkpoints): sample, score under both answer formats, measure."""

from __future__ import annotations

from collections.abc import Sequence

from vcpo.evaluation import HFGenerator, SamplingParams, evaluate_rows
from vcpo.sim.tasks import Problem, SimTask, evaluation_rows

# Sequences generated per model.generate call; a batch holds this many // samples problems.
SEQUENCES_PER_BATCH = 64


def heldout_accuracy(
    model,
    tokenizer,
    task: SimTask,
    problems: Sequence[Problem],
    *,
    temperature: float = 1.0,
    max_new_tokens: int | None = None,
    samples: int = 1,
    seed: int = 0,
) -> dict:
    """The harness's metrics of ``model`` on ``problems``: ``samples`` responses each (temperature 0:
    greedy, one response), plain sampling from the temperature-scaled distribution (no top-k or top-p,
    as the rollouts sample), at most ``max_new_tokens`` tokens each (default: the task's budget).

    Returns ``vcpo.evaluation.evaluate_rows``' metrics (``mean_at_n`` and ``pass_at_k`` in the strict
    answer format, ``by_answer_format``, ``mean_response_tokens``, ``truncated``, ``reasons``, ...).
    Deterministic given ``seed``; the global random state and the model's training mode are left as
    they were.
    """
    if samples < 1:
        raise ValueError(f"heldout_accuracy: samples must be >= 1, got {samples}")
    n = 1 if temperature == 0 else samples  # every greedy sample would be the same
    sampling = SamplingParams(
        n=n, temperature=temperature, top_p=1.0, max_new_tokens=max_new_tokens or task.max_response_tokens, seed=seed
    )
    generator = HFGenerator(model, tokenizer, batch_size=max(1, SEQUENCES_PER_BATCH // n), progress=False)
    _, metrics = evaluate_rows(generator, evaluation_rows(task, list(problems)), sampling, desc=task.name, progress=False)
    return metrics


def validation_metrics(task_name: str, result: dict) -> dict[str, float]:
    """``heldout_accuracy``'s result under verl's validation metric names (``val-core`` the headline,
    ``val-aux`` the rest), and ``val/accuracy``, the accuracy every table and figure reads."""
    n = result["num_samples"] // result["num_problems"]
    return {
        "val/accuracy": result["mean_at_n"],
        f"val-core/{task_name}/acc/mean@{n}": result["mean_at_n"],
        **{f"val-aux/{task_name}/acc/pass@{k}": value for k, value in result["pass_at_k"].items()},
        **{
            f"val-aux/{task_name}/acc_{name}/mean@{n}": format_metrics["mean_at_n"]
            for name, format_metrics in result["by_answer_format"].items()
            if name != result["answer_format"]
        },
        f"val-aux/{task_name}/response_length/mean": result["mean_response_tokens"],
        f"val-aux/{task_name}/response_length/clip_ratio": result["truncated"],
    }
