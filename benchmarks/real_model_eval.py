"""The base evaluation of the real pretrained model on CPU, as registered in recipes/real_model.yaml.

For each benchmark: the subset the registered rule gives (the first K problems), ``python -m vcpo.evaluation``
with the registered sampling on the hf backend, then mean@n with a bootstrap interval over problems, the
response length and the generation throughput, into tables/real_model/base_eval.{json,md} (commands, commit,
time and machine included). A benchmark already evaluated in --work is read back, not rerun; one interrupted there
is resumed where it stopped (``python -m vcpo.evaluation`` appends its samples as they finish). The evaluation dies
with this script.

    python benchmarks/real_model_eval.py --data DIR [--benchmarks gsm8k,math500] [--work results/real_model]
                                         [--limit K] [--tables DIR]
    python benchmarks/real_model_eval.py --render [--tables DIR]    # base_eval.md again from base_eval.json

``--limit K`` evaluates at most K problems of each benchmark; a table row never gives way to one over fewer problems
(one line, nothing written): write such rows to a folder of your own with ``--tables``.

``--data``: benchmark files as <benchmark>/test.jsonl (``python -m vcpo.data`` writes them; the repository's
fixtures are too small for this table).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from vcpo.cli import output_folder_problem, shrink_problem
from vcpo.evaluation.harness import EvaluationInputError, benchmark_rows, load_benchmarks
from vcpo.evaluation.metrics import per_problem_means
from vcpo.lifetimes import dies_with_this_thread
from vcpo.local_models import packaged_model
from vcpo.locks import write_atomic
from vcpo.provenance import code_state, cpu_name, library_versions, utc_now
from vcpo.recipes import read_yaml, recipes_dir
from vcpo.studies.statistics import bootstrap_mean_interval, percent_cell

REPO = Path(__file__).resolve().parents[1]

OUT = REPO / "tables" / "real_model"


def subset_size(problems: int, samples: int, plan: dict) -> int:
    """The registered rule: the most problems whose worst case fits the budget."""
    rule, tokens = plan["subset"], plan["sampling"]["max_new_tokens"]
    return min(problems, math.floor(rule["budget_s"] * rule["slots_per_s"] / (samples * tokens)))


def per_problem(samples_file: Path, answer_format: str) -> list[float]:
    """Each problem's mean score over its samples, under ``answer_format``."""
    records = map(json.loads, samples_file.read_text().splitlines())
    return per_problem_means(records, lambda record: record["by_answer_format"][answer_format]["acc"])


def finished(origin: dict, summary_file: Path) -> dict:
    """An evaluation's record as it began and ended: a driver killed after its evaluation wrote ``summary_file`` but
    before it recorded the end leaves the end as the time of that summary."""
    written = datetime.fromtimestamp(summary_file.stat().st_mtime, timezone.utc).isoformat(timespec="seconds")
    return {"end": written, **origin}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, help="benchmark files: <benchmark>/test.jsonl")
    parser.add_argument("--render", action="store_true", help="write base_eval.md again from base_eval.json and stop")
    parser.add_argument("--benchmarks", default=None, help="comma-separated; default: the registered ones")
    parser.add_argument("--work", type=Path, default=REPO / "results" / "real_model")
    parser.add_argument("--other-work", default=None,
                        help="what else ran on the machine during the generation, if anything (recorded: it slows tokens/s)")
    parser.add_argument("--limit", type=int, default=None, help="at most K problems of each benchmark")
    parser.add_argument("--tables", type=Path, default=OUT, help="where base_eval.{json,md} go (default: the study's)")
    args = parser.parse_args(argv)
    if args.render:
        print(render(args.tables))
        return 0
    if args.data is None:
        parser.error("--data is required to evaluate")
    if args.limit is not None and args.limit < 1:
        parser.error(f"--limit {args.limit}: at least 1")
    plan = read_yaml(recipes_dir() / "real_model.yaml")
    names = args.benchmarks.split(",") if args.benchmarks else plan["benchmarks"]
    try:  # what the evaluation would refuse, found by its own rules before any model is looked up
        benchmarks = {b.name: b for b in load_benchmarks(recipes_dir() / "benchmarks.yaml", names)}
        problems = {name: len(benchmark_rows(benchmark, source_dir=args.data)) for name, benchmark in benchmarks.items()}
    except EvaluationInputError as error:
        parser.error(str(error))
    if problem := output_folder_problem(args.work):
        parser.error(f"--work {args.work}: {problem}")
    results_file = args.tables / "base_eval.json"
    rows = json.loads(results_file.read_text())["rows"] if results_file.exists() else {}
    sizes = {name: min(subset_size(problems[name], benchmarks[name].sampling.n, plan), args.limit or problems[name])
             for name in names}
    recorded = {name: rows[name]["problems"] for name in names if name in rows}  # the other benchmarks' rows stay
    if problem := shrink_problem(results_file, recorded, sizes, "pass --tables for a folder of your own", unit="problems"):
        parser.error(problem)
    model = packaged_model(plan["model"])
    args.tables.mkdir(parents=True, exist_ok=True)
    for name in names:
        k = sizes[name]
        out = args.work / name
        command = [sys.executable, "-m", "vcpo.evaluation", "--model", str(model), "--benchmarks", name, "--out", str(out),
                   "--source-dir", str(args.data), "--limit", str(k), "--max-new-tokens", str(plan["sampling"]["max_new_tokens"]),
                   "--backend", "hf", "--batch-size", str(plan["sampling"]["batch_size"])]
        summary_file, origin_file = out / name / "summary.json", out / "provenance.json"
        if not summary_file.exists():
            print(f"{name}: the first {k} of {problems[name]} problems, n = {benchmarks[name].sampling.n}", flush=True)
            out.mkdir(parents=True, exist_ok=True)
            origin = {**code_state(), "start": utc_now(), "cpu": cpu_name(), "threads": plan["threads"], "libraries": library_versions()}
            origin_file.write_text(json.dumps(origin, indent=2) + "\n")
            env = {**os.environ, "OMP_NUM_THREADS": str(plan["threads"])}
            if code := subprocess.run(command, env=env, preexec_fn=dies_with_this_thread).returncode:
                sys.exit(f"error: {name}: python -m vcpo.evaluation ended with exit {code} (its message above); "
                         "the same command resumes it")
            origin_file.write_text(json.dumps({**origin, "end": utc_now()}, indent=2) + "\n")
        summary = json.loads(summary_file.read_text())
        interval = plan["interval"]
        row = {"problems": k, "of": problems[name], "n": summary["sampling"]["n"], "max_new_tokens": summary["sampling"]["max_new_tokens"],
               "mean_response_tokens": summary["mean_response_tokens"], "truncated": summary["truncated"],
               "tokens_per_s": summary["num_samples"] * summary["mean_response_tokens"] / summary["generation_seconds"],
               "generation_s": summary["generation_seconds"], "command": " ".join(["python", *command[1:]])}
        for answer_format in ("strict", "lenient"):
            values = per_problem(out / name / "samples.jsonl", answer_format)
            low, high = bootstrap_mean_interval(values, interval["level"], interval["resamples"], interval["seed"])
            row[answer_format] = {"mean_at_n": sum(values) / len(values), "low": low, "high": high}
        row["provenance"] = {**finished(json.loads(origin_file.read_text()), summary_file), "other_work": args.other_work}
        rows[name] = row
        provenance = {"model": plan["model"], "registration": "recipes/real_model.yaml"}
        write_atomic(results_file, json.dumps({"provenance": provenance, "rows": rows}, indent=2) + "\n")  # after each benchmark
        write_atomic(args.tables / "base_eval.md", table(rows))
    print(table(rows))
    return 0


