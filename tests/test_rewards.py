"""Rewards: GSM8K, math-verify in worker processes, Countdown, and their behaviour on hostile input."""

import functools
import json
import os
import random
import signal
import string
from collections import Counter

import numpy as np
import pytest
import torch
from scaling import LINEAR_GROWTH, growth_at_8n

from vcpo.data import load_rows
from vcpo.rewards import ANSWER_FORMATS, REASONS, compute_score, countdown_ground_truth, reward_stats, score_batch
from vcpo.rewards.adversarial import ADVERSARIAL_KINDS, MEGABYTE_FILLERS, adversarial_answers
from vcpo.rewards.math_workers import MathVerifyPool
from vcpo.rewards.scoring import _IN_PROCESS_SCORERS

RESULT_KEYS = {"score", "acc", "reason", "truncated"}


def reason(data_source, solution, ground_truth, **options):
    result = compute_score(data_source, solution, ground_truth, **options)
    assert set(result) == RESULT_KEYS and result["reason"] in REASONS
    assert result["score"] == (1.0 if result["reason"] == "correct" else 0.0) and result["acc"] == (
        result["score"] == 1.0
    )
    return result["reason"]


@pytest.mark.parametrize(
    "solution, gold, expected",
    [
        ("She makes 9 * 2 = $18.\n#### 18", "18", "correct"),
        ("#### 1,000.", "1000", "correct"),
        ("#### $18.00", "18", "correct"),
        ("####18 dollars", "18", "correct"),
        ("#### -3", "-3", "correct"),
        ("first #### 5, then corrected: #### 18", "18", "correct"),
        ("#### 18", "2,125", "wrong"),
        ("#### 2125", "2,125", "correct"),
        ("#### 17", "18", "wrong"),
        ("The answer is 18.", "18", "no_answer"),
        ("#### eighteen", "18", "invalid"),
        ("", "18", "no_answer"),
    ],
)
def test_gsm8k_requires_the_hash_format(solution, gold, expected):
    assert reason("gsm8k", solution, gold) == expected


@pytest.mark.parametrize(
    "solution, gold, expected",
    [
        (r"so $\boxed{\frac12}$", r"\frac{1}{2}", "correct"),
        (r"so $\boxed{0.5}$", r"\frac{1}{2}", "correct"),
        (r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"\left( 3, \frac{\pi}{2} \right)", "correct"),
        (r"\boxed{25}", "25", "correct"),
        (r"\boxed{26}", "25", "wrong"),
        ("I do not know.", "25", "no_answer"),
        (r"\boxed{9^{9^{9^9}}}", "25", "invalid"),  # 370-million-digit exponent: refused, not computed
        ("\\boxed{" + "{" * 100 + "1" + "}" * 100 + "}", "1", "invalid"),  # nesting beyond any real answer
    ],
)
def test_math_answers(solution, gold, expected):
    assert reason("aime24", solution, gold) == expected


def test_long_outputs_keep_their_tail_and_say_so():
    result = compute_score("math500", "x" * 1_000_000 + r" so \boxed{42}", "42")
    assert result == {"score": 1.0, "acc": True, "reason": "correct", "truncated": True}
    assert compute_score("math500", r"\boxed{42}", "42")["truncated"] is False


def test_unknown_data_source_and_bad_ground_truth_are_errors():
    with pytest.raises(ValueError, match="no reward for data_source 'openai/gsm9k'"):
        compute_score("openai/gsm9k", "#### 1", "1")
    with pytest.raises(ValueError, match="GSM8K ground_truth must be a number"):
        compute_score("gsm8k", "#### 1", "one")
    with pytest.raises(ValueError, match="countdown ground_truth"):
        compute_score("countdown", "<answer>1</answer>", '{"numbers": [1]}')


def test_score_batch_keeps_order_and_checks_lengths():
    results = score_batch(
        ["gsm8k", "aime24", "countdown", "aime24"],
        ["#### 3", r"\boxed{7}", "<answer>1 + 2</answer>", r"\boxed{8}"],
        ["3", "7", countdown_ground_truth([1, 2], 3), "7"],
        workers=2,
    )
    assert [result["reason"] for result in results] == ["correct", "correct", "correct", "wrong"]
    with pytest.raises(ValueError, match="solutions has 1 items, data_sources has 2"):
        score_batch(["gsm8k", "gsm8k"], ["#### 1"], ["1", "1"])


