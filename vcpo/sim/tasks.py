"""Tasks a tiny model can learn: short single-turn problems generated offline with Reasoning Gym.

Each :class:`SimTask` names a Reasoning Gym generator and its configuration, a short prompt and
solution template, and the ``vcpo.rewards`` rule that scores answers (``data_source``). Problems are
generated from index 0 upwards with the task's seed; a problem is identified by its key (Countdown:
the numbers as a multiset and the target; arithmetic: the expression), duplicates are skipped, the
first ``validation_size`` distinct problems form the validation split and the next ``train_size``
the train split, so the two never share a problem and the validation split does not change with
``train_size``. Generated splits are kept in-process and in ``<cache_dir>/sim-tasks/`` (Countdown's
generator goes through sympy: 5,000 puzzles take about 20 s on one core).

Prompts are short on purpose: every rollout pays for the prompt, and a tiny model reads a short
instruction as easily as a long one. With the 512-token tokenizer that ``vcpo.sim.base`` trains on
the task's own text (digits one token each, as Qwen2 splits them), a rendered prompt, chat markup
included, takes 31-36 tokens (Countdown) or 23-27 (arithmetic), under ``max_prompt_tokens`` = 40.

``countdown``: Reasoning Gym ``countdown`` with 3 numbers in 1..20 and a target in 1..50 (``SIM_COUNTDOWN``), all four
operators; the SFT solution is Reasoning Gym's own expression in ``<answer>`` tags (scored by the
Countdown rule: every number once, value equal to the target). Why this size: with 3 numbers the
expression has 2 operators and a handful of orders, so a policy that has learnt the format finds
the target by sampling often enough for a reward signal from the first step, and what remains to
learn is the choice of operators and order, which RL improves (a choice among a few plausible
candidates, the kind of decision policy gradients move quickly). The ranges are the smallest with
enough distinct puzzles (3 numbers in 1..12 with targets up to 40 give only 3,279; these give 11,693).

``arithmetic``: Reasoning Gym ``chain_sum``, 4-5 single-digit terms joined by + and -, answer after
``####`` (GSM8K rule, data_source ``gsm8k``). Every SFT solution is correct and in that format, in
one of two styles drawn per problem with equal odds: the running sums (``7-9=-2, -2+3=1, 1+0=1 ####
1``) or the bare answer (``#### 1``). A tiny model computes single-digit steps well and the whole sum
in one go badly, so RL has something to learn: to work the sum out, and to get the steps right. With the
running sums alone the remaining errors are slips in confident steps, which a policy gradient corrects slowly.

``arithmetic_long``: the same generator with 9-10 terms and the running sums only, so every response
works the sum out over 8-9 steps, about 5x Countdown's response length at the same per-token difficulty:
the long-response task of the stability map (the sequence log-ratio sums over ~5x more tokens).

``tir``: tool-integrated reasoning, the smoke-scale stand-in of SimpleTIR (``paper_task``: its ρ_on and
turn budget come from ``recipes/tasks/simpletir.yaml``). Reasoning Gym ``products``, two factors of 2-3
digits, answer after ``####``: a product of that size is beyond a tiny model's head, and a one-line
program computes it. The model runs Python by writing ``<code>...</code>``; the rollout stops there, runs
the program in the sandbox and appends its output as ``<output>...</output>`` (``vcpo.sim.rollout``).
SFT solutions come in four styles, drawn per problem: the program, its output and the answer (2 in 8);
a program that forgets to print (its output is empty), then the corrected one (1 in 8); a program with
an unclosed parenthesis (the sandbox's ``SyntaxError`` line), then the corrected one (1 in 8); the bare
answer (4 in 8), which a tiny model cannot compute. The tool outputs written in the solutions are what
the sandbox returns for those programs (tested). What RL can learn here: to call the tool instead of
guessing, to retry after a failed program, and to copy the digits right.

What each task's SFT base reaches, and what a synchronous run adds to it, is measured in docs/simulator.md
("Tasks and SFT bases").
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import random
from dataclasses import asdict, dataclass
from typing import Any

from vcpo.data.countdown import SIM_COUNTDOWN, puzzle_key
from vcpo.data.draws import reasoning_gym_draws
from vcpo.locks import cache_dir, cache_entry_lock, write_atomic
from vcpo.recipes import load_tasks
from vcpo.rewards import REWARD_BY_DATA_SOURCE, countdown_ground_truth

SPLITS = ("train", "validation", "test")
# Bump when the way problems are built from Reasoning Gym entries changes: it names the disk cache.
PROBLEM_FORMAT_VERSION = 1
# Draws allowed per distinct problem before a configuration is declared too small for its sizes.
_MAX_DRAWS_PER_PROBLEM = 3


@dataclass(frozen=True)
class Problem:
    prompt: str  # the user message (plain text; the chat template is applied by render_prompt)
    ground_truth: str  # what vcpo.rewards.compute_score(data_source, ...) expects for this task
    solution: str  # a correct assistant response for SFT, in the exact answer format the prompt asks for


@dataclass(frozen=True)
class SimTask:
    name: str
    data_source: str  # key of vcpo.rewards.REWARD_BY_DATA_SOURCE
    description: str
    generator: str  # Reasoning Gym dataset name
    generator_config: tuple[tuple[str, Any], ...]  # its configuration, as (field, value) pairs (hashable)
    prompt_template: str  # str.format fields: those of the generator's builder in _FIELDS
    # One is drawn per problem (seeded, so each problem always has the same solution); all answer in
    # the format the prompt asks for.
    solution_templates: tuple[str, ...]
    train_size: int = 5000
    validation_size: int = 200
    # Problems drawn after the train split for final evaluations whose sampling noise must be small
    # (recipes/sim/evidence.md); not in settings(): the other splits do not depend on it.
    test_size: int = 1000
    seed: int = 0
    max_prompt_tokens: int = 40  # budget of a rendered prompt, chat markup included (checked by the tests)
    max_response_tokens: int = 48  # generation budget of a response (rollouts and evaluation, unless a run sets another)
    # The paper task (recipes/tasks) this one stands for where its settings apply at smoke scale: a
    # multi-turn paper task gives the tool-call budget (max_turns) and the ESS rule's rho_on.
    paper_task: str | None = None

    def __post_init__(self) -> None:
        if self.data_source not in REWARD_BY_DATA_SOURCE:
            raise ValueError(f"task {self.name!r}: no reward for data_source {self.data_source!r}")
        if self.generator not in _FIELDS:
            raise ValueError(f"task {self.name!r}: no problem builder for generator {self.generator!r}")
        if self.train_size < 1 or self.validation_size < 1 or self.test_size < 1:
            raise ValueError(f"task {self.name!r}: train_size, validation_size and test_size must be >= 1")

    @property
    def config(self) -> dict[str, Any]:
        """The Reasoning Gym configuration (keyword arguments of ``create_dataset``)."""
        return dict(self.generator_config)

    def settings(self) -> dict[str, Any]:
        """Everything that determines the problems, for cache keys (not the description or token budget)."""
        import reasoning_gym

        settings = asdict(self)
        del settings["description"], settings["max_prompt_tokens"], settings["max_response_tokens"], settings["paper_task"]
        del settings["test_size"]
        settings["generator_config"] = self.config
        settings["format_version"] = PROBLEM_FORMAT_VERSION
        settings["reasoning_gym"] = reasoning_gym.__version__
        return settings

    @property
    def paper_settings(self) -> dict[str, Any]:
        """The ``paper`` block of the recipe of ``paper_task`` (empty without one)."""
        return load_tasks()[self.paper_task].paper if self.paper_task else {}

    @property
    def max_turns(self) -> int:
        """Tool calls allowed per response by default: the paper task's turn budget, 0 (single-turn) without one."""
        return int(self.paper_settings.get("max_turns", 0))

    def problems(self, split: str) -> list[Problem]:
        """The problems of ``split`` ("train", "validation" or "test"); deterministic, generated once per process."""
        if split not in SPLITS:
            raise ValueError(f"task {self.name!r} has no split {split!r}; its splits: {', '.join(SPLITS)}")
        if split == "test":
            return list(_test_split(self))
        train, validation = _splits(self)
        return list(train if split == "train" else validation)


