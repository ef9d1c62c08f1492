"""Evaluate a checkpoint on named benchmarks: sample, score, write per-sample records and summaries.

Every completion is scored under each answer format of ``vcpo.rewards.ANSWER_FORMATS``: ``strict`` (the
answer in the format the prompt asks for: ``\\boxed{}``, ``#### N``, ``<answer>`` tags) and ``lenient``
(also a bare final number or expression). A benchmark's ``answer_format`` (benchmarks YAML, default
``strict``; ``python -m vcpo.evaluation --answer-format`` overrides it) names the primary one.

Output layout, for each benchmark B under ``out_dir``:
    B/samples.jsonl   one record per completion: problem_id, sample_index, completion, tokens, truncated,
                      tool_calls, ground_truth, score, acc, reason (primary format) and ``by_answer_format``:
                      {"strict": {"score", "acc", "reason"}, "lenient": {...}}
    B/summary.json    the benchmark definition and sampling used, ``answer_format`` (the primary one),
                      mean_at_n, pass_at_k, timeouts, no_answer and reasons under the primary format,
                      ``by_answer_format``: {"strict": {mean_at_n, pass_at_k, timeouts, no_answer,
                      reasons}, "lenient": {...}} with the same metrics under every format, and
                      mean_response_tokens, truncated (the fraction that hit max_new_tokens) and
                      tool_calls_per_response (multi-turn evaluation: ``--tool-config``)
and ``summary.json`` with every benchmark's summary and the run's configuration.

A benchmark's samples are appended to ``samples.jsonl`` as each chunk of problems finishes (one generate call per
chunk: the generator's batch, or ``DEFAULT_CHUNK_PROBLEMS``), and ``B/evaluation.json`` says what they belong to
(model, sampling, problems, chunk). The same command after a kill reads back the complete chunks and goes on from
there: no sample is drawn twice or lost, and each chunk draws from its own seed (the sampling seed plus its first
problem's position), so a resumed evaluation holds the samples an uninterrupted one would. A folder holding another
evaluation's samples starts clean. The samples' bar moves within a chunk where the generator reports its decode steps
(HFGenerator's ``on_progress``: tokens as they are generated, samples as they end), else at the chunk's end.

``evaluate_rows`` is the whole measurement without the files; the simulator's held-out evaluation
calls it on a model in memory, so smoke and paper accuracies come from the same code.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import yaml
from tqdm.auto import tqdm
from transformers import AutoConfig

from vcpo import data, rewards
from vcpo.evaluation.generation import Completion, Generator, SamplingParams, make_generator
from vcpo.evaluation.metrics import benchmark_pass_at_k, default_ks, mean_at_n
from vcpo.evaluation.tool_use import ToolAgentGenerator, ToolUse

_SAMPLING_KEYS = {field.name for field in fields(SamplingParams)}


@dataclass(frozen=True)
class Benchmark:
    name: str
    task: str  # vcpo.data.load_rows task name
    split: str
    sampling: SamplingParams
    answer_format: str = "strict"  # the primary format of the summary (every format is scored)

    def __post_init__(self):
        if self.answer_format not in rewards.ANSWER_FORMATS:
            raise ValueError(
                f"benchmark {self.name!r}: unknown answer_format {self.answer_format!r}; "
                f"allowed: {', '.join(rewards.ANSWER_FORMATS)}"
            )


SUMMARY_FILE = "summary.json"  # an evaluation's results, in --out and in each benchmark's folder
SAMPLES_FILE = "samples.jsonl"
RESUME_FILE = "evaluation.json"  # in a benchmark's folder: what its samples.jsonl belongs to
DEFAULT_CHUNK_PROBLEMS = 256  # problems per generate call for a generator without a batch size (vLLM)


class EvaluationInputError(ValueError):
    """An input of an evaluation (benchmarks file, benchmark data) that cannot be used: found before any
    model is loaded, said in one line naming the file."""


def load_benchmarks(
    path: str | Path,
    names: list[str],
    overrides: dict[str, Any] | None = None,
    *,
    answer_format: str | None = None,
) -> list[Benchmark]:
    """The benchmarks ``names`` from a benchmarks YAML (``defaults`` + ``benchmarks``), with sampling
    ``overrides`` (keys of SamplingParams; None values ignored) applied on top of both, and
    ``answer_format`` (when not None) replacing every benchmark's primary answer format."""
    try:
        spec = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        raise EvaluationInputError(f"{path}: no such benchmarks file") from None
    except yaml.YAMLError as error:
        where = getattr(error, "problem_mark", None)
        raise EvaluationInputError(f"{path}: not valid YAML{f' (line {where.line + 1})' if where else ''}: "
                                   f"{getattr(error, 'problem', None) or error}") from None
    if not isinstance(spec, dict):
        raise EvaluationInputError(f"{path}: expected a mapping with 'benchmarks' (and 'defaults'), got {type(spec).__name__}")
    defaults, definitions = spec.get("defaults", {}), spec.get("benchmarks", {})
    overrides = {key: value for key, value in (overrides or {}).items() if value is not None}
    unknown_names = [name for name in names if name not in definitions]
    if unknown_names:
        raise EvaluationInputError(f"{path}: unknown benchmark(s) {unknown_names}; defined: {sorted(definitions)}")
    benchmarks = []
    for name in names:
        definition = {**defaults, **definitions[name]}
        settings = {**{key: definition.pop(key) for key in _SAMPLING_KEYS & set(definition)}, **overrides}
        task, split = definition.pop("task", None), definition.pop("split", None)
        defined_format = definition.pop("answer_format", "strict")
        primary_format = answer_format or defined_format
        if task is None or split is None or definition:
            raise EvaluationInputError(
                f"{path}: benchmark {name!r} needs 'task' and 'split' and only 'answer_format' and sampling "
                f"keys {sorted(_SAMPLING_KEYS)}; unexpected: {sorted(definition)}"
            )
        if task not in data.DATASETS:
            raise EvaluationInputError(f"{path}: benchmark {name!r}: unknown task {task!r}; tasks: {sorted(data.DATASETS)}")
        try:
            sampling = SamplingParams(**settings)
        except TypeError as error:
            raise EvaluationInputError(f"{path}: benchmark {name!r}: incomplete sampling settings {settings}") from error
        try:
            benchmarks.append(
                Benchmark(name=name, task=task, split=split, sampling=sampling, answer_format=primary_format)
            )
        except ValueError as error:
            raise EvaluationInputError(f"{path}: {error}") from error
    return benchmarks