# ---- answer formats: strict (the prompt's format only) and lenient ------------------------------


@pytest.mark.parametrize(
    "data_source, solution, gold, strict, lenient",
    [
        # math: strict reads only the last complete box; lenient is math-verify's own extraction.
        ("aime25", "The answer is 25.", "25", "no_answer", "correct"),
        ("aime25", "so $25$", "25", "no_answer", "correct"),
        ("math500", r"\boxed{25}", "25", "correct", "correct"),
        ("math500", r"\boxed{24}, no wait: 25", "25", "wrong", "wrong"),  # the box still wins
        ("math500", r"\boxed{25} and then \boxed{26", "25", "correct", "correct"),  # unclosed box skipped
        ("math500", r"\boxed{x = 25} then 7", "25", "correct", "correct"),
        ("dapo_math", r"first 25, finally \boxed{7}", "25", "wrong", "wrong"),
        ("amc23", "I do not know.", "25", "no_answer", "no_answer"),
        # gsm8k: strict reads only the number after the last ####; lenient falls back to the last number.
        ("gsm8k", "She has 1,000 apples.", "1000", "no_answer", "correct"),
        ("gsm8k", "#### 18", "18", "correct", "correct"),
        ("gsm8k", "It is 18. #### 17", "18", "wrong", "wrong"),  # a #### number is never overridden
        ("gsm8k", "#### eighteen, that is 18", "18", "invalid", "correct"),
        ("gsm8k", "Numbers 1,2,3", "123", "no_answer", "wrong"),  # 1,2,3 is three numbers
        ("gsm8k", "no numbers at all", "18", "no_answer", "no_answer"),
        # countdown: strict reads the last tag or box; lenient falls back to the last arithmetic line.
        ("countdown", "3 + 4", "3 4 7", "no_answer", "correct"),
        ("countdown", "Try:\n(3 + 4)\nwhich gives 7.", "3 4 7", "no_answer", "correct"),
        ("countdown", "4 + 3\nno, 3 * 4\nthat is 12", "3 4 7", "no_answer", "correct"),  # 3 * 4 is not a line
        ("countdown", "3 * 4", "3 4 7", "no_answer", "wrong"),
        ("countdown", "<answer>3 + 4</answer>", "3 4 7", "correct", "correct"),
        ("countdown", "<answer>1</answer>\n3 + 4", "3 4 7", "invalid", "invalid"),  # a tag is never overridden
        ("countdown", "<answer></answer>\n3 + 4", "3 4 7", "no_answer", "correct"),
        ("countdown", "3 + 4 = 7", "3 4 7", "no_answer", "no_answer"),  # "= 7" is not arithmetic
        ("countdown", "__import__('os').system('true')\n7", "3 4 7", "no_answer", "invalid"),
    ],
)
def test_strict_and_lenient_answer_formats(data_source, solution, gold, strict, lenient):
    if data_source == "countdown":
        *numbers, target = map(int, gold.split())
        gold = countdown_ground_truth(numbers, target)
    assert reason(data_source, solution, gold) == strict  # strict is the default
    assert reason(data_source, solution, gold, answer_format="strict") == strict
    assert reason(data_source, solution, gold, answer_format="lenient") == lenient
    [batch_strict], [batch_lenient] = (
        score_batch([data_source], [solution], [gold], answer_format=answer_format) for answer_format in ANSWER_FORMATS
    )
    assert (batch_strict["reason"], batch_lenient["reason"]) == (strict, lenient)


def test_unknown_answer_format_is_an_error():
    assert ANSWER_FORMATS == ("strict", "lenient")
    for call in (
        lambda: compute_score("gsm8k", "#### 1", "1", answer_format="loose"),
        lambda: score_batch(["gsm8k"], ["#### 1"], ["1"], answer_format="loose"),
    ):
        with pytest.raises(ValueError, match=r"unknown answer_format 'loose'; allowed: strict, lenient"):
            call()


