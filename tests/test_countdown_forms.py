"""Countdown's three forms (the paper's puzzle set, the simulator's task, the starter task) draw the same puzzles,
in the same order and splits, for fixed seeds as they did when each had its own generator: a digest of each
form's output, recorded from that code."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest

from vcpo.data.countdown import countdown_split
from vcpo.data.datasets import get_dataset
from vcpo.data.generated import generated_split
from vcpo.sim.tasks import get_sim_task

# sha256 (first 16 hex digits) of each form's output below, written by the code before the forms shared a generator
RECORDED = {"paper": "edc9e532d2595e40", "sim": "f2b9fe62545646ae", "starter": "8f115dedc27d77ac"}


def digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def paper_form() -> list:
    """The paper's set of 30 puzzles of seed 7: its train and validation splits (the set's last tenth)."""
    return [countdown_split(split, size=30, seed=7) for split in ("train", "validation")]


def sim_form() -> list:
    """The simulator's countdown with small splits: validation first, then train, then test."""
    from vcpo.sim.tasks import _problem_dicts

    task = dataclasses.replace(get_sim_task("countdown"), train_size=30, validation_size=10, test_size=5)
    return list(_problem_dicts(task, 5))


def starter_form() -> list:
    """The starter task countdown3 from 60 draws of seed 3: train, validation and the test split's second draw."""
    return [generated_split(get_dataset("countdown3"), split, size=60, seed=3) for split in ("train", "validation", "test")]


@pytest.mark.parametrize("form", ["paper", "sim", "starter"])
def test_each_countdown_form_draws_what_it_drew(form, tmp_path, monkeypatch):
    monkeypatch.setenv("VCPO_CACHE_DIR", str(tmp_path))  # the paper's set is generated, not read from a cache
    drawn = {"paper": paper_form, "sim": sim_form, "starter": starter_form}[form]()
    assert all(drawn) and digest(drawn) == RECORDED[form]