def _countdown_fields(entry: dict[str, Any]) -> tuple[Any, dict[str, Any], str]:
    numbers, target = entry["metadata"]["numbers"], entry["metadata"]["target"]
    fields = {"numbers": ", ".join(map(str, numbers)), "target": target, "answer": entry["answer"]}
    return puzzle_key(entry), fields, countdown_ground_truth(numbers, target)


def _chain_sum_fields(entry: dict[str, Any]) -> tuple[Any, dict[str, Any], str]:
    expression = entry["metadata"]["expression"]
    tokens = expression.split()
    steps, total = [], int(tokens[0])
    for operator, operand in zip(tokens[1::2], tokens[2::2], strict=True):
        new_total = total + int(operand) if operator == "+" else total - int(operand)
        steps.append(f"{total}{operator}{operand}={new_total}")
        total = new_total
    if str(total) != entry["answer"]:
        raise AssertionError(f"chain_sum: {expression} = {entry['answer']}, the steps give {total}")
    fields = {"expression": expression, "steps": ", ".join(steps), "answer": entry["answer"]}
    return expression, fields, entry["answer"]


def _products_fields(entry: dict[str, Any]) -> tuple[Any, dict[str, Any], str]:
    expression = entry["metadata"]["expression"]
    if str(math.prod(int(factor) for factor in expression.split("*"))) != entry["answer"]:
        raise AssertionError(f"products: {expression} = {entry['answer']}?")
    return expression, {"expression": expression, "answer": entry["answer"]}, entry["answer"]