# Digits, letters, punctuation (which holds \ { } # < > $ and the operators) and spaces.
RANDOM_ALPHABET = string.digits + string.ascii_letters + string.punctuation + " "


def random_texts(count, seed, *, max_line_chars=200, max_lines=1):
    """``count`` seeded random texts of 1 to ``max_lines`` lines of 0 to ``max_line_chars`` characters."""
    rng = random.Random(seed)
    return [
        "\n".join(
            "".join(rng.choice(RANDOM_ALPHABET) for _ in range(rng.randint(0, max_line_chars)))
            for _ in range(rng.randint(1, max_lines))
        )
        for _ in range(count)
    ]


def correct_counts(data_sources, texts, golds, lenient_limit=None):
    """Correct answers under each format; lenient reads only the first ``lenient_limit`` texts."""
    counts = {}
    for answer_format in ANSWER_FORMATS:
        limit = lenient_limit if answer_format == "lenient" else None
        results = score_batch(
            data_sources[:limit], texts[:limit], golds[:limit], answer_format=answer_format, workers=2
        )
        counts[answer_format] = sum(result["reason"] == "correct" for result in results)
        assert all(result["score"] == 0.0 or result["reason"] == "correct" for result in results)
    return counts


RANDOM_TEXT_COUNT = 2000


def test_random_text_never_scores_under_strict_but_does_under_lenient():
    """An untrained model's output is close to random text: only the lenient formats credit it.

    AIME-style integer golds 0..9 and 25 (single digits are where a random last number hits most often).
    Lenient math runs math-verify on every text (a few ms each), so it reads only the first 500.
    """
    texts = random_texts(RANDOM_TEXT_COUNT, seed=0)
    golds = [str(index % 11) if index % 11 < 10 else "25" for index in range(len(texts))]
    counts = {
        "math": correct_counts(["aime25"] * len(texts), texts, golds, lenient_limit=500),
        "gsm8k": correct_counts(["gsm8k"] * len(texts), texts, golds),
    }
    # Countdown: the lenient fallback reads whole lines, so the random text here has short lines;
    # one-number puzzles ("7" alone makes 7) are the ones random lines can solve.
    lines = random_texts(RANDOM_TEXT_COUNT, seed=1, max_line_chars=4, max_lines=40)
    puzzles = [countdown_ground_truth([index % 10], index % 10) for index in range(len(lines))]
    counts["countdown"] = correct_counts(["countdown"] * len(lines), lines, puzzles)
    print(f"correct answers among {RANDOM_TEXT_COUNT} random texts (lenient math: 500): {counts}")
    for kind, count in counts.items():
        assert count["strict"] == 0, kind
        assert count["lenient"] > count["strict"], kind


# ---- Countdown ----------------------------------------------------------------------------------

PUZZLE = countdown_ground_truth([36, 29, 95, 32, 4, 15], 139)


@pytest.mark.parametrize(
    "solution, expected",
    [
        ("<answer>15 - 4 + 95 + 36 - 32 + 29</answer>", "correct"),
        (r"\boxed{(15 - 4) + 95 + 36 - 32 + 29}", "correct"),
        ("<answer>15 - 4 + 95 + 36 - 32 + 29</answer> oops <answer>1</answer>", "invalid"),  # the last tag counts
        (r"<answer>0</answer> ... \boxed{15 - 4 + 95 + 36 - 32 + 29}", "correct"),  # a later box wins
        ("<answer>15 - 4 + 95 + 36 - 32 - 29</answer>", "wrong"),
        ("<answer>15 - 4 + 95 + 36 - 32</answer>", "invalid"),  # 29 missing
        ("<answer>15 - 4 + 95 + 36 - 32 + 29 + 29 - 29</answer>", "invalid"),  # 29 used three times
        ("<answer>15 − 4 + 95 + 36 − 32 + 29</answer>", "invalid"),  # U+2212 minus is not ASCII
        ("<answer>-4 + 15 + 95 + 36 - 32 + 29</answer>", "correct"),  # a leading minus is allowed
        ("<answer>-(4 - 15) + 95 + 36 - 32 + 29</answer>", "correct"),
        ("<answer>+15 - 4 + 95 + 36 - 32 + 29</answer>", "invalid"),  # unary plus is not
        ("<answer>15 - 4 + 95 + 36 - 32 + 29 = 139</answer>", "invalid"),
        ("<answer>9**9**9</answer>", "invalid"),
        ("<answer>__import__('os').system('true')</answer>", "invalid"),
        ("<answer></answer>", "no_answer"),
        ("", "no_answer"),
        ("１５ - ４ + ９５ + ３６ - ３２ + ２９", "no_answer"),
        ("<answer>１５ - ４ + ９５ + ３６ - ３２ + ２９</answer>", "invalid"),  # full-width digits
        ("<answer>" + "(" * 2000 + "15" + ")" * 2000 + "</answer>", "invalid"),  # over the length cap
    ],
)
def test_countdown_rules_and_rejections(solution, expected):
    assert reason("countdown", solution, PUZZLE) == expected


