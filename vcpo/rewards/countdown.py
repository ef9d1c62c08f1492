"""Countdown: the final expression must use every given number exactly once and equal the target.

Ground truth format (written by ``vcpo.data`` and accepted here as a JSON string or a dict):
``{"numbers": [36, 29, 95, 32, 4, 15], "target": 139}``.

The expression is the content of the last ``\\boxed{}`` or ``<answer>`` tag, whichever comes later
(answer format ``strict``, the default). Under ``lenient``, a response with neither (or only empty ones)
is read from its last line that parses as an arithmetic expression by the rules below.
It may hold only digits, whitespace, ``+ - * / × ÷`` and parentheses (``\\times``, ``\\cdot`` and
``\\div`` are read as operators); every other character, ``**``, ``//`` and a unary ``+`` are rejected
before anything is evaluated. A leading minus is allowed: Reasoning Gym's own solutions use it
(``-100 + (92*(24 + 15) - 83)/5``). Evaluation walks the syntax tree over exact fractions; nothing is
ever passed to ``eval``.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from fractions import Fraction

from vcpo.rewards.extract import check_answer_format, last_boxed_or_answer_tag

# Checked after the operator spellings below are rewritten to * and /. re.ASCII keeps \s to ASCII
# whitespace (and there is no \d: it would admit every Unicode digit).
_ALLOWED_CHARACTERS = re.compile(r"[0-9\s+\-*/()]*", re.ASCII)
_OPERATOR_SPELLINGS = {r"\times": "*", r"\cdot": "*", r"\div": "/", "×": "*", "÷": "/"}
# Six numbers of three digits with operators and generous spacing fit in far less.
MAX_EXPRESSION_CHARS = 256
_BINARY_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_ALLOWED_NODES = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.USub, ast.Constant, *_BINARY_OPERATORS)


def countdown_ground_truth(numbers: list[int], target: int) -> str:
    """The ground-truth string for a puzzle (the one format this module reads)."""
    return json.dumps({"numbers": [int(number) for number in numbers], "target": int(target)})


def parse_ground_truth(ground_truth: str | dict) -> tuple[list[int], int]:
    """``(numbers, target)`` from a ground truth in the format of :func:`countdown_ground_truth`."""
    try:
        puzzle = json.loads(ground_truth) if isinstance(ground_truth, str) else dict(ground_truth)
        numbers, target = puzzle["numbers"], puzzle["target"]
        if not all(isinstance(value, int) for value in [*numbers, target]):
            raise TypeError("numbers and target must be integers")
    except (ValueError, TypeError, KeyError) as error:
        raise ValueError(
            f'countdown ground_truth must be {{"numbers": [int, ...], "target": int}}, got {ground_truth!r}'
        ) from error
    return list(numbers), target


def score_countdown(solution: str, ground_truth: str | dict, answer_format: str = "strict") -> str:
    """Reason for ``solution``: correct only when all numbers are used once and the value equals the target."""
    check_answer_format(answer_format)
    numbers, target = parse_ground_truth(ground_truth)
    expression = last_boxed_or_answer_tag(solution)
    if expression is None or not expression.strip():
        tree = _last_arithmetic_line(solution) if answer_format == "lenient" else None
        if tree is None:
            return "no_answer"
    else:
        tree = _parse_arithmetic(expression)
    if tree is None or sorted(_literals(tree)) != sorted(numbers):
        return "invalid"
    try:
        value = _evaluate(tree.body)
    except ZeroDivisionError:
        return "invalid"
    return "correct" if value == target else "wrong"


def _parse_arithmetic(expression: str) -> ast.Expression | None:
    """The syntax tree of ``expression`` if it is plain binary arithmetic on integer literals, else None."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        return None
    for spelling, symbol in _OPERATOR_SPELLINGS.items():
        expression = expression.replace(spelling, symbol)
    if not _ALLOWED_CHARACTERS.fullmatch(expression):
        return None
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    nodes_allowed = all(isinstance(node, _ALLOWED_NODES) for node in ast.walk(tree))
    return tree if nodes_allowed else None


def _last_arithmetic_line(text: str) -> ast.Expression | None:
    """The syntax tree of the last line of ``text`` that is plain arithmetic (lenient fallback)."""
    for line in reversed(text.splitlines()):
        tree = _parse_arithmetic(line) if line.strip() else None
        if tree is not None:
            return tree
    return None


def _literals(tree: ast.Expression) -> list[int]:
    return [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)]


def _evaluate(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp):
        return -_evaluate(node.operand)
    return _BINARY_OPERATORS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
