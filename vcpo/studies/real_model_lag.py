"""The real model's policy-lag study (recipes/real_model_lag.md): the task chosen by its registered rule, then the runs.

    python -m vcpo.studies.real_model_lag choose [--work results/real_model_lag/task_choice]
    python -m vcpo.studies.real_model_lag run [--work results/real_model_lag] [--commit]
    python -m vcpo.studies.real_model_lag status
    python -m vcpo.studies.real_model_lag report

``choose`` scores SmolLM2-135M-Instruct's samples (the training's sampling and reward) on the first validation problems
of each candidate task of ``recipes/real_model_lag.yaml``, applies the rule and writes
tables/real_model_lag/task_choice.{json,md}: every candidate's mean@4 with its bootstrap interval over problems, the
truncation and no-answer counts, and the chosen task (or none). A candidate already evaluated in ``--work`` is read
back, not rerun.

``run`` trains what the registration asks next through verl's trainer, one Snakemake job per run (``real_model_lag.smk``
beside this file, one run at a time on the machine's cores): the learning-rate ladder rate by rate until its rule
decides, then (once ``regime.json``, which it writes, is committed) the confirmation, seed by seed. Each finished run
appends its row to tables/real_model_lag/runs.jsonl (verl's staleness per step, the held-out accuracies, the rule's
inputs, commit, start, finish, CPU) and keeps its verl metrics beside it, gzipped; ``--commit`` commits them at once,
so that a session's end loses at most the run under way, which starts over. ``status`` says what is done and what
is left; ``report`` writes the study's statistics, tables, figures and prose from the rows
(``vcpo.studies.real_model_lag_report``), and docs/claims.md's rows of the claims it tests.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from vcpo.data import DATASETS, load_rows
from vcpo.lifetimes import dies_with_this_thread, run_jobs_with_snakemake
from vcpo.locks import run_folder_lock, write_atomic
from vcpo.provenance import code_state, cpu_name, is_committed, library_versions, output_record, utc_now
from vcpo.recipes import read_yaml, recipes_dir
from vcpo.reporting.run_data import read_metrics, series
from vcpo.runs import METRICS_FILE, SEQ_ESS_RATIO, STALENESS, STEP_SECONDS, VAL_ACCURACY
from vcpo.studies.statistics import bootstrap_mean_interval

DESIGN = "real_model_lag.yaml"
MODEL = "smollm2-135m-instruct"  # vcpo.local_models.PACKAGED_MODELS
TABLES = Path("tables") / "real_model_lag"
WORK = Path("results") / "real_model_lag"
SNAKEFILE = Path(__file__).with_name("real_model_lag.smk")
CLAIMS_DOC, CLAIMS_BLOCK = Path("docs") / "claims.md", "real_model_claims"  # the block of the claims rows it tests
RUNS_FILE, REGIME_FILE, METRICS_FOLDER = "runs.jsonl", "regime.json", "metrics"
INTERVAL = {"level": 0.95, "resamples": 10_000, "seed": 0}  # percentile bootstrap over problems, as the base evaluation


def chosen_task(means: dict[str, float], band: tuple[float, float], target: float) -> str | None:
    """The registered rule: of the candidates (in their registered order) whose mean lies in ``band``, the one
    closest to ``target`` (the earlier on a tie); None when none lies in the band."""
    inside = [name for name, mean in means.items() if band[0] <= mean <= band[1]]
    return min(inside, key=lambda name: abs(means[name] - target)) if inside else None


def evaluate_candidate(name: str, rule: dict, answer_format: str, seed: int, model: Path, out: Path) -> dict:
    """Generate and score the candidate's problems into ``out`` (or read back an earlier evaluation there)."""
    # transformers: imported where a model generates, not where this module is
    from vcpo.evaluation.generation import HFGenerator, SamplingParams
    from vcpo.evaluation.harness import evaluate_rows
    from vcpo.evaluation.metrics import per_problem_means

    summary_file = out / "summary.json"
    if summary_file.exists():
        return json.loads(summary_file.read_text())
    rows = load_rows(name, rule["split"])[: rule["problems"]]
    started = {**code_state(), "start": utc_now(), "cpu": cpu_name(), "threads": os.environ.get("OMP_NUM_THREADS"),
               "libraries": library_versions()}
    generator = HFGenerator.load(model, batch_size=rule["batch_size"])
    sampling = SamplingParams(**{**rule["sampling"], "seed": seed})
    records, measured = evaluate_rows(generator, rows, sampling, answer_format, name)
    per_problem = per_problem_means(records, lambda record: record["score"])
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "samples.jsonl", "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
    summary = {"task": name, "problems": len(rows), "per_problem_reward": per_problem,
               "mean_reward": sum(per_problem) / len(per_problem), **measured,
               "provenance": {**started, "end": utc_now()}}
    write_atomic(summary_file, json.dumps(summary, indent=2) + "\n")  # written last: its presence means complete
    return summary