# Reasoning Gym generator -> (key, template fields, ground truth) of one of its entries.
_FIELDS = {"countdown": _countdown_fields, "chain_sum": _chain_sum_fields, "products": _products_fields}
# What the sandbox tool (vcpo.sim.rollout.sandbox_tool) returns for a program with an unclosed "(".
UNCLOSED_PARENTHESIS = "SyntaxError: '(' was never closed"


def _problem_dicts(task: SimTask, test_size: int = 0) -> tuple[list[dict], list[dict], list[dict]]:
    """(train, validation, test): the first distinct problems in generation order, validation first; a
    test split (``test_size`` > 0) takes the ones after the train split, so the other two are unchanged."""
    needed = task.validation_size + task.train_size + test_size
    style = random.Random(task.seed)
    limit = needed * _MAX_DRAWS_PER_PROBLEM
    dataset = reasoning_gym_draws(task.generator, task.config, limit, task.seed)
    build = _FIELDS[task.generator]
    problems: list[dict] = []
    keys: list = []
    seen: set = set()
    for index in range(limit):
        key, fields, ground_truth = build(dataset[index])
        if key in seen:
            continue
        seen.add(key)
        keys.append(key)
        problems.append(
            {
                "prompt": task.prompt_template.format(**fields),
                "ground_truth": ground_truth,
                "solution": style.choice(task.solution_templates).format(**fields),
            }
        )
        if len(problems) == needed:
            break
    else:
        raise ValueError(
            f"task {task.name!r}: Reasoning Gym gave only {len(problems)} distinct problems in {limit} draws, "
            f"{needed} needed; use smaller splits or a wider configuration"
        )
    train_end = task.validation_size + task.train_size
    validation, train, test = problems[: task.validation_size], problems[task.validation_size : train_end], problems[train_end:]
    shared = set(keys[: task.validation_size]) & set(keys[task.validation_size :])
    if shared or {p["prompt"] for p in validation} & {p["prompt"] for p in train}:
        raise AssertionError(f"task {task.name!r}: train and validation share problems")
    return train, validation, test


def _cached_json(path, build) -> dict:
    """``path``'s JSON, else ``build()`` written there atomically (a concurrent reader never sees half a
    file) by one process (a concurrent builder waits, then reads it)."""
    if not path.exists():
        with cache_entry_lock(path):
            if not path.exists():
                write_atomic(path, json.dumps(build()))
    return json.loads(path.read_text())


def _settings_digest(task: SimTask) -> tuple[str, str]:
    settings = json.dumps(task.settings(), sort_keys=True, default=str)
    return settings, hashlib.sha256(settings.encode()).hexdigest()[:12]


@functools.lru_cache(maxsize=16)
def _splits(task: SimTask) -> tuple[tuple[Problem, ...], tuple[Problem, ...]]:
    settings, digest = _settings_digest(task)

    def build() -> dict:
        train, validation, _ = _problem_dicts(task)
        return {"settings": json.loads(settings), "train": train, "validation": validation}

    stored = _cached_json(cache_dir() / "sim-tasks" / f"{task.name}-{task.train_size}-{task.validation_size}-{digest}.json", build)
    train = tuple(Problem(**problem) for problem in stored["train"])
    validation = tuple(Problem(**problem) for problem in stored["validation"])
    if {p.prompt for p in train} & {p.prompt for p in validation}:
        raise AssertionError(f"task {task.name!r}: train and validation share problems")
    return train, validation


