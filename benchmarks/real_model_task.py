"""A task where the real model learns, chosen by the rule registered in recipes/real_model.yaml (``task_choice``).

    python benchmarks/real_model_task.py choose [--work results/real_model/tasks]
    python benchmarks/real_model_task.py train --arm sync|vcpo [--seed 0] [--work results/real_model/training]

``choose`` evaluates SmolLM2-135M-Instruct on the first problems of each candidate starter task (vcpo.data.tasks)
with the training's sampling and reward, applies the rule and writes tables/real_model/task_choice.{json,md}:
every candidate's mean reward with its bootstrap interval, and the chosen task (or none). A candidate already
evaluated in --work is read back, not rerun.

``train`` runs one arm of the registered training (``training`` in recipes/real_model.yaml) on the chosen task
through verl's own trainer (``python -m vcpo.launch.cpu``), into <work>/<arm>_s<seed>/ (metrics.jsonl).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from vcpo.local_models import packaged_model
from vcpo.provenance import code_state, cpu_name, library_versions, utc_now
from vcpo.recipes import read_yaml, recipes_dir
from vcpo.studies.statistics import bootstrap_mean_interval

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "tables" / "real_model"


def chosen_task(means: dict[str, float], band: tuple[float, float], target: float) -> str | None:
    """The registered rule: of the candidates (in their registered order) whose mean lies in ``band``, the one
    closest to ``target`` (the earlier on a tie); None when none lies in the band."""
    inside = [name for name, mean in means.items() if band[0] <= mean <= band[1]]
    return min(inside, key=lambda name: abs(means[name] - target)) if inside else None


def evaluate_candidate(name: str, rule: dict, answer_format: str, seed: int, model: Path, out: Path) -> dict:
    """Generate and score the candidate's problems into ``out`` (or read back an earlier evaluation there)."""
    from vcpo.data import load_rows
    from vcpo.evaluation.generation import HFGenerator, SamplingParams
    from vcpo.evaluation.harness import evaluate_rows

    summary_file = out / "summary.json"
    if summary_file.exists():
        return json.loads(summary_file.read_text())
    rows = load_rows(name, rule["split"])[: rule["problems"]]
    started = {**code_state(), "start": utc_now(), "cpu": cpu_name(), "threads": os.environ.get("OMP_NUM_THREADS"),
               "libraries": library_versions()}
    generator = HFGenerator.load(model, batch_size=rule["batch_size"])
    sampling = SamplingParams(**rule["sampling"], seed=seed)
    records, measured = evaluate_rows(generator, rows, sampling, answer_format, name)
    scores: dict[int, list[float]] = {}
    for record in records:
        scores.setdefault(record["problem_id"], []).append(float(record["score"]))
    per_problem = [sum(values) / len(values) for _, values in sorted(scores.items())]
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "samples.jsonl", "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
    summary = {"task": name, "problems": len(rows), "per_problem_reward": per_problem,
               "mean_reward": sum(per_problem) / len(per_problem), **measured,
               "provenance": {**started, "end": utc_now()}}
    summary_file.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def choose(work: Path) -> dict:
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
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "task_choice.json").write_text(json.dumps(result, indent=2) + "\n")
    (OUT / "task_choice.md").write_text(choice_markdown(result))
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
            lines.append(f"| {number} ({round_['answer_format']}) | {name} | {row['problems']} | {100 * row['mean_reward']:.1f}% "
                         f"[{100 * row['low']:.1f}, {100 * row['high']:.1f}] | {row['no_answer']} | "
                         f"{row['mean_response_tokens']:.0f} ({100 * row['truncated']:.0f}%) | {'yes' if inside else 'no'} |")
    chosen = result["chosen"]
    verdict = (f"Chosen: **{chosen}**, scored {result['answer_format']} (in the band, closest to {100 * rule['target']:.0f}%)."
               if chosen else "No candidate lies in the band in any round: no task is chosen.")
    first = next(iter(result["rounds"][0]["rows"].values()))["provenance"]
    return "\n".join([
        *lines, "",
        f"SmolLM2-135M-Instruct before training, hf backend on CPU: the first {rule['problems']} {rule['split']} problems of "
        f"each starter task (vcpo.data.tasks), n = {sampling['n']}, temperature {sampling['temperature']}, top-p "
        f"{sampling['top_p']}, {sampling['max_new_tokens']} new tokens, the task's reward in the round's answer format; "
        f"95% percentile bootstrap over problems. Rule (recipes/real_model.yaml, registered before each round ran): the "
        f"candidate whose mean lies in [{100 * rule['band'][0]:.0f}%, {100 * rule['band'][1]:.0f}%] and is closest to "
        f"{100 * rule['target']:.0f}%; a round runs only when the one before it chose none. {verdict}",
        f"`python benchmarks/real_model_task.py choose`; commit {first['commit'][:12]}, from {first['start']}, {first['cpu']}.",
        "",
    ])