def real_model_run_command(method: str, lag: int, seed: int, training: dict, task: str, answer_format: str,
                           val_rows: list[dict], out: Path, data: Path, extra: tuple[str, ...] = ()) -> tuple[list[str], Path]:
    """The ``python -m vcpo.launch.cpu`` command of one verl run of the real model: ``method`` at ``lag``, ``training``'s
    batch, lengths, temperature, steps and validation interval (a ``training`` block of recipes/real_model*.yaml), ``task``'s train
    split and reward in ``answer_format``, greedy validation on ``val_rows``; the parquet files under ``data``/task, the
    run into ``out``. ``extra``: Hydra overrides appended last."""
    from vcpo.launch.cpu import quiet_verl_import  # the launcher's imports (Hydra, verl's config): where a run is built

    quiet_verl_import()  # the runner's console shows the runs' lines, not verl's import warnings
    from vcpo.verl_plugin.cpu.recipe import (  # imports verl: where a run is built
        pretrained_task_overrides,
        write_task_data,
    )

    files = write_task_data(task, val_rows, data)
    overrides = [
        *pretrained_task_overrides(training, answer_format), "trainer.save_freq=-1",
        # a Ray instance of its own: two arms at once would otherwise share one, and its memory monitor kills either's workers
        "+ray_kwargs.ray_init.address=local",
    ]
    launch_task = "countdown" if DATASETS[task].data_source == "countdown" else "gsm8k"
    command = [sys.executable, "-m", "vcpo.launch.cpu", "--out", str(out), "--task", launch_task, "--method", method,
               "--lag", str(lag), "--seed", str(seed), "--steps", str(training["steps"]), "--model", MODEL,
               "--train", str(files["train"]), "--val", str(files["val"]), "--", *overrides, *extra]
    return command, out


