"""GSM8K: strict ``#### <number>`` matching, compared as exact decimals."""

from __future__ import annotations

import re
from decimal import Decimal

_FINAL_MARKER = "####"
# The answer token after the marker: an optional sign and dollar sign, digits with thousands commas, a
# decimal part, and a sentence-ending period that is not part of the number.
_NUMBER_AFTER_MARKER = re.compile(r"\s*(-?\s*\$?\s*-?[0-9][0-9,]*(?:\.[0-9]+)?)\.?(?![0-9])")


def parse_number(text: str) -> Decimal | None:
    """``text`` as an exact decimal after dropping thousands commas, ``$``, spaces and a trailing ``.``."""
    cleaned = re.sub(r"[,$\s]", "", text).rstrip(".")
    if not re.fullmatch(r"-?[0-9]+(?:\.[0-9]+)?", cleaned):
        return None
    return Decimal(cleaned)


def score_gsm8k(solution: str, ground_truth: str) -> str:
    """Reason for ``solution``: only the number right after the LAST ``####`` counts (strict format)."""
    gold = parse_number(str(ground_truth))
    if gold is None:
        raise ValueError(f"GSM8K ground_truth must be a number, got {ground_truth!r}")
    marker = solution.rfind(_FINAL_MARKER)
    if marker < 0:
        return "no_answer"
    match = _NUMBER_AFTER_MARKER.match(solution, marker + len(_FINAL_MARKER))
    answer = parse_number(match.group(1)) if match else None
    if answer is None:
        return "invalid"
    return "correct" if answer == gold else "wrong"
