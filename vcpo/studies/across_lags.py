"""The across-lags study (recipes/sim/across_lags.md): its table of runs, its statistics, its timing runs.

    python -m vcpo.studies.evidence --design recipes/sim/across_lags.yaml run --out RUNS --archive tables/across_lags/runs
    python -m vcpo.studies.across_lags rows              # tables/across_lags/runs.jsonl, from the archived runs
    python -m vcpo.studies.across_lags timing --out DIR  # tables/across_lags/timing.json (an otherwise idle two-core machine)
    python -m vcpo.studies.across_lags report            # stats.json, summary.md, end_vs_lag.png, time.png

The runs use the evidence study's runner and its row of a run; this module adds what across_lags.md
registers beyond it: steps and time to sync's accuracy, the per-lag comparisons, the equivalence test,
the tool-use search's qualifying rule, and which rows count (started after the registration, clean tree).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from vcpo.cli import shrink_problem
from vcpo.lifetimes import dies_with_this_thread
from vcpo.locks import write_atomic
from vcpo.provenance import code_state, cpu_name, output_record, utc_now
from vcpo.reporting.run_data import read_metrics
from vcpo.runs import VAL_ACCURACY, exit_with, is_finished, read_json
from vcpo.sim.config import load_config_file
from vcpo.studies.design import (
    Design,
    analysis_code_commit,
    analysis_commit_problem,
    archived_metrics,
    command_line,
    load_design,
    run_folder,
    run_settings,
)
from vcpo.studies.evidence import arm_summary, compare, keep_every_run, missing_seeds, read_rows, rows_by_arm, run_row
from vcpo.studies.statistics import ALPHA, equivalence, holm

DESIGN = Path("recipes/sim/across_lags.yaml")
TABLE = Path("tables/across_lags/runs.jsonl")
ARCHIVE = TABLE.parent / "runs"
TIMING = TABLE.parent / "timing.json"
SEARCH = TABLE.parent / "tir_search.md"  # the tool-use search's outcome, committed before any confirmatory run
# the commit that added recipes/sim/across_lags.md, and its time: a row counts only if its run started later
REGISTRATION = {"commit": "abf4ae1676011c092af9659abb7adfdfa26f8363", "time": "2026-11-26T14:17:50+00:00"}
LAGS = (12, 24, 48, 96)
EQUIVALENCE_MARGIN = 0.03  # across_lags.md: VCPO - sync inside [-3, +3] points
TIMING_FROM_STEP = 10  # seconds per step: the mean of timing_s/step from this step on (start-up left out)
STEP_FACTOR_LEAVES_ONE = 0.95  # tool-use search: VCPO's mean actor/lr_scale below this
SEARCH_SEEDS = 3
CONFIRM_TASK = "tir_confirm"  # the comparison at the search's chosen cell


# -- rows -------------------------------------------------------------------------------------------
def validation_curve(lines: list[dict]) -> list[tuple[int, float]]:
    return [(int(line["step"]), float(line[VAL_ACCURACY])) for line in lines if VAL_ACCURACY in line]


def steps_to_target(curve: list[tuple[int, float]], target: float) -> int | None:
    """The first evaluation step whose validation accuracy is >= ``target`` (None: never)."""
    return next((step for step, accuracy in curve if accuracy >= target), None)


def counts(row: dict) -> bool:
    """across_lags.md: a row counts when its run started after the registration, from a clean tree, and records when
    it started and finished."""
    return (row.get("started") is not None and row["started"] > REGISTRATION["time"] and row.get("dirty") is False
            and row.get("finished") is not None)


def sync_target(rows: list[dict]) -> dict | None:
    """Sync at its best rate (the sync arm with the higher mean end) and the target: its mean end_validation."""
    by_arm: dict[str, list[dict]] = {}
    for row in rows:
        if row["task"] == "countdown" and row["method"] == "sync":
            by_arm.setdefault(row["arm"], []).append(row)
    if not by_arm:
        return None
    best = max(by_arm, key=lambda name: np.mean([row["end"] for row in by_arm[name]]))
    return {"arm": best, "target": float(np.mean([row["end_validation"] for row in by_arm[best]])), "n": len(by_arm[best])}


def write_rows(design: Design, archive: Path, table: Path) -> list[dict]:
    rows = []
    for arm in design.arms:
        for seed in design.seeds_of(arm.task):
            folder = run_folder(archive, arm, seed)
            if is_finished(folder):
                lines = archived_metrics(folder)
                rows.append({**run_row(design, arm, seed, archive, lines), "study_task": arm.task,
                             "validation_curve": validation_curve(lines)})
    target = sync_target([row for row in rows if counts(row)])
    for row in rows:
        row["counts"] = counts(row)
        row["target"] = target["target"] if target and row["study_task"] == "countdown" else None
        row["steps_to_target"] = steps_to_target(row["validation_curve"], row["target"]) if row["target"] is not None else None
    keep_every_run(table, rows)
    table.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(table, "".join(json.dumps(row) + "\n" for row in rows))
    left_out = [f"{row['study_task']}/{row['arm']} seed {row['seed']}" for row in rows if not row["counts"]]
    if left_out:
        print(f"{len(left_out)} rows do not count (started before the registration, or a dirty tree): {', '.join(left_out)}")
    return rows


# -- statistics -------------------------------------------------------------------------------------
def median_steps(values: list[int | None]) -> float:
    """The median, a run that never reached the target counting as later than any step (inf)."""
    return float(np.median([math.inf if v is None else v for v in values])) if values else math.nan


def countdown_report(rows: list[dict], design: Design, timing: dict | None) -> dict:
    by_arm = rows_by_arm(rows)
    arms = {}
    for arm in (a for a in design.arms if a.task == "countdown"):
        if arm.name in by_arm:
            members = list(by_arm[arm.name].values())
            steps = [row["steps_to_target"] for row in members]
            arms[arm.name] = {**arm_summary(members), "reached": sum(s is not None for s in steps), "median_steps": median_steps(steps)}
    target = sync_target(rows)
    missing = missing_seeds(by_arm, [arm for arm in design.arms if arm.task == "countdown"], design.seeds_of("countdown"))
    result = {
        "lags": list(LAGS), "arms": arms, "target": target, "missing": missing,
        "primary": compare(by_arm, [(f"vcpo_k{k}", f"seq_tis_lr5e-5_k{k}") for k in LAGS]),
        "same_rate": compare(by_arm, [(f"vcpo_k{k}", f"seq_tis_k{k}") for k in LAGS]),
        "equivalence": equivalence_report(by_arm, arms),
        # exploratory, beyond the registration: the tuned arms against each other, VCPO's two rates, and which
        # rate each method prefers at each lag (whether the premise of the transfer claim arises at all)
        "tuned": compare(by_arm, [(f"vcpo_lr1e-4_k{k}", f"seq_tis_lr5e-5_k{k}") for k in LAGS]),
        "vcpo_rates": compare(by_arm, [(f"vcpo_lr1e-4_k{k}", f"vcpo_k{k}") for k in LAGS]),
        "best_rates": best_rates(arms),
    }
    if timing and target:
        result["time_to_target"] = time_report(arms, target["arm"], timing, load_config_file(design.configs["countdown"]).steps)
        result["time_ratio_range"] = time_ratio_range(result["time_to_target"], arms, timing)
    return result


def best_rates(arms: dict) -> list[dict]:
    """Per method and lag, the tested rates by mean end and the best of them."""
    by_cell: dict[tuple[str, int], dict[float, float]] = {}
    for arm in arms.values():
        by_cell.setdefault((arm["method"], arm["lag"]), {})[arm["lr"]] = arm["end"]
    return [{"method": method, "lag": lag, "ends": {str(lr): end for lr, end in sorted(ends.items())},
             "best_lr": max(ends, key=ends.get)} for (method, lag), ends in sorted(by_cell.items()) if len(ends) > 1]


def time_ratio_range(results: list[dict], arms: dict, timing: dict) -> dict:
    """The VCPO / sync time-to-target ratio under each choice the one timing seed leaves open: the lag, and which sync
    arm's seconds per step (the two rates' step times differ) multiply sync's median steps."""
    per_step = timing["seconds_per_step"]
    syncs = [name for name, arm in arms.items() if arm["method"] == "sync" and name in per_step]
    ratios = [r["seconds"] / (r["sync_median_steps"] * per_step[name]) for r in results for name in syncs]
    return {"low": min(ratios), "high": max(ratios), "sync_arms": syncs, "timing_seeds": 1} if ratios else {}


