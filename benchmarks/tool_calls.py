"""What the sandboxed tool costs a multi-turn simulator step, with its calls run one at a time and
concurrently, in one process, with ratios to the first setting.

    python benchmarks/tool_calls.py --workers 1,4 --steps 20 [key=value ...]

Trains sync on the ``tir`` task (its cached SFT base; the ``--config`` file's settings or the defaults,
plus any ``key=value`` override, no held-out evaluation) for ``--steps`` optimizer steps once per
``tool_workers`` value, and prints per setting: the mean step time and its tool share, the sandbox
executions per step and per second, their p50 / p99 latency, the calls per response and the error
fraction, and the step and tool time relative to the first setting. The runs sample the same tokens
(the tool's concurrency changes when programs run, not what they return).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from vcpo.runs import METRICS_FILE
from vcpo.sim.config import apply_overrides, start_config
from vcpo.sim.train import Trainer


def measure(config, workers: int, out: Path) -> dict[str, float]:
    run = apply_overrides(config, {"tool_workers": workers, "out": str(out / f"workers{workers}")})
    Trainer(run).run()
    lines = [json.loads(line) for line in (Path(run.out) / METRICS_FILE).read_text().splitlines()]
    steps = [line for line in lines if "tool/time_s" in line][1:]  # the first step also loads the model
    executions = sum(line["tool/executions"] for line in steps)
    return {
        "workers": workers,
        "step_s": float(np.mean([line["timing_s/step"] for line in steps])),
        "tool_s": float(np.mean([line["tool/time_s"] for line in steps])),
        "tool_frac": float(np.mean([line["tool/time_frac"] for line in steps])),
        "executions_per_step": executions / len(steps),
        "executions_per_s": executions / sum(line["tool/time_s"] for line in steps),
        "p50_s": float(np.median([line["tool/latency_p50_s"] for line in steps if "tool/latency_p50_s" in line])),
        "p99_s": float(np.max([line["tool/latency_p99_s"] for line in steps if "tool/latency_p99_s" in line])),
        "calls_per_response": float(np.mean([line["tool/calls_per_response"] for line in steps])),
        "error_frac": float(np.mean([line["tool/error_frac"] for line in steps])),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="1,4", help="tool_workers values, the first is the reference")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--config", default=None, help="a python -m vcpo.sim --config file")
    parser.add_argument("overrides", nargs="*", help="key=value settings")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first step, which also loads the model, is not counted)")
    base = apply_overrides(start_config(args.config), ["task=tir", "method=sync", "lag=0", f"steps={args.steps}",
                                                       "eval_every=0", "eval_problems=0", "progress=false", *args.overrides])  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(base, int(workers), Path(tmp)) for workers in args.workers.split(",")]
    print("| tool_workers | step s | tool s | tool share | executions / step | executions / s | p50 s | p99 s "
          "| calls / response | error frac | step / first | tool / first |")
    print("|---:" * 12 + "|")
    for row in rows:
        print(f"| {row['workers']} | {row['step_s']:.2f} | {row['tool_s']:.2f} | {row['tool_frac']:.2f} | "
              f"{row['executions_per_step']:.1f} | {row['executions_per_s']:.1f} | {row['p50_s']:.3f} | {row['p99_s']:.3f} | "
              f"{row['calls_per_response']:.2f} | {row['error_frac']:.3f} | {row['step_s'] / rows[0]['step_s']:.2f} | "
              f"{row['tool_s'] / rows[0]['tool_s']:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