def portable(command: str) -> str:
    """A recorded command as a reader can run it: the checkout's results folder relative, a home folder ``~``, the
    data folder ``DIR`` (the JSON keeps the command as it ran). Read from the command alone, so that every checkout
    renders it alike, wherever the one that ran it was."""
    command = re.sub(r"(?<=\s)/\S*?/(results/\S*)", r"\1", command)
    command = re.sub(r"(?<=\s)(?:/root|/home/[^/\s]+)(?=/)", "~", command)
    return re.sub(r"--source-dir \S+", "--source-dir DIR", command)


def score_cell(score: dict, problems: int) -> str:
    """'2.6% [0.5, 5.1]'; with no success at all, '0.0% [0.0, 0.0], Wilson <= 5.6%' (``percent_cell``)."""
    return percent_cell(score["mean_at_n"], score["low"], score["high"], problems)


def render(tables: Path) -> str:
    """base_eval.md again from the committed base_eval.json (no evaluation runs)."""
    text = table(json.loads((tables / "base_eval.json").read_text())["rows"])
    (tables / "base_eval.md").write_text(text)
    return text


def table(rows: dict) -> str:
    lines = ["| benchmark | problems (of) | n | mean@n strict [95% CI] | mean@n lenient [95% CI] | response tokens (truncated) | tokens/s |",
             "|---|---:|---:|---|---|---:|---:|"]
    for name, row in rows.items():
        cells = [score_cell(row[f], row["problems"]) for f in ("strict", "lenient")]
        lines.append(f"| {name} | {row['problems']} ({row['of']}) | {row['n']} | {cells[0]} | {cells[1]} | "
                     f"{row['mean_response_tokens']:.0f} ({100 * row['truncated']:.0f}%) | {row['tokens_per_s']:.1f} |")
    lines.append("")
    lines.append("SmolLM2-135M-Instruct (vcpo.local_models: the Q4_1 GGUF dequantized), hf backend on CPU; registered in "
                 "recipes/real_model.yaml; mean@n over the first K problems, 95% percentile bootstrap over problems. A bootstrap "
                 "of zero successes has zero width: beside it, the 95% Wilson upper bound over the problems, none solved.")
    for name, row in rows.items():
        origin = row["provenance"]
        lines.append(f"- {name}: `{portable(row['command'])}`; commit {origin['commit'][:12]}{' (dirty)' if origin['dirty'] else ''}, "
                     f"{origin['start']} to {origin['end']}, {origin['cpu']}, {origin['threads']} threads"
                     f"{'; other work on the machine: ' + origin['other_work'] if origin['other_work'] else ''}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