def best_arm(arms: dict, names: list[str]) -> str | None:
    present = [name for name in names if name in arms]
    return max(present, key=lambda name: arms[name]["end"]) if present else None


def equivalence_report(by_arm: dict[str, dict[int, dict]], arms: dict) -> list[dict]:
    """Per lag: VCPO at its best rate there minus sync at its best rate, TOST, Holm over the lags."""
    sync = best_arm(arms, [name for name in arms if arms[name]["method"] == "sync"])
    results = []
    for lag in LAGS:
        vcpo = best_arm(arms, [name for name in arms if arms[name]["method"] == "vcpo" and arms[name]["lag"] == lag])
        if vcpo is None or sync is None:
            continue
        seeds = sorted(set(by_arm[vcpo]) & set(by_arm[sync]))
        test = equivalence([by_arm[vcpo][s]["end"] for s in seeds], [by_arm[sync][s]["end"] for s in seeds], EQUIVALENCE_MARGIN)
        results.append({"lag": lag, "a": vcpo, "b": sync, **test})
    tested = [r for r in results if math.isfinite(r["p"])]
    for result, adjusted in zip(tested, holm([r["p"] for r in tested]), strict=True):
        result["p_holm"] = adjusted
        result["verdict"] = "equivalent" if adjusted < ALPHA else "equivalence not shown"
    return results


