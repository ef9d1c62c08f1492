"""A task where the real model learns, chosen by the rule registered in recipes/real_model.yaml (``task_choice``).

    python benchmarks/real_model_task.py choose [--work results/real_model/tasks]

Evaluates SmolLM2-135M-Instruct on the first problems of each candidate starter task (vcpo.data.tasks) with the
training's sampling and reward, applies the rule and writes tables/real_model/task_choice.{json,md}: every
candidate's mean reward with its bootstrap interval, and the chosen task (or none). A candidate already evaluated
in --work is read back, not rerun.
"""

from __future__ import annotations

import argparse
import json
import os
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


def evaluate_candidate(name: str, rule: dict, model: Path, work: Path) -> dict:
    """Generate and score the candidate's problems (or read back an earlier evaluation)."""
    from vcpo.data import load_rows
    from vcpo.evaluation.generation import HFGenerator, SamplingParams
    from vcpo.evaluation.harness import evaluate_rows

    out = work / name
    summary_file = out / "summary.json"
    if summary_file.exists():
        return json.loads(summary_file.read_text())
    rows = load_rows(name, rule["split"])[: rule["problems"]]
    started = {**code_state(), "start": utc_now(), "cpu": cpu_name(), "threads": os.environ.get("OMP_NUM_THREADS"),
               "libraries": library_versions()}
    generator = HFGenerator.load(model, batch_size=rule["batch_size"])
    records, measured = evaluate_rows(generator, rows, SamplingParams(**rule["sampling"]), rule["answer_format"], name)
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
    plan = read_yaml(recipes_dir() / "real_model.yaml")
    rule = plan["task_choice"]
    model = packaged_model(plan["model"])
    interval = plan["interval"]
    rows = {}
    for name in rule["candidates"]:
        print(f"{name}: the first {rule['problems']} {rule['split']} problems, n = {rule['sampling']['n']}", flush=True)
        summary = evaluate_candidate(name, rule, model, work)
        low, high = bootstrap_mean_interval(summary["per_problem_reward"], interval["level"], interval["resamples"], interval["seed"])
        rows[name] = {"problems": summary["problems"], "mean_reward": summary["mean_reward"], "low": low, "high": high,
                      "mean_response_tokens": summary["mean_response_tokens"], "truncated": summary["truncated"],
                      "no_answer": summary["no_answer"], "generation_s": summary["generation_seconds"],
                      "provenance": summary["provenance"]}
    choice = chosen_task({name: row["mean_reward"] for name, row in rows.items()}, tuple(rule["band"]), rule["target"])
    result = {"rule": rule, "rows": rows, "chosen": choice, "written": utc_now()}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "task_choice.json").write_text(json.dumps(result, indent=2) + "\n")
    (OUT / "task_choice.md").write_text(choice_markdown(result))
    print(choice_markdown(result))
    return result


def choice_markdown(result: dict) -> str:
    rule = result["rule"]
    sampling = rule["sampling"]
    lines = ["| task | problems | base mean reward [95% CI] | no answer | response tokens (truncated) | in the band |",
             "|---|---:|---|---:|---:|---|"]
    for name, row in result["rows"].items():
        inside = rule["band"][0] <= row["mean_reward"] <= rule["band"][1]
        lines.append(f"| {name} | {row['problems']} | {100 * row['mean_reward']:.1f}% [{100 * row['low']:.1f}, "
                     f"{100 * row['high']:.1f}] | {row['no_answer']} | {row['mean_response_tokens']:.0f} "
                     f"({100 * row['truncated']:.0f}%) | {'yes' if inside else 'no'} |")
    chosen = result["chosen"]
    verdict = (f"Chosen: **{chosen}** (in the band, closest to {100 * rule['target']:.0f}%)." if chosen else
               "No candidate lies in the band: no task is chosen.")
    first = next(iter(result["rows"].values()))["provenance"]
    return "\n".join([
        *lines, "",
        f"SmolLM2-135M-Instruct before training, hf backend on CPU: the first {rule['problems']} {rule['split']} problems of "
        f"each starter task (vcpo.data.tasks), n = {sampling['n']}, temperature {sampling['temperature']}, top-p "
        f"{sampling['top_p']}, {sampling['max_new_tokens']} new tokens, the task's reward ({rule['answer_format']}); "
        f"95% percentile bootstrap over problems. Rule (recipes/real_model.yaml, registered before this ran): the "
        f"candidate whose mean lies in [{100 * rule['band'][0]:.0f}%, {100 * rule['band'][1]:.0f}%] and is closest to "
        f"{100 * rule['target']:.0f}%. {verdict}",
        f"`python benchmarks/real_model_task.py choose`; commit {first['commit'][:12]}, from {first['start']}, {first['cpu']}.",
        "",
    ])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser("choose", help="evaluate the candidates and apply the registered rule")
    command.add_argument("--work", type=Path, default=REPO / "results" / "real_model" / "tasks")
    args = parser.parse_args(argv)
    choose(args.work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
