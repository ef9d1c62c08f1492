"""How often each answer format's score is wrong on the real model's own responses, against labels made by reading.

    python benchmarks/answer_format_audit.py sample   # responses and their scores -> tables/real_model/answer_audit/samples.jsonl
    python benchmarks/answer_format_audit.py report   # with labels.jsonl beside them -> audit.{json,md}

``sample``: SmolLM2-135M-Instruct (``vcpo.local_models``) answers the first problems of the validation split of each
audited task at the training's sampling (recipes/real_model.yaml ``task_choice.sampling``: temperature 1, 64 new
tokens), every response scored by ``vcpo.rewards`` under ``strict`` and ``lenient`` (a response cut at the length
limit read strictly, ``vcpo.rewards.scoring.format_for``). ``labels.jsonl`` holds one label per response, made by
reading it (not by any rule): ``correct`` (it states the right final answer as its answer), ``wrong`` (it states
another), ``no_answer`` (it states none, or only numbers that are not its answer); with a note where it is unclear.
``report``: per format (and lenient as it was before it read cut responses strictly), its false positives (scored correct, labelled otherwise) and false negatives (labelled
correct, scored otherwise), each with a 95% Wilson interval over the responses.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vcpo.cli import shrink_problem
from vcpo.locks import write_atomic

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "tables" / "real_model" / "answer_audit"
TASKS = ("sums", "chain_sums")
PROBLEMS = 48  # per task: 48 x 4 samples = 192 responses
LABELS = ("correct", "wrong", "no_answer")
# the scores audited: the two formats, and lenient as it read a cut response before the cut rule (no response_ended)
ROWS = ("strict", "lenient", "lenient, cut responses read leniently")


def sample(out: Path) -> None:
    from vcpo.data import load_rows
    from vcpo.evaluation.generation import HFGenerator, SamplingParams
    from vcpo.evaluation.harness import evaluate_rows
    from vcpo.local_models import packaged_model
    from vcpo.provenance import code_state, cpu_name, utc_now
    from vcpo.recipes import read_yaml, recipes_dir

    plan = read_yaml(recipes_dir() / "real_model.yaml")
    sampling = SamplingParams(**plan["task_choice"]["sampling"], seed=0)
    generator = HFGenerator.load(packaged_model(plan["model"]), batch_size=16)
    started = {**code_state(), "start": utc_now(), "cpu": cpu_name()}
    lines = []
    for task in TASKS:
        rows = load_rows(task, "validation")[:PROBLEMS]
        records, _ = evaluate_rows(generator, rows, sampling, "lenient", f"audit {task}")
        for number, record in enumerate(records):  # problem-major, sampling.n per problem
            lines.append({"id": f"{task}/{record['problem_id']}/{record['sample_index']}", "task": task,
                          "question": rows[number // sampling.n]["extra_info"]["question"],
                          "ground_truth": record["ground_truth"], "response": record["completion"],
                          "ended": not record["truncated"], "tokens": record["tokens"],
                          "scores": {name: value["reason"] for name, value in record["by_answer_format"].items()}})
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "samples.jsonl", "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)
    (out / "provenance.json").write_text(json.dumps({**started, "end": utc_now(), "sampling": vars(sampling)}, indent=1) + "\n")
    print(f"{len(lines)} responses -> {out / 'samples.jsonl'}")


def audit(samples: list[dict], labels: dict[str, dict]) -> dict:
    from vcpo.studies.statistics import wilson_interval as wilson

    missing = [line["id"] for line in samples if line["id"] not in labels]
    if missing:
        raise SystemExit(f"{len(missing)} responses have no label (first: {missing[:3]})")
    result = {"responses": len(samples), "labels": {name: sum(labels[line["id"]]["label"] == name for line in samples)
                                                    for name in LABELS}}
    for answer_format in ROWS:
        scored = [line["scores"][answer_format] == "correct" for line in samples]
        truth = [labels[line["id"]]["label"] == "correct" for line in samples]
        false_pos = [line["id"] for line, s, t in zip(samples, scored, truth, strict=True) if s and not t]
        false_neg = [line["id"] for line, s, t in zip(samples, scored, truth, strict=True) if t and not s]
        n = len(samples)
        result[answer_format] = {"scored_correct": sum(scored), "false_positives": len(false_pos),
                                 "false_positive_interval": wilson(len(false_pos), n), "false_negatives": len(false_neg),
                                 "false_negative_interval": wilson(len(false_neg), n),
                                 "false_positive_ids": false_pos, "false_negative_ids": false_neg}
    result["labelled_correct"] = result["labels"]["correct"]
    return result


def markdown(result: dict) -> str:
    n = result["responses"]
    lines = ["| format | scored correct | labelled correct | false positives [95% Wilson] | false negatives [95% Wilson] |",
             "|---|---:|---:|---|---|"]
    for name in ROWS:
        row = result[name]
        fp_low, fp_high = row["false_positive_interval"]
        fn_low, fn_high = row["false_negative_interval"]
        lines.append(f"| {name} | {row['scored_correct']} | {result['labelled_correct']} | {row['false_positives']} of {n} "
                     f"[{100 * fp_low:.1f}%, {100 * fp_high:.1f}%] | {row['false_negatives']} of {n} "
                     f"[{100 * fn_low:.1f}%, {100 * fn_high:.1f}%] |")
    labels = result["labels"]
    return "\n".join([*lines, "", f"{n} responses of SmolLM2-135M-Instruct ({', '.join(TASKS)}: the first {PROBLEMS} validation "
                      f"problems x 4 samples, temperature 1, 64 new tokens), each labelled by reading it (an LLM agent under the rules "
                      f"of the script's docstring, not a person): {labels['correct']} "
                      f"correct, {labels['wrong']} wrong, {labels['no_answer']} with no answer (labels.jsonl). Lenient reads a "
                      "response cut at the length limit strictly; the last row scores the same responses as lenient did before that rule. "
                      "`python benchmarks/answer_format_audit.py report`.", ""])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("sample", "report"))
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    if args.command == "sample":
        if (args.out / "samples.jsonl").exists():  # the labels belong to these responses: new samples would orphan them
            parser.error(f"{args.out / 'samples.jsonl'} exists (its labels.jsonl labels those responses): "
                         "sample into another --out")
        sample(args.out)
        return 0
    samples = [json.loads(line) for line in (args.out / "samples.jsonl").read_text().splitlines()]
    from vcpo.data import DATASETS
    from vcpo.rewards import compute_score

    for line in samples:
        line["scores"][ROWS[2]] = compute_score(DATASETS[line["task"]].data_source, line["response"], line["ground_truth"],
                                                answer_format="lenient")["reason"]
    labels = {entry["id"]: entry for entry in map(json.loads, (args.out / "labels.jsonl").read_text().splitlines())}
    result = audit(samples, labels)
    earlier = args.out / "audit.json"
    recorded = {"the audit": json.loads(earlier.read_text())["responses"]} if earlier.exists() else {}
    if problem := shrink_problem(earlier, recorded, {"the audit": result["responses"]}, "pass --out for a folder of your own",
                                 unit="responses"):
        sys.exit(f"error: {problem}")
    write_atomic(earlier, json.dumps(result, indent=1) + "\n")
    write_atomic(args.out / "audit.md", markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
