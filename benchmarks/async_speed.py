"""Does asynchrony buy time on two cores? Serial against concurrent execution of one run beside its overlap
bound, and sync against async seq-TIS and VCPO across lags, in one run of this script.

    python benchmarks/async_speed.py --out tables/async_speed                # ~30 minutes, an idle 2-core machine
    python benchmarks/async_speed.py --out /tmp/speed --tasks countdown --lags 4 --steps 20   # a quick look
    python benchmarks/async_speed.py --out tables/async_speed/rounds_tir --tasks tir --lags 2 --skip-overlap --repeats 5
    python benchmarks/async_speed.py --out tables/async_speed/rounds_countdown --tasks countdown --lags 48 --skip-overlap --repeats 5

Every run is a fresh ``python -m vcpo.sim train`` process from the task's cached SFT base (seed 0,
``eval_every=0``, one thread per process unless said), timed from its start to its end. Parts:

  overlap  Countdown, VCPO, k = 4, ``lag_model=fixed``, serial then concurrent. The overlap bound is what a
           perfect overlap of the serial run's own work would take: its wall time outside the steps (start-up,
           the end) plus, per step, the larger of its generator side (generation + rewards) and the rest.
  sync     sync (k = 0, which cannot overlap) per task, serial on one thread and on two (both cores for one
           run); the faster is the sync time the async runs are compared with.
  lags     seq-TIS (c = 8) and VCPO at each lag per task, concurrent: seconds per step, the wall time to the
           task's step count, the speed-up over the best sync, and which side bounds (generator or learner).

Writes OUT/async_speed.json (every run's timings, the machine) and OUT/async_speed.md (the tables). The
ratios, not the seconds, are what compares with the paper's Table 1 (tiny models, two cores).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from vcpo.cli import shrink_problem
from vcpo.lifetimes import dies_with_this_thread
from vcpo.locks import write_atomic
from vcpo.provenance import code_state, cpu_name, utc_now
from vcpo.reporting.run_data import read_metrics
from vcpo.sim.config import SimConfig

STEPS = {"countdown": 100, "tir": 50}
GENERATOR_SIDE = ("timing_s/gen", "timing_s/reward")


def run(task: str, method: str, lag: int, steps: int, out: Path, **settings) -> dict:
    """One simulator run in its own process: its wall time and the sums of its per-step timings."""
    overrides = {"eval_every": 0, "threads": 1, "progress": "false", "lag_model": "fixed"} | settings
    command = [sys.executable, "-m", "vcpo.sim", "train", "--task", task, "--method", method, "--lag", str(lag),
               "--steps", str(steps), "--seed", "0", "--out", str(out), *[f"{k}={v}" for k, v in overrides.items()]]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(command, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          preexec_fn=dies_with_this_thread)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)}\nfailed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    wall = time.perf_counter() - started
    lines = [line for line in read_metrics(out) if "timing_s/step" in line]
    total = {name: sum(line.get(name, 0.0) for line in lines) for name in
             ("timing_s/step", "timing_s/gen", "timing_s/reward", "timing_s/update_actor", "timing_s/wait_gen",
              "timing_s/gen_wait_weights")}  # fmt: skip
    generator = [sum(line[name] for name in GENERATOR_SIDE) for line in lines]
    rest = [line["timing_s/step"] - side for line, side in zip(lines, generator, strict=True)]
    result = {
        "task": task, "method": method, "lag": lag, "steps": steps, "settings": overrides, "wall_s": wall,
        "steps_s": total["timing_s/step"], "outside_steps_s": wall - total["timing_s/step"], "sums_s": total,
        # serial: a perfect overlap of this run's own work
        "overlap_bound_s": wall - total["timing_s/step"] + sum(max(g, r) for g, r in zip(generator, rest, strict=True)),
        "generation_share": sum(generator) / total["timing_s/step"],
    }  # fmt: skip
    label = f"{task} {method} k={lag} {overrides.get('execution', 'serial')} threads={overrides['threads']}"
    print(f"{label:<52} wall {wall:7.1f} s  steps {total['timing_s/step']:7.1f} s  gen+reward {sum(generator):6.1f} s", flush=True)
    return result


def overlap_part(root: Path) -> dict:
    serial = run("countdown", "vcpo", 4, 100, root / "overlap-serial")
    concurrent = run("countdown", "vcpo", 4, 100, root / "overlap-concurrent", execution="concurrent")
    return {"serial": serial, "concurrent": concurrent, "concurrent_over_bound": concurrent["wall_s"] / serial["overlap_bound_s"],
            "serial_over_concurrent": serial["wall_s"] / concurrent["wall_s"]}  # fmt: skip


def task_part(root: Path, task: str, steps: int, methods: list[str], lags: list[int], repeats: int = 1,
              sync_threads: tuple[int, ...] = (1, 2), settings: dict | None = None) -> dict:
    """Sync on each of ``sync_threads``, then each method at each lag, concurrent, every run with ``settings`` too;
    ``repeats`` rounds of all of them in turn (round-robin, so a drift of the machine's speed reaches every arm
    alike). A configuration's result is its run of median wall time, with every round's wall time beside it."""
    common = settings or {}
    configs = [("sync", 0, common | {"threads": threads}) for threads in sync_threads]
    configs += [(method, lag, common | {"execution": "concurrent"}) for method in methods for lag in lags]
    rounds = [[run(task, method, lag, steps, root / f"{task}-{method}-k{lag}-{'-'.join(map(str, config.values()))}-r{r}", **config)
               for method, lag, config in configs] for r in range(repeats)]  # fmt: skip
    results = []
    for runs in zip(*rounds, strict=True):
        median = sorted(runs, key=lambda result: result["wall_s"])[(len(runs) - 1) // 2]
        results.append(median | {"wall_s_rounds": [result["wall_s"] for result in runs]})
    sync = {config[2]["threads"]: result for config, result in zip(configs, results, strict=True) if config[0] == "sync"}
    best = min(sync.values(), key=lambda r: r["wall_s"])
    arms = []
    for result in results[len(sync):]:
        learner_busy = result["steps_s"] - result["sums_s"]["timing_s/wait_gen"]
        generator_busy = result["sums_s"]["timing_s/gen"] + result["sums_s"]["timing_s/reward"]
        per_round = [sync_wall / wall for sync_wall, wall in zip(best["wall_s_rounds"], result["wall_s_rounds"], strict=True)]
        result |= {"speedup_over_sync": best["wall_s"] / result["wall_s"], "speedup_rounds": per_round,
                   "bound_by": "generator" if generator_busy > learner_busy else "learner",
                   "learner_busy_s": learner_busy, "generator_busy_s": generator_busy}  # fmt: skip
        arms.append(result)
    return {"steps": steps, "repeats": repeats, "sync": {str(t): r for t, r in sync.items()}, "best_sync_threads": best["settings"]["threads"],
            "arms": arms}  # fmt: skip


def configurations(report: dict) -> dict[str, int]:
    """Each configuration a report (``async_speed.json``) measured, and in how many rounds."""
    measured = {"overlap": 1} if "overlap" in report else {}
    for task, part in report["tasks"].items():
        repeats = part.get("repeats", 1)
        measured |= {f"{task} sync threads={threads}": repeats for threads in part["sync"]}
        measured |= {f"{task} {arm['method']} k={arm['lag']}": repeats for arm in part["arms"]}
    return measured


def planned(args: argparse.Namespace) -> dict[str, tuple[int, list[int]]]:
    """Each task's steps and the lags it reaches (a lag above the steps is left out)."""
    plan = {}
    for task in args.tasks:
        steps = args.steps or STEPS[task]
        plan[task] = (steps, [lag for lag in args.lags if lag <= steps])
    return plan


