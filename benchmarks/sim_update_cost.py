"""What OPOB costs in the simulator's learner: one optimizer step of VCPO against seq-TIS on the same batches.

    python benchmarks/sim_update_cost.py                          # Countdown, the study's regime, k = 12
    python benchmarks/sim_update_cost.py --profile                # operators by self time, VCPO against seq-TIS
    python benchmarks/sim_update_cost.py --config recipes/sim/regime.yaml task=tir --batches 4

A VCPO run of the regime's settings (``--config`` plus key=value overrides, ``threads=1``) trains
``--warmup-steps`` steps and keeps the ``--batches`` real batches of the steps after; then each method's
learner takes one update per batch from the same weights and optimizer state (the run's last), the variants
taking turns (round-robin, so background load slows them alike), ``--repeats`` times: seq-TIS, VCPO as it
runs by default (PerSequenceGradients with the deferred combination, choosing ghost norms or materialised
per-sequence gradients per call), VCPO forced to each route, VCPO with the two-buffer combination (G_R and
G_S^γ during the backward, the studies' numerics: recipes/sim/regime.yaml keeps it) and with the split one (each
group's success and failure buffers during the backward, verl's engine's). It prints, per variant, the median seconds of an update, of its forward and backward, and the update's
process CPU time (steadier on a shared machine), each with its ratio to seq-TIS (the paper reports OPOB at +19% of
a step). ``--json`` also writes them.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from vcpo.cli import shrink_problem
from vcpo.locks import write_atomic
from vcpo.provenance import cpu_name
from vcpo.sim.config import apply_overrides, load_config_file
from vcpo.sim.learner import Learner, collate, warmup_stable_decay
from vcpo.sim.train import Trainer
from vcpo.sim.validation import validate

METHODS = ("seq_tis_c8", "vcpo")
# what is timed: (label, method, PerSequenceGradients settings over the learner's own: mode "auto", the
# config's combination, "deferred" by default)
VARIANTS = (("seq_tis_c8", "seq_tis_c8", {}), ("vcpo", "vcpo", {}), ("vcpo materialize", "vcpo", {"mode": "materialize"}),
            ("vcpo ghost", "vcpo", {"mode": "ghost"}), ("vcpo buffers", "vcpo", {"combination": "buffers"}),
            ("vcpo split", "vcpo", {"combination": "split"}))
# cpu_s/update: the process's CPU time of the update; on one thread it leaves out the time other jobs on a shared
# machine hold the core, so its ratio moves less between runs there than the wall-clock ones
PARTS = ("timing_s/update", "timing_s/forward", "timing_s/backward", "cpu_s/update")


def batches(config, count: int, warmup_steps: int, folder: Path) -> tuple[Trainer, list]:
    """A trainer of ``config`` after ``warmup_steps + count`` steps, and the batches of its last ``count``."""
    trainer = Trainer(dataclasses.replace(config, out=str(folder), steps=warmup_steps + count, eval_every=0))
    produced, produce = [], trainer.produce

    def keep(step: int):
        made = produce(step)
        if step >= warmup_steps:
            produced.append((step, collate(made.trajectories, [r["score"] for r in made.results], trainer.tokenizer.pad_token_id,
                                           trainer.model.dtype)))
        return made

    trainer.produce = keep
    trainer._start()
    while trainer.step < warmup_steps + count:
        trainer.train_step()
    return trainer, produced


def timed_update(trainer: Trainer, config, step: int, batch, engine_settings: dict | None = None) -> dict:
    """One update by a fresh learner of ``config``'s method on copies of the trainer's model and optimizer state."""
    learner = Learner(copy.deepcopy(trainer.model), config.method_preset, config)
    for name, value in (engine_settings or {}).items():
        setattr(learner.opob, name, value)
    learner.optimizer.load_state_dict(trainer.learner.optimizer.state_dict())
    schedule_factor = warmup_stable_decay(step, config.steps, config.warmup_steps, config.decay_steps)
    started, started_cpu = time.perf_counter(), time.process_time()
    metrics = learner.update(batch, schedule_factor, None)
    return {"timing_s/update": time.perf_counter() - started, "timing_s/forward": metrics["timing_s/forward"],
            "timing_s/backward": metrics["timing_s/backward"], "cpu_s/update": time.process_time() - started_cpu}


def operator_times(trainer: Trainer, configs: dict, step: int, batch, repeats: int) -> dict:
    """Each method's update under torch.profiler, after a warm-up: mean self CPU milliseconds per operator over
    ``repeats`` updates; prints the operators by VCPO's excess over seq-TIS."""
    from torch.profiler import ProfilerActivity, profile

    self_ms = {}
    for method in METHODS:
        timed_update(trainer, configs[method], step, batch)
        totals: dict[str, float] = {}
        for _ in range(repeats):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                timed_update(trainer, configs[method], step, batch)
            for event in prof.key_averages():
                totals[event.key] = totals.get(event.key, 0.0) + event.self_cpu_time_total / 1e3 / repeats
        self_ms[method] = totals
    base, vcpo = self_ms["seq_tis_c8"], self_ms["vcpo"]
    total = {method: sum(times.values()) for method, times in self_ms.items()}
    print(f"self CPU of one update: seq-TIS {total['seq_tis_c8']:.1f} ms, VCPO {total['vcpo']:.1f} ms "
          f"({total['vcpo'] / total['seq_tis_c8']:.2f}x); operators by VCPO's excess (ms):")
    for op in sorted(set(base) | set(vcpo), key=lambda op: base.get(op, 0.0) - vcpo.get(op, 0.0))[:12]:
        print(f"  {op[:48]:48s} seq-TIS {base.get(op, 0.0):7.2f}  VCPO {vcpo.get(op, 0.0):7.2f}  {vcpo.get(op, 0.0) - base.get(op, 0.0):+7.2f}")
    return {"self_ms": self_ms, "total_ms": total}


