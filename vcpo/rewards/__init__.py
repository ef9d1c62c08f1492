"""Verifiable rewards: GSM8K ``####`` match, math-verify for MATH / AIME / AMC / DAPO, Countdown.

From verl::

    reward.custom_reward_function.path=pkg://vcpo.rewards reward.custom_reward_function.name=compute_score

``compute_score`` returns ``{"score", "acc", "reason", "truncated"}``; ``reason`` is one of ``REASONS``.
``score_batch`` scores many answers with math-verify running in parallel worker processes, each answer
bounded by a hard timeout (reason ``timeout``; totals in ``reward_stats()``).
Both entry points take ``answer_format``, one of ``ANSWER_FORMATS``: ``strict`` (the default) reads only
the answer format the task's prompt asks for, ``lenient`` also a bare final number or expression (see
``vcpo.rewards.scoring``).
"""

from vcpo.rewards.countdown import countdown_ground_truth
from vcpo.rewards.extract import ANSWER_FORMATS
from vcpo.rewards.scoring import (
    DEFAULT_TIMEOUT_S,
    MAX_SOLUTION_CHARS,
    REASONS,
    RESPONSE_ENDED,
    REWARD_BY_DATA_SOURCE,
    compute_score,
    reward_kind,
    reward_stats,
    score_batch,
)

__all__ = [
    "ANSWER_FORMATS",
    "DEFAULT_TIMEOUT_S",
    "MAX_SOLUTION_CHARS",
    "REASONS",
    "RESPONSE_ENDED",
    "REWARD_BY_DATA_SOURCE",
    "compute_score",
    "countdown_ground_truth",
    "reward_kind",
    "reward_stats",
    "score_batch",
]
