"""verl's own asynchrony on CPU: the V1 trainer's ``separate_async`` at lag 1 and 2 against ``sync``, timed by
verl's own ``timing_s/*``, on one model, one data set and the same cores.

    python benchmarks/verl_async_speed.py --out tables/verl_async_speed      # ~8 minutes on 2 cores

Each run is ``python -m vcpo.launch.cpu --out DIR --method vcpo --lag K --steps N`` (K = 0 runs verl's sync
trainer; the CPU recipe of ``vcpo.verl_plugin.cpu``: Ray, FSDP2 on gloo, the transformers rollout server, 4
prompts x 2 responses of up to 16 tokens per step), all from one ``vcpo.local_models`` model and one data
set written first. Per run: the mean over the steps after ``--warmup`` of every ``timing_s/*`` key verl logs,
the step time against sync's, and the wall time of the whole process (Ray and worker start-up included).
Writes OUT/verl_async_speed.json and OUT/verl_async_speed.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vcpo.cli import shrink_problem
from vcpo.lifetimes import dies_with_this_thread
from vcpo.locks import write_atomic
from vcpo.provenance import cpu_name
from vcpo.reporting.run_data import read_metrics
from vcpo.verl_plugin.cpu.recipe import write_data

STALENESS = "training/off_policy/trajectory_staleness/max"  # the lag of the step's data, as verl logs it


def launch(out: Path, lag: int, steps: int, model: Path, data: dict[str, Path], warmup: int) -> dict:
    command = [sys.executable, "-m", "vcpo.launch.cpu", "--out", str(out), "--method", "vcpo" if lag else "sync",
               "--steps", str(steps), "--model", str(model), "--train", str(data["train"]), "--val", str(data["val"])]  # fmt: skip
    if lag:
        command += ["--lag", str(lag)]
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, preexec_fn=dies_with_this_thread)
    wall = time.perf_counter() - started
    if result.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr[-4000:]}")
    lines = [line for line in read_metrics(out) if "timing_s/step" in line]
    timed = [line for line in lines if line["step"] > warmup]
    keys = sorted({key for line in timed for key in line if key.startswith("timing_s/")})
    means = {key: statistics.mean(line[key] for line in timed if key in line) for key in keys}
    staleness = [line.get(STALENESS) for line in timed]
    report = {"lag": lag, "method": "vcpo" if lag else "sync", "steps": steps, "timed_steps": len(timed), "wall_s": wall,
              "timing_s_mean": means, "staleness": staleness}  # fmt: skip
    print(f"lag {lag}: {len(timed)} timed steps, step {means.get('timing_s/step', float('nan')):.3f} s, wall {wall:.0f} s", flush=True)
    return report


def markdown(report: dict) -> str:
    runs = report["runs"]
    keys = sorted({key for run in runs for key in run["timing_s_mean"]}, key=lambda key: (key != "timing_s/step", key))
    sync_step = runs[0]["timing_s_mean"]["timing_s/step"]
    lines = [
        "# verl's `separate_async` against `sync` on CPU: measured by `python benchmarks/verl_async_speed.py`", "",
        f"Machine: {report['machine']}; {report['date']}. `python -m vcpo.launch.cpu` (the CPU recipe: 4 prompts x 2 "
        f"responses of up to 16 tokens per step), {report['steps']} steps, the mean over steps {report['warmup'] + 1}-"
        f"{report['steps']} of each `timing_s/*` key verl logs (seconds; blank: not logged by that trainer).", "",
        "| key | " + " | ".join(f"{run['method']} k = {run['lag']}" for run in runs) + " |",
        "|---|" + "---:|" * len(runs),
    ]  # fmt: skip
    for key in keys:
        cells = [f"{run['timing_s_mean'][key]:.3f}" if key in run["timing_s_mean"] else "" for run in runs]
        lines.append(f"| `{key}` | " + " | ".join(cells) + " |")
    lines += [
        "| step / sync's step | " + " | ".join(f"{run['timing_s_mean']['timing_s/step'] / sync_step:.2f}" for run in runs) + " |",
        "| process wall time, s (start-up included) | " + " | ".join(f"{run['wall_s']:.0f}" for run in runs) + " |",
        "| trajectory staleness of the timed steps (max per step) | " + " | ".join(
            ", ".join(sorted({str(int(value)) for value in run["staleness"] if value is not None})) or "-" for run in runs) + " |", "",
    ]  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--lags", default="0,1,2", help="0 (sync) first: the ratios are to it")
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of the means (start-up, the lag's warm-up batches)")
    args = parser.parse_args(argv)
    lags = [int(lag) for lag in args.lags.split(",")]
    if lags[0] != 0:
        parser.error("--lags must start with 0 (sync), the reference of the ratios")
    earlier = args.out / "verl_async_speed.json"
    recorded = {f"lag {run['lag']}": run["timed_steps"] for run in json.loads(earlier.read_text())["runs"]} \
        if earlier.exists() else {}
    if problem := shrink_problem(earlier, recorded, {f"lag {lag}": args.steps - args.warmup for lag in lags},
                                 "pass --out for a folder of your own", rows="runs", unit="timed steps"):
        sys.exit(f"error: {problem}")
    report = {"machine": cpu_name(), "date": time.strftime("%Y-%m-%d", time.gmtime()), "steps": args.steps,
              "warmup": args.warmup, "command": sys.argv, "runs": []}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="verl-async-speed-") as scratch:
        root = Path(scratch)
        model = root / "model"
        subprocess.run([sys.executable, "-m", "vcpo.local_models", str(model)], check=True, stdout=subprocess.DEVNULL,
                       preexec_fn=dies_with_this_thread)
        data = write_data(root / "data")
        for lag in lags:
            report["runs"].append(launch(root / f"lag{lag}", lag, args.steps, model, data, args.warmup))
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(earlier, json.dumps(report, indent=2) + "\n")
    write_atomic(args.out / "verl_async_speed.md", markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