@functools.lru_cache(maxsize=16)
def _test_split(task: SimTask) -> tuple[Problem, ...]:
    """The ``test_size`` problems after the train split. Generated in one pass with the other splits,
    which are checked against the cached ones: a generator whose entries depended on the dataset's
    size would otherwise give a test split that overlaps them."""
    settings, digest = _settings_digest(task)

    def build() -> dict:
        train, validation, test = _problem_dicts(task, task.test_size)
        if (tuple(Problem(**p) for p in train), tuple(Problem(**p) for p in validation)) != _splits(task):
            raise AssertionError(f"task {task.name!r}: generating a test split changed the train or validation split")
        return {"settings": json.loads(settings), "test": test}

    name = f"{task.name}-{task.train_size}-{task.validation_size}-test{task.test_size}-{digest}.json"
    test = tuple(Problem(**problem) for problem in _cached_json(cache_dir() / "sim-tasks" / name, build)["test"])
    train, validation = _splits(task)
    if {p.prompt for p in test} & ({p.prompt for p in train} | {p.prompt for p in validation}):
        raise AssertionError(f"task {task.name!r}: the test split shares problems with train or validation ({name})")
    return test


SIM_TASKS: dict[str, SimTask] = {
    task.name: task
    for task in [
        SimTask(
            name="countdown",
            data_source="countdown",
            description=(
                "Reasoning Gym countdown, 3 numbers in 1..20, target 1..50: two operators and an order to choose, "
                "a reward that sampling finds often enough to learn from"
            ),
            generator="countdown",
            generator_config=tuple(SIM_COUNTDOWN.config().items()),
            prompt_template="Use {numbers} once each to make {target}. Answer in <answer></answer>.",
            solution_templates=("<answer>{answer}</answer>",),
        ),
        SimTask(
            name="arithmetic",
            data_source="gsm8k",
            description=(
                "Reasoning Gym chain_sum, 4-5 single-digit terms with + and -, answer after ####; SFT solutions "
                "either work out the running sums (reliable) or state the answer (unreliable): RL learns to work it out"
            ),
            generator="chain_sum",
            generator_config=(("min_terms", 4), ("max_terms", 5), ("min_digits", 1), ("max_digits", 1)),
            prompt_template="{expression} = ? Answer after ####.",
            solution_templates=("{steps} #### {answer}", "#### {answer}"),
        ),
        SimTask(
            name="arithmetic_long",
            data_source="gsm8k",
            description=(
                "Reasoning Gym chain_sum, 9-10 single-digit terms with + and -, every running sum written out, answer "
                "after ####: responses of ~69 tokens (about 5x Countdown's), each step a chance to slip"
            ),
            generator="chain_sum",
            generator_config=(("min_terms", 9), ("max_terms", 10), ("min_digits", 1), ("max_digits", 1)),
            prompt_template="{expression} = ? Answer after ####.",
            solution_templates=("{steps} #### {answer}",),
            max_prompt_tokens=44,
            max_response_tokens=128,
        ),
        SimTask(
            name="tir",
            data_source="gsm8k",
            description=(
                "Reasoning Gym products, two factors of 2-3 digits, answer after ####, with the sandboxed Python tool "
                "(multi-turn, SimpleTIR's budget): the product is computed by a program, not in the head"
            ),
            generator="products",
            generator_config=(("min_terms", 2), ("max_terms", 2), ("min_digits", 2), ("max_digits", 3)),
            prompt_template="{expression} = ? Run Python in <code></code>. Answer after ####.",
            solution_templates=(
                *["<code>print({expression})</code><output>{answer}\n</output> #### {answer}"] * 2,
                "<code>{expression}</code><output></output><code>print({expression})</code><output>{answer}\n</output> #### {answer}",
                f"<code>print({{expression}}</code><output>{UNCLOSED_PARENTHESIS}</output>"
                "<code>print({expression})</code><output>{answer}\n</output> #### {answer}",
                *["#### {answer}"] * 4,
            ),
            max_prompt_tokens=44,
            max_response_tokens=96,
            paper_task="simpletir",
        ),
    ]
}


def get_sim_task(name: str) -> SimTask:
    try:
        return SIM_TASKS[name]
    except KeyError:
        raise ValueError(f"unknown sim task {name!r}; known: {', '.join(sorted(SIM_TASKS))}") from None


def conversation(problem: Problem) -> list[dict[str, str]]:
    return [{"role": "user", "content": problem.prompt}]


def render_prompt(tokenizer, problem: Problem) -> str:
    """The chat-formatted prompt, ending with the assistant turn's opening (add_generation_prompt)."""
    return tokenizer.apply_chat_template(conversation(problem), add_generation_prompt=True, tokenize=False)


def evaluation_rows(task: SimTask, problems: list[Problem]) -> list[dict]:
    """``problems`` as the rows ``vcpo.evaluation`` reads (the layout of ``vcpo.data``'s rows)."""
    return [
        {
            "prompt": conversation(problem),
            "data_source": task.data_source,
            "reward_model": {"ground_truth": problem.ground_truth},
            "extra_info": {"index": index},
        }
        for index, problem in enumerate(problems)
    ]