def benchmark_rows(benchmark: Benchmark, limit: int | None = None, source_dir: str | Path | None = None) -> list[dict]:
    """The first ``limit`` problems of a benchmark, from the hub or ``source_dir``; none, or a file that
    cannot be read, is an EvaluationInputError naming the benchmark and the file."""
    source = None
    try:
        source = local_benchmark_file(benchmark, source_dir) if source_dir is not None else None
        rows = data.load_rows(benchmark.task, benchmark.split, source=source)[:limit]
    except (OSError, ValueError, KeyError) as error:
        raise EvaluationInputError(f"benchmark {benchmark.name!r} ({source or source_dir or 'the hub'}): {error}") from None
    if not rows:
        raise EvaluationInputError(
            f"benchmark {benchmark.name!r}: no rows for task {benchmark.task!r}, split {benchmark.split!r}"
            f"{f' in {source}' if source else ''}"
        )
    return rows


def evaluate_benchmark(
    generator: Generator,
    benchmark: Benchmark,
    out_dir: str | Path,
    *,
    limit: int | None = None,
    source_dir: str | Path | None = None,
    run_info: dict[str, Any] | None = None,
    rows: list[dict] | None = None,
    resume: bool = True,
    progress: bool = True,
) -> dict[str, Any]:
    """Generate, score and write ``out_dir/<benchmark>/{samples.jsonl,summary.json}``; return the summary.

    Problems come from the hub, or from ``source_dir`` laid out like the shared data folder
    (``gsm8k/test.jsonl``, ...). ``run_info`` (model, backend, ...) is copied into the summary so that
    it names what produced it. ``rows``: the benchmark's problems when already loaded (``benchmark_rows``).
    Samples are written chunk by chunk and an interrupted evaluation resumed (the module docstring); ``resume``
    False starts clean.
    """
    rows = benchmark_rows(benchmark, limit, source_dir) if rows is None else rows
    n, chunk = benchmark.sampling.n, getattr(generator, "batch_size", DEFAULT_CHUNK_PROBLEMS)
    benchmark_dir = Path(out_dir) / benchmark.name
    benchmark_dir.mkdir(parents=True, exist_ok=True)
    identity = {"model": (run_info or {}).get("model"), "sampling": asdict(benchmark.sampling),
                "answer_format": benchmark.answer_format, "chunk_problems": chunk,
                "problems": [_problem_id(row, position) for position, row in enumerate(rows)]}
    records = _resumed_records(benchmark_dir, identity, n * chunk) if resume else []
    if not records:
        _write_json(benchmark_dir / RESUME_FILE, identity)
        (benchmark_dir / SAMPLES_FILE).write_text("")
    seconds = {"generation": 0.0, "scoring": 0.0}
    bar = tqdm(total=len(rows) * n, initial=len(records), unit="sample", desc=benchmark.name, disable=not progress)
    tokens = sum(record["tokens"] for record in records)  # as decoded: the chunk under way's step by step
    bar.set_postfix(tokens=tokens)

    def decoded(step_tokens: int, ended: int) -> None:  # a decode step of the chunk under way (HFGenerator)
        nonlocal tokens
        tokens += step_tokens
        bar.set_postfix(tokens=tokens, refresh=False)
        bar.update(ended)

    with open(benchmark_dir / SAMPLES_FILE, "a", encoding="utf-8") as handle, _progress_by_step(generator, decoded):
        for start in range(len(records) // n, len(rows), chunk):
            sampling = replace(benchmark.sampling, seed=benchmark.sampling.seed + start)
            new, spent = _generate_and_score(generator, rows[start : start + chunk], sampling, benchmark.answer_format,
                                             benchmark.name, progress=False, first_position=start)
            handle.write("".join(json.dumps(record, ensure_ascii=False) + "\n" for record in new))
            handle.flush()
            os.fsync(handle.fileno())
            records += new
            seconds = {key: seconds[key] + spent[key] for key in seconds}
            tokens = sum(record["tokens"] for record in records)  # the chunk's as written, its truncated samples in
            bar.update(len(records) - bar.n)
            bar.set_postfix(tokens=tokens)
    bar.close()
    summary = {
        **(run_info or {}),
        "benchmark": benchmark.name,
        "task": benchmark.task,
        "split": benchmark.split,
        "sampling": asdict(benchmark.sampling),
        **_measured(records, len(rows), n, benchmark.answer_format, seconds),
    }
    _write_json(benchmark_dir / SUMMARY_FILE, summary)
    return summary


@contextmanager
def _progress_by_step(generator: Generator, decoded) -> Iterator[None]:
    """The generator's own progress bar (one per generate call, a chunk here) off: the samples' bar replaces it; a
    generator that reports its decode steps (HFGenerator's ``on_progress``) tells ``decoded`` each step's tokens and
    ended samples, so the bar moves within a chunk, not only at its end (vLLM's generates a chunk at once)."""
    shown, reported = getattr(generator, "progress", None), hasattr(generator, "on_progress")
    if shown is not None:
        generator.progress = False
    if reported:
        earlier, generator.on_progress = generator.on_progress, decoded
    try:
        yield
    finally:
        if shown is not None:
            generator.progress = shown
        if reported:
            generator.on_progress = earlier


def _resumed_records(benchmark_dir: Path, identity: dict, chunk_samples: int) -> list[dict]:
    """The complete chunks of an earlier run of the same evaluation in ``benchmark_dir`` (the file cut back to them);
    none when it holds another evaluation's samples or none."""
    resume, samples = benchmark_dir / RESUME_FILE, benchmark_dir / SAMPLES_FILE
    try:
        if json.loads(resume.read_text(encoding="utf-8")) != identity:
            return []
        lines = samples.read_text(encoding="utf-8").splitlines(keepends=True)
    except (OSError, ValueError):
        return []
    complete = [line for line in lines if line.endswith("\n")]  # a torn last line is dropped, and a torn chunk
    total = len(identity["problems"]) * identity["sampling"]["n"]
    kept = complete if len(complete) == total else complete[: len(complete) - len(complete) % chunk_samples]
    samples.write_text("".join(kept), encoding="utf-8")
    return [json.loads(line) for line in kept]


def evaluate_rows(
    generator: Generator,
    rows: list[dict],
    sampling: SamplingParams,
    answer_format: str = "strict",
    desc: str = "evaluation",
    *,
    progress: bool = True,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Generate ``sampling.n`` completions per row (``vcpo.data`` rows: prompt, data_source,
    reward_model.ground_truth), score each under every answer format, and return the per-completion
    records and the metrics: those of the primary ``answer_format`` at the top level, every format's in
    ``by_answer_format``, and the response length and truncation."""
    records, seconds = _generate_and_score(generator, rows, sampling, answer_format, desc, progress)
    return records, _measured(records, len(rows), sampling.n, answer_format, seconds)


def _generate_and_score(generator: Generator, rows: list[dict], sampling: SamplingParams, answer_format: str, desc: str,
                        progress: bool, first_position: int = 0) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """The records of ``rows`` (the first at ``first_position`` of its benchmark) and the seconds spent generating
    and scoring them."""
    if not rows:
        raise ValueError(f"{desc}: no rows to evaluate")
    started = time.monotonic()
    completions = generator.generate([row["prompt"] for row in rows], sampling, desc=desc)
    generation_seconds = time.monotonic() - started
    if [len(samples) for samples in completions] != [sampling.n] * len(rows):
        raise RuntimeError(f"{desc}: the generator did not return {sampling.n} completions per prompt")
    started = time.monotonic()
    records = _score(rows, completions, answer_format, progress, first_position)
    return records, {"generation": generation_seconds, "scoring": time.monotonic() - started}


def _measured(records: list[dict[str, Any]], num_problems: int, n: int, answer_format: str,
              seconds: dict[str, float]) -> dict[str, Any]:
    """The metrics of problem-major ``records``: the primary format's at the top level, every format's in
    ``by_answer_format``, the response length, truncation and tool calls, and the seconds spent."""
    by_format = {
        name: _metrics([record["by_answer_format"][name] for record in records], num_problems, n)
        for name in rewards.ANSWER_FORMATS
    }
    return {
        "answer_format": answer_format,
        "num_problems": num_problems,
        "num_samples": len(records),
        **by_format[answer_format],
        "by_answer_format": by_format,
        "mean_response_tokens": sum(record["tokens"] for record in records) / len(records),
        "truncated": sum(record["truncated"] for record in records) / len(records),
        "tool_calls_per_response": sum(record["tool_calls"] for record in records) / len(records),
        "generation_seconds": seconds["generation"],
        "scoring_seconds": seconds["scoring"],
    }


def local_benchmark_file(benchmark: Benchmark, source_dir: str | Path) -> Path | None:
    """The file of ``benchmark`` under ``source_dir``; None for tasks generated offline (Countdown)."""
    task = data.DATASETS[benchmark.task]
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


def _metrics(results: list[dict[str, Any]], num_problems: int, n: int) -> dict[str, Any]:
    """mean@n, pass@k and reason counts of problem-major ``results`` (``n`` per problem)."""
    correct = [[bool(result["acc"]) for result in results[i * n : (i + 1) * n]] for i in range(num_problems)]
    reason_counts = Counter(result["reason"] for result in results)
    return {
        "mean_at_n": mean_at_n(correct),
        "pass_at_k": {str(k): value for k, value in benchmark_pass_at_k(correct, default_ks(n)).items()},
        "timeouts": reason_counts["timeout"],
        "no_answer": reason_counts["no_answer"],
        "reasons": {reason: reason_counts[reason] for reason in rewards.REASONS},
    }


def _score(
    rows: list[dict], completions: list[list[Completion]], primary_format: str, progress: bool, first_position: int = 0
) -> list[dict[str, Any]]:
    """One record per completion, problem-major: the reward's score, accuracy and reason under the
    primary answer format, and under every format in ``by_answer_format``."""
    owners = [(position, index) for position, texts in enumerate(completions) for index in range(len(texts))]
    sample_rows = [rows[position] for position, _ in owners]
    samples = [completions[position][index] for position, index in owners]
    ground_truths = [row["reward_model"]["ground_truth"] for row in sample_rows]
    results_by_format = {
        answer_format: rewards.score_batch(
            [row["data_source"] for row in sample_rows],
            [sample.text for sample in samples],
            ground_truths,
            [{**(row.get("extra_info") or {}), rewards.RESPONSE_ENDED: not sample.truncated}
             for row, sample in zip(sample_rows, samples, strict=True)],
            answer_format=answer_format,
            progress=progress,
        )
        for answer_format in rewards.ANSWER_FORMATS
    }
    records = []
    for number, ((position, index), row, sample, ground_truth) in enumerate(
        zip(owners, sample_rows, samples, ground_truths, strict=True)
    ):
        by_format = {
            answer_format: {
                "score": results[number]["score"],
                "acc": bool(results[number]["acc"]),
                "reason": results[number]["reason"],
            }
            for answer_format, results in results_by_format.items()
        }
        records.append(
            {
                "problem_id": _problem_id(row, first_position + position),
                "sample_index": index,
                "completion": sample.text,
                "tokens": sample.tokens,
                "truncated": sample.truncated,
                "tool_calls": sample.tool_calls,
                **by_format[primary_format],
                "ground_truth": ground_truth,
                "by_answer_format": by_format,
            }
        )
    return records


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
    answer_format: str | None = None,
    tool_use: ToolUse | None = None,
    resume: bool = True,
) -> dict[str, Any]:
    """Evaluate ``model`` on each benchmark with one loaded generator; write and return ``summary.json``. An
    interrupted evaluation in ``out_dir`` is resumed (``resume`` False: started clean).

    ``answer_format`` (when not None) replaces each benchmark's primary answer format. With ``tool_use``
    the responses are multi-turn tool dialogues (``ToolAgentGenerator``), as the model's rollouts were."""
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    benchmarks = load_benchmarks(
        benchmarks_file, benchmark_names, {**(sampling_overrides or {}), "seed": seed}, answer_format=answer_format
    )
    problems = {benchmark.name: benchmark_rows(benchmark, limit, source_dir) for benchmark in benchmarks}  # before the model
    generator = make_generator(backend, model, batch_size=batch_size, seed=seed)
    backend_name = type(generator).__name__
    if tool_use is not None:
        model_type = AutoConfig.from_pretrained(model).model_type
        generator = ToolAgentGenerator(generator, generator.tokenizer, tool_use, model_type=model_type)
    run_info = {
        "model": str(model),
        "backend": backend_name,
        "tool_use": {**asdict(tool_use), "tool_config": str(tool_use.tool_config)} if tool_use else None,
        "benchmarks_file": str(benchmarks_file),
        "limit": limit,
        "source_dir": str(source_dir) if source_dir is not None else None,
    }
    results = {
        benchmark.name: evaluate_benchmark(
            generator, benchmark, out_dir, limit=limit, source_dir=source_dir, run_info=run_info, rows=problems[benchmark.name],
            resume=resume,
        )
        for benchmark in benchmarks
    }
    summary = {**run_info, "results": results}
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    _write_json(Path(out_dir) / SUMMARY_FILE, summary)
    return summary
