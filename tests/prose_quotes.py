"""Checks of the numbers the README and docs quote against the files they come from, whatever the sentence around
them: ``section`` cuts a document's part, ``assert_quoted`` finds each expected number in it as a number (not as
part of a longer one), and ``assert_quotes_are_the_statistics`` checks that each 'X% [a, b]' a study's prose quotes
is an arm's end or last-quarter mean with its interval, and each '+X points [a, b], Holm p = P' a registered
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


ROOT = Path(__file__).resolve().parents[1]


def section(path: str, start: str | None = None, stop: str | None = None) -> str:
    """The part of ``path`` (relative to the repository) from the first ``start`` to the next ``stop`` after it (the
    whole file without them), `normalised`."""
    text = (ROOT / path).read_text()
    begin = text.index(start) if start else 0
    end = text.index(stop, begin) if stop else len(text)
    return normalised(text[begin:end])


def assert_quoted(text: str, *numbers: str) -> None:
    """Each of ``numbers`` (as formatted, e.g. "1.44", "+3.0", "72.5%") stands in ``text`` as a whole number: not
    preceded by a digit or a point, not followed by a digit or a decimal part. '−' counts as '-'."""
    text = normalised(text)
    missing = [number for number in numbers
               if not re.search(rf"(?<![\d.]){re.escape(normalised(number))}(?!\d|\.\d)", text)]
    assert not missing, f"not quoted: {missing}"


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
