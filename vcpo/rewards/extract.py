"""Locating final answers in model output: the last ``\\boxed{}``, the last ``<answer>`` tag, the tail.

``ANSWER_FORMATS`` names how far each reward looks for an answer: ``strict`` reads only the format the
task's prompt asks for (``\\boxed{}``, ``#### N``, ``<answer>`` tags), ``lenient`` falls back to a bare
number or expression anywhere in the text when that format is missing.
"""

from __future__ import annotations

import re

ANSWER_FORMATS = ("strict", "lenient")

# \fbox is the variant a handful of MATH reference solutions use for their final answer.
_BOX_COMMAND = re.compile(r"\\(?:boxed|fbox)\b\s*")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def check_answer_format(answer_format: str) -> str:
    """``answer_format`` itself if it is one of :data:`ANSWER_FORMATS`, else ValueError."""
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"unknown answer_format {answer_format!r}; allowed: {', '.join(ANSWER_FORMATS)}")
    return answer_format


def last_boxed(text: str) -> str | None:
    """Content of the last complete ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced.

    Unbalanced or unterminated boxes are skipped in favour of an earlier complete one. The short form
    ``\\boxed 5`` (no braces) yields the token after the command. None when there is no complete box.
    """
    found = _last_boxed_with_start(text)
    return found[0] if found else None


def _last_boxed_with_start(text: str) -> tuple[str, int] | None:
    closing = _matching_braces(text)
    for match in reversed(list(_BOX_COMMAND.finditer(text))):
        start = match.end()
        if start < len(text) and text[start] == "{":
            if start in closing:
                return text[start + 1 : closing[start]], match.start()
        else:
            token = re.match(r"[^\s$]+", text[start:])
            if token:
                return token.group(0), match.start()
    return None


def _matching_braces(text: str) -> dict[int, int]:
    """Index of each group-opening brace -> index of its closing brace, in one pass (unmatched ones absent)."""
    open_indices: list[int] = []
    closing: dict[int, int] = {}
    for index, char in enumerate(text):
        # An escaped brace (\{ or \}) is a literal set brace, not a group delimiter.
        if char not in "{}" or (index and text[index - 1] == "\\"):
            continue
        if char == "{":
            open_indices.append(index)
        elif open_indices:
            closing[open_indices.pop()] = index
    return closing


def last_boxed_or_answer_tag(text: str) -> str | None:
    """Whichever of the last complete ``\\boxed{}`` and the last ``<answer>`` tag starts later in ``text``."""
    candidates = [found for found in (_last_boxed_with_start(text), _last_answer_tag(text)) if found]
    return max(candidates, key=lambda found: found[1])[0] if candidates else None


def _last_answer_tag(text: str) -> tuple[str, int] | None:
    matches = list(_ANSWER_TAG.finditer(text))
    return (matches[-1].group(1), matches[-1].start()) if matches else None


def keep_tail(text: str, max_chars: int) -> tuple[str, bool]:
    """The last ``max_chars`` characters of ``text`` (final answers sit at the end) and whether it was cut."""
    if len(text) <= max_chars:
        return text, False
    return text[-max_chars:], True


def max_bracket_depth(text: str) -> int:
    """Deepest nesting of ``{``, ``(`` and ``[`` taken together (closers of any kind close one level)."""
    depth = deepest = 0
    for char in text:
        if char in "{([":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "})]" and depth:
            depth -= 1
    return deepest
