"""Answers per second of each reward on correct, wrong and adversarial answers.

For every reward it scores three mixes with ``vcpo.rewards.score_batch`` and prints a markdown table:
  correct      the reference answers: GSM8K's own worked solutions (ending in ``#### n``), MATH-500's
               worked solutions (ending in ``\\boxed{}``), Countdown's Reasoning Gym expressions,
  wrong        GSM8K and MATH-500: the answers shifted by one problem (a derangement); Countdown: each
               expression with its first operator changed (same numbers, another value),
  adversarial  ``vcpo.rewards.adversarial``: exponent towers, megabyte outputs, deep nesting, long
               sums, code and non-ASCII text, cycling through the kinds.
math-verify workers are started (and timed out of the measurement) before the first mix. Data: the
folder in ``--data`` (one ``<benchmark>/test.jsonl`` per benchmark, as in ``tests/fixtures/data``), else
``VCPO_SHARED_DATA``, else the project's 20-row fixtures.

    python benchmarks/reward_throughput.py --data DATA --workers 2
"""

from __future__ import annotations

import argparse
import os
import time
from collections import Counter
from pathlib import Path

from vcpo.data import load_rows
from vcpo.data.sources import read_local
from vcpo.rewards import reward_stats, score_batch
from vcpo.rewards.adversarial import adversarial_answers

FIXTURE_DATA = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "data"


def reference_answers(reward: str, args: argparse.Namespace) -> tuple[str, list[str], list[str]]:
    """``(data_source, answers, golds)`` with the reference answer of every problem of the reward's set."""
    if reward == "countdown":
        rows = load_rows("countdown", "validation", size=args.countdown_size)
        answers = [f"Combining the numbers: <answer>{row['extra_info']['answer']}</answer>" for row in rows]
    else:
        benchmark = {"gsm8k": "gsm8k", "math": "math500"}[reward]
        source = Path(args.data) / benchmark / "test.jsonl"
        rows = load_rows(benchmark, "test", source=source)
        # The worked solution: GSM8K keeps it as its answer field, MATH-500 in "solution".
        answers = [record.get("solution", record["answer"]) for record in read_local(source)]
    return rows[0]["data_source"], answers, [row["reward_model"]["ground_truth"] for row in rows]


def wrong_answers(reward: str, answers: list[str]) -> list[str]:
    if reward != "countdown":
        return answers[1:] + answers[:1]
    # Puzzle numbers are >= 1: swapping + and - always changes the value, * and / only keep it for a
    # factor of 1 (the reasons column shows any such case).
    swaps = {"+": "-", "-": "+", "*": "/", "/": "*"}
    expression_start = len("Combining the numbers: <answer>")

    def change_first_operator(answer: str) -> str:
        position = next(index for index in range(expression_start + 1, len(answer)) if answer[index] in swaps)
        return answer[:position] + swaps[answer[position]] + answer[position + 1 :]

    return [change_first_operator(answer) for answer in answers]


def measure(data_source: str, answers: list[str], golds: list[str], args: argparse.Namespace) -> dict:
    timeouts_before = reward_stats()["timeouts"]
    started = time.perf_counter()
    results = score_batch([data_source] * len(answers), answers, golds, timeout_s=args.timeout_s, workers=args.workers)
    seconds = time.perf_counter() - started
    return {
        "answers": len(answers),
        "seconds": seconds,
        "per_second": len(answers) / seconds,
        "reasons": Counter(result["reason"] for result in results),
        "timeouts": reward_stats()["timeouts"] - timeouts_before,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=os.environ.get("VCPO_SHARED_DATA") or str(FIXTURE_DATA))
    parser.add_argument("--workers", type=int, default=2, help="math-verify worker processes")
    parser.add_argument("--timeout-s", type=float, default=5.0, help="per-answer limit of math-verify")
    parser.add_argument("--adversarial", type=int, default=400, help="adversarial answers per reward")
    parser.add_argument("--countdown-size", type=int, default=1000, help="Countdown set size (validation: a tenth)")
    args = parser.parse_args()

    score_batch(["math500"] * args.workers, [r"\boxed{1}"] * args.workers, ["1"] * args.workers, workers=args.workers)
    hostile = [answer for _, answer in adversarial_answers(args.adversarial, seed=0)]
    print(
        f"data: {args.data}; math-verify workers: {args.workers}; timeout {args.timeout_s:g} s; {os.cpu_count()} CPUs\n"
    )
    print("| reward | mix | answers | seconds | answers/s | reasons | timeouts |")
    print("|---|---|---:|---:|---:|---|---:|")
    for reward in ("gsm8k", "math", "countdown"):
        data_source, answers, golds = reference_answers(reward, args)
        mixes = {"correct": answers, "wrong": wrong_answers(reward, answers), "adversarial": hostile}
        for mix, mix_answers in mixes.items():
            mix_golds = golds if mix != "adversarial" else [golds[i % len(golds)] for i in range(len(hostile))]
            row = measure(data_source, mix_answers, mix_golds, args)
            reasons = ", ".join(f"{name} {count}" for name, count in row["reasons"].most_common())
            print(
                f"| {reward} | {mix} | {row['answers']} | {row['seconds']:.2f} | {row['per_second']:,.0f} "
                f"| {reasons} | {row['timeouts']} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
