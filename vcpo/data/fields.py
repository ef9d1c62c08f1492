"""Reading the question and gold answer out of a raw record, whatever layout its copy uses.

Layouts seen: ``question``/``problem``/``Problem`` (AIME 2024 on the hub capitalises its columns),
answers as strings, integers or floats (``70.0``), GSM8K solutions ending in ``#### 18``, MATH
records with only a ``solution`` whose last ``\\boxed{}`` holds the answer, and verl-schema records
(DAPO-Math-17k) with a chat ``prompt`` and ``reward_model.ground_truth``.
"""

from __future__ import annotations

import math
import re
from typing import Any

from vcpo.data.datasets import GOLD_AFTER_HASHES, DatasetSpec
from vcpo.rewards.extract import last_boxed

_QUESTION_KEYS = ("problem", "question", "prompt")
# DAPO-Math-17k wraps each problem in an instruction to end with "Answer: ..."; our template asks for
# \boxed{} instead, so the problem is cut out of the wrapper.
_DAPO_PREFIX = "Solve the following math problem step by step."
_DAPO_SUFFIX = "\n\nRemember to put your answer on its own line after"


def question_of(record: dict[str, Any]) -> str:
    """The problem statement of ``record``."""
    value = _first_field(record, _QUESTION_KEYS)
    if isinstance(value, (list, tuple)):  # a chat prompt: the user turn holds the problem
        value = next((turn["content"] for turn in value if turn.get("role") == "user"), None)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"no question field ({'/'.join(_QUESTION_KEYS)}) in record with keys {sorted(record)}")
    return _strip_dapo_wrapper(value.strip())


def gold_of(record: dict[str, Any], task: DatasetSpec) -> str:
    """The gold final answer of ``record`` as a normalised string."""
    answer = _answer_field(record)
    if task.gold_rule == GOLD_AFTER_HASHES:
        if answer is None:
            raise ValueError(f"no 'answer' field (nor 'reward_model.ground_truth') in record with keys {sorted(record)}")
        return gsm8k_final_answer(str(answer))
    if answer is None or (isinstance(answer, str) and not answer.strip()):
        solution = _first_field(record, ("solution",))
        answer = last_boxed(solution) if isinstance(solution, str) else None
    if answer is None:
        raise ValueError(
            f"no answer in record with keys {sorted(record)}: expected 'answer', "
            "'reward_model.ground_truth' or a 'solution' ending in \\boxed{...}"
        )
    return normalise_answer(answer)


def original_answer_of(record: dict[str, Any]) -> str:
    """The record's own answer text, kept in ``extra_info``: its answer, else its solution."""
    answer = _answer_field(record)
    return str(answer if answer is not None else _first_field(record, ("solution",)))


def _answer_field(record: dict[str, Any]) -> Any:
    answer = _first_field(record, ("answer",))
    if answer is None and isinstance(record.get("reward_model"), dict):
        answer = record["reward_model"].get("ground_truth")
    return answer


def gsm8k_final_answer(solution: str) -> str:
    """The number after the last ``####`` of a GSM8K reference solution, without thousands commas."""
    if "####" not in solution:
        raise ValueError(f"GSM8K answer has no '####' final answer: {solution[-200:]!r}")
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


def normalise_answer(answer: Any) -> str:
    """Answers as text: ``70.0`` -> ``"70"``, ``"025"`` -> ``"25"`` (AIME pads to three digits)."""
    if isinstance(answer, bool):
        raise ValueError(f"answer must be text or a number, got {answer!r}")
    if isinstance(answer, float) and math.isfinite(answer) and answer.is_integer():
        return str(int(answer))
    text = str(answer).strip()
    if re.fullmatch(r"-?[0-9]+", text):
        return str(int(text))
    return text


def _first_field(record: dict[str, Any], names: tuple[str, ...]) -> Any:
    """The first of ``names`` present in ``record``, matching keys case-insensitively."""
    by_lower_name = {key.lower(): value for key, value in record.items()}
    return next((by_lower_name[name] for name in names if by_lower_name.get(name) is not None), None)


def _strip_dapo_wrapper(text: str) -> str:
    if not text.startswith(_DAPO_PREFIX) or "\n\n" not in text:
        return text
    body = text.split("\n\n", 1)[1]
    return body.rsplit(_DAPO_SUFFIX, 1)[0].strip()
