"""The real model's policy-lag study (recipes/real_model_lag.md): the task chosen by its registered rule.

    python -m vcpo.studies.real_model_lag choose [--work results/real_model_lag/task_choice]

``choose`` scores SmolLM2-135M-Instruct's samples (the training's sampling and reward) on the first validation problems
of each candidate task of ``recipes/real_model_lag.yaml``, applies the rule and writes
tables/real_model_lag/task_choice.{json,md}: every candidate's mean@4 with its bootstrap interval over problems, the
truncation and no-answer counts, and the chosen task (or none). A candidate already evaluated in ``--work`` is read
back, not rerun.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from vcpo.data import DATASETS, load_rows
from vcpo.locks import write_atomic
from vcpo.provenance import code_state, cpu_name, library_versions, utc_now
from vcpo.recipes import read_yaml, recipes_dir
from vcpo.studies.statistics import bootstrap_mean_interval
from vcpo.verl_contract import END_AWARE_REWARD_MANAGER

DESIGN = "real_model_lag.yaml"
MODEL = "smollm2-135m-instruct"  # vcpo.local_models.PACKAGED_MODELS
TABLES = Path("tables") / "real_model_lag"
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
    import pandas as pd  # the reproduction stack (vcpo[repro])

    folder = data / task
    folder.mkdir(parents=True, exist_ok=True)
    files = {"train": folder / "train.parquet", "val": folder / f"val_{len(val_rows)}.parquet"}
    pd.DataFrame(load_rows(task, "train")).to_parquet(files["train"])
    pd.DataFrame(val_rows).to_parquet(files["val"])
    rollout = "actor_rollout_ref.rollout"
    overrides = [
        # the task's own reward (the CPU recipe's default adds a dense term for random models)
        "reward.custom_reward_function.path=pkg://vcpo.rewards", "reward.custom_reward_function.name=compute_score",
        f"+reward.custom_reward_function.reward_kwargs.answer_format={answer_format}",
        # the reward learns whether each response ended or was cut at the length limit (lenient reads a cut one strictly)
        *END_AWARE_REWARD_MANAGER,
        f"data.train_batch_size={training['prompts_per_step']}", f"{rollout}.n={training['responses_per_prompt']}",
        f"{rollout}.temperature={training['temperature']}",
        f"data.max_response_length={training['max_response_length']}", f"data.max_prompt_length={training['max_prompt_length']}",
        f"trainer.test_freq={training['validation']['every']}", "trainer.val_before_train=true", "trainer.save_freq=-1",
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
    tables.mkdir(parents=True, exist_ok=True)
    write_atomic(tables / "task_choice.json", json.dumps(result, indent=2) + "\n")
    write_atomic(tables / "task_choice.md", choice_markdown(result))
    print(choice_markdown(result))
    return result


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vcpo.studies.real_model_lag", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser("choose", help="evaluate the candidate tasks and apply the registered rule")
    command.add_argument("--work", type=Path, default=Path("results") / "real_model_lag" / "task_choice")
    command.add_argument("--tables", type=Path, default=TABLES)
    args = parser.parse_args(argv)
    choose(args.work, args.tables)
    return 0


if __name__ == "__main__":
    sys.exit(main())
