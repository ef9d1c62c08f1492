"""How a cost grows with its input, measured in CPU time so that other work on the machine does not count.

A wall-clock bound fails on a loaded machine; the ratio of one thread's CPU time at n and 8n, measured in the
same test, tells a linear cost (about 8) from a quadratic one (about 64) at any load.
"""

from __future__ import annotations

import time
from collections.abc import Callable

# A linear cost grows about 8x from n to 8n, a quadratic one about 64x: the bound lies between, with room for the
# noise a loaded machine adds to CPU time (caches shared with other processes).
LINEAR_GROWTH = 24


def cpu_seconds(run: Callable[[], object], repeats: int = 3) -> float:
    """The least CPU time this thread spends in ``run()`` over ``repeats`` calls."""
    least = float("inf")
    for _ in range(repeats):
        started = time.thread_time()
        run()
        least = min(least, time.thread_time() - started)
    return least


def growth_at_8n(cost: Callable[[int], Callable[[], object]], n: int) -> float:
    """How many times more CPU time ``cost(8 * n)()`` takes than ``cost(n)()``; ``cost(size)`` builds the input
    first, so that only the work on it is measured."""
    small, large = cost(n), cost(8 * n)
    return cpu_seconds(large) / max(cpu_seconds(small), 1e-6)
