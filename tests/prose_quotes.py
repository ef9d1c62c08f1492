"""The numbers a study's prose quotes, checked against the study's committed statistics: each 'X% [a, b]' must be
an arm's end or last-quarter mean with its interval, and each '+X points [a, b], Holm p = P' a registered
comparison, with its adjusted (and, where quoted, unadjusted) p-value."""

from __future__ import annotations

import re
from pathlib import Path

from vcpo.studies.evidence_report import interval, p_value, points, signed_points

ARM_QUOTE = re.compile(r"\d+\.\d% \[\d+\.\d, \d+\.\d\]")
COMPARISON_QUOTE = re.compile(r"([+-]\d+\.\d points \[[+-]\d+\.\d, [+-]\d+\.\d\])(?:,? \(?(?:unadjusted p = (\d\.\d{3}), )?"
                              r"Holm p (?:= )?(< 0\.001|\d\.\d{3}))?")


def normalised(text: str) -> str:
    """Whitespace-joined, typographic minus signs as '-'."""
    return " ".join(text.replace("\u2212", "-").split())


def study_prose(root: Path, path: str, studies_span: tuple[str, str], readme_marker: str) -> str:
    """A study's part of docs/studies.md (from studies_span[0] to studies_span[1]) or of the README (between
    <!-- readme_marker --> and <!-- /readme_marker -->), `normalised`."""
    text = (root / path).read_text()
    start, stop = studies_span if path == "docs/studies.md" else (f"<!-- {readme_marker} -->", f"<!-- /{readme_marker} -->")
    return normalised(text[text.index(start):text.index(stop)])


def assert_quotes_are_the_statistics(prose: str, arms: list[dict], comparisons: list[dict]) -> None:
    arm_quotes = set()
    for arm in arms:
        arm_quotes.add(f"{points(arm['end'])}% {interval(arm['end_low'], arm['end_high'])}")
        arm_quotes.add(f"{points(arm['last_quarter'])}% {interval(arm['last_quarter_low'], arm['last_quarter_high'])}")
    comparison_quotes = {
        (f"{signed_points(c['mean'])} points {interval(c['low'], c['high'], signed=True)}", p_value(c["p_holm"]), p_value(c["p"]))
        for c in comparisons if "verdict" in c
    }
    quoted_arms, quoted_comparisons = ARM_QUOTE.findall(prose), COMPARISON_QUOTE.findall(prose)
    assert quoted_arms and quoted_comparisons
    assert set(quoted_arms) <= arm_quotes, set(quoted_arms) - arm_quotes
    for quote, unadjusted, holm_p in quoted_comparisons:
        matches = [c for c in comparison_quotes if c[0] == quote]
        assert matches, quote
        assert not holm_p or any(c[1] == holm_p for c in matches), (quote, holm_p)
        assert not unadjusted or any(c[2] == unadjusted for c in matches), (quote, unadjusted)
