"""verl-schema rows for every task, and parquet files with a manifest beside each."""

from __future__ import annotations

import hashlib
import json
import random
import sys
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from vcpo import __version__
from vcpo.data.countdown import countdown_split, default_size
from vcpo.data.datasets import DatasetSpec, check_split, get_dataset
from vcpo.data.fields import gold_of, original_answer_of, question_of
from vcpo.data.generated import DRAWS, generated_gold, generated_split
from vcpo.data.sources import read_hub, read_local
from vcpo.rewards.countdown import countdown_ground_truth

_PROGRESS_FROM_RECORDS = 10_000


def load_rows(
    task: str, split: str, source: str | Path | None = None, size: int | None = None, seed: int = 0
) -> list[dict[str, Any]]:
    """The rows of ``task``/``split`` in verl's schema, from the hub or from the local file ``source``.

    ``size`` keeps a seeded random subset of that many rows (in their original order). For Countdown
    it is the size of the whole generated set instead (default 10,000: 9,000 train and 1,000
    validation) and ``seed`` is the generation seed; for the starter tasks the number of draws
    (`vcpo.data.generated`).
    """
    spec = get_dataset(task)
    check_split(spec, split)
    if size is not None and size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    if spec.hub_id is None:
        if source is not None:
            raise ValueError(f"task {task!r} is generated offline with Reasoning Gym and takes no source")
        if spec.generator is not None:
            return [_row(spec, split, index, entry["question"], generated_gold(spec, entry), str(entry["answer"]))
                    for index, entry in enumerate(generated_split(spec, split, size, seed))]
        return [
            _countdown_row(spec, split, index, entry) for index, entry in enumerate(countdown_split(split, size, seed))
        ]
    records = read_local(source) if source is not None else read_hub(spec, split)
    rows = _benchmark_rows(spec, split, records, source)
    return _seeded_subset(rows, size, seed)


def build(
    task: str,
    out_dir: str | Path,
    split: str | None = None,
    source: str | Path | None = None,
    size: int | None = None,
    seed: int = 0,
) -> list[Path]:
    """Write ``<out_dir>/<task>/<split>.parquet`` and ``<split>.manifest.json`` for one split, or for
    every split of the task when ``split`` is None; return the parquet paths.

    With a local ``source`` and no ``split``, the split is the file's name (``test.jsonl`` -> test) or
    the task's only split.
    """
    spec = get_dataset(task)
    splits = [split] if split is not None else splits_for_source(spec, source)
    if split is not None and source is not None:
        warn_if_the_name_says_another_split(spec, split, Path(source))
    paths = []
    for name in splits:
        rows = load_rows(task, name, source=source, size=size, seed=seed)
        paths.append(_write_split(spec, name, rows, Path(out_dir), _describe_source(spec, name, source, size, seed)))
    return paths


def _benchmark_rows(spec: DatasetSpec, split: str, records: list[dict], source) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    gold_by_question: dict[str, str] = {}
    conflicts = 0
    progress = tqdm(records, desc=f"{spec.name}/{split}", unit="record", disable=len(records) < _PROGRESS_FROM_RECORDS)
    for index, record in enumerate(progress):
        try:
            question, gold = question_of(record), gold_of(record, spec)
        except ValueError as error:
            raise ValueError(f"{source or spec.hub_id}, record {index + 1}: {error}") from None  # 1-based, as an editor counts
        if spec.dedupe_by_question and question in gold_by_question:
            conflicts += gold_by_question[question] != gold
            continue
        gold_by_question[question] = gold
        rows.append(_row(spec, split, index, question, gold, original_answer_of(record)))
    if conflicts:
        tqdm.write(f"{spec.name}/{split}: {conflicts} repeated questions had a different answer; kept the first")
    return rows


def _countdown_row(spec: DatasetSpec, split: str, index: int, entry: dict[str, Any]) -> dict[str, Any]:
    gold = countdown_ground_truth(entry["metadata"]["numbers"], entry["metadata"]["target"])
    return _row(spec, split, index, entry["question"], gold, entry["answer"])


def _row(spec: DatasetSpec, split: str, index: int, question: str, gold: str, original_answer: str) -> dict[str, Any]:
    return {
        "data_source": spec.data_source,
        "prompt": [{"role": "user", "content": spec.template.format(question=question)}],
        "ability": spec.ability,
        "reward_model": {"style": "rule", "ground_truth": gold},
        "extra_info": {"split": split, "index": index, "question": question, "answer": original_answer},
    }


def _seeded_subset(rows: list[dict], size: int | None, seed: int) -> list[dict]:
    if size is None or size >= len(rows):
        return rows
    keep = sorted(random.Random(seed).sample(range(len(rows)), size))
    return [rows[index] for index in keep]


SPLIT_NAMES = ("train", "test", "validation", "val", "dev")


def warn_if_the_name_says_another_split(spec: DatasetSpec, split: str, source: Path) -> None:
    """A source file named after another split (``--split train --source test.jsonl``) is written as asked,
    with a warning: its name suggests the run would train on held-out problems."""
    named = source.stem.lower()
    if named != split and (named in spec.splits or named in SPLIT_NAMES):
        tqdm.write(f"warning: {source} is named after split {named!r} but is written as {spec.name}/{split}; "
                   "the manifest records the source", file=sys.stderr)


def splits_for_source(spec: DatasetSpec, source) -> list[str]:
    """The splits ``build`` writes when none is named: all, or the one a local ``source`` holds."""
    if source is None:
        return list(spec.splits)
    if Path(source).stem in spec.splits:
        return [Path(source).stem]
    if len(spec.splits) == 1:
        return list(spec.splits)
    raise ValueError(
        f"task {spec.name!r} has splits {', '.join(spec.splits)}: say which one {source} holds with "
        "split= (--split), or name the file after it"
    )


def _describe_source(spec: DatasetSpec, split: str, source, size: int | None, seed: int) -> dict[str, Any]:
    if spec.hub_id is None:
        import reasoning_gym

        if spec.generator is not None:
            return {"source": f"reasoning_gym {reasoning_gym.__version__} {spec.generator} {spec.generator_config}, "
                              f"{size or DRAWS} draws, seed {seed}"}
        total = size or default_size()
        return {"source": f"reasoning_gym {reasoning_gym.__version__} countdown, {total} puzzles, seed {seed}"}
    subset = {"subset": {"size": size, "seed": seed}} if size is not None else {}
    if source is None:
        config = f", config {spec.hub_config}" if spec.hub_config else ""
        return {"source": f"hf://{spec.hub_id} (split {spec.hub_split(split)}{config})", **subset}
    return {"source": str(Path(source).resolve()), "source_sha256": _sha256(Path(source)), **subset}


def _write_split(spec: DatasetSpec, split: str, rows: list[dict], out_dir: Path, provenance: dict[str, Any]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not rows:
        raise ValueError(f"{spec.name}/{split}: no rows to write")
    task_dir = out_dir / spec.name
    task_dir.mkdir(parents=True, exist_ok=True)
    parquet_path = task_dir / f"{split}.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet_path)
    manifest = {
        "task": spec.name,
        "split": split,
        "rows": len(rows),
        "data_source": spec.data_source,
        **provenance,
        "parquet": parquet_path.name,
        "sha256": _sha256(parquet_path),
        "prompt_template": spec.template.format(question="{question}"),
        "vcpo_version": __version__,
    }
    manifest_path = task_dir / f"{split}.manifest.json"
    manifest_path.write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return parquet_path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