def test_a_hostile_countdown_answer_is_never_evaluated_nor_parsed_past_the_length_cap(monkeypatch):
    """What keeps every answer cheap: a power tower is refused before anything computes it, an answer over the
    length cap before the parser sees it, code before both."""
    from vcpo.rewards import countdown

    parsed, evaluated = [], []
    parse, evaluate = countdown.ast.parse, countdown._evaluate
    monkeypatch.setattr(countdown.ast, "parse", lambda source, *args, **kwargs: parsed.append(source) or parse(source, *args, **kwargs))
    monkeypatch.setattr(countdown, "_evaluate", lambda node: evaluated.append(node) or evaluate(node))
    assert reason("countdown", "<answer>9**9**9</answer>", PUZZLE) == "invalid"
    assert parsed == ["9**9**9"] and evaluated == []
    too_long = "(" * 2000 + "15" + ")" * 2000
    assert reason("countdown", f"<answer>{too_long}</answer>", PUZZLE) == "invalid"
    assert reason("countdown", "<answer>__import__('os').system('true')</answer>", PUZZLE) == "invalid"
    assert parsed == ["9**9**9"] and evaluated == []
    assert reason("countdown", "<answer>15 - 4 + 95 + 36 - 32 + 29</answer>", PUZZLE) == "correct"
    assert len(parsed) == 2 and evaluated  # the counting sees an answer that is read


def test_countdown_operator_spellings_and_exact_fractions():
    puzzle = countdown_ground_truth([6, 4, 3, 2], 10)
    assert reason("countdown", r"\boxed{6 \times 4 \div 3 + 2}", puzzle) == "correct"
    assert reason("countdown", "<answer>6 × 4 ÷ 3 + 2</answer>", puzzle) == "correct"
    assert reason("countdown", "<answer>(6 / 4) * (2 + 3) + 2.5</answer>", puzzle) == "invalid"  # no decimals
    assert (
        reason("countdown", "<answer>6 / (4 - 2 * 2) + 3</answer>", countdown_ground_truth([6, 4, 2, 2, 3], 3))
        == "invalid"
    )
    # 1/3 + 2/3 is exactly 1 over fractions; floats would give 0.9999999999999999.
    assert reason("countdown", "<answer>1 / 3 + 2 / 3</answer>", countdown_ground_truth([1, 3, 2, 3], 1)) == "correct"


def test_countdown_oracle_expressions_score_one_and_shuffled_targets_zero():
    rows = load_rows("countdown", "validation", size=100)
    oracles = [row["extra_info"]["answer"] for row in rows]
    golds = [row["reward_model"]["ground_truth"] for row in rows]
    assert [
        reason("countdown", f"<answer>{oracle}</answer>", gold) for oracle, gold in zip(oracles, golds, strict=True)
    ] == ["correct"] * len(rows)
    # Each oracle against the next puzzle: other numbers, so never correct.
    shifted = [
        reason("countdown", f"<answer>{oracle}</answer>", gold)
        for oracle, gold in zip(oracles, golds[1:] + golds[:1], strict=True)
    ]
    assert "correct" not in shifted


