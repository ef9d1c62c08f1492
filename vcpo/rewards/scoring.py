"""One entry point per use: ``compute_score`` for verl, ``score_batch`` for evaluation and simulation.

Both take ``answer_format``, one of ``ANSWER_FORMATS`` (``vcpo.rewards.extract``): where the answer is.

- ``strict`` (the default, for training and evaluation): only the format the task's prompt asks for
  (vcpo.data.datasets). math: the last complete ``\\boxed{}``, re-boxed alone and given to math-verify;
  gsm8k: the number after the last ``####``; countdown: the last ``<answer>`` tag or ``\\boxed{}``.
  Unformatted text scores 0 with reason ``no_answer``.
- ``lenient``: also a right value written without the format, as many published evaluations accept.
  math: math-verify's own extraction over the whole text (a box first, else the last number or LaTeX
  expression); gsm8k: the ``####`` number, else the last number in the text; countdown: the tag or
  box, else the last line that is plain arithmetic. A response the length limit cut off (``extra_info``'s
  ``response_ended`` False: the caller knows it did not end with its end-of-sequence token) has no answer
  unless it wrote one in the format: the last number of a cut text is wherever the cut fell, not an answer
  (a cut "...4 bolts.\n3. Now, we know that half" would score the list number 3). Callers that do not say
  (``response_ended`` absent) are read as before.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tqdm.auto import tqdm

from vcpo.rewards.countdown import score_countdown
from vcpo.rewards.extract import check_answer_format, keep_tail, last_boxed
from vcpo.rewards.gsm8k import score_gsm8k

logger = logging.getLogger(__name__)

REASONS = ("correct", "wrong", "no_answer", "timeout", "invalid", "error")
DEFAULT_TIMEOUT_S = 5.0
# Final answers sit at the end of a response; the tail bounds the parsing cost of megabyte outputs
# and still holds several thousand tokens of a normal response.
MAX_SOLUTION_CHARS = 8_000
# extra_info's key for whether the response ended with its end-of-sequence token (False: cut at the length limit)
RESPONSE_ENDED = "response_ended"

# vcpo.data writes the task name as data_source; each names the rule that verifies its answers.
REWARD_BY_DATA_SOURCE = {
    "gsm8k": "gsm8k",
    "countdown": "countdown",
    **{name: "math" for name in ("math", "math500", "aime24", "aime25", "amc23", "dapo_math")},
}
_IN_PROCESS_SCORERS = {"gsm8k": score_gsm8k, "countdown": score_countdown}


def reward_kind(data_source: str) -> str:
    """``gsm8k``, ``countdown`` or ``math``: the rule that scores answers of ``data_source``."""
    try:
        return REWARD_BY_DATA_SOURCE[data_source]
    except KeyError:
        raise ValueError(f"no reward for data_source {data_source!r}; known: {sorted(REWARD_BY_DATA_SOURCE)}") from None


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    answer_format: str = "strict",
    **kwargs: Any,
) -> dict[str, Any]:
    """verl ``custom_reward_function``: ``{"score": 0.0|1.0, "acc": bool, "reason": str, "truncated": bool}``.

    ``reason`` is one of :data:`REASONS`. ``truncated`` says that only the last ``MAX_SOLUTION_CHARS``
    characters of the response were read. Every call returns the same keys, as verl's reward managers
    collect each key into one column. ``extra_info`` and other keyword arguments that verl passes
    (``reward_router_address``, ...) are accepted and not needed. ``answer_format`` (``strict`` or
    ``lenient``, see the module docstring) and ``timeout_s`` can be set through
    ``custom_reward_function.reward_kwargs``; an unknown ``answer_format`` is a ValueError.
    """
    check_answer_format(answer_format)
    return _score_one(reward_kind(data_source), solution_str, ground_truth, timeout_s, format_for(answer_format, extra_info))


def format_for(answer_format: str, extra_info: dict | None) -> str:
    """The format a response is read in: ``strict`` for a ``lenient`` response cut at the length limit."""
    cut = isinstance(extra_info, dict) and extra_info.get(RESPONSE_ENDED) is False
    return "strict" if answer_format == "lenient" and cut else answer_format


def score_batch(
    data_sources: Sequence[str],
    solutions: Sequence[str],
    ground_truths: Sequence[Any],
    extra_infos: Sequence[dict] | None = None,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    answer_format: str = "strict",
    workers: int | None = None,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """:func:`compute_score` for many answers at once, math answers on ``workers`` processes in parallel.

    Results come back in input order. Every answer is read under the one ``answer_format``, except that
    ``extra_infos``' ``response_ended`` False reads a ``lenient`` answer as ``strict`` (:func:`format_for`).
    """
    check_answer_format(answer_format)
    columns = {"solutions": solutions, "ground_truths": ground_truths}
    if extra_infos is not None:
        columns["extra_infos"] = extra_infos
    for name, column in columns.items():
        if len(column) != len(data_sources):
            raise ValueError(f"score_batch: {name} has {len(column)} items, data_sources has {len(data_sources)}")
    kinds = [reward_kind(source) for source in data_sources]
    thread_count = 1
    if "math" in kinds:
        thread_count = _math_pool(workers).size

    def score(index: int) -> dict[str, Any]:
        info = extra_infos[index] if extra_infos is not None else None
        return _score_one(kinds[index], solutions[index], ground_truths[index], timeout_s, format_for(answer_format, info))

    with ThreadPoolExecutor(max_workers=thread_count) as executor:
        results = list(
            tqdm(executor.map(score, range(len(kinds))), total=len(kinds), desc="scoring", disable=not progress)
        )
    reasons = Counter(result["reason"] for result in results)
    if reasons["timeout"] or reasons["error"]:
        logger.warning(
            "score_batch: %d of %d answers timed out (limit %.1f s), %d failed with a worker error",
            reasons["timeout"],
            len(results),
            timeout_s,
            reasons["error"],
        )
    return results


def reward_stats() -> dict[str, int]:
    """Totals of this process's math-verify workers: ``timeouts``, ``worker_errors``, ``workers_started``."""
    return _math_pool(None).stats()


