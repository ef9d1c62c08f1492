"""Calls per second and latency of the code sandbox with N programs running at once, and a leak check.

For each isolation mode and each concurrency N, ``--calls`` programs go through ``run_python`` from
N threads (as verl's tool agent loop runs them, see ``vcpo.tools.python_tool``); the table gives calls
per second (wall clock of the whole batch), the median and 99th-percentile latency of one call, and
any call that did not end ``ok``. Afterwards it checks that no sandbox process, sandbox directory, child
process or open file descriptor of this process was left behind.

    python benchmarks/sandbox_throughput.py --calls 2500 --concurrency 1,2,4,8     # 10,000 calls per mode
    python benchmarks/sandbox_throughput.py --program numpy --calls 200
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from tqdm import tqdm

from vcpo.tools.sandbox import leftover_sandboxes, namespaces_available, run_python

PROGRAMS = {
    "trivial": "print(1)",
    "numpy": "import numpy\nprint(int(numpy.arange(1000).sum()))",
    "sympy": "import sympy\nprint(sympy.factorint(2**32 + 1))",
}


def child_processes() -> list[int]:
    """Pids whose parent is this process (a zombie left unreaped counts)."""
    children = []
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == os.getpid():
            children.append(int(name))
    return children


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def measure(code: str, calls: int, concurrency: int, isolation: str, progress: tqdm) -> dict:
    def one_call(_index: int) -> tuple[float, str]:
        started = time.perf_counter()
        result = run_python(code, isolation=isolation)
        progress.update()
        return time.perf_counter() - started, result.status.value

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        outcomes = list(pool.map(one_call, range(calls)))
    seconds = time.perf_counter() - started
    latencies = [latency for latency, _ in outcomes]
    return {
        "isolation": isolation,
        "concurrency": concurrency,
        "calls": calls,
        "calls_per_s": calls / seconds,
        "p50_ms": 1000 * statistics.median(latencies),
        "p99_ms": 1000 * percentile(latencies, 0.99),
        "statuses": dict(Counter(status for _, status in outcomes)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=500, help="calls per (mode, concurrency)")
    parser.add_argument("--concurrency", default="1,2,4,8", help="comma-separated numbers of concurrent sandboxes")
    parser.add_argument("--isolation", default="namespaces,hooks", help="comma-separated modes")
    parser.add_argument("--program", choices=sorted(PROGRAMS), default="trivial")
    parser.add_argument("--json", help="also write the rows and the leak check to this file")
    args = parser.parse_args()

    levels = [int(level) for level in args.concurrency.split(",")]
    modes = [mode for mode in args.isolation.split(",") if mode != "namespaces" or namespaces_available()]
    code = PROGRAMS[args.program]
    for mode in modes:  # start-up probes (namespaces, seccomp) and imports, outside the measurement
        run_python(code, isolation=mode)
    descriptors_before, children_before = open_descriptors(), child_processes()
    print(f"program {args.program!r}; {os.cpu_count()} CPUs; {args.calls} calls per row\n")
    rows = []
    with tqdm(total=len(modes) * len(levels) * args.calls, unit="call", desc="sandbox calls") as progress:
        for mode in modes:
            for level in levels:
                rows.append(measure(code, args.calls, level, mode, progress))
    pids, directories = leftover_sandboxes(os.getpid())
    leaks = {
        "calls": len(rows) * args.calls,
        "sandbox_processes": pids,
        "sandbox_directories": directories,
        "child_processes": sorted(set(child_processes()) - set(children_before)),
        "open_descriptors_added": open_descriptors() - descriptors_before,
    }
    print("| isolation | concurrent | calls | calls/s | p50 ms | p99 ms | statuses |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for row in rows:
        statuses = ", ".join(f"{status} {count}" for status, count in sorted(row["statuses"].items()))
        print(
            f"| {row['isolation']} | {row['concurrency']} | {row['calls']} | {row['calls_per_s']:.1f} "
            f"| {row['p50_ms']:.0f} | {row['p99_ms']:.0f} | {statuses} |"
        )
    print(f"\nafter {leaks['calls']} calls: {json.dumps({k: v for k, v in leaks.items() if k != 'calls'})}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"program": args.program, "rows": rows, "leaks": leaks}, handle, indent=2)


if __name__ == "__main__":
    main()
