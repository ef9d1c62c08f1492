"""Wall time and step-time split of simulator runs, several methods in one process, with ratios.

    python benchmarks/sim_speed.py --steps 200 --methods seq_tis_c8,vcpo --lag 12 [key=value ...]

Trains each method for ``--steps`` optimizer steps with the default tiny configuration (plus any
``key=value`` override) into a temporary folder and prints, per method: total wall time, tokens/s
(response tokens trained on per second of step time), the mean seconds per step spent in generation,
reward scoring, learner forward, learner backward, optimizer and held-out evaluation, and the
learner's forward+backward relative to the first method (the OPOB extra when the first method is
seq_tis_c8 or tis_ess and another is vcpo).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from vcpo.sim.config import SimConfig, apply_overrides
from vcpo.sim.train import METRICS, Trainer

PARTS = (
    ("timing_s/gen", "gen"),
    ("timing_s/reward", "reward"),
    ("timing_s/forward", "fwd"),
    ("timing_s/backward", "bwd"),
    ("timing_s/optimizer", "optim"),
    ("timing_s/testing", "eval"),
)


def run(method: str, args, overrides: list[str], folder: Path) -> dict:
    config = apply_overrides(SimConfig(), {"method": method, "lag": args.lag, "steps": args.steps, "progress": True})
    config = apply_overrides(config, [*overrides, f"out={folder / method}"])
    trainer = Trainer(config)  # loads (or builds and caches) the SFT base before the clock starts
    started = time.perf_counter()
    trainer.run()
    wall = time.perf_counter() - started
    lines = [json.loads(line) for line in (folder / method / METRICS).read_text().splitlines()]
    steps = [line for line in lines if "timing_s/step" in line]
    tokens = sum(line["perf/throughput"] * line["timing_s/step"] for line in steps)
    result = {"method": method, "wall_s": wall, "tokens_per_s": tokens / sum(line["timing_s/step"] for line in steps)}
    for key, name in PARTS:
        result[name] = float(np.sum([line.get(key, 0.0) for line in lines])) / len(steps)
    result["step"] = float(np.mean([line["timing_s/step"] for line in steps]))
    result["final_accuracy"] = lines[-1].get("val/accuracy")
    result["initial_accuracy"] = lines[0].get("val/accuracy")
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lag", type=int, default=12)
    parser.add_argument("--methods", default="seq_tis_c8,vcpo")
    args, overrides = parser.parse_known_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        results = [run(method, args, overrides, Path(folder)) for method in args.methods.split(",")]
    reference = results[0]["fwd"] + results[0]["bwd"]
    names = [name for _, name in PARTS]
    print(f"\n{args.steps} steps, lag {args.lag}, overrides {overrides or 'none'}; seconds per step:")
    print(f"{'method':14s} {'wall min':>8s} {'tok/s':>7s} {'step':>6s} " + " ".join(f"{n:>6s}" for n in names) + "  fwd+bwd / first  acc start->end")
    for r in results:
        ratio = (r["fwd"] + r["bwd"]) / reference
        accuracy = f"{r['initial_accuracy']} -> {r['final_accuracy']}"
        print(f"{r['method']:14s} {r['wall_s'] / 60:8.2f} {r['tokens_per_s']:7.0f} {r['step']:6.3f} "
              + " ".join(f"{r[n]:6.3f}" for n in names) + f"  {ratio:15.2f}  {accuracy}")


if __name__ == "__main__":
    main()