# ---- gold answers of the real benchmarks --------------------------------------------------------


def gold_solutions(benchmark, rows):
    """What a perfect model would write: GSM8K's own reference solution, else the gold in \\boxed{}."""
    if benchmark == "gsm8k":
        return [row["extra_info"]["answer"] for row in rows]
    return [f"The final answer is $\\boxed{{{row['reward_model']['ground_truth']}}}$." for row in rows]


def derangement(count, seed=0):
    rng = random.Random(seed)
    order = list(range(count))
    while any(index == target for index, target in enumerate(order)):
        rng.shuffle(order)
    return order


# Deranged pairs that still score 1 although their gold strings differ, each checked by hand: the
# seed-0 derangement of the full MATH test set pairs these equal answers.
EQUIVALENT_GOLDS = {frozenset({"9", r"9 \text{ multiples}"})}  # math-verify ignores the unit text


@pytest.mark.parametrize(
    "benchmark", ["gsm8k", "math500", "aime24", "aime25", "amc23", pytest.param("math", marks=pytest.mark.slow)]
)
def test_every_gold_answer_scores_one_and_a_deranged_gold_zero(benchmark, benchmark_data):
    rows = load_rows(benchmark, "test", source=benchmark_data.file(benchmark))
    golds = [row["reward_model"]["ground_truth"] for row in rows]
    solutions = gold_solutions(benchmark, rows)
    sources = [benchmark] * len(rows)

    results = score_batch(sources, solutions, golds, workers=2)
    assert [index for index, result in enumerate(results) if result["score"] != 1.0] == []

    order = derangement(len(rows))
    results = score_batch(sources, [solutions[target] for target in order], golds, workers=2)
    nonzero = {index for index, result in enumerate(results) if result["score"] != 0.0}
    # Only duplicate answers may score: two problems whose golds are the same value.
    same_gold = {
        index
        for index, target in enumerate(order)
        if golds[index] == golds[target] or frozenset({golds[index], golds[target]}) in EQUIVALENT_GOLDS
    }
    assert nonzero == same_gold


# ---- worker processes: timeouts, crashes, hostile input -----------------------------------------


@pytest.mark.timeout(300)  # a guard against a hang only: the stopped worker would keep the pool waiting
def test_a_timed_out_answer_is_counted_and_the_worker_replaced():
    pool = MathVerifyPool(1)
    try:
        # The first answer waits for the worker's imports (seconds on a fresh virtualenv).
        assert pool.judge(r"\boxed{1}", "1", timeout_s=30) == "correct"
        (worker,) = pool._workers
        os.kill(worker._process.pid, signal.SIGSTOP)  # its answer never comes: only the pool's limit ends the wait
        assert pool.judge(r"\boxed{1}", "1", timeout_s=0.05) == "timeout"
        assert pool.stats()["timeouts"] == 1
        assert pool.judge(r"\boxed{2}", "2", timeout_s=30) == "correct"
        assert pool.stats() == {"timeouts": 1, "worker_errors": 0, "workers_started": 2}
    finally:
        pool.close()


def test_a_crashed_worker_gives_error_and_is_replaced():
    pool = MathVerifyPool(1)
    try:
        assert pool.judge(r"\boxed{2}", "2", timeout_s=30) == "correct"
        (worker,) = pool._workers
        worker._process.kill()
        worker._process.wait()
        assert pool.judge(r"\boxed{2}", "2", timeout_s=30) == "error"
        assert pool.judge(r"\boxed{2}", "2", timeout_s=30) == "correct"
        assert pool.stats()["worker_errors"] == 1
    finally:
        pool.close()


def test_shared_pool_reports_timeouts_from_compute_score():
    before = reward_stats()["timeouts"]
    slow = r"\boxed{" + "{" * 11 + "1" + "}" * 11 + "}"
    assert compute_score("math500", slow, "1", timeout_s=0.05)["reason"] == "timeout"
    assert reward_stats()["timeouts"] == before + 1