def choose(work: Path, tables: Path) -> dict:
    """Round by round (a round runs only when the ones before it chose no task), evaluate every candidate (or read its
    earlier evaluation in ``work``), apply the rule, write the table."""
    from vcpo.local_models import packaged_model  # transformers and the model cache, where a model is evaluated

    design = read_yaml(recipes_dir() / DESIGN)
    rule = design["task_choice"]
    model = packaged_model(design["model"])
    plan = [(changes.get("candidates", rule["candidates"]),
             {**rule["sampling"], **{key: value for key, value in changes.items() if key != "candidates"}})
            for changes in rule["rounds"]]
    for name in dict.fromkeys(name for candidates, _ in plan for name in candidates):
        test = len(load_rows(name, "test"))
        if test < rule["test_problems"]:
            raise SystemExit(f"{name}: {test} test problems, the registration needs {rule['test_problems']}")
    rounds = []
    for number, (candidates, sampling) in enumerate(plan, 1):
        rows = {}
        for name in candidates:
            print(f"round {number}, {name}: the first {rule['problems']} {rule['split']} problems, n = {sampling['n']}, "
                  f"{sampling['max_new_tokens']} new tokens", flush=True)
            summary = evaluate_candidate(name, {**rule, "sampling": sampling}, rule["answer_format"], sampling["seed"], model,
                                         work / f"round{number}" / name)
            low, high = bootstrap_mean_interval(summary["per_problem_reward"], INTERVAL["level"], INTERVAL["resamples"],
                                                INTERVAL["seed"])
            rows[name] = {"problems": summary["problems"], "mean_reward": summary["mean_reward"], "low": low, "high": high,
                          "mean_response_tokens": summary["mean_response_tokens"], "truncated": summary["truncated"],
                          "no_answer": summary["no_answer"], "provenance": summary["provenance"]}
        chosen = chosen_task({name: row["mean_reward"] for name, row in rows.items()}, tuple(rule["band"]), rule["target"])
        rounds.append({"sampling": sampling, "rows": rows, "chosen": chosen})
        if chosen is not None:
            break
    last = rounds[-1]
    result = {"rule": rule, "rounds": rounds, "chosen": last["chosen"],
              # the study's response length and temperature: the choosing round's (recipes/real_model_lag.md)
              "max_response_length": last["sampling"]["max_new_tokens"] if last["chosen"] else None,
              "temperature": last["sampling"]["temperature"] if last["chosen"] else None,
              "written": utc_now(), "analysis": code_state()}
    if (conflict := choice_conflict(tables / "task_choice.json", result)) is not None:
        raise SystemExit(f"{tables / 'task_choice.json'} holds another result ({conflict}): nothing written; pass "
                         "--tables for a folder of your own")
    recorded = tables / "task_choice.json"
    if recorded.exists() and len(json.loads(recorded.read_text())["rounds"]) == len(rounds):
        print(f"{recorded} already records this result; left as it is")
        return json.loads(recorded.read_text())
    tables.mkdir(parents=True, exist_ok=True)
    write_atomic(tables / "task_choice.json", json.dumps(result, indent=2) + "\n")
    write_atomic(tables / "task_choice.md", choice_markdown(result))
    print(choice_markdown(result))
    return result


def choice_conflict(path: Path, result: dict) -> str | None:
    """How ``result`` contradicts the task choice already at ``path`` (None when it only repeats it, or adds rounds
    registered since): a recorded round's means, measured again on another machine or at another commit, may differ."""
    if not path.exists():
        return None
    earlier = json.loads(path.read_text())["rounds"]
    if len(result["rounds"]) < len(earlier):
        return f"{len(earlier)} rounds, this one {len(result['rounds'])}"
    for number, (old, new) in enumerate(zip(earlier, result["rounds"], strict=False), 1):
        means = {name: row["mean_reward"] for name, row in old["rows"].items()}
        if means != {name: row["mean_reward"] for name, row in new["rows"].items()}:
            return f"round {number}'s means differ"
    return None