def _score_one(kind: str, solution: Any, ground_truth: Any, timeout_s: float, answer_format: str) -> dict[str, Any]:
    if not isinstance(solution, str):
        return _result("invalid", truncated=False)
    solution, truncated = keep_tail(solution, MAX_SOLUTION_CHARS)
    if kind == "math":
        reason = _score_math(solution, _answer_text(ground_truth), timeout_s, answer_format)
    else:
        reason = _IN_PROCESS_SCORERS[kind](solution, ground_truth, answer_format)
    return _result(reason, truncated)


def _score_math(solution: str, gold: str, timeout_s: float, answer_format: str) -> str:
    if answer_format == "strict":
        # Only the last complete box reaches math-verify, so its fallbacks (the last number or LaTeX
        # expression anywhere) never see the rest of the text; no box is no answer, without a worker.
        boxed = last_boxed(solution)
        if boxed is None:
            return "no_answer"
        solution = "\\boxed{" + boxed + "}"
    return _math_pool(None).judge(solution, gold, timeout_s)


def _answer_text(ground_truth: Any) -> str:
    if not isinstance(ground_truth, (str, int, float)) or not str(ground_truth).strip():
        raise ValueError(f"math ground_truth must be a non-empty string or number, got {ground_truth!r}")
    return str(ground_truth)


def _result(reason: str, truncated: bool) -> dict[str, Any]:
    correct = reason == "correct"
    return {"score": 1.0 if correct else 0.0, "acc": correct, "reason": reason, "truncated": truncated}


def _math_pool(workers: int | None):
    # Imported on first use: the worker module loads sympy and math-verify, which the GSM8K and
    # Countdown rewards (and vcpo.data) never need.
    from vcpo.rewards.math_workers import shared_pool

    return shared_pool(workers)
