"""math-verify in worker processes, each answer bounded by a hard timeout that the parent enforces.

math-verify (sympy underneath) can run for hours on a hostile answer, and its own signal-based
timeout only works in a process's main thread: verl calls reward functions from executor threads.
So every answer goes to a worker process; when one runs past its time limit the parent kills that
worker and the answer scores 0 with reason ``timeout``; a replacement starts at once.

Workers are fresh interpreters (``python -m vcpo.rewards._math_verify_worker``), not forks: forking a
multi-threaded trainer can deadlock the child, and multiprocessing's spawn and fork-server modes
re-import the caller's main script, which breaks scripts without a ``__main__`` guard.
"""

from __future__ import annotations

import atexit
import os
import queue
import socket
import subprocess
import sys
import threading
from collections import Counter
from multiprocessing.connection import Connection
from pathlib import Path

from vcpo.rewards.extract import max_bracket_depth

READY = "ready"
_WORKER_MODULE = "vcpo.rewards._math_verify_worker"
# Reference solutions of MATH and AIME nest at most 7 deep; math-verify's LaTeX parsing time grows
# exponentially with nesting (braces 12 deep take about a second, 16 deep several).
MAX_BRACKET_DEPTH = 12
WORKER_MEMORY_LIMIT_BYTES = 4 * 1024**3
WORKER_START_TIMEOUT_S = 120.0


def default_worker_count() -> int:
    return min(4, os.cpu_count() or 1)


class _Worker:
    """One worker process and the socket to it; restarted after every kill."""

    def __init__(self):
        self.counters: Counter = Counter()
        self._process: subprocess.Popen | None = None
        self._connection: Connection | None = None
        self._ready = False

    def judge(self, solution: str, gold: str, timeout_s: float) -> str:
        if self._process is None:
            self._launch()
        self._wait_until_ready()
        try:
            self._connection.send((solution, gold))
            if self._connection.poll(timeout_s):
                return self._connection.recv()
        except (EOFError, OSError):
            # The worker died (out of memory, crashed in C code): the answer gets no verdict.
            self.counters["worker_errors"] += 1
            self._restart()
            return "error"
        self.counters["timeouts"] += 1
        self._restart()
        return "timeout"

    def _launch(self) -> None:
        """Start a worker without waiting for it: its imports overlap with other work."""
        parent_socket, child_socket = socket.socketpair()
        with child_socket:
            self._process = subprocess.Popen(
                [sys.executable, "-m", _WORKER_MODULE, str(child_socket.fileno()), str(WORKER_MEMORY_LIMIT_BYTES)],
                pass_fds=[child_socket.fileno()],
                stdin=subprocess.DEVNULL,
                env=_worker_environment(),
            )
        self._connection = Connection(parent_socket.detach())
        self._ready = False
        self.counters["workers_started"] += 1

    def _wait_until_ready(self) -> None:
        # The import happens before the first answer so that it never counts against a time limit.
        if self._ready:
            return
        try:
            self._ready = self._connection.poll(WORKER_START_TIMEOUT_S) and self._connection.recv() == READY
        except EOFError:
            self._ready = False
        if not self._ready:
            self.stop()
            raise RuntimeError(
                f"a math-verify worker ({sys.executable} -m {_WORKER_MODULE}) did not start within "
                f"{WORKER_START_TIMEOUT_S:.0f} s; its error output, if any, is above"
            )

    def _restart(self) -> None:
        self.stop()
        self._launch()

    def stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._connection.close()
        self._process = self._connection = None


def _worker_environment() -> dict[str, str]:
    """This environment, with the directory that holds ``vcpo`` first on the worker's import path."""
    package_root = str(Path(__file__).resolve().parents[2])
    python_path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([package_root, python_path] if python_path else [package_root])}


class MathVerifyPool:
    """Up to ``size`` worker processes shared by any number of calling threads."""

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"workers must be >= 1, got {size}")
        self._workers: list[_Worker] = []
        self._idle: queue.LifoQueue[_Worker] = queue.LifoQueue()  # warm workers first
        self._resize_lock = threading.Lock()
        self.ensure_size(size)
        atexit.register(self.close)

    @property
    def size(self) -> int:
        return len(self._workers)

    def stats(self) -> dict[str, int]:
        """Totals since the pool was made: ``timeouts``, ``worker_errors``, ``workers_started``."""
        totals = Counter({"timeouts": 0, "worker_errors": 0, "workers_started": 0})
        for worker in self._workers:
            totals.update(worker.counters)
        return dict(totals)

    def ensure_size(self, size: int) -> None:
        """Grow to at least ``size`` workers (processes start lazily, on their first answer)."""
        with self._resize_lock:
            for _ in range(size - len(self._workers)):
                worker = _Worker()
                self._workers.append(worker)
                self._idle.put(worker)

    def judge(self, solution: str, gold: str, timeout_s: float) -> str:
        """Reason for ``solution`` against ``gold``; blocks while every worker is busy."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_bracket_depth(solution) > MAX_BRACKET_DEPTH:
            return "invalid"
        worker = self._idle.get()
        try:
            return worker.judge(solution, gold, timeout_s)
        finally:
            self._idle.put(worker)

    def close(self) -> None:
        """Stop every worker process (also done at exit); a later answer starts them again."""
        for _ in self._workers:
            worker = self._idle.get()  # waits for answers in flight
            worker.stop()
            self._idle.put(worker)


_shared_pool: MathVerifyPool | None = None
_shared_pool_lock = threading.Lock()


def shared_pool(min_workers: int | None = None) -> MathVerifyPool:
    """The process-wide pool, created on first use and grown to ``min_workers`` when asked."""
    global _shared_pool
    with _shared_pool_lock:
        if _shared_pool is None:
            _shared_pool = MathVerifyPool(min_workers or default_worker_count())
        elif min_workers:
            _shared_pool.ensure_size(min_workers)
        return _shared_pool
