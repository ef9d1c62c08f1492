"""Countdown: the puzzles, drawn offline from Reasoning Gym's generator, and the paper's set (VCPO App. F).

Countdown comes in three forms, one generator with three sets of ranges (`CountdownRanges`): the paper's puzzles
(`PAPER_COUNTDOWN`, Reasoning Gym's defaults), the simulator's ``countdown`` task (`SIM_COUNTDOWN`, small enough for a
tiny model: ``vcpo.sim.tasks`` says why) and the starter task ``countdown3`` (`STARTER_COUNTDOWN`, for a small
pretrained model). All three are scored by one reward, ``vcpo.rewards.countdown``.

The paper's set: one seeded set of ``size`` distinct puzzles (default 10,000) is generated; the last tenth is the
validation split (1,000) and the rest the train split (9,000). Puzzles are identified by their
numbers (as a multiset) and target, and duplicates are skipped during generation, so the two splits
can never share a puzzle.
"""

from __future__ import annotations

import functools
import hashlib
import json
import multiprocessing
import os
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm

from vcpo.data.draws import reasoning_gym_draws
from vcpo.locks import cache_dir, write_atomic
from vcpo.recipes import load_tasks


@dataclass(frozen=True)
class CountdownRanges:
    """What a Countdown puzzle is drawn from: how many numbers (inclusive range), their values and the target's."""

    numbers: tuple[int, int]
    values: tuple[int, int]
    targets: tuple[int, int]

    def config(self) -> dict[str, int]:
        """The ranges as Reasoning Gym's ``countdown`` configuration."""
        return {"min_numbers": self.numbers[0], "max_numbers": self.numbers[1], "min_value": self.values[0],
                "max_value": self.values[1], "min_target": self.targets[0], "max_target": self.targets[1]}


PAPER_COUNTDOWN = CountdownRanges(numbers=(4, 6), values=(1, 100), targets=(100, 999))  # Reasoning Gym's defaults
SIM_COUNTDOWN = CountdownRanges(numbers=(3, 3), values=(1, 20), targets=(1, 50))
STARTER_COUNTDOWN = CountdownRanges(numbers=(3, 3), values=(1, 10), targets=(1, 30))


def countdown_draws(ranges: CountdownRanges, size: int, seed: int) -> Sequence[dict[str, Any]]:
    """``size`` seeded Countdown puzzles drawn from ``ranges`` (entry i depends on the seed and i alone)."""
    return reasoning_gym_draws("countdown", ranges.config(), size, seed)

VALIDATION_FRACTION = 0.1
# Reasoning Gym draws each puzzle from its own seed + index; skipping duplicates needs a few spare indices.
_MAX_DRAWS_PER_PUZZLE = 4
# Indices generated per worker task: large enough to amortise the worker start, small enough to
# stop soon after ``size`` distinct puzzles exist.
_CHUNK = 500


def default_size() -> int:
    """The puzzles of the Countdown task's recipe (``data.size`` in recipes/tasks/countdown.yaml)."""
    return int(load_tasks()["countdown"].spec["data"]["size"])


def countdown_split(split: str, size: int | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """The Reasoning Gym entries of ``split`` ("train" or "validation") of the ``size``-puzzle set
    (default: the recipe's ``default_size()``)."""
    train, validation = _train_and_validation(size or default_size(), seed)
    return list({"train": train, "validation": validation}[split])


def puzzle_key(entry: dict[str, Any]) -> tuple[tuple[int, ...], int]:
    """What makes two puzzles the same: their numbers as a multiset and their target."""
    return tuple(sorted(entry["metadata"]["numbers"])), entry["metadata"]["target"]


@functools.lru_cache(maxsize=4)
def _train_and_validation(size: int, seed: int) -> tuple[list[dict], list[dict]]:
    if size < 2:
        raise ValueError(f"countdown size must be >= 2 (one train and one validation puzzle), got {size}")
    puzzles = _cached_distinct_puzzles(size, seed)
    validation_count = max(1, round(size * VALIDATION_FRACTION))
    train, validation = puzzles[:-validation_count], puzzles[-validation_count:]
    shared = {puzzle_key(entry) for entry in train} & {puzzle_key(entry) for entry in validation}
    if shared:
        raise AssertionError(f"countdown train and validation share {len(shared)} puzzles")
    return train, validation


def _cached_distinct_puzzles(size: int, seed: int) -> list[dict[str, Any]]:
    """The puzzle set, generated once per (size, seed, Reasoning Gym version) and kept on disk:
    the full set takes minutes to generate, and every process that trains or evaluates needs it."""
    import reasoning_gym

    path = cache_dir() / f"countdown-{size}-seed{seed}-rg{reasoning_gym.__version__}.json"
    digest_path = path.with_name(path.name + ".sha256")  # written with the set, checked at every read
    if path.exists():
        text = path.read_text()
        recorded = digest_path.read_text().strip() if digest_path.exists() else None
        try:
            if recorded not in (None, hashlib.sha256(text.encode()).hexdigest()):
                raise ValueError("its content differs from the digest recorded when it was generated")
            return json.loads(text)
        except ValueError as error:  # JSONDecodeError included: a truncated or altered file
            print(f"{path} is damaged ({error}): generating it again", file=sys.stderr)
    text = json.dumps(_distinct_puzzles(size, seed))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, text)  # concurrent builders never read a half-written set
    write_atomic(digest_path, hashlib.sha256(text.encode()).hexdigest() + "\n")
    return json.loads(text)  # the same values (lists, not tuples) as a later cached read


def _generate(seed: int, indices: range) -> list[dict[str, Any]]:
    draws = countdown_draws(PAPER_COUNTDOWN, indices.stop, seed)
    return [draws[index] for index in indices]


def _distinct_puzzles(size: int, seed: int) -> list[dict[str, Any]]:
    """The first ``size`` distinct puzzles in index order. Reasoning Gym draws each index from its
    own seed, so indices are generated in chunks (in parallel when the set needs more than one chunk) and deduplicated
    in order afterwards."""
    puzzles: list[dict[str, Any]] = []
    seen: set = set()
    limit = size * _MAX_DRAWS_PER_PUZZLE
    chunk = max(1, min(_CHUNK, size))
    workers = min(os.cpu_count() or 1, 8)
    chunks = (range(start, min(start + chunk, limit)) for start in range(0, limit, chunk))
    generate = functools.partial(_generate, seed)
    # a set of one chunk is drawn here: starting the workers (each imports Reasoning Gym) costs more than the chunk
    pool = None if size <= _CHUNK else ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    with tqdm(total=size, desc=f"countdown puzzles (seed {seed})", unit="puzzle") as progress, pool or nullcontext():
        for entries in pool.map(generate, chunks) if pool else map(generate, chunks):
            for entry in entries:
                if puzzle_key(entry) in seen:
                    continue
                seen.add(puzzle_key(entry))
                puzzles.append(entry)
                progress.update()
                if len(puzzles) == size:
                    if pool:
                        pool.shutdown(cancel_futures=True)
                    return puzzles
    raise RuntimeError(f"Reasoning Gym gave fewer than {size} distinct countdown puzzles for seed {seed}")
