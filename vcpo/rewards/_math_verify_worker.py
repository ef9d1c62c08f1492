"""The program each math-verify worker process runs (started by ``vcpo.rewards.math_workers``).

``python -m vcpo.rewards._math_verify_worker FD MEMORY_LIMIT_BYTES`` answers ``(solution, gold)``
requests on the socket FD with a reason string, one at a time. The parent kills it whenever an answer
runs past its time limit, so it keeps no state worth saving. math-verify's own signal-based timeouts
are switched off: the parent enforces the limit.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import resource
import sys
import threading
import time
import warnings
from multiprocessing.connection import Connection

import sympy
from math_verify import LatexExtractionConfig, parse, verify

from vcpo.rewards.math_workers import READY

# Exact integers of more digits than this are not compared: sympy evaluates integer powers and
# factorials exactly, so an answer such as 9^{9^9} (370 million digits) would never finish.
MAX_RESULT_DIGITS = 1_000_000


def serve(connection: Connection, memory_limit_bytes: int) -> None:
    """Answer requests on ``connection`` until the parent closes it."""
    _limit_address_space(memory_limit_bytes)
    _exit_with_parent()
    # math-verify warns once per process that its timeouts are off; here that is deliberate.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    # Arbitrary text (lenient answers) makes latex2sympy build odd sympy objects, and sympy prints a
    # multi-line deprecation warning for many of them onto the caller's terminal.
    warnings.filterwarnings("ignore", category=sympy.utilities.exceptions.SymPyDeprecationWarning)
    connection.send(READY)
    while True:
        try:
            solution, gold = connection.recv()
        except EOFError:
            return
        connection.send(judge(solution, gold))


def judge(solution: str, gold: str) -> str:
    """``correct``, ``wrong``, ``no_answer``, ``invalid`` (unevaluable size) or ``error``."""
    try:
        gold_parsed = _parse_gold(gold)
        answer = parse(solution, parsing_timeout=None)
        if not answer:
            return "no_answer"
        if any(_log10_size(item) > MAX_RESULT_DIGITS for item in answer if isinstance(item, sympy.Basic)):
            return "invalid"
        return "correct" if verify(gold_parsed, answer, timeout_seconds=None) else "wrong"
    except Exception:  # MemoryError past the address-space limit, RecursionError, a sympy bug: no verdict
        return "error"


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> list:
    # Boxing the gold makes math-verify read all of it as one LaTeX answer (a gold such as
    # "\text{(C)}" or "3, 5" must not be cut to its first number). Many responses share a gold.
    parsed = parse("\\boxed{" + gold + "}", extraction_config=[LatexExtractionConfig()], parsing_timeout=None)
    return parsed or parse(gold, parsing_timeout=None)


def _log10_size(expr: sympy.Basic) -> float:
    """Rough upper estimate of the decimal digits of the exact numbers sympy would build from ``expr``."""
    if isinstance(expr, sympy.Rational):
        return math.log10(abs(expr.p) + 1) + math.log10(expr.q)
    if isinstance(expr, sympy.Pow) and isinstance(expr.base, sympy.Rational) and expr.exp.is_number:
        return _value_bound(expr.exp) * _log10_size(expr.base)
    if isinstance(expr, sympy.factorial) and expr.args[0].is_number:
        count = _value_bound(expr.args[0])
        return count * math.log10(count + 1)
    return max((_log10_size(arg) for arg in expr.args if isinstance(arg, sympy.Basic)), default=0.0)


def _value_bound(expr: sympy.Basic) -> float:
    digits = _log10_size(expr)
    return math.inf if digits > 300 else 10.0**digits


def _exit_with_parent() -> None:
    """Exit once the parent is gone, even in the middle of an answer, instead of spinning on as an orphan."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _limit_address_space(limit_bytes: int) -> None:
    """Make a runaway computation fail with MemoryError instead of exhausting the machine."""
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit_bytes = min(limit_bytes, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, hard))


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])), int(sys.argv[2]))
