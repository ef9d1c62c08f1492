"""The one table of tasks: where each comes from, its splits, prompt template and gold-answer rule.

Prompt templates follow verl's example preprocessors: GSM8K asks for the answer after ``####``, the
math sets ask for it in ``\\boxed{}``; Countdown keeps the Reasoning Gym question and asks for the
expression in ``<answer>`` tags (``\\boxed{}`` is accepted too).
"""

from __future__ import annotations

from dataclasses import dataclass, field

GSM8K_TEMPLATE = '{question} Let\'s think step by step and output the final answer after "####".'
MATH_TEMPLATE = "{question} Let's think step by step and output the final answer within \\boxed{{}}."
COUNTDOWN_TEMPLATE = (
    "{question}\nThink step by step, then write only the final expression inside <answer> </answer> tags, "
    "for example <answer>(1 + 2) * 3</answer>."
)

# Gold-answer rules (vcpo.data.fields): the number after "####" in a GSM8K solution, or the answer
# field of a math set, falling back to the last \boxed{} of its solution.
GOLD_AFTER_HASHES = "after_hashes"
GOLD_FINAL_ANSWER = "final_answer"


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    ability: str
    template: str
    splits: tuple[str, ...]
    hub_id: str | None = None  # None: generated offline (Countdown)
    hub_config: str | None = None
    # Our split name -> the hub split that holds it, where the two differ.
    hub_splits: dict[str, str] = field(default_factory=dict)
    gold_rule: str = GOLD_FINAL_ANSWER
    # The hub copy of DAPO-Math-17k repeats every prompt about a hundred times.
    dedupe_by_question: bool = False
    # Our split name -> a copy in the shared data folder, named in errors when the hub is unreachable.
    shared_files: dict[str, str] = field(default_factory=dict)

    def hub_split(self, split: str) -> str:
        return self.hub_splits.get(split, split)

    @property
    def data_source(self) -> str:
        # vcpo.rewards.REWARD_BY_DATA_SOURCE maps this name to the rule that scores the task.
        return self.name


def _math_task(name: str, hub_id: str, splits: tuple[str, ...], **details) -> DatasetSpec:
    return DatasetSpec(name=name, ability="math", template=MATH_TEMPLATE, splits=splits, hub_id=hub_id, **details)


TASKS: dict[str, DatasetSpec] = {
    task.name: task
    for task in [
        DatasetSpec(
            name="gsm8k",
            ability="math",
            template=GSM8K_TEMPLATE,
            hub_id="openai/gsm8k",
            hub_config="main",
            splits=("train", "test"),
            gold_rule=GOLD_AFTER_HASHES,
            shared_files={"test": "gsm8k/test.jsonl"},
        ),
        _math_task(
            "math",
            "DigitalLearningGmbH/MATH-lighteval",
            ("train", "test"),
            shared_files={"test": "math/test.jsonl"},
        ),
        _math_task("math500", "HuggingFaceH4/MATH-500", ("test",), shared_files={"test": "math500/test.jsonl"}),
        _math_task(
            "aime24",
            "Maxwell-Jia/AIME_2024",
            ("test",),
            hub_splits={"test": "train"},  # the hub copy names its only split "train"
            shared_files={"test": "aime24/test.jsonl"},
        ),
        _math_task("aime25", "math-ai/aime25", ("test",), shared_files={"test": "aime25/test.jsonl"}),
        _math_task("amc23", "math-ai/amc23", ("test",), shared_files={"test": "amc23/test.jsonl"}),
        _math_task("dapo_math", "BytedTsinghua-SIA/DAPO-Math-17k", ("train",), dedupe_by_question=True),
        DatasetSpec(
            name="countdown",
            ability="arithmetic",
            template=COUNTDOWN_TEMPLATE,
            splits=("train", "validation"),
        ),
    ]
}


def get_dataset(name: str) -> DatasetSpec:
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}") from None


def check_split(task: DatasetSpec, split: str) -> None:
    if split not in task.splits:
        raise ValueError(f"task {task.name!r} has no split {split!r}; its splits: {', '.join(task.splits)}")