def choice_markdown(result: dict) -> str:
    rule = result["rule"]
    lines = ["| round: new tokens, temperature | task | problems | base mean@4 [95% CI] | no answer | response tokens "
             "(cut at the limit) | in the band |", "|---|---|---:|---|---:|---:|---|"]
    for number, round_ in enumerate(result["rounds"], 1):
        for name, row in round_["rows"].items():
            inside = rule["band"][0] <= row["mean_reward"] <= rule["band"][1]
            lines.append(f"| {number}: {round_['sampling']['max_new_tokens']}, {round_['sampling']['temperature']:g} | "
                         f"{name} | {row['problems']} | "
                         f"{100 * row['mean_reward']:.1f}% [{100 * row['low']:.1f}, {100 * row['high']:.1f}] | "
                         f"{row['no_answer']} | {row['mean_response_tokens']:.0f} ({100 * row['truncated']:.0f}%) | "
                         f"{'yes' if inside else 'no'} |")
    chosen, sampling = result["chosen"], rule["sampling"]
    verdict = (f"Chosen: **{chosen}** (in the band, closest to {100 * rule['target']:.0f}%), with {result['max_response_length']} "
               f"response tokens and temperature {result['temperature']:g} for every run." if chosen
               else "No candidate lies in the band in any round: no task is chosen, and the study stops here.")
    commits = sorted({row["provenance"]["commit"][:12] + (" (dirty)" if row["provenance"].get("dirty") else "")
                      for round_ in result["rounds"] for row in round_["rows"].values()})
    return "\n".join([
        *lines, "",
        f"SmolLM2-135M-Instruct before training (hf backend, CPU): the first {rule['problems']} {rule['split']} problems of "
        f"each of the round's candidates, n = {sampling['n']}, top-p {sampling['top_p']}, the round's new tokens, "
        f"temperature and seed, scored {rule['answer_format']} (a response cut at the limit read strictly); 95% percentile "
        f"bootstrap over problems. Rule (recipes/real_model_lag.md, each round registered before it ran): the candidate "
        f"whose mean lies in [{100 * rule['band'][0]:.0f}%, {100 * rule['band'][1]:.0f}%] and is closest to "
        f"{100 * rule['target']:.0f}%, ties to the earlier; a round runs only when the ones before it chose none. {verdict}",
        f"`python -m vcpo.studies.real_model_lag choose`; evaluated at commit {', '.join(commits)}; written {result['written']}.",
        "",
    ])


# ------------------------------------------------------------------------------------------------------------ the runs
@dataclass(frozen=True)
class Run:
    """One registered training: ``arm`` of ``phase`` ("regime" or "confirmation") at learning rate ``rate``."""

    phase: str
    arm: str
    method: str
    lag: int
    rate: float
    seed: int

    @property
    def name(self) -> str:
        return f"{self.phase}-{self.arm}-lr{self.rate:g}-seed{self.seed}"


def run_outcome(heldout: list[list], ess_min: float | None, rule: dict) -> dict:
    """The regime rule's inputs and verdicts for one run (recipes/real_model_lag.yaml ``regime``): held-out accuracy at
    step 0 (``base``), its best and its last (``end``) value; ``collapsed``: end at most ``end_over_best_at_most`` of the
    best and the sequence ESS ratio at or below ``seq_ess_ratio_at_most`` at some step (a run that logs no ESS ratio
    cannot collapse); ``improves``: end at least ``sync_improves_by`` above base, and not collapsed."""
    if not heldout or heldout[0][0] != 0:
        raise ValueError("a run needs its step-0 held-out evaluation to be judged")
    accuracies = [accuracy for _, accuracy in heldout]
    base, best, end = accuracies[0], max(accuracies), accuracies[-1]
    collapse = rule["collapse"]
    collapsed = (end <= collapse["end_over_best_at_most"] * best and ess_min is not None
                 and ess_min <= collapse["seq_ess_ratio_at_most"])
    return {"base": base, "best": best, "end": end, "ess_min": ess_min, "collapsed": collapsed,
            "improves": end >= base + rule["sync_improves_by"] and not collapsed}


def ladder(design: dict, rows: dict[str, dict]) -> tuple[list[Run], dict | None]:
    """The regime's next runs (the lowest rate not yet run, both arms) or, once its rule decides, the regime: the lowest
    rate at which seq-TIS collapses and sync improves; none: the highest rate at which sync improves; none: the
    registered fallback rate."""
    regime = design["regime"]
    verdicts = []
    for rate in regime["rates"]:
        runs = {arm: Run("regime", arm, spec["method"], spec["lag"], rate, regime["seed"]) for arm, spec in regime["arms"].items()}
        missing = [run for run in runs.values() if run.name not in rows]
        if missing:
            return missing, None
        verdict = {"rate": rate, "sync_improves": rows[runs["sync"].name]["outcome"]["improves"],
                   "seq_tis_collapses": rows[runs["seq_tis"].name]["outcome"]["collapsed"]}
        verdicts.append(verdict)
        if verdict["sync_improves"] and verdict["seq_tis_collapses"]:
            return [], {"rate": rate, "by": "the lowest rate at which seq-TIS collapses and sync improves", "ladder": verdicts}
    improving = [verdict["rate"] for verdict in verdicts if verdict["sync_improves"]]
    if improving:
        return [], {"rate": max(improving), "by": "fallback: no rate qualifies; the highest rate at which sync improves",
                    "ladder": verdicts}
    return [], {"rate": regime["fallback_rate"], "by": "fallback: sync improves at no rate", "ladder": verdicts}


