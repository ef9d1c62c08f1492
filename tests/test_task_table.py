"""The paper's tasks are the rows of recipes/tasks; every other task (the simulator's, the starter tasks) is named in
one place, docs/DESIGN.md's glossary, as a row's stand-in or as a study's own."""

from __future__ import annotations

import re
from pathlib import Path

from vcpo.data.datasets import DATASETS
from vcpo.recipes import load_tasks
from vcpo.sim.tasks import SIM_TASKS

ROOT = Path(__file__).resolve().parents[1]


def glossary_entry(word: str) -> str:
    glossary = (ROOT / "docs/DESIGN.md").read_text().split("## Glossary", 1)[1]
    return re.search(rf"^- \*\*{word}\*\*:(.*?)(?=^- \*\*|\Z)", glossary, flags=re.S | re.M).group(1)


def named(entry: str) -> set[str]:
    return set(re.findall(r"`([a-z0-9_]+)`", entry))


def test_every_task_outside_the_table_is_named_in_the_glossary():
    entry = glossary_entry("task")
    starters = {name for name, spec in DATASETS.items() if spec.generator is not None}
    stand_ins = {recipe.stand_in("sim") for recipe in load_tasks().values()}
    assert stand_ins == {"countdown", "tir"} and stand_ins < set(SIM_TASKS)
    assert set(SIM_TASKS) - stand_ins <= named(entry)  # the simulator's own tasks
    brief = {name for name in starters if name.endswith("_brief")}
    assert starters - brief <= named(entry) and "_brief" in entry
    assert set(load_tasks()) <= set(re.findall(r"[a-z0-9_]+", entry.split("the one table of tasks")[0]))