def planned_configurations(args: argparse.Namespace) -> dict[str, int]:
    skeleton = {"tasks": {task: {"repeats": args.repeats, "sync": {str(threads): {} for threads in args.sync_threads},
                                 "arms": [{"method": method, "lag": lag} for method in args.methods for lag in lags]}
                          for task, (_, lags) in planned(args).items()}}
    return configurations(skeleton | ({} if args.skip_overlap else {"overlap": {}}))


def spread(values: list[float]) -> str:
    return f" ({min(values):.2f}-{max(values):.2f})"


def markdown(report: dict) -> str:
    lines = ["# Asynchrony on two cores: measured by `python benchmarks/async_speed.py`", "",
             f"Machine: {report['machine']['cpu']}, {report['machine']['cores']} cores; torch {report['machine']['torch']}; "
             f"{report['date']}. One process per run, from the task's seed-0 SFT base, `eval_every=0` and `lag_model=fixed` "
             f"unless the settings below say otherwise; OPOB combines `{report['opob_combination']}` (the simulator's default)."
             + (f" Settings of every run: {', '.join(f'`{k}={v}`' for k, v in report['settings'].items())}." if report.get("settings") else ""),
             ""]  # fmt: skip
    if "overlap" in report:
        o = report["overlap"]
        lines += ["## Serial against concurrent execution of one run", "",
                  "Countdown, VCPO, k = 4, `lag_model=fixed`, 100 steps. Overlap bound: the serial run's time outside its steps "
                  "plus, per step, the larger of generation + rewards and the rest of the step.", "",
                  "| serial s | concurrent s | overlap bound s | concurrent / bound | serial / concurrent |", "|---:|---:|---:|---:|---:|",
                  f"| {o['serial']['wall_s']:.1f} | {o['concurrent']['wall_s']:.1f} | {o['serial']['overlap_bound_s']:.1f} | "
                  f"{o['concurrent_over_bound']:.2f} | {o['serial_over_concurrent']:.2f} |", ""]  # fmt: skip
    for task, part in report["tasks"].items():
        repeated = part.get("repeats", 1) > 1
        rounds = f" (median of {part['repeats']} rounds)" if repeated else ""
        lines += [f"## {task}: sync against async, {part['steps']} steps{rounds}", "",
                  "| arm | execution | threads | s / step | wall s | generation share | bound by | speed-up over best sync |",
                  "|---|---|---:|---:|---:|---:|---|---:|"]  # fmt: skip
        best_wall = part["sync"][str(part["best_sync_threads"])]["wall_s"]
        for threads, result in part["sync"].items():
            best = " (best)" if int(threads) == part["best_sync_threads"] else ""
            lines.append(f"| sync (k = 0){best} | serial | {threads} | {result['steps_s'] / result['steps']:.3f} | {result['wall_s']:.1f} | "
                         f"{result['generation_share']:.0%} | | {best_wall / result['wall_s']:.2f} |")  # fmt: skip
        for result in part["arms"]:
            lines.append(f"| {result['method']} k = {result['lag']} | concurrent | 1 + 1 | {result['steps_s'] / result['steps']:.3f} | "
                         f"{result['wall_s']:.1f} | {result['generation_share']:.0%} | {result['bound_by']} | {result['speedup_over_sync']:.2f}"
                         f"{spread(result['speedup_rounds']) if repeated else ''} |")  # fmt: skip
        lines.append("")
    lines += ["Generation share: generation + rewards over the step time (for a concurrent run, of its generator's work against "
              "its learner's steps). Bound by: the side that was busy longer. Over several rounds, each configuration's run of "
              "median wall time is shown, and beside its speed-up the range of the speed-ups per round (each against that "
              "round's best sync).", ""]
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for async_speed.json and async_speed.md")
    parser.add_argument("--tasks", default="countdown,tir")
    parser.add_argument("--methods", default="seq_tis_c8,vcpo")
    parser.add_argument("--lags", default="1,2,4,12,48")
    parser.add_argument("--steps", type=int, default=None, help=f"steps of every run (default per task: {STEPS})")
    parser.add_argument("--skip-overlap", action="store_true", help="leave out the serial-against-concurrent pair")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of every sync and async run, in turn (median shown)")
    parser.add_argument("--sync-threads", default="1,2", help="the thread counts sync runs with (the faster is compared with)")
    parser.add_argument("--settings", nargs="*", default=[], metavar="KEY=VALUE",
                        help="vcpo.sim settings of every run (e.g. reference_lr=2e-4, eval_every=10): one difference at a time")
    args = parser.parse_args(argv)
    args.sync_threads = [int(threads) for threads in args.sync_threads.split(",")]
    if any("=" not in item for item in args.settings):
        parser.error("--settings takes KEY=VALUE items")
    args.settings = dict(item.split("=", 1) for item in args.settings)
    args.tasks, args.methods = args.tasks.split(","), args.methods.split(",")
    args.lags = [int(lag) for lag in args.lags.split(",")]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    earlier = args.out / "async_speed.json"
    if earlier.exists() and (problem := shrink_problem(earlier, configurations(json.loads(earlier.read_text())),
                                                        planned_configurations(args), "pass --out for a folder of your own",
                                                        rows="configurations", unit="rounds")):
        sys.exit(f"error: {problem}")
    load_at_start = os.getloadavg()
    report = {"machine": {"cpu": cpu_name(), "cores": len(os.sched_getaffinity(0)), "torch": torch.__version__,
                          "python": platform.python_version()},
              "date": time.strftime("%Y-%m-%d", time.gmtime()), "command": sys.argv,
              "opob_combination": SimConfig().opob_combination, "settings": args.settings, **code_state(), "started": utc_now(),
              "tasks": {}}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="async-speed-") as scratch:
        root = Path(scratch)
        if not args.skip_overlap:
            report["overlap"] = overlap_part(root)
        for task, (steps, lags) in planned(args).items():
            report["tasks"][task] = task_part(root, task, steps, args.methods, lags, args.repeats, tuple(args.sync_threads),
                                              args.settings)
    report["finished"] = utc_now()
    report["load_average"] = {"started": load_at_start, "finished": os.getloadavg()}  # other work on the machine shows here
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(earlier, json.dumps(report, indent=2) + "\n")
    write_atomic(args.out / "async_speed.md", markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
