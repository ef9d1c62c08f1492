"""The starter tasks (``DatasetSpec.generator``), generated offline by Reasoning Gym.

One seeded draw of ``size`` problems (default `DRAWS`) is made; repeated questions are dropped (the easiest
tasks have a few hundred distinct problems in all), and the last fifth of what remains is the validation
split, so the splits never share a question.
"""

from __future__ import annotations

import functools
from typing import Any

from vcpo.data.datasets import DatasetSpec, get_dataset
from vcpo.rewards.countdown import countdown_ground_truth

DRAWS = 2000
VALIDATION_FRACTION = 0.2


def generated_split(spec: DatasetSpec, split: str, size: int | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """The Reasoning Gym entries of ``split`` ("train" or "validation") of the task's ``size`` draws."""
    train, validation = _train_and_validation(spec.name, size or DRAWS, seed)
    return list({"train": train, "validation": validation}[split])


def generated_gold(spec: DatasetSpec, entry: dict[str, Any]) -> str:
    """The ground truth the task's reward reads: a Countdown puzzle's numbers and target, else the answer."""
    if spec.data_source == "countdown":
        return countdown_ground_truth(entry["metadata"]["numbers"], entry["metadata"]["target"])
    return str(entry["answer"])


@functools.lru_cache(maxsize=8)
def _train_and_validation(task: str, size: int, seed: int) -> tuple[tuple[dict, ...], tuple[dict, ...]]:
    import reasoning_gym

    spec = get_dataset(task)
    if size < 2:
        raise ValueError(f"{task}: size must be >= 2 (one train and one validation problem), got {size}")
    generator = reasoning_gym.create_dataset(spec.generator, size=size, seed=seed, **spec.generator_config)
    distinct: dict[str, dict] = {}
    for index in range(size):
        entry = generator[index]
        distinct.setdefault(entry["question"], entry)
    entries = list(distinct.values())
    validation_count = max(1, round(len(entries) * VALIDATION_FRACTION))
    return tuple(entries[:-validation_count]), tuple(entries[-validation_count:])