def confirmation(design: dict, rate: float) -> list[Run]:
    """The confirmation's runs in their registered order: seed by seed, the arms in order within a seed."""
    plan = design["confirmation"]
    return [Run("confirmation", arm, spec["method"], spec["lag"], rate, seed)
            for seed in plan["seeds"] for arm, spec in plan["arms"].items()]


def read_rows(tables: Path) -> dict[str, dict]:
    path = tables / RUNS_FILE
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return {row["name"]: row for row in rows}


def next_runs(design: dict, tables: Path, commit_gate: bool = True, write: bool = False) -> tuple[list[Run], str]:
    """What the registration asks next, and a sentence on where the study stands. With ``commit_gate`` (the study's
    own tables) the confirmation waits until the regime the ladder chose is committed; without it (a reproduction in a
    results folder) the confirmation follows the ladder's rule at once. ``write``: write the regime once the ladder has
    decided (the runner does; ``status`` only says so)."""
    rows = read_rows(tables)
    runs, regime = ladder(design, rows)
    if runs:
        return runs, f"the learning-rate ladder: rate {runs[0].rate:g} ({len(rows)} runs done)"
    regime_file = tables / REGIME_FILE
    if not regime_file.exists():
        if not write:
            return [], f"the ladder has decided (rate {regime['rate']:g}: {regime['by']}); `run` writes {regime_file}"
        write_regime(regime, tables)
    if commit_gate and not is_committed(regime_file):
        return [], (f"the regime is chosen ({regime_file}): commit {regime_file} and regime.md, then run again for the "
                    "confirmation")
    rate = json.loads(regime_file.read_text())["rate"]
    left = [run for run in confirmation(design, rate) if run.name not in rows]
    return left, f"the confirmation at rate {rate:g}: {len(confirmation(design, rate)) - len(left)} of " \
                 f"{len(confirmation(design, rate))} runs done"


def write_regime(regime: dict, tables: Path) -> None:
    lines = ["| rate | sync improves | seq-TIS collapses |", "|---:|---|---|"]
    lines += [f"| {v['rate']:g} | {'yes' if v['sync_improves'] else 'no'} | {'yes' if v['seq_tis_collapses'] else 'no'} |"
              for v in regime["ladder"]]
    decided = utc_now()  # the rule reads committed rows: the decision takes no time of its own
    text = "\n".join([*lines, "", f"Chosen rate: **{regime['rate']:g}** ({regime['by']}; recipes/real_model_lag.md, part 2). "
                       f"From tables/real_model_lag/runs.jsonl by `python -m vcpo.studies.real_model_lag run`, {decided}.", ""])
    write_atomic(tables / REGIME_FILE, json.dumps({**regime, **output_record(decided)}, indent=2) + "\n")
    write_atomic(tables / "regime.md", text)


def study_setup(tables: Path) -> tuple[dict, dict, dict]:
    """The design, the task choice (which must have chosen) and the settings every run shares."""
    design = read_yaml(recipes_dir() / DESIGN)
    choice = json.loads((tables / "task_choice.json").read_text())
    if choice["chosen"] is None:
        raise SystemExit(f"{tables / 'task_choice.json'} chose no task: the study has nothing to train")
    training = {**design["training"], "max_response_length": choice["max_response_length"],
                "temperature": choice["temperature"]}
    return design, choice, training


