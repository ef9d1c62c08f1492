"""A task where the real model learns, chosen by the rule registered in recipes/real_model.yaml (``task_choice``).

    python benchmarks/real_model_task.py choose [--work results/real_model/tasks]
    python benchmarks/real_model_task.py train --arm sync|vcpo [--seed 0] [--work results/real_model/training]
    python benchmarks/real_model_task.py report [--work results/real_model/training]
    python benchmarks/real_model_task.py tables          # task_choice.md and training.md again from their JSON

``choose`` evaluates SmolLM2-135M-Instruct on the first problems of each candidate starter task (vcpo.data.datasets)
with the training's sampling and reward, applies the rule and writes tables/real_model/task_choice.{json,md}:
every candidate's mean reward with its bootstrap interval, and the chosen task (or none). A candidate already
evaluated in --work is read back, not rerun.

``train`` runs one arm of the registered training (``training`` in recipes/real_model.yaml) on the chosen task
through verl's own trainer (``python -m vcpo.launch.cpu``), into <work>/<arm>_s<seed>/ (metrics.jsonl), from its start
whatever the folder holds (verl cannot resume the real model's runs).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from vcpo.cli import shrink_problem
from vcpo.data import load_rows
from vcpo.lifetimes import dies_with_this_thread
from vcpo.local_models import packaged_model
from vcpo.locks import write_atomic
from vcpo.provenance import code_state, cpu_name, output_record, utc_now
from vcpo.recipes import read_yaml, recipes_dir
from vcpo.studies.real_model_lag import choice_conflict, chosen_task, evaluate_candidate, real_model_run_command
from vcpo.studies.statistics import bootstrap_mean_interval, mean_interval, percent_cell

REPO = Path(__file__).resolve().parents[1]
TABLES = REPO / "tables" / "real_model"  # where the tables go (--tables)
RUN_PROVENANCE = "provenance.json"  # what ``train`` records of a run, beside its metrics


def choose(work: Path, tables: Path = TABLES) -> dict:
    """Round by round (a later round runs only when the earlier chose no task), as registered."""
    plan = read_yaml(recipes_dir() / "real_model.yaml")
    rule = plan["task_choice"]
    model = packaged_model(plan["model"])
    interval = plan["interval"]
    rounds = []
    for number, settings in enumerate(rule["rounds"], 1):
        rows = {}
        for name in rule["candidates"]:
            print(f"round {number} ({settings['answer_format']}), {name}: the first {rule['problems']} {rule['split']} "
                  f"problems, n = {rule['sampling']['n']}", flush=True)
            summary = evaluate_candidate(name, rule, settings["answer_format"], settings["seed"], model,
                                         work / f"round{number}" / name)
            low, high = bootstrap_mean_interval(summary["per_problem_reward"], interval["level"], interval["resamples"],
                                                interval["seed"])
            rows[name] = {"problems": summary["problems"], "mean_reward": summary["mean_reward"], "low": low, "high": high,
                          "mean_response_tokens": summary["mean_response_tokens"], "truncated": summary["truncated"],
                          "no_answer": summary["no_answer"], "generation_s": summary["generation_seconds"],
                          "provenance": summary["provenance"]}
        chosen = chosen_task({name: row["mean_reward"] for name, row in rows.items()}, tuple(rule["band"]), rule["target"])
        rounds.append({**settings, "rows": rows, "chosen": chosen})
        if chosen is not None:
            break
    result = {"rule": rule, "rounds": rounds, "chosen": rounds[-1]["chosen"],
              "answer_format": rounds[-1]["answer_format"] if rounds[-1]["chosen"] else None, "written": utc_now()}
    if (conflict := choice_conflict(tables / "task_choice.json", result)) is not None:
        raise SystemExit(f"{tables / 'task_choice.json'} holds another result ({conflict}): nothing written; pass "
                         "--tables for a folder of your own")
    tables.mkdir(parents=True, exist_ok=True)
    (tables / "task_choice.json").write_text(json.dumps(result, indent=2) + "\n")
    (tables / "task_choice.md").write_text(choice_markdown(result))
    print(choice_markdown(result))
    return result


def choice_markdown(result: dict) -> str:
    rule = result["rule"]
    sampling = rule["sampling"]
    lines = ["| round (answer format) | task | problems | base mean reward [95% CI] | no answer | response tokens (truncated) | in the band |",
             "|---|---|---:|---|---:|---:|---|"]
    for number, round_ in enumerate(result["rounds"], 1):
        for name, row in round_["rows"].items():
            inside = rule["band"][0] <= row["mean_reward"] <= rule["band"][1]
            lines.append(f"| {number} ({round_['answer_format']}) | {name} | {row['problems']} | "
                         f"{percent_cell(row['mean_reward'], row['low'], row['high'], row['problems'])} | {row['no_answer']} | "
                         f"{row['mean_response_tokens']:.0f} ({100 * row['truncated']:.0f}%) | {'yes' if inside else 'no'} |")
    chosen = result["chosen"]
    verdict = (f"Chosen: **{chosen}**, scored {result['answer_format']} (in the band, closest to {100 * rule['target']:.0f}%)."
               if chosen else "No candidate lies in the band in any round: no task is chosen.")
    cpus = sorted({row["provenance"]["cpu"] for round_ in result["rounds"] for row in round_["rows"].values()})
    return "\n".join([
        *lines, "",
        f"SmolLM2-135M-Instruct before training, hf backend on CPU: the first {rule['problems']} {rule['split']} problems of "
        f"each starter task (vcpo.data.datasets), n = {sampling['n']}, temperature {sampling['temperature']}, top-p "
        f"{sampling['top_p']}, {sampling['max_new_tokens']} new tokens, the task's reward in the round's answer format; "
        f"95% percentile bootstrap over problems (where none succeeds, the Wilson interval's upper bound over them beside "
        f"it). Rule (recipes/real_model.yaml, registered before each round ran): the "
        f"candidate whose mean lies in [{100 * rule['band'][0]:.0f}%, {100 * rule['band'][1]:.0f}%] and is closest to "
        f"{100 * rule['target']:.0f}%; a round runs only when the one before it chose none. {verdict}",
        f"`python benchmarks/real_model_task.py choose`, written {result['written']}, {', '.join(cpus)}; each row's code and time:",
        *(f"- round {number}, {name}: {code_and_time(row['provenance'])}" for number, round_ in enumerate(result["rounds"], 1)
          for name, row in round_["rows"].items()),
        "",
    ])


def code_and_time(origin: dict) -> str:
    """'commit f7ac18246d58 (dirty), 2026-11-28T09:55:21+00:00 to 2026-11-28T09:58:59+00:00'."""
    return (f"commit {origin['commit'][:12]}{' (dirty)' if origin['dirty'] else ''}, {origin['start']} to "
            f"{origin.get('end', origin.get('finish'))}")


def training_command(arm: str, seed: int, work: Path, tables: Path = TABLES) -> tuple[list[str], Path]:
    """The ``python -m vcpo.launch.cpu`` command of one arm of the registered training, and its run folder (the
    chosen task's parquet files are written under ``work``)."""
    plan = read_yaml(recipes_dir() / "real_model.yaml")
    training = plan["training"]
    if arm not in training["arms"]:
        raise SystemExit(f"--arm {arm}: not a registered arm (recipes/real_model.yaml: {', '.join(training['arms'])})")
    if not (tables / "task_choice.json").exists():
        raise SystemExit(f"{tables / 'task_choice.json'}: no task choice yet (run `choose` first)")
    spec, choice = training["arms"][arm], json.loads((tables / "task_choice.json").read_text())
    if choice["chosen"] is None:
        raise SystemExit("tables/real_model/task_choice.json chose no task: there is nothing to train on")
    val = load_rows(choice["chosen"], plan["task_choice"]["split"])[: training["validation"]["problems"]]
    from vcpo.launch import overwriting

    command, out = real_model_run_command(spec["method"], spec["lag"], seed, training, choice["chosen"],
                                          choice["answer_format"], val, work / f"{arm}_s{seed}", work / "data")
    return overwriting(command), out  # a run killed before its end is trained again from its start (verl cannot resume it)


# verl's metric names: the training reward, the step's time split, and VCPO's own
TRAIN_REWARD = "critic/score/mean"
TIME_SPLIT = ("timing_s/gen", "timing_s/update_actor", "timing_s/update_weights", "timing_s/testing")  # old log-probs: 0 (bypass)
VCPO_METRICS = ("rollout_corr/seq_ess_ratio", "actor/lr_scale", "actor/opob_baseline", "actor/seq_grad_norm_mean")
WINDOW = 5  # steps averaged at the start and at the end of a run


def arm_summary(lines: list[dict], steps: int) -> dict:
    """One run: its training reward over the first and last WINDOW steps (with the t interval of each window's
    per-step values: the step-to-step spread, the only spread one seed shows), its validation accuracy at each
    evaluation, the VCPO metrics' means, and where a step's time goes."""
    from vcpo.runs import VAL_ACCURACY

    train = [line for line in lines if TRAIN_REWARD in line]
    rewards = [line[TRAIN_REWARD] for line in train]
    first, last = mean_interval(rewards[:WINDOW]), mean_interval(rewards[-WINDOW:])
    step_time = [line["timing_s/step"] for line in train if "timing_s/step" in line]
    return {
        "steps": len(train), "planned_steps": steps,
        "reward_first": first, "reward_last": last, "reward_per_step": rewards,
        "validation": [(line["step"], line[VAL_ACCURACY]) for line in lines if VAL_ACCURACY in line],
        **{key: sum(line[key] for line in train if key in line) / max(1, sum(key in line for line in train))
           for key in VCPO_METRICS if any(key in line for line in train)},
        "ess_per_step": [(line["step"], line["rollout_corr/seq_ess_ratio"], line.get("actor/lr_scale", 1.0))
                         for line in train if "rollout_corr/seq_ess_ratio" in line],
        "seconds_per_step": sum(step_time) / len(step_time) if step_time else None,
        "time_split": {key: sum(line.get(key, 0.0) for line in train) / len(train) for key in TIME_SPLIT} if train else {},
    }


def report(work: Path, tables: Path = TABLES, other_work: dict[str, str] | None = None) -> dict:
    """tables/real_model/training.{json,md,png} from the registered arms' runs under ``work``; ``other_work``: what
    else ran on the machine during a run, by run name (kept from the last report unless given: it slows a step)."""
    from vcpo.reporting.run_data import read_metrics

    plan = read_yaml(recipes_dir() / "real_model.yaml")["training"]
    runs = {f"{arm}_s{seed}": work / f"{arm}_s{seed}" for arm in plan["arms"] for seed in plan["seeds"]}
    earlier = tables / "training.json"
    recorded = json.loads(earlier.read_text()) if earlier.exists() else {}
    arms = {name: {**arm_summary(read_metrics(folder), plan["steps"]),
                   "provenance": run_origin(folder, recorded.get("arms", {}).get(name, {}))}
            for name, folder in runs.items() if (folder / "metrics.jsonl").exists()}
    choice = json.loads((tables / "task_choice.json").read_text())
    steps = {name: arm["steps"] for name, arm in recorded.get("arms", {}).items()}
    if problem := shrink_problem(earlier, steps, {name: arm["steps"] for name, arm in arms.items()},
                                 f"pass --work with every run (not {work}), or --tables for a folder of your own",
                                 rows="runs", unit="steps"):
        raise SystemExit(problem)
    other_work = {**recorded.get("other_work", {}), **(other_work or {})}
    result = {"plan": plan, "task": choice["chosen"], "answer_format": choice["answer_format"], "arms": arms,
              "other_work": {name: text for name, text in other_work.items() if name in arms},
              "provenance": {**code_state(), "written": utc_now(), "cpu": cpu_name()}}
    write_atomic(tables / "training.json", json.dumps(result, indent=1) + "\n")
    write_atomic(tables / "training.md", training_markdown(result))
    draw_training(result, tables / "training.png")
    print(training_markdown(result))
    return result


def run_origin(folder: Path, earlier: dict) -> dict | None:
    """A training run's provenance: what ``train`` recorded beside it, else what the last report kept of it."""
    path = folder / RUN_PROVENANCE
    return json.loads(path.read_text()) if path.exists() else earlier.get("provenance")


def render(tables: Path = TABLES) -> list[Path]:
    """Write task_choice.md and training.md again from their committed JSON (the runs need not be here)."""
    written = [tables / "task_choice.md"]
    written[0].write_text(choice_markdown(json.loads((tables / "task_choice.json").read_text())))
    if (tables / "training.json").exists():
        written.append(tables / "training.md")
        written[1].write_text(training_markdown(json.loads((tables / "training.json").read_text())))
    return written


def percent(value: float) -> str:
    return f"{100 * value:.1f}"


def training_markdown(result: dict) -> str:
    plan = result["plan"]
    lines = [f"| run | steps | train reward, first {WINDOW} steps [95% CI] | last {WINDOW} [95% CI] | validation: first -> last "
             "| ESS ratio | lr scale | s / step: generation, update, weight sync, rest |",
             "|---|---:|---|---|---|---:|---:|---|"]
    for name, arm in result["arms"].items():
        (a, a_low, a_high), (b, b_low, b_high) = arm["reward_first"], arm["reward_last"]
        validation = arm["validation"]
        val = f"{percent(validation[0][1])}% -> {percent(validation[-1][1])}% (step {validation[-1][0]})" if validation else "-"
        split = arm["time_split"]
        rest = (arm["seconds_per_step"] or 0) - sum(split.get(key, 0) for key in TIME_SPLIT[:3])  # validation included
        lines.append(f"| {name} | {arm['steps']}/{arm['planned_steps']} | {percent(a)}% [{percent(a_low)}, {percent(a_high)}] | "
                     f"{percent(b)}% [{percent(b_low)}, {percent(b_high)}] | {val} | "
                     f"{arm.get('rollout_corr/seq_ess_ratio', 1.0):.3f} | {arm.get('actor/lr_scale', 1.0):.3f} | "
                     f"{split.get('timing_s/gen', 0):.0f}, {split.get('timing_s/update_actor', 0):.0f}, "
                     f"{split.get('timing_s/update_weights', 0):.0f}, {rest:.0f} of {arm['seconds_per_step'] or 0:.0f} |")
    verdicts = []
    for name, arm in result["arms"].items():
        (a, a_low, a_high), (b, b_low, b_high) = arm["reward_first"], arm["reward_last"]
        if b_low > a_high:
            verdicts.append(f"{name}: the training reward rose from {percent(a)}% to {percent(b)}%, beyond the step-to-step spread")
        elif b > a:
            verdicts.append(f"{name}: the training reward moved from {percent(a)}% to {percent(b)}%, within the step-to-step spread")
        else:
            verdicts.append(f"{name}: the training reward did not rise ({percent(a)}% -> {percent(b)}%)")
    return "\n".join([
        *lines, "",
        f"SmolLM2-135M-Instruct trained by verl's own trainer on CPU (`python benchmarks/real_model_task.py train --arm ARM`), "
        f"task `{result['task']}` scored {result['answer_format']}, {plan['prompts_per_step']} prompts x "
        f"{plan['responses_per_prompt']} responses per step, {plan['max_response_length']} response tokens, lr 1e-5; "
        f"validation greedy on {plan['validation']['problems']} problems every {plan['validation']['every']} steps. "
        f"One seed per arm, so the only spread shown is the step-to-step spread of the training reward (95% t interval "
        f"over the {WINDOW} steps of each window), not the run-to-run spread.",
        "", *(f"- {verdict}." for verdict in verdicts), "",
        *(f"Other work on the machine during {name} (its seconds per step are slower for it): {text}." for name, text
          in result.get("other_work", {}).items()),
        *([""] if result.get("other_work") else []),
        f"`python benchmarks/real_model_task.py report`; commit {result['provenance']['commit'][:12]}, "
        f"{result['provenance']['written']}, {result['provenance']['cpu']}. Each run's code and time:",
        *(f"- {name}: {run_origin_text(arm.get('provenance'))}" for name, arm in result["arms"].items()), "",
    ])


def run_origin_text(origin: dict | None) -> str:
    """A run's code and time as recorded, or what was not recorded and what git shows instead."""
    if not origin:
        return "not recorded"
    if "not_recorded" in origin:
        added = origin["not_recorded"]["git_shows"]["added"]
        return (f"{', '.join(origin['not_recorded']['fields'])} not recorded; git shows the run committed in "
                f"{added['commit'][:12]} at {added['time']}, so it ran before then")
    return code_and_time(origin)


def draw_training(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (reward, validation, ess) = plt.subplots(1, 3, figsize=(13, 3.6))
    for (name, arm), color in zip(result["arms"].items(), ("tab:blue", "tab:orange", "tab:green", "tab:red"), strict=False):
        values = arm["reward_per_step"]
        smoothed = [sum(values[max(0, i - WINDOW + 1): i + 1]) / len(values[max(0, i - WINDOW + 1): i + 1]) for i in range(len(values))]
        reward.plot(range(1, len(values) + 1), values, color=color, alpha=0.25, linewidth=1)
        reward.plot(range(1, len(values) + 1), smoothed, color=color, label=name)
        if arm["validation"]:
            steps, accuracy = zip(*arm["validation"], strict=True)
            validation.plot(steps, accuracy, marker="o", color=color, label=name)
        if arm["ess_per_step"]:
            steps, ratios, scales = zip(*arm["ess_per_step"], strict=True)
            ess.plot(steps, ratios, color=color, label=f"{name}: ESS ratio")
            ess.plot(steps, scales, color=color, linestyle="--", label=f"{name}: lr scale")
    reward.set(title=f"training reward ({result['answer_format']}), {WINDOW}-step mean", xlabel="step", ylabel="mean reward")
    validation.set(title="validation accuracy (greedy)", xlabel="step")
    ess.set(title="ESS ratio and the step size's factor", xlabel="step", ylim=(0, 1.05))
    for axes in (reward, validation, ess):
        axes.legend(fontsize=8)
    figure.suptitle(f"SmolLM2-135M-Instruct on {result['task']} through verl's trainer (CPU)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser("choose", help="evaluate the candidates and apply the registered rule")
    command.add_argument("--work", type=Path, default=REPO / "results" / "real_model" / "tasks")
    command.add_argument("--tables", type=Path, default=TABLES)
    command = commands.add_parser("train", help="one arm of the registered training on the chosen task")
    command.add_argument("--arm", required=True)
    command.add_argument("--seed", type=int, default=0)
    command.add_argument("--work", type=Path, default=REPO / "results" / "real_model" / "training")
    command.add_argument("--print", action="store_true", help="print the command and exit")
    command.add_argument("--tables", type=Path, default=TABLES)
    command = commands.add_parser("tables", help="write task_choice.md and training.md again from their JSON")
    command.add_argument("--tables", type=Path, default=TABLES)
    command = commands.add_parser("report", help="the table and figure of the training runs")
    command.add_argument("--work", type=Path, default=REPO / "results" / "real_model" / "training")
    command.add_argument("--tables", type=Path, default=TABLES)
    command.add_argument("--other-work", action="append", default=[], metavar="RUN=TEXT",
                         help="what else ran on the machine during RUN (e.g. sync_s0), recorded beside its step times")
    args = parser.parse_args(argv)
    if args.command == "report":
        if any("=" not in note for note in args.other_work):
            parser.error("--other-work takes RUN=TEXT, e.g. sync_s0='the project's tests'")
        notes = dict(note.split("=", 1) for note in args.other_work)
        report(args.work, args.tables, notes)
        return 0
    if args.command == "choose":
        choose(args.work, args.tables)
        return 0
    if args.command == "tables":
        print("\n".join(str(path) for path in render(args.tables)))
        return 0
    command, out = training_command(args.arm, args.seed, args.work, args.tables)
    if args.print:
        print(" ".join(command))
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    started = utc_now()
    returncode = subprocess.run(command, check=False, preexec_fn=dies_with_this_thread).returncode
    # the launcher's run folder records no commit or times: the run's own, beside its metrics, for the report
    write_atomic(out / RUN_PROVENANCE, json.dumps({**output_record(started), "exit": returncode}, indent=1) + "\n")
    return returncode


if __name__ == "__main__":
    sys.exit(main())