def time_report(arms: dict, sync_arm: str, timing: dict, last_step: int) -> list[dict]:
    """Per lag: median steps to target x seconds per step, async VCPO (2e-4) against sync at its best rate. An
    arm whose median falls on runs that never reached the target ("> last_step") takes at least last_step steps:
    its seconds and its ratio to sync are then lower bounds (``at_least``); sync's must be reached."""
    per_step = timing["seconds_per_step"]
    results = []
    sync_steps = arms[sync_arm]["median_steps"] if sync_arm in arms else math.nan
    sync_time = sync_steps * per_step[sync_arm] if sync_arm in per_step else math.nan
    for lag in LAGS:
        name = f"vcpo_k{lag}"
        if name not in arms or name not in per_step:
            continue
        at_least = arms[name]["median_steps"] == math.inf
        seconds = (last_step if at_least else arms[name]["median_steps"]) * per_step[name]
        ratio = seconds / sync_time if math.isfinite(sync_time) and sync_time else math.nan
        results.append({"lag": lag, "arm": name, "median_steps": arms[name]["median_steps"], "seconds_per_step": per_step[name],
                        "seconds": seconds, "at_least": at_least, "sync_arm": sync_arm, "sync_median_steps": sync_steps,
                        "sync_seconds_per_step": per_step.get(sync_arm), "sync_seconds": sync_time, "ratio": ratio})
    return results


def search_report(rows: list[dict]) -> dict:
    """The tool-use search's cells and across_lags.md's qualifying rule and order."""
    cells: dict[tuple[float, int], dict] = {}
    sync: dict[float, list[dict]] = {}
    for row in rows:
        if row["method"] == "sync":
            sync.setdefault(row["lr"], []).append(row)
        else:
            cells.setdefault((row["lr"], row["lag"]), {}).setdefault(row["method"], []).append(row)
    table = []
    for (lr, lag), methods in sorted(cells.items()):
        references, seq_tis, vcpo = sync.get(lr, []), methods.get("seq_tis_c8", []), methods.get("vcpo", [])
        complete = all(len(group) == SEARCH_SEEDS for group in (references, seq_tis, vcpo))
        cell = {
            "lr": lr, "lag": lag, "complete": complete,
            "sync_holds": sum(row["holds"] for row in references), "sync_n": len(references),
            "seq_tis_collapses": sum(row["collapsed"] for row in seq_tis), "seq_tis_n": len(seq_tis),
            "seq_tis_end_over_best": float(np.mean([row["end_validation"] / row["best"] for row in seq_tis])) if seq_tis else math.nan,
            "vcpo_mean_step_factor": float(np.mean([row["mean_lr_scale"] for row in vcpo])) if vcpo else math.nan, "vcpo_n": len(vcpo),
            "sync_end": float(np.mean([row["end"] for row in references])) if references else math.nan,
            "seq_tis_end": float(np.mean([row["end"] for row in seq_tis])) if seq_tis else math.nan,
            "vcpo_end": float(np.mean([row["end"] for row in vcpo])) if vcpo else math.nan,
        }
        cell["qualifies"] = (complete and cell["sync_holds"] == SEARCH_SEEDS and cell["seq_tis_collapses"] >= 2
                             and cell["vcpo_mean_step_factor"] < STEP_FACTOR_LEAVES_ONE)
        table.append(cell)
    qualifying = sorted((c for c in table if c["qualifies"]),
                        key=lambda c: (-c["seq_tis_collapses"], c["seq_tis_end_over_best"], c["lr"], c["lag"]))
    return {"cells": table, "complete": bool(table) and all(c["complete"] for c in table),
            "chosen": {"lr": qualifying[0]["lr"], "lag": qualifying[0]["lag"]} if qualifying else None}