def score_adversarial(count, timeout_s, answer_format):
    """Each reward's results on ``count`` hostile answers, after checking that none scores: math answers are each
    bounded by ``timeout_s`` (the pool's limit, tested above), the in-process rewards by their linear cost (below)."""
    answers = [answer for _, answer in adversarial_answers(count, seed=7)]
    results = {}
    for data_source, gold in [("aime24", "25"), ("gsm8k", "25"), ("countdown", countdown_ground_truth([25, 1], 25))]:
        results[data_source] = batch = score_batch(
            [data_source] * count, answers, [gold] * count, timeout_s=timeout_s, answer_format=answer_format, workers=2
        )
        # Lenient GSM8K and Countdown may credit a stray number or line (a power tower's base of 25).
        if answer_format == "strict" or data_source == "aime24":
            assert all(result["score"] == 0.0 for result in batch), data_source
        assert all(result["reason"] in REASONS for result in batch)
    print(f"math-verify on adversarial answers: {Counter(result['reason'] for result in results['aime24'])}")
    return results


@pytest.mark.parametrize("answer_format", ANSWER_FORMATS)
def test_adversarial_answers_are_scored_zero(answer_format):
    score_adversarial(4 * len(ADVERSARIAL_KINDS), timeout_s=2.0, answer_format=answer_format)


@pytest.mark.slow
def test_a_thousand_adversarial_answers_are_scored_zero():
    """At scale in the strict format; the lenient one reads the same answers in the fast test above."""
    before = reward_stats()["timeouts"]
    results = score_adversarial(1000, timeout_s=5.0, answer_format="strict")
    timed_out = sum(result["reason"] == "timeout" for result in results["aime24"])
    assert reward_stats()["timeouts"] - before == timed_out


