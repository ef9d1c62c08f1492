"""GSM8K: the number after the last ``####``, compared as an exact decimal.

``strict`` (the default) reads only that number: the prompt asks for the answer after ``####``.
``lenient`` falls back to the last number anywhere in the text when no ``####`` number is there.
"""

from __future__ import annotations

import re
from decimal import Decimal

from vcpo.rewards.extract import check_answer_format

_FINAL_MARKER = "####"
# The answer token after the marker: an optional sign and dollar sign, digits with thousands commas, a
# decimal part, and a sentence-ending period that is not part of the number.
_NUMBER_AFTER_MARKER = re.compile(r"\s*(-?\s*\$?\s*-?[0-9][0-9,]*(?:\.[0-9]+)?)\.?(?![0-9])")
# Any number in running text (lenient fallback): a sign, a dollar sign, digits with well-formed
# thousands groups, a decimal part. "1,2,3" is three numbers, not 123.
_ANY_NUMBER = re.compile(r"-?\$?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?(?![0-9])")


def parse_number(text: str) -> Decimal | None:
    """``text`` as an exact decimal after dropping thousands commas, ``$``, spaces and a trailing ``.``."""
    cleaned = re.sub(r"[,$\s]", "", text).rstrip(".")
    if not re.fullmatch(r"-?[0-9]+(?:\.[0-9]+)?", cleaned):
        return None
    return Decimal(cleaned)


def score_gsm8k(solution: str, ground_truth: str, answer_format: str = "strict") -> str:
    """Reason for ``solution``: the number right after the LAST ``####`` counts; under ``lenient``, when
    there is no such number, the last number of the text does."""
    check_answer_format(answer_format)
    gold = parse_number(str(ground_truth))
    if gold is None:
        raise ValueError(f"GSM8K ground_truth must be a number, got {ground_truth!r}")
    reason, answer = _marked_answer(solution)
    if answer is None and answer_format == "lenient":
        answer = _last_number(solution)
    if answer is None:
        return reason
    return "correct" if answer == gold else "wrong"


def _marked_answer(solution: str) -> tuple[str, Decimal | None]:
    """``(reason, number)`` for the text after the last marker: ``no_answer`` without a marker,
    ``invalid`` when no number follows it."""
    marker = solution.rfind(_FINAL_MARKER)
    if marker < 0:
        return "no_answer", None
    match = _NUMBER_AFTER_MARKER.match(solution, marker + len(_FINAL_MARKER))
    answer = parse_number(match.group(1)) if match else None
    return ("invalid", None) if answer is None else ("", answer)


def _last_number(text: str) -> Decimal | None:
    matches = list(_ANY_NUMBER.finditer(text))
    return parse_number(matches[-1].group(0)) if matches else None