def confirm_report(rows: list[dict], design: Design) -> dict:
    """across_lags.md: at the searched cell, VCPO - seq-TIS (primary) and VCPO - sync (secondary) on ``end``,
    paired by seed, Holm over the two."""
    arms = [arm for arm in design.arms if arm.task == CONFIRM_TASK]
    by_arm = rows_by_arm(rows)
    name = {arm.method: arm.name for arm in arms}
    summaries = {arm.name: arm_summary(list(by_arm[arm.name].values())) for arm in arms if arm.name in by_arm}
    return {"arms": summaries, "missing": missing_seeds(by_arm, arms, design.seeds_of(CONFIRM_TASK)),
            "comparisons": compare(by_arm, [(name["vcpo"], name["seq_tis_c8"]), (name["vcpo"], name["sync"])])}


def report(rows: list[dict], design: Design, timing: dict | None) -> dict:
    counted = [row for row in rows if row["counts"]]
    return {
        "registration": REGISTRATION, "rows": len(rows), "rows_counted": len(counted),
        "countdown": countdown_report([r for r in counted if r["study_task"] == "countdown"], design, timing),
        "tir_search": search_report([r for r in counted if r["study_task"] == "tir_search"]),
        "tir_confirm": confirm_report([r for r in counted if r["study_task"] == CONFIRM_TASK], design),
        "timing": timing,
    }


# -- timing runs ------------------------------------------------------------------------------------
def timing_arms(design: Design) -> list[str]:
    """across_lags.md: sync at both rates, VCPO 2e-4 and seq-TIS 5e-5 at every lag."""
    names = [arm.name for arm in design.arms if arm.task == "countdown" and arm.method == "sync"]
    return names + [f"{prefix}_k{lag}" for lag in LAGS for prefix in ("vcpo", "seq_tis_lr5e-5")]


def timing_command(design: Design, name: str, out: Path) -> list[str]:
    """Seed 0 of the arm with the study's settings, no intermediate evaluations, on both cores: sync on two
    threads, an async arm with generation and training concurrent (one thread each)."""
    arm = design.arm("countdown", name)
    settings = run_settings(design, arm, 0, out)
    own = ("threads=2",) if arm.method == "sync" else ("threads=1", "execution=concurrent")
    return command_line(design, arm, settings, str(out / name), ("eval_every=0", "test_problems=100", *own, "progress=false"))


