"""The datasets: where each comes from, its splits, prompt template and gold-answer rule.

A paper task (``recipes/tasks/*.yaml``, the one table of tasks) names its training and validation data here.

Prompt templates follow verl's example preprocessors: GSM8K asks for the answer after ``####``, the
math sets ask for it in ``\\boxed{}``; Countdown keeps the Reasoning Gym question and asks for the
expression in ``<answer>`` tags (``\\boxed{}`` is accepted too).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vcpo.data.countdown import STARTER_COUNTDOWN

GSM8K_TEMPLATE = '{question} Let\'s think step by step and output the final answer after "####".'
MATH_TEMPLATE = "{question} Let's think step by step and output the final answer within \\boxed{{}}."
# the starter tasks (a small pretrained model's first RL task): the answer after "####", without asking for
# step-by-step reasoning, so that a 64-token response holds it
STARTER_TEMPLATE = '{question} Output the final answer after "####".'
# A short answer: under the lenient format a response that ended scores its last number
BRIEF_TEMPLATE = "{question} Reply with only the final number."
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
    # generated offline by this Reasoning Gym dataset with this configuration (vcpo.data.generated); None: the hub,
    # or Countdown's own generator (vcpo.data.countdown)
    generator: str | None = None
    generator_config: dict = field(default_factory=dict)
    # the reward rule's data source (vcpo.rewards.REWARD_BY_DATA_SOURCE) when it is not the task's own name
    reward_source: str | None = None

    def hub_split(self, split: str) -> str:
        return self.hub_splits.get(split, split)

    @property
    def data_source(self) -> str:
        # vcpo.rewards.REWARD_BY_DATA_SOURCE maps this name to the rule that scores the task.
        return self.reward_source or self.name


def _math_task(name: str, hub_id: str, splits: tuple[str, ...], **details) -> DatasetSpec:
    return DatasetSpec(name=name, ability="math", template=MATH_TEMPLATE, splits=splits, hub_id=hub_id, **details)


def _starter_task(name: str, generator: str, config: dict, *, template: str = STARTER_TEMPLATE,
                  reward_source: str = "gsm8k") -> DatasetSpec:
    return DatasetSpec(name=name, ability="arithmetic", template=template, splits=("train", "validation", "test"),
                       generator=generator, generator_config=config, reward_source=reward_source)


# Reasoning Gym settings shared by a task and its short-answer variant
_PLUS_MINUS_FLAT = {"operators": ["+", "-"], "allow_parentheses": False, "allow_negation": False}
SUMS_2DIGIT = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, **_PLUS_MINUS_FLAT}
SUMS_2TO3 = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1, **_PLUS_MINUS_FLAT}
CHAIN_SUMS = {"min_terms": 3, "max_terms": 3, "min_digits": 1, "max_digits": 1}

DATASETS: dict[str, DatasetSpec] = {
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
        # Starter tasks, generated offline: easy enough for SmolLM2-135M-Instruct to get some right before training
        # (recipes/real_model.yaml chooses among them). Numeric answers are scored by the GSM8K rule (after "####").
        _starter_task("sums", "basic_arithmetic",
                      {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, **_PLUS_MINUS_FLAT}),
        _starter_task("chain_sums", "chain_sum", CHAIN_SUMS),
        _starter_task("word_problems", "gsm_symbolic", {}),
        # candidates with room for a held-out test split of 400 (recipes/real_model_lag.md), registered in this order
        _starter_task("sums_2digit", "basic_arithmetic", SUMS_2DIGIT),
        _starter_task("sums_2to3", "basic_arithmetic", SUMS_2TO3),
        # the same problems asked for a short answer (the lag study's rounds 3 and 4)
        _starter_task("sums_2digit_brief", "basic_arithmetic", SUMS_2DIGIT, template=BRIEF_TEMPLATE),
        _starter_task("sums_2to3_brief", "basic_arithmetic", SUMS_2TO3, template=BRIEF_TEMPLATE),
        _starter_task("chain_sums_brief", "chain_sum", CHAIN_SUMS, template=BRIEF_TEMPLATE),
        _starter_task("countdown3", "countdown", STARTER_COUNTDOWN.config(), template=COUNTDOWN_TEMPLATE,
                      reward_source="countdown"),
    ]
}


def get_dataset(name: str) -> DatasetSpec:
    try:
        return DATASETS[name]
    except KeyError:
        raise ValueError(f"unknown dataset {name!r}; known datasets: {', '.join(DATASETS)}") from None


def check_split(task: DatasetSpec, split: str) -> None:
    if split not in task.splits:
        raise ValueError(f"task {task.name!r} has no split {split!r}; its splits: {', '.join(task.splits)}")
