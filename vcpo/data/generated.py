"""The starter tasks (``DatasetSpec.generator``), generated offline by Reasoning Gym.

One seeded draw of ``size`` problems (default `DRAWS`) is made; repeated questions are dropped (the easiest
tasks have a few hundred distinct problems in all), and the last fifth of what remains is the validation
split, so the splits never share a question. The held-out ``test`` split comes from a second draw (seed
`TEST_SEED_OFFSET` above the first): its questions that neither train nor validation holds, up to `TEST_PROBLEMS`; a task
with too few distinct problems left has a short test split or none (``sums``: its 200 one-digit sums are all used).
"""

from __future__ import annotations

import functools
from typing import Any

from vcpo.data.datasets import DatasetSpec, get_dataset
from vcpo.data.draws import reasoning_gym_draws
from vcpo.rewards.countdown import countdown_ground_truth

DRAWS = 2000
VALIDATION_FRACTION = 0.2
TEST_PROBLEMS = 400
TEST_SEED_OFFSET = 1_000_003


def generated_split(spec: DatasetSpec, split: str, size: int | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """The Reasoning Gym entries of ``split`` ("train", "validation" or "test") of the task's ``size`` draws."""
    train, validation = _train_and_validation(spec.name, size or DRAWS, seed)
    if split == "test":
        seen = {entry["question"] for entry in (*train, *validation)}
        return [entry for entry in _distinct(spec.name, size or DRAWS, seed + TEST_SEED_OFFSET)
                if entry["question"] not in seen][:TEST_PROBLEMS]
    return list({"train": train, "validation": validation}[split])


def generated_gold(spec: DatasetSpec, entry: dict[str, Any]) -> str:
    """The ground truth the task's reward reads: a Countdown puzzle's numbers and target, else the answer."""
    if spec.data_source == "countdown":
        return countdown_ground_truth(entry["metadata"]["numbers"], entry["metadata"]["target"])
    return str(entry["answer"])


@functools.lru_cache(maxsize=16)
def _distinct(task: str, size: int, seed: int) -> tuple[dict, ...]:
    """The entries of one seeded draw of ``size``, each question once, in draw order."""
    spec = get_dataset(task)
    draws = reasoning_gym_draws(spec.generator, spec.generator_config, size, seed)
    distinct: dict[str, dict] = {}
    for index in range(size):
        entry = draws[index]
        distinct.setdefault(entry["question"], entry)
    return tuple(distinct.values())


@functools.lru_cache(maxsize=8)
def _train_and_validation(task: str, size: int, seed: int) -> tuple[tuple[dict, ...], tuple[dict, ...]]:
    if size < 2:
        raise ValueError(f"{task}: size must be >= 2 (one train and one validation problem), got {size}")
    entries = _distinct(task, size, seed)
    validation_count = max(1, round(len(entries) * VALIDATION_FRACTION))
    return tuple(entries[:-validation_count]), tuple(entries[-validation_count:])