def run_timing(design: Design, out: Path, table: Path) -> dict:
    recorded = read_json(table, keys=("seconds_per_step",))["seconds_per_step"] if table.exists() else {}
    if problem := shrink_problem(table, dict.fromkeys(recorded, 1), dict.fromkeys(timing_arms(design), 1),
                                 "pass --table for a file of your own", rows="arms"):
        raise SystemExit(f"error: {problem}")
    started = {**code_state(), "start": utc_now(), "load_average_start": os.getloadavg()}
    seconds = {}
    for name in timing_arms(design):
        command = timing_command(design, name, out)
        print(f"timing {name}: {' '.join(command[1:])}", flush=True)
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, preexec_fn=dies_with_this_thread)
        steps = [line["timing_s/step"] for line in read_metrics(out / name) if "timing_s/step" in line and line["step"] >= TIMING_FROM_STEP]
        seconds[name] = float(np.mean(steps))
        print(f"  {seconds[name]:.3f} s per step", flush=True)
    # the load average says whether other work shared the machine (an idle two-core machine stays near 2 while it runs)
    provenance = {**started, "end": utc_now(), "load_average_end": os.getloadavg()}
    result = {"cpu": cpu_name(), "from_step": TIMING_FROM_STEP, "seconds_per_step": seconds, "provenance": provenance,
              "commands": {name: " ".join(["python", *timing_command(design, name, Path("DIR"))[1:]]) for name in seconds}}
    table.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(table, json.dumps(result, indent=1) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vcpo.studies.across_lags", description=__doc__.split("\n\n")[0])
    parser.add_argument("--design", type=Path, default=DESIGN)
    commands = parser.add_subparsers(dest="command", required=True)
    rows = commands.add_parser("rows", help="the table of archived runs")
    rows.add_argument("--archive", type=Path, default=ARCHIVE)
    rows.add_argument("--table", type=Path, default=TABLE)
    timing = commands.add_parser("timing", help="seconds per step of the timing runs (an idle two-core machine)")
    timing.add_argument("--out", type=Path, required=True, help="where the timing runs go")
    timing.add_argument("--table", type=Path, default=TIMING)
    search = commands.add_parser("search", help="the tool-use search's cells and choice (once its runs are complete)")
    search.add_argument("--table", type=Path, default=TABLE)
    search.add_argument("--out", type=Path, default=SEARCH)
    summary = commands.add_parser("report", help="statistics, summary and figures from the table")
    summary.add_argument("--table", type=Path, default=TABLE)
    summary.add_argument("--timing", type=Path, default=TIMING)
    summary.add_argument("--out", type=Path, default=TABLE.parent)
    summary.add_argument("--any-analysis-commit", action="store_true",
                         help="run even where the analysis code differs from the commit the registration names")
    args = parser.parse_args(argv)
    design = load_design(args.design)
    if args.command == "rows":
        print(f"{len(write_rows(design, args.archive, args.table))} archived runs -> {args.table}")
    elif args.command == "timing":
        run_timing(design, args.out, args.table)
    elif args.command == "search":
        # the report's modules (matplotlib) only for the commands that write it
        from vcpo.studies.across_lags_report import outcome_cells, search_markdown, written_cells

        outcome = search_report([row for row in read_rows(args.table) if row["counts"] and row["study_task"] == "tir_search"])
        if not outcome["complete"]:
            print("error: the tool-use search is not complete: nothing chosen, nothing written", file=sys.stderr)
            return 1
        if args.out.exists() and (problem := shrink_problem(args.out, dict.fromkeys(written_cells(args.out.read_text()), 1),
                                                             dict.fromkeys(outcome_cells(outcome), 1),
                                                             "pass --out for a file of your own", rows="cells")):
            print(f"error: {problem}", file=sys.stderr)
            return 2
        write_atomic(args.out, search_markdown(outcome))
        print(f"{'chosen: ' + json.dumps(outcome['chosen']) if outcome['chosen'] else 'no cell qualifies'} -> {args.out}")
    else:
        # the report's modules (matplotlib) only for the commands that write it
        from vcpo.studies.across_lags_report import replace_block, results_markdown, write_report
        from vcpo.studies.readme_results import ACROSS_LAGS, committed_statistics
        from vcpo.studies.readme_results import results_markdown as readme_results

        problem = analysis_commit_problem(REGISTRATION, analysis_code_commit())
        if problem and not args.any_analysis_commit:
            print(f"error: {problem}", file=sys.stderr)
            return 2
        started = utc_now()
        timing_table = json.loads(args.timing.read_text()) if args.timing.exists() else None
        rows = read_rows(args.table)
        stats = {**report(rows, design, timing_table), "provenance": output_record(started)}
        earlier = args.out / "stats.json"
        if earlier.exists() and (problem := shrink_problem(earlier, {"the report": read_json(earlier)["rows"]},
                                                            {"the report": stats["rows"]}, "pass --out for a folder of your own",
                                                            unit="runs")):
            print(f"error: {problem}", file=sys.stderr)
            return 2
        write_report(stats, rows, args.out)
        if args.table == TABLE:  # the committed study: its prose in the docs and the README is generated here
            replace_block(Path("docs/studies.md"), "across_lags_results", results_markdown(stats))
            replace_block(Path("README.md"), "results", readme_results(committed_statistics() | {ACROSS_LAGS: stats}))
            print("wrote the across-lags block of docs/studies.md and the results block of README.md")
            if "analysis_commit" not in REGISTRATION:
                print("note: this study's registration predates naming its analysis commit; the analysis code is at "
                      f"{analysis_code_commit()}")
    return 0


if __name__ == "__main__":
    exit_with(main)