def run_one(run: Run, work: Path, tables: Path, commit: bool) -> dict:
    """Train ``run`` through verl's trainer (an unfinished earlier attempt starts over) and append its row."""
    design, choice, training = study_setup(tables)
    out = work / "runs" / run.name
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rule = design["task_choice"]
    val = load_rows(choice["chosen"], "test")[: rule["test_problems"]]
    command, _ = real_model_run_command(run.method, run.lag, run.seed, training, choice["chosen"], rule["answer_format"],
                                        val, out, work / "data", extra=(f"actor_rollout_ref.actor.optim.lr={run.rate}",))
    started = {**code_state(), "start": utc_now(), "cpu": cpu_name(), "libraries": library_versions(),
               "load_at_start": os.getloadavg()[0]}
    log = work / "runs" / f"{run.name}.log"
    print(f"{run.name}: {training['steps']} steps; log {log}", flush=True)
    with open(log, "w") as handle:
        code = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, preexec_fn=dies_with_this_thread).returncode
    if code:
        raise RuntimeError(f"{run.name}: verl's trainer exited with {code}; see {log}")
    lines = read_metrics(out)
    steps, accuracy = series(lines, VAL_ACCURACY)
    _, ess = series(lines, SEQ_ESS_RATIO)
    staleness = [[line["step"], line[f"{STALENESS}/max"], line[f"{STALENESS}/mean"]] for line in lines
                 if f"{STALENESS}/max" in line]
    heldout = [[int(step), float(value)] for step, value in zip(steps, accuracy, strict=True)]
    times = sorted(line[STEP_SECONDS] for line in lines if STEP_SECONDS in line)
    row = {**asdict(run), "name": run.name, "task": choice["chosen"], "steps": max(line["step"] for line in lines),
           "staleness": staleness, "heldout": heldout,
           "outcome": run_outcome(heldout, float(ess.min()) if ess.size else None, design["regime"]),
           "median_step_s": times[len(times) // 2] if times else None, **started, "finish": utc_now(),
           "load_at_finish": os.getloadavg()[0]}  # the one-minute load: a step time read beside other work says so
    keep_row(row, out, tables, commit)
    return row


def keep_row(row: dict, out: Path, tables: Path, commit: bool) -> None:
    """Append ``row`` to the study's runs.jsonl and keep the run's verl metrics beside it, gzipped (and commit both)."""
    metrics = tables / METRICS_FOLDER / f"{row['name']}.jsonl.gz"
    metrics.parent.mkdir(parents=True, exist_ok=True)
    with open(out / METRICS_FILE, "rb") as source, gzip.open(metrics, "wb") as target:
        shutil.copyfileobj(source, target)
    with open(tables / RUNS_FILE, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(row) + "\n")
    if commit:
        paths = [str(tables / RUNS_FILE), str(metrics)]
        git_with_retry("add", "--", *paths)
        git_with_retry("commit", "-q", "-m", f"The real model's lag study: run {row['name']} (its row and metrics)",
                       "--", *paths)


def git_with_retry(*args: str, attempts: int = 30) -> None:
    """Run git, waiting out another process's index lock (someone committing in the same checkout): a finished run's
    row must not be lost to a lock held for a moment."""
    for attempt in range(attempts):
        result = subprocess.run(["git", *args], capture_output=True, text=True)
        if result.returncode == 0:
            return
        if "index.lock" not in result.stderr or attempt == attempts - 1:
            raise RuntimeError(f"git {args[0]} failed: {result.stderr.strip()}")
        time.sleep(2)


def run_study(work: Path, tables: Path, commit: bool, commit_gate: bool = True) -> int:
    """Run what the registration asks next until it asks for nothing (or for the regime's commit), one Snakemake job
    per run, in the registration's order (seed by seed: a study stopped between sessions leaves whole pairs); returns
    1 when a run failed, which stops the study, else 0."""
    work, tables = work.resolve(), tables.resolve()
    study_setup(tables)  # refuses a study with no task
    work.mkdir(parents=True, exist_ok=True)
    with run_folder_lock(work):
        while True:
            runs, where = next_runs(read_yaml(recipes_dir() / DESIGN), tables, commit_gate, write=True)
            print(f"study: {where}", flush=True)
            if not runs:
                return 0
            plan, run = work / "plan.json", runs[0]  # Snakemake would choose among several in an order of its own
            write_atomic(plan, json.dumps({"work": str(work), "tables": str(tables), "commit": commit, "plan": str(plan),
                                           "runs": [{**asdict(run), "name": run.name}]}))
            run_jobs_with_snakemake(SNAKEFILE, plan, os.cpu_count() or 1)
            if run.name not in read_rows(tables):
                print(f"failed: {run.name} (its log in {work / 'runs'}); the same command runs it again", file=sys.stderr)
                return 1


def run_planned(plan_file: Path, name: str) -> None:
    """Snakemake's job: the run ``name`` of the plan ``run_study`` wrote."""
    plan = json.loads(plan_file.read_text())
    fields = next(fields for fields in plan["runs"] if fields["name"] == name)
    run = Run(**{key: value for key, value in fields.items() if key != "name"})
    run_one(run, Path(plan["work"]), Path(plan["tables"]), plan["commit"])


def status(tables: Path) -> str:
    design = read_yaml(recipes_dir() / DESIGN)
    rows = read_rows(tables)
    choice = tables / "task_choice.json"
    if not choice.exists() or json.loads(choice.read_text())["chosen"] is None:
        return f"{len(rows)} runs done; no task is chosen ({choice}): the study has nothing to run."
    runs, where = next_runs(design, tables)
    lines = [f"{len(rows)} runs done; now: {where}."]
    if runs:
        lines.append(f"next: {', '.join(run.name for run in runs[:3])}{' ...' if len(runs) > 3 else ''} "
                     f"({len(runs)} to run in this phase)")
        lines.append("resume: python -m vcpo.studies.real_model_lag run --commit")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vcpo.studies.real_model_lag", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser("choose", help="evaluate the candidate tasks and apply the registered rule")
    command.add_argument("--work", type=Path, default=WORK / "task_choice")
    command.add_argument("--tables", type=Path, default=TABLES)
    command = commands.add_parser("run", help="train the runs the registration asks for next (hours)")
    command.add_argument("--work", type=Path, default=WORK)
    command.add_argument("--tables", type=Path, default=TABLES)
    command.add_argument("--commit", action="store_true", help="commit each run's row and metrics as it finishes")
    command.add_argument("--no-commit-gate", dest="commit_gate", action="store_false",
                         help="go on to the confirmation without waiting for regime.json's commit (a reproduction "
                              "in a results folder, not the study's own tables)")
    command = commands.add_parser("run-one", help="one run of a plan that `run` wrote (Snakemake's job)")
    command.add_argument("--plan", type=Path, required=True)
    command.add_argument("--name", required=True)
    command = commands.add_parser("report", help="the statistics, tables, figures and prose from the rows")
    command.add_argument("--tables", type=Path, default=TABLES)
    command = commands.add_parser("status", help="what is done and what is left")
    command.add_argument("--tables", type=Path, default=TABLES)
    args = parser.parse_args(argv)
    if args.command == "choose":
        choose(args.work, args.tables)
    elif args.command == "run":
        return run_study(args.work, args.tables, args.commit, args.commit_gate)
    elif args.command == "run-one":
        run_planned(args.plan, args.name)
    elif args.command == "report":
        # matplotlib and scipy, for the report only
        from vcpo.studies.across_lags_report import replace_block
        from vcpo.studies.real_model_lag_report import claims_markdown, write_report

        statistics = write_report(args.tables, read_rows(args.tables), read_yaml(recipes_dir() / DESIGN), METRICS_FOLDER)
        print(f"wrote {args.tables / 'report.md'}")
        if args.tables == TABLES:  # the study's own rows: docs/claims.md quotes them
            replace_block(CLAIMS_DOC, CLAIMS_BLOCK, claims_markdown(statistics))
            print(f"wrote {CLAIMS_DOC}'s rows of this study")
    else:
        print(status(args.tables))
    return 0


if __name__ == "__main__":
    sys.exit(main())
