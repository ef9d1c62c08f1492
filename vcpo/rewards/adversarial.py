"""Hostile model outputs for robustness tests and throughput benchmarks of the rewards.

Each kind stresses one way a verifier can hang or blow up: exponent towers that sympy would evaluate
exactly, megabyte outputs, brace and parenthesis nesting that makes LaTeX parsing exponential, long
flat expressions, and code-like or non-ASCII text aimed at the Countdown evaluator.
"""

from __future__ import annotations

import random


def _power_tower(rng: random.Random) -> str:
    base = rng.randint(2, 99)
    return rf"The answer is \boxed{{{base}^{{{base}^{{{base}^{base}}}}}}}."


def _huge_factorial(rng: random.Random) -> str:
    return rf"\boxed{{({rng.randint(10**7, 10**9)})!}}"


# What a megabyte answer repeats: plain letters and digits, LaTeX, inline math, unclosed groups.
MEGABYTE_FILLERS = ("x", "1", "\\frac{1}{2}+", "$a$ ", "{", "(")


def _megabyte_text(rng: random.Random) -> str:
    filler = rng.choice(MEGABYTE_FILLERS)
    return filler * (1_000_000 // len(filler)) + rf"\boxed{{{rng.randint(0, 999)}}}"


def _nested_braces(rng: random.Random) -> str:
    depth = rng.randint(50, 5000)
    return r"\boxed{" + "{" * depth + str(rng.randint(0, 9)) + "}" * depth + "}"


def _nested_fractions(rng: random.Random) -> str:
    depth = rng.randint(50, 500)
    return r"\boxed{" + r"\frac{1}{" * depth + str(rng.randint(2, 9)) + "}" * depth + "}"


def _long_sum(rng: random.Random) -> str:
    terms = rng.randint(500, 3000)
    return r"\boxed{" + "+".join(rng.choice(["x", "y", "1", r"\pi"]) for _ in range(terms)) + "}"


def _code_injection(rng: random.Random) -> str:
    payload = rng.choice(["__import__('os').system('true')", "9**9**9", "(lambda: 1)()", "open('/etc/passwd')"])
    return f"<answer>{payload}</answer> \\boxed{{{payload}}}"


def _non_ascii(rng: random.Random) -> str:
    return rng.choice(["<answer>１２ + ３４</answer>", "\\boxed{٣ × ٤}", "<answer>\u202e1+2</answer>", "\\boxed{∞}"])


ADVERSARIAL_KINDS = {
    "power_tower": _power_tower,
    "huge_factorial": _huge_factorial,
    "megabyte_text": _megabyte_text,
    "nested_braces": _nested_braces,
    "nested_fractions": _nested_fractions,
    "long_sum": _long_sum,
    "code_injection": _code_injection,
    "non_ascii": _non_ascii,
}


def adversarial_answers(count: int, seed: int = 0) -> list[tuple[str, str]]:
    """``count`` ``(kind, answer)`` pairs cycling through every kind, with seeded variation."""
    rng = random.Random(seed)
    kinds = list(ADVERSARIAL_KINDS)
    return [(kinds[index % len(kinds)], ADVERSARIAL_KINDS[kinds[index % len(kinds)]](rng)) for index in range(count)]
