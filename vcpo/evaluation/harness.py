"""Evaluate a checkpoint on named benchmarks: sample, score, write per-sample records and summaries.

Output layout, for each benchmark B under ``out_dir``:
    B/samples.jsonl   one record per completion: problem_id, sample_index, completion, score, acc, reason
    B/summary.json    mean@n, pass@k, failure reasons, the benchmark definition and sampling used
and ``summary.json`` with every benchmark's summary and the run's configuration.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from vcpo import data, rewards
from vcpo.evaluation.generation import Generator, SamplingParams, make_generator
from vcpo.evaluation.metrics import benchmark_pass_at_k, default_ks, mean_at_n

_SAMPLING_KEYS = {field.name for field in fields(SamplingParams)}


@dataclass(frozen=True)
class Benchmark:
    name: str
    task: str  # vcpo.data.load_rows task name
    split: str
    sampling: SamplingParams


def load_benchmarks(path: str | Path, names: list[str], overrides: dict[str, Any] | None = None) -> list[Benchmark]:
    """The benchmarks ``names`` from a benchmarks YAML (``defaults`` + ``benchmarks``), with sampling
    ``overrides`` (keys of SamplingParams; None values ignored) applied on top of both."""
    spec = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    defaults, definitions = spec.get("defaults", {}), spec.get("benchmarks", {})
    overrides = {key: value for key, value in (overrides or {}).items() if value is not None}
    unknown_names = [name for name in names if name not in definitions]
    if unknown_names:
        raise ValueError(f"{path}: unknown benchmark(s) {unknown_names}; defined: {sorted(definitions)}")
    benchmarks = []
    for name in names:
        definition = {**defaults, **definitions[name]}
        settings = {**{key: definition.pop(key) for key in _SAMPLING_KEYS & set(definition)}, **overrides}
        task, split = definition.pop("task", None), definition.pop("split", None)
        if task is None or split is None or definition:
            raise ValueError(
                f"{path}: benchmark {name!r} needs 'task' and 'split' and only sampling keys "
                f"{sorted(_SAMPLING_KEYS)}; unexpected: {sorted(definition)}"
            )
        if task not in data.TASKS:
            raise ValueError(f"{path}: benchmark {name!r}: unknown task {task!r}; tasks: {sorted(data.TASKS)}")
        try:
            sampling = SamplingParams(**settings)
        except TypeError as error:
            raise ValueError(f"{path}: benchmark {name!r}: incomplete sampling settings {settings}") from error
        benchmarks.append(Benchmark(name=name, task=task, split=split, sampling=sampling))
    return benchmarks


def evaluate_benchmark(
    generator: Generator,
    benchmark: Benchmark,
    out_dir: str | Path,
    *,
    limit: int | None = None,
    source_dir: str | Path | None = None,
    run_info: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Generate, score and write ``out_dir/<benchmark>/{samples.jsonl,summary.json}``; return the summary.

    Problems come from the hub, or from ``source_dir`` laid out like the shared data folder
    (``gsm8k/test.jsonl``, ...). ``run_info`` (model, backend, ...) is copied into the summary so that
    it names what produced it.
    """
    source = local_benchmark_file(benchmark, source_dir) if source_dir is not None else None
    rows = data.load_rows(benchmark.task, benchmark.split, source=source)[:limit]
    if not rows:
        raise ValueError(
            f"benchmark {benchmark.name!r}: no rows for task {benchmark.task!r}, split {benchmark.split!r}"
        )
    n = benchmark.sampling.n

    started = time.monotonic()
    completions = generator.generate([row["prompt"] for row in rows], benchmark.sampling, desc=benchmark.name)
    generation_seconds = time.monotonic() - started
    if [len(samples) for samples in completions] != [n] * len(rows):
        raise RuntimeError(f"benchmark {benchmark.name!r}: the generator did not return {n} completions per prompt")

    started = time.monotonic()
    records = _score(rows, completions)
    scoring_seconds = time.monotonic() - started

    correct = [[bool(record["acc"]) for record in records[i * n : (i + 1) * n]] for i in range(len(rows))]
    reason_counts = Counter(record["reason"] for record in records)
    summary = {
        **(run_info or {}),
        "benchmark": benchmark.name,
        "task": benchmark.task,
        "split": benchmark.split,
        "sampling": asdict(benchmark.sampling),
        "num_problems": len(rows),
        "num_samples": len(records),
        "mean_at_n": mean_at_n(correct),
        "pass_at_k": {str(k): value for k, value in benchmark_pass_at_k(correct, default_ks(n)).items()},
        "timeouts": reason_counts["timeout"],
        "no_answer": reason_counts["no_answer"],
        "reasons": {reason: reason_counts[reason] for reason in rewards.REASONS},
        "generation_seconds": generation_seconds,
        "scoring_seconds": scoring_seconds,
    }
    benchmark_dir = Path(out_dir) / benchmark.name
    benchmark_dir.mkdir(parents=True, exist_ok=True)
    with open(benchmark_dir / "samples.jsonl", "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    _write_json(benchmark_dir / "summary.json", summary)
    return summary


def local_benchmark_file(benchmark: Benchmark, source_dir: str | Path) -> Path | None:
    """The file of ``benchmark`` under ``source_dir``; None for tasks generated offline (Countdown)."""
    task = data.TASKS[benchmark.task]
    if task.hub_id is None:
        return None
    relative = task.shared_files.get(benchmark.split)
    if relative is None:
        raise ValueError(
            f"benchmark {benchmark.name!r}: task {task.name!r} has no local file for split {benchmark.split!r}"
        )
    path = Path(source_dir) / relative
    if not path.is_file():
        raise FileNotFoundError(f"benchmark {benchmark.name!r}: {path} does not exist (source dir {str(source_dir)!r})")
    return path


def _score(rows: list[dict], completions: list[list[str]]) -> list[dict[str, Any]]:
    """One record per completion, problem-major, with the reward's score, accuracy and reason."""
    owners = [(position, index) for position, texts in enumerate(completions) for index in range(len(texts))]
    sample_rows = [rows[position] for position, _ in owners]
    texts = [completions[position][index] for position, index in owners]
    ground_truths = [row["reward_model"]["ground_truth"] for row in sample_rows]
    results = rewards.score_batch(
        [row["data_source"] for row in sample_rows],
        texts,
        ground_truths,
        [row.get("extra_info") or {} for row in sample_rows],
        progress=True,
    )
    return [
        {
            "problem_id": _problem_id(row, position),
            "sample_index": index,
            "completion": text,
            "score": result["score"],
            "acc": bool(result["acc"]),
            "reason": result["reason"],
            "ground_truth": ground_truth,
        }
        for (position, index), row, text, ground_truth, result in zip(
            owners, sample_rows, texts, ground_truths, results, strict=True
        )
    ]


def _problem_id(row: dict, position: int):
    return (row.get("extra_info") or {}).get("index", position)


def _write_json(path: Path, content: dict) -> None:
    path.write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def run_evaluation(
    model: str | Path,
    benchmark_names: list[str],
    out_dir: str | Path,
    *,
    benchmarks_file: str | Path,
    sampling_overrides: dict[str, Any] | None = None,
    backend: str = "auto",
    limit: int | None = None,
    source_dir: str | Path | None = None,
    batch_size: int = 8,
    seed: int = 0,
) -> dict[str, Any]:
    """Evaluate ``model`` on each benchmark with one loaded generator; write and return ``summary.json``."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    benchmarks = load_benchmarks(benchmarks_file, benchmark_names, {**(sampling_overrides or {}), "seed": seed})
    generator = make_generator(backend, model, batch_size=batch_size, seed=seed)
    run_info = {
        "model": str(model),
        "backend": type(generator).__name__,
        "benchmarks_file": str(benchmarks_file),
        "limit": limit,
        "source_dir": str(source_dir) if source_dir is not None else None,
    }
    results = {
        benchmark.name: evaluate_benchmark(
            generator, benchmark, out_dir, limit=limit, source_dir=source_dir, run_info=run_info
        )
        for benchmark in benchmarks
    }
    summary = {**run_info, "results": results}
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    _write_json(Path(out_dir) / "summary.json", summary)
    return summary