def training_command(arm: str, seed: int, work: Path) -> tuple[list[str], Path]:
    """The ``python -m vcpo.launch.cpu`` command of one arm of the registered training, and its run folder (the
    chosen task's parquet files are written under ``work``)."""
    import pandas as pd

    from vcpo.data import TASKS, load_rows

    plan = read_yaml(recipes_dir() / "real_model.yaml")
    training, rule = plan["training"], plan["task_choice"]
    choice = json.loads((OUT / "task_choice.json").read_text())
    task = choice["chosen"]
    if task is None:
        raise SystemExit("tables/real_model/task_choice.json chose no task: there is nothing to train on")
    data = work / "data" / task
    data.mkdir(parents=True, exist_ok=True)
    files = {"train": data / "train.parquet", "val": data / "val.parquet"}
    pd.DataFrame(load_rows(task, "train")).to_parquet(files["train"])
    pd.DataFrame(load_rows(task, rule["split"])[: training["validation"]["problems"]]).to_parquet(files["val"])
    spec = training["arms"][arm]
    out = work / f"{arm}_s{seed}"
    rollout = "actor_rollout_ref.rollout"
    overrides = [
        # the task's own reward (the CPU recipe's default adds a dense term for random models)
        "reward.custom_reward_function.path=pkg://vcpo.rewards", "reward.custom_reward_function.name=compute_score",
        f"+reward.custom_reward_function.reward_kwargs.answer_format={choice['answer_format']}",
        f"data.train_batch_size={training['prompts_per_step']}", f"{rollout}.n={training['responses_per_prompt']}",
        f"data.max_response_length={training['max_response_length']}", f"data.max_prompt_length={training['max_prompt_length']}",
        f"trainer.test_freq={training['validation']['every']}", "trainer.val_before_train=true", "trainer.save_freq=-1",
    ]
    launch_task = "countdown" if TASKS[task].data_source == "countdown" else "gsm8k"
    command = [sys.executable, "-m", "vcpo.launch.cpu", "--out", str(out), "--task", launch_task, "--method", spec["method"],
               "--lag", str(spec["lag"]), "--seed", str(seed), "--steps", str(training["steps"]), "--model", plan["model"],
               "--train", str(files["train"]), "--val", str(files["val"]), "--", *overrides]
    return command, out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser("choose", help="evaluate the candidates and apply the registered rule")
    command.add_argument("--work", type=Path, default=REPO / "results" / "real_model" / "tasks")
    command = commands.add_parser("train", help="one arm of the registered training on the chosen task")
    command.add_argument("--arm", required=True)
    command.add_argument("--seed", type=int, default=0)
    command.add_argument("--work", type=Path, default=REPO / "results" / "real_model" / "training")
    command.add_argument("--print", action="store_true", help="print the command and exit")
    args = parser.parse_args(argv)
    if args.command == "choose":
        choose(args.work)
        return 0
    command, out = training_command(args.arm, args.seed, args.work)
    if args.print:
        print(" ".join(command))
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.run(command, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