def write_json(path: Path | None, result: dict) -> None:
    """``--json``: the result, where one was asked for."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(result, indent=1) + "\n")


def measured(result: dict) -> dict[str, int]:
    """Each variant a ``--json`` result timed, and over how many updates (a profile's: each method's repeats)."""
    if "self_ms" in result:
        return dict.fromkeys(result["self_ms"], result["repeats"])
    return dict.fromkeys(result["median_s"], result["repeats"] * result["batches"])


def planned(args: argparse.Namespace) -> dict[str, int]:
    if args.profile:
        return measured({"self_ms": dict.fromkeys(METHODS), "repeats": args.repeats})
    return measured({"median_s": dict.fromkeys(label for label, _, _ in VARIANTS), "repeats": args.repeats,
                     "batches": args.batches})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="recipes/sim/regime.yaml")
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true",
                        help="profile both methods' updates instead (--repeats each): operators by self time, VCPO against seq-TIS")
    parser.add_argument("--json", type=Path)
    parser.add_argument("overrides", nargs="*", help="key=value settings over the config file (default lag=12)")
    args = parser.parse_args(argv)
    if args.json is not None and args.json.exists() and (problem := shrink_problem(
            args.json, measured(json.loads(args.json.read_text())), planned(args), "pass --json for a file of your own",
            rows="variants", unit="updates")):
        sys.exit(f"error: {problem}")
    torch.set_num_threads(1)
    settings = {"lag": "12", "lag_model": "pipeline_overlap", "method": "vcpo", "threads": "1", "progress": "false",
                "opob_combination": "deferred", **dict(item.split("=", 1) for item in args.overrides)}
    configs = {method: validate(apply_overrides(load_config_file(args.config), {**settings, "method": method})) for method in METHODS}
    config = configs["vcpo"]
    with tempfile.TemporaryDirectory() as scratch:
        trainer, produced = batches(config, args.batches, args.warmup_steps, Path(scratch) / "run")
        if args.profile:
            profiled = operator_times(trainer, configs, *produced[0], args.repeats)
            write_json(args.json, {"cpu": cpu_name(), "settings": settings, "repeats": args.repeats, **profiled})
            return
        times = {label: [] for label, _, _ in VARIANTS}
        for _ in tqdm(range(args.repeats), desc="repeats"):
            for step, batch in produced:
                for label, method, engine_settings in VARIANTS:
                    times[label].append(timed_update(trainer, configs[method], step, batch, engine_settings))
    result = {"cpu": cpu_name(), "config": args.config, "settings": settings, "batches": args.batches,
              "repeats": args.repeats, "tokens_per_batch": [int(b.mask.sum()) for _, b in produced],
              "padded_shape": [list(b.mask.shape) for _, b in produced], "median_s": {}}
    for label in times:
        result["median_s"][label] = {part: statistics.median(t[part] for t in times[label]) for part in PARTS}
    base = result["median_s"]["seq_tis_c8"]
    result["ratio_to_seq_tis"] = {label: {p: result["median_s"][label][p] / base[p] for p in PARTS} for label in times}
    for label in times:
        line = ", ".join(f"{p.split('/')[1]}{' CPU' if p.startswith('cpu') else ''} {result['median_s'][label][p] * 1e3:.1f} ms "
                         f"({result['ratio_to_seq_tis'][label][p]:.2f}x)" for p in PARTS)
        print(f"{label}: {line}")
    write_json(args.json, result)


if __name__ == "__main__":
    main(sys.argv[1:])