@pytest.mark.parametrize("filler", MEGABYTE_FILLERS)
@pytest.mark.parametrize("answer_format", ANSWER_FORMATS)
@pytest.mark.parametrize("data_source", ["gsm8k", "countdown"])
def test_an_in_process_reward_reads_a_hostile_answer_in_linear_time(data_source, answer_format, filler):
    """A megabyte answer's filler: eight times the text costs about eight times the work (a backtracking pattern
    or a rescan per line would cost 64 times)."""
    score = _IN_PROCESS_SCORERS[data_source]
    gold = "25" if data_source == "gsm8k" else countdown_ground_truth([25, 1], 25)

    def scoring(chars):
        return functools.partial(score, filler * (chars // len(filler)) + r"\boxed{7}", gold, answer_format)

    assert growth_at_8n(scoring, 50_000) < LINEAR_GROWTH


# ---- verl integration ---------------------------------------------------------------------------


class CharTokenizer:
    """Just enough of a tokenizer for verl's reward manager: one token per character."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(int(token)) for token in ids)


def as_tokens(texts, width):
    ids = torch.zeros(len(texts), width, dtype=torch.long)
    mask = torch.zeros(len(texts), width, dtype=torch.long)
    for row, text in enumerate(texts):
        ids[row, : len(text)] = torch.tensor([ord(char) for char in text])
        mask[row, : len(text)] = 1
    return ids, mask


def test_plugs_into_verl_as_custom_reward_function():
    from omegaconf import OmegaConf
    from verl import DataProto
    from verl.trainer.ppo.reward import get_custom_reward_fn
    from verl.workers.reward_manager.naive import NaiveRewardManager

    config = OmegaConf.create(
        {
            "reward": {
                "custom_reward_function": {
                    "path": "pkg://vcpo.rewards",
                    "name": "compute_score",
                    "reward_kwargs": {"timeout_s": 10},
                }
            }
        }
    )
    reward_fn = get_custom_reward_fn(config)
    responses = ["#### 18", r"so \boxed{5}", "<answer>2 * 3</answer>"]
    prompts, prompt_mask = as_tokens(["q"] * 3, 4)
    response_ids, response_mask = as_tokens(responses, 32)
    batch = DataProto.from_dict(
        tensors={
            "prompts": prompts,
            "responses": response_ids,
            "attention_mask": torch.cat([prompt_mask, response_mask], 1),
        },
        non_tensors={
            "data_source": np.array(["gsm8k", "aime24", "countdown"], dtype=object),
            "reward_model": np.array(
                [{"ground_truth": "18"}, {"ground_truth": "4"}, {"ground_truth": countdown_ground_truth([3, 2], 6)}],
                dtype=object,
            ),
            "extra_info": np.array([{}, {}, {}], dtype=object),
        },
    )
    output = NaiveRewardManager(CharTokenizer(), num_examine=0, compute_score=reward_fn)(batch, return_dict=True)
    last_token = [len(text) - 1 for text in responses]
    assert output["reward_tensor"][range(3), last_token].tolist() == [1.0, 0.0, 1.0]
    assert output["reward_tensor"].sum().item() == 2.0
    assert output["reward_extra_info"]["reason"] == ["correct", "wrong", "correct"]
    assert {key: len(values) for key, values in output["reward_extra_info"].items()} == {key: 3 for key in RESULT_KEYS}


@pytest.mark.parametrize("answer_format, expected", [("strict", [0.0, 0.0, 0.0]), ("lenient", [1.0, 1.0, 1.0])])
def test_answer_format_passes_through_verl_reward_kwargs(answer_format, expected):
    from omegaconf import OmegaConf
    from verl.trainer.ppo.reward import get_custom_reward_fn

    config = OmegaConf.create(
        {
            "reward": {
                "custom_reward_function": {
                    "path": "pkg://vcpo.rewards",
                    "name": "compute_score",
                    "reward_kwargs": {"answer_format": answer_format},
                }
            }
        }
    )
    reward_fn = get_custom_reward_fn(config)
    cases = [
        ("gsm8k", "so it is 18", "18"),
        ("aime24", "so it is 4", "4"),
        ("countdown", "so:\n2 * 3", countdown_ground_truth([3, 2], 6)),
    ]
    scores = [
        reward_fn(data_source=source, solution_str=text, ground_truth=gold, extra_info={})["score"]
        for source, text, gold in cases
    ]
    assert scores == expected


def test_results_are_json_serialisable():
    result = compute_score("countdown", "<answer>2 * 3</answer>", {"numbers": [2, 3], "target": 6})
    assert json.loads(json.dumps(result)) == result


@pytest.mark.parametrize(
    ("data_source", "solution", "gold", "ended", "expected"),
    [
        # a cut response's last number is wherever the cut fell: no answer under lenient
        ("gsm8k", "She buys 4 bolts.\n3. Now, we know that half", "3", False, "no_answer"),
        ("gsm8k", "She buys 4 bolts.\n3. Now, we know that half", "3", True, "correct"),
        ("gsm8k", "She buys 4 bolts.\n3. Now, we know that half", "3", None, "correct"),  # caller did not say: as before
        ("gsm8k", "4 + 5 = 9\n#### 9\nAnd then we", "9", False, "correct"),  # a marked answer counts, cut or not
        ("math", "so the value is 12 and then", "12", False, "no_answer"),
        ("math", "the answer is \\boxed{12} and then", "12", False, "correct"),
        ("countdown", "3 + 4", "3 4 7", False, "no_answer"),
        ("countdown", "3 + 4", "3 4 7", True, "correct"),
    ],
)
def test_lenient_reads_a_response_cut_at_the_length_limit_strictly(data_source, solution, gold, ended, expected):
    """extra_info's response_ended False (the response did not end with its end-of-sequence token) takes away the
    lenient fallback, in compute_score (verl) and score_batch (evaluation) alike; strict is unchanged."""
    from vcpo.rewards import RESPONSE_ENDED

    if data_source == "countdown":
        *numbers, target = map(int, gold.split())
        gold = countdown_ground_truth(numbers, target)
    info = {} if ended is None else {RESPONSE_ENDED: ended}
    assert compute_score(data_source, solution, gold, dict(info), answer_format="lenient")["reason"] == expected
    [batch] = score_batch([data_source], [solution], [gold], [dict(info)], answer_format="lenient")
    assert batch["reason"] == expected
    strict = compute_score(data_source, solution, gold, dict(info))["reason"]
    assert strict == compute_score(data_source, solution, gold)["reason"]
