"""Evaluation harness: pass@k / mean@n estimators, benchmark definitions, and an end-to-end CLI run."""

import itertools
import json
import math
import os
from fractions import Fraction
from pathlib import Path

import pytest

from vcpo import data
from vcpo.evaluation import (
    Completion,
    SamplingParams,
    benchmark_pass_at_k,
    default_ks,
    evaluate_benchmark,
    load_benchmarks,
    mean_at_n,
    pass_at_k,
)
from vcpo.evaluation.generation import is_hub_id
from vcpo.evaluation.harness import EvaluationInputError

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS_FILE = REPO / "recipes" / "benchmarks.yaml"


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """Fraction of all k-subsets of n samples (the first c correct) that contain a correct sample."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(sample < c for sample in subset) for subset in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 8))
def test_pass_at_k_matches_enumeration_of_all_subsets(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_hand_cases():
    assert pass_at_k(5, 0, 3) == 0.0
    assert pass_at_k(5, 5, 1) == 1.0
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(3, 1, 1) == pytest.approx(1 / 3)  # pass@1 is the plain accuracy


def test_pass_at_k_is_stable_where_binomials_overflow_floats():
    n, c, k = 2000, 37, 500
    exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
    assert math.comb(n, k) > 10**308  # as a float this would be inf
    assert pass_at_k(n, c, k) == pytest.approx(float(exact), rel=1e-12)


@pytest.mark.parametrize("n, c, k", [(3, 4, 1), (3, -1, 1), (3, 1, 0), (3, 1, 4)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k"):
        pass_at_k(n, c, k)


def test_mean_at_n_and_benchmark_pass_at_k():
    correct = [[True, False, False], [True, True, True], [False, False, False]]
    assert mean_at_n(correct) == pytest.approx(4 / 9)
    result = benchmark_pass_at_k(correct, [1, 2, 3])
    assert result[1] == pytest.approx(4 / 9)  # pass@1 equals mean@n
    assert result[2] == pytest.approx((2 / 3 + 1 + 0) / 3)  # 1 - C(2,2)/C(3,2) = 2/3 for one correct of three
    assert result[3] == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        mean_at_n([])


def test_per_problem_means_group_samples_by_problem_in_problem_order():
    from vcpo.evaluation.metrics import per_problem_means

    records = [{"problem_id": 2, "acc": 1}, {"problem_id": 0, "acc": 0}, {"problem_id": 2, "acc": 0},
               {"problem_id": 0, "acc": 1}, {"problem_id": 0, "acc": 1}, {"problem_id": 1, "acc": 0}]
    assert per_problem_means(records, lambda record: record["acc"]) == [2 / 3, 0.0, 0.5]
    # mean@n is their mean when every problem has the same n
    assert per_problem_means([{"problem_id": i // 3, "acc": a} for i, a in enumerate([1, 0, 0, 1, 1, 1])],
                             lambda record: record["acc"]) == [1 / 3, 1.0]


def test_default_ks_are_powers_of_two_and_n():
    assert default_ks(1) == [1]
    assert default_ks(3) == [1, 2, 3]
    assert default_ks(5) == [1, 2, 4, 5]
    assert default_ks(16) == [1, 2, 4, 8, 16]


def test_benchmark_file_carries_the_papers_sampling_defaults():
    benchmarks = {
        b.name: b
        for b in load_benchmarks(BENCHMARKS_FILE, ["gsm8k", "math500", "aime24", "aime25", "amc23", "countdown"])
    }
    assert benchmarks["gsm8k"].sampling == SamplingParams(n=3, temperature=0.8, top_p=0.7, max_new_tokens=2048)
    assert benchmarks["math500"].sampling.n == 3 and benchmarks["math500"].sampling.max_new_tokens == 4096
    assert benchmarks["aime24"].sampling.n == benchmarks["aime25"].sampling.n == 5
    assert (benchmarks["countdown"].task, benchmarks["countdown"].split) == ("countdown", "validation")
    assert (benchmarks["gsm8k"].task, benchmarks["gsm8k"].split) == ("gsm8k", "test")
    assert {benchmark.answer_format for benchmark in benchmarks.values()} == {"strict"}


def test_overrides_replace_benchmark_settings_and_bad_names_are_reported():
    (aime,) = load_benchmarks(BENCHMARKS_FILE, ["aime25"], {"n": 2, "temperature": None, "max_new_tokens": 64})
    assert aime.sampling == SamplingParams(n=2, temperature=0.8, top_p=0.7, max_new_tokens=64)
    with pytest.raises(ValueError, match="gsm9k"):
        load_benchmarks(BENCHMARKS_FILE, ["gsm9k"])
    with pytest.raises(ValueError, match="top_p"):
        load_benchmarks(BENCHMARKS_FILE, ["gsm8k"], {"top_p": 1.5})


def test_answer_format_comes_from_the_definition_or_the_override(tmp_path):
    path = tmp_path / "benchmarks.yaml"
    path.write_text(
        "defaults: {n: 2, temperature: 1.0, top_p: 1.0, max_new_tokens: 8}\n"
        "benchmarks:\n"
        "  plain: {task: gsm8k, split: test}\n"
        "  loose: {task: gsm8k, split: test, answer_format: lenient}\n"
        "  typo: {task: gsm8k, split: test, answer_format: relaxed}\n"
    )
    plain, loose = load_benchmarks(path, ["plain", "loose"])
    assert (plain.answer_format, loose.answer_format) == ("strict", "lenient")
    assert [b.answer_format for b in load_benchmarks(path, ["plain", "loose"], answer_format="strict")] == [
        "strict",
        "strict",
    ]
    with pytest.raises(ValueError, match="unknown answer_format 'relaxed'; allowed: strict, lenient"):
        load_benchmarks(path, ["typo"])
    with pytest.raises(ValueError, match="unknown answer_format 'loose'"):
        load_benchmarks(path, ["plain"], answer_format="loose")


def test_benchmark_definitions_with_unknown_keys_are_rejected(tmp_path):
    path = tmp_path / "benchmarks.yaml"
    path.write_text(
        "benchmarks:\n  toy: {task: gsm8k, split: test, n: 2, temperature: 1.0, top_p: 1.0, max_new_tokens: 8, topk: 5}\n"
    )
    with pytest.raises(ValueError, match="topk"):
        load_benchmarks(path, ["toy"])


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


class ScriptedGenerator:
    """Answers problem i correctly in its first ``correct_counts[i]`` samples; the others are wrong or
    give the right number without the ``####`` format (no answer under strict, correct under lenient when it
    ended), alternately. A completion's token count is its number of characters; the wrong ones are cut at the
    length limit, and with ``cut_unformatted`` the unformatted ones too (lenient then reads them strictly)."""

    def __init__(self, ground_truths: list[str], correct_counts: list[int], cut_unformatted: bool = False):
        self.ground_truths, self.correct_counts = ground_truths, correct_counts
        self.cut_unformatted = cut_unformatted

    def generate(self, conversations, sampling, desc):
        assert len(conversations) == len(self.ground_truths)
        texts = [
            [
                f"Step by step. #### {truth}"
                if sample < correct
                else ("#### -1" if sample % 2 else f"I am not sure; maybe {truth}?")
                for sample in range(sampling.n)
            ]
            for truth, correct in zip(self.ground_truths, self.correct_counts, strict=True)
        ]
        cut = ("####", "I am") if self.cut_unformatted else ("####",)
        return [[Completion(text, len(text), text.startswith(cut)) for text in row] for row in texts]


def test_scores_become_the_right_metrics_and_records(benchmark_data, tmp_path):
    (gsm8k,) = load_benchmarks(BENCHMARKS_FILE, ["gsm8k"], {"n": 3})
    rows = data.load_rows("gsm8k", "test", source=benchmark_data.file("gsm8k"))[:3]
    generator = ScriptedGenerator([row["reward_model"]["ground_truth"] for row in rows], correct_counts=[0, 1, 3])
    summary = evaluate_benchmark(
        generator, gsm8k, tmp_path, limit=3, source_dir=benchmark_data.root, run_info={"model": "m"}
    )

    assert summary["answer_format"] == "strict"
    assert summary["mean_at_n"] == pytest.approx(4 / 9)
    assert summary["pass_at_k"] == pytest.approx({"1": 4 / 9, "2": (0 + 2 / 3 + 1) / 3, "3": 2 / 3})
    # Wrong samples alternate the unformatted right number (index 0, 2) and "#### -1" (index 1).
    assert (summary["reasons"]["correct"], summary["no_answer"], summary["reasons"]["wrong"]) == (4, 3, 2)
    assert summary["timeouts"] == 0 and summary["model"] == "m" and summary["num_samples"] == 9
    completions = [completion for row in generator.generate(rows, gsm8k.sampling, "") for completion in row]
    assert summary["mean_response_tokens"] == pytest.approx(sum(len(c.text) for c in completions) / 9)
    assert summary["truncated"] == pytest.approx(2 / 9)  # the 2 "#### -1" samples
    # Lenient also credits the unformatted right numbers: 2, 2 and 3 of 3 correct.
    strict, lenient = summary["by_answer_format"]["strict"], summary["by_answer_format"]["lenient"]
    assert strict == {key: summary[key] for key in ("mean_at_n", "pass_at_k", "timeouts", "no_answer", "reasons")}
    assert lenient["mean_at_n"] == pytest.approx(7 / 9)
    assert lenient["pass_at_k"] == pytest.approx({"1": 7 / 9, "2": 1.0, "3": 1.0})
    assert (lenient["reasons"]["correct"], lenient["no_answer"], lenient["reasons"]["wrong"]) == (7, 0, 2)

    records = read_jsonl(tmp_path / "gsm8k" / "samples.jsonl")
    assert [(r["problem_id"], r["sample_index"]) for r in records] == [
        (row["extra_info"]["index"], sample) for row in rows for sample in range(3)
    ]
    assert [r["acc"] for r in records] == [False] * 3 + [True, False, False] + [True] * 3
    assert [r["by_answer_format"]["strict"]["acc"] for r in records] == [r["acc"] for r in records]
    assert [r["by_answer_format"]["lenient"]["acc"] for r in records] == [True, False, True] * 2 + [True] * 3
    assert records[0]["by_answer_format"]["strict"] == {"score": 0.0, "acc": False, "reason": "no_answer"}
    assert json.loads((tmp_path / "gsm8k" / "summary.json").read_text()) == summary

    # The same samples with lenient as the primary format: the top-level metrics follow it.
    (gsm8k_lenient,) = load_benchmarks(BENCHMARKS_FILE, ["gsm8k"], {"n": 3}, answer_format="lenient")
    summary = evaluate_benchmark(
        generator, gsm8k_lenient, tmp_path / "lenient", limit=3, source_dir=benchmark_data.root
    )
    assert summary["answer_format"] == "lenient" and summary["mean_at_n"] == pytest.approx(7 / 9)
    assert summary["by_answer_format"]["strict"]["mean_at_n"] == pytest.approx(4 / 9)

    # Cut at the length limit, the unformatted right numbers are no answer under lenient too.
    cut = ScriptedGenerator([row["reward_model"]["ground_truth"] for row in rows], [0, 1, 3], cut_unformatted=True)
    summary = evaluate_benchmark(cut, gsm8k_lenient, tmp_path / "cut", limit=3, source_dir=benchmark_data.root)
    assert summary["mean_at_n"] == pytest.approx(4 / 9) and summary["truncated"] == pytest.approx(5 / 9)
    records = read_jsonl(tmp_path / "lenient" / "gsm8k" / "samples.jsonl")
    assert [r["acc"] for r in records] == [r["by_answer_format"]["lenient"]["acc"] for r in records]


def test_cli_end_to_end_on_a_tiny_model(benchmark_data, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    from vcpo.evaluation.__main__ import main

    out = tmp_path / "out"
    argv = [
        "--model",
        str(tiny_model_dir),
        "--benchmarks",
        "gsm8k",
        "--out",
        str(out),
        "--limit",
        "3",
        "--n",
        "2",
        "--max-new-tokens",
        "8",
        "--backend",
        "hf",
        "--source-dir",
        str(benchmark_data.root),
        "--answer-format",
        "lenient",
    ]
    assert main(argv) == 0

    records = read_jsonl(out / "gsm8k" / "samples.jsonl")
    assert len(records) == 6 and len({r["problem_id"] for r in records}) == 3
    assert [r["sample_index"] for r in records] == [0, 1] * 3
    assert set(records[0]) == {
        "problem_id",
        "sample_index",
        "completion",
        "tokens",
        "truncated",
        "tool_calls",
        "score",
        "acc",
        "reason",
        "ground_truth",
        "by_answer_format",
    }
    assert all(set(r["by_answer_format"]) == {"strict", "lenient"} for r in records)
    assert [r["acc"] for r in records] == [r["by_answer_format"]["lenient"]["acc"] for r in records]
    summary = json.loads((out / "gsm8k" / "summary.json").read_text())
    assert (summary["num_problems"], summary["num_samples"], summary["backend"]) == (3, 6, "HFGenerator")
    assert summary["sampling"] == {"n": 2, "temperature": 0.8, "top_p": 0.7, "max_new_tokens": 8, "seed": 0}
    assert set(summary["pass_at_k"]) == {"1", "2"}
    assert summary["answer_format"] == "lenient" and set(summary["by_answer_format"]) == {"strict", "lenient"}
    assert summary["by_answer_format"]["lenient"]["mean_at_n"] == summary["mean_at_n"]
    assert summary["by_answer_format"]["strict"]["mean_at_n"] == pytest.approx(
        sum(r["by_answer_format"]["strict"]["acc"] for r in records) / 6
    )
    assert summary["mean_at_n"] == pytest.approx(sum(r["acc"] for r in records) / 6)
    assert summary["no_answer"] == sum(r["reason"] == "no_answer" for r in records)
    assert all(0 < r["tokens"] <= 8 for r in records) and all(r["tokens"] == 8 for r in records if r["truncated"])
    assert summary["mean_response_tokens"] == pytest.approx(sum(r["tokens"] for r in records) / 6)
    assert summary["truncated"] == pytest.approx(sum(r["truncated"] for r in records) / 6)
    assert sum(summary["reasons"].values()) == 6
    run = json.loads((out / "summary.json").read_text())
    assert run["model"] == str(tiny_model_dir) and run["results"]["gsm8k"] == summary


def test_cli_answer_format_option(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    from vcpo.evaluation.__main__ import parse_args

    required = ["--model", "org/m", "--benchmarks", "gsm8k", "--out", "o"]
    assert parse_args(required).answer_format is None  # each benchmark's own (strict unless it says)
    assert parse_args([*required, "--answer-format", "lenient"]).answer_format == "lenient"
    with pytest.raises(SystemExit):
        parse_args([*required, "--answer-format", "loose"])


def test_source_dir_without_the_benchmark_file_is_reported(tmp_path):
    (gsm8k,) = load_benchmarks(BENCHMARKS_FILE, ["gsm8k"])
    with pytest.raises(EvaluationInputError, match="gsm8k/test.jsonl"):
        evaluate_benchmark(ScriptedGenerator([], []), gsm8k, tmp_path, source_dir=tmp_path)


@pytest.mark.parametrize(
    "name, hub",
    [("Qwen/Qwen2.5-7B", True), ("org/model-v1.5", True), ("/abs/model", False), ("./model", False),
     ("results/runs/x/checkpoint", False), ("~/model", False), ("model", False)],
)  # fmt: skip
def test_a_missing_model_path_is_read_as_a_hub_id_only_in_org_name_form(name, hub):
    assert is_hub_id(name) is hub


def test_org_name_below_a_local_folder_is_a_missing_local_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert is_hub_id("results/final")
    (tmp_path / "results").mkdir()
    assert not is_hub_id("results/final")


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--model", "results/missing/final"], "--model results/missing/final: no such folder"),
        (["--benchmarks", "gsm8k,nope"], "unknown benchmark(s) ['nope']"),
        (["--benchmarks-file", "{tmp}/bad.yaml"], "bad.yaml: not valid YAML (line 3)"),
        (["--benchmarks-file", "{tmp}/nosplit.yaml"], "nosplit.yaml: benchmark 'gsm8k' needs 'task' and 'split'"),
        (["--benchmarks-file", "{tmp}/absent.yaml"], "absent.yaml: no such benchmarks file"),
        (["--source-dir", "{tmp}/data"], "no rows for task 'gsm8k', split 'test' in"),
        (["--out", "{tmp}/done"], "holds an earlier evaluation (summary.json): pass --overwrite"),
    ],
    ids=["missing-model", "unknown-benchmark", "bad-yaml", "no-split", "no-file", "empty-data", "earlier-evaluation"],
)
def test_the_cli_answers_bad_input_in_one_line_before_loading_a_model(tmp_path, monkeypatch, capsys, arguments, message):
    """Each input error is one line naming the argument or file, found before any model is loaded."""
    import vcpo.evaluation.harness as harness
    from vcpo.evaluation.__main__ import main

    (tmp_path / "bad.yaml").write_text("benchmarks:\n  gsm8k: [task: gsm8k\n")
    (tmp_path / "nosplit.yaml").write_text("benchmarks:\n  gsm8k: {task: gsm8k, n: 1}\n")
    (tmp_path / "data" / "gsm8k").mkdir(parents=True)
    (tmp_path / "data" / "gsm8k" / "test.jsonl").write_text("")
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "summary.json").write_text("{}")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    monkeypatch.setattr(harness, "make_generator", lambda *a, **k: pytest.fail("a model was loaded"))
    given = {"--model": str(model), "--benchmarks": "gsm8k", "--out": str(tmp_path / "out"),
             **dict(zip(arguments[::2], [a.format(tmp=tmp_path) for a in arguments[1::2]], strict=True))}
    argv = [item for pair in given.items() for item in pair]
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    said = capsys.readouterr().err
    assert code == 2 and "Traceback" not in said
    assert message in said.strip().splitlines()[-1], said


class ChunkedGenerator:
    """Answers each prompt right in its first sample and wrong in the others, ``batch_size`` prompts per generate call
    (the harness's chunk), recording each call's seed; raises KeyboardInterrupt on call ``die_on_call`` (a kill)."""

    def __init__(self, truths: dict[str, str], batch_size: int, die_on_call: int | None = None):
        self.truths, self.batch_size, self.die_on_call = truths, batch_size, die_on_call
        self.seeds, self.progress = [], True

    def generate(self, conversations, sampling, desc):
        assert len(conversations) <= self.batch_size and self.progress is False  # the samples' bar replaces the batches'
        if len(self.seeds) == self.die_on_call:
            raise KeyboardInterrupt
        self.seeds.append(sampling.seed)
        texts = [[f"#### {self.truths[c[0]['content']]}" if i == 0 else "#### -1" for i in range(sampling.n)]
                 for c in conversations]
        return [[Completion(text, len(text), False) for text in row] for row in texts]


def test_a_killed_evaluation_resumes_without_repeating_or_losing_a_sample(benchmark_data, tmp_path):
    """Seven problems in chunks of 2, killed during the third chunk and again after a torn write: the same call goes on
    from the first unfinished chunk (the torn line and the torn chunk dropped), and ends with exactly the records and
    summary of an uninterrupted run; each chunk samples with the seed plus its first problem's position; an evaluation
    with other settings in the folder starts clean."""
    (gsm8k,) = load_benchmarks(BENCHMARKS_FILE, ["gsm8k"], {"n": 2, "seed": 5})
    rows = data.load_rows("gsm8k", "test", source=benchmark_data.file("gsm8k"))[:7]
    truths = {row["prompt"][0]["content"]: row["reward_model"]["ground_truth"] for row in rows}
    whole = evaluate_benchmark(ChunkedGenerator(truths, 2), gsm8k, tmp_path / "whole", rows=rows, progress=False)

    killed = ChunkedGenerator(truths, 2, die_on_call=2)
    with pytest.raises(KeyboardInterrupt):
        evaluate_benchmark(killed, gsm8k, tmp_path / "run", rows=rows, progress=False)
    samples = tmp_path / "run" / "gsm8k" / "samples.jsonl"
    assert len(read_jsonl(samples)) == 2 * 2 * 2  # two chunks of two problems, two samples each
    lines = samples.read_text().splitlines(keepends=True)
    samples.write_text("".join(lines) + "".join(lines[:3]) + lines[3][:10])  # a torn third chunk and a torn line
    resumed = ChunkedGenerator(truths, 2)
    summary = evaluate_benchmark(resumed, gsm8k, tmp_path / "run", rows=rows, progress=False)
    assert killed.seeds == [5, 7] and resumed.seeds == [9, 11]
    assert read_jsonl(samples) == read_jsonl(tmp_path / "whole" / "gsm8k" / "samples.jsonl")
    assert {key: value for key, value in summary.items() if not key.endswith("seconds")} == {
        key: value for key, value in whole.items() if not key.endswith("seconds")}
    assert summary["mean_at_n"] == pytest.approx(0.5) and summary["num_samples"] == 14

    (other,) = load_benchmarks(BENCHMARKS_FILE, ["gsm8k"], {"n": 3, "seed": 5})
    again = ChunkedGenerator(truths, 2)
    assert evaluate_benchmark(again, other, tmp_path / "run", rows=rows, progress=False)["num_samples"] == 21
    assert again.seeds == [5, 7, 9, 11] and len(read_jsonl(samples)) == 21


def early_ending_generator(model_dir: Path, batch_size: int):
    """An HFGenerator of the tiny random model that ends a sequence at any of a tenth of its vocabulary (its generation
    config's end-of-sequence ids), so that some samples end within a few tokens and others run on."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vcpo.evaluation import HFGenerator

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.generation_config.eos_token_id = list(range(100, 132))
    return HFGenerator(model, AutoTokenizer.from_pretrained(model_dir), batch_size=batch_size, progress=False)


def test_the_generator_reports_tokens_and_ended_samples_as_it_decodes_without_changing_a_sample(tiny_model_dir):
    """HFGenerator.on_progress is told each decode step's tokens and the samples it ended, while the batch decodes:
    the tokens add up to the completions' and the ended samples to those not truncated, and the samples are those of
    the same seed without the reports."""
    conversations = [[{"role": "user", "content": f"What is {a} + 2?"}] for a in range(4)]
    sampling = SamplingParams(n=2, temperature=1.0, top_p=1.0, max_new_tokens=8, seed=1)
    quiet = early_ending_generator(tiny_model_dir, batch_size=8)
    expected = quiet.generate(conversations, sampling, "quiet")
    reporting, reports = early_ending_generator(tiny_model_dir, batch_size=8), []
    reporting.on_progress = lambda tokens, ended: reports.append((tokens, ended))
    completions = reporting.generate(conversations, sampling, "reported")
    assert completions == expected
    flat = [completion for group in completions for completion in group]
    assert 0 < sum(not c.truncated for c in flat) < len(flat)  # some end early, some run to the limit
    assert len(reports) == max(c.tokens for c in flat) > 1  # one report per decode step of the one batch
    assert sum(tokens for tokens, _ in reports) == sum(c.tokens for c in flat)
    assert sum(ended for _, ended in reports) == sum(not c.truncated for c in flat)
    assert reports[0] == (8, sum(c.tokens == 1 and not c.truncated for c in flat))


def test_the_evaluations_bar_moves_in_samples_and_tokens_before_its_batch_ends(benchmark_data, tiny_model_dir, tmp_path,
                                                                              monkeypatch):
    """Four problems in one batch of eight: the samples' bar counts tokens and ended samples while the batch decodes,
    not only when it ends, and ends at every sample and token written."""
    from vcpo.evaluation import harness

    shown = []

    class Bar:  # tqdm as the harness calls it, recording what it would show
        def __init__(self, total, initial, **kwargs):
            self.n, self.tokens = initial, 0

        def update(self, count):
            self.n += count
            shown.append((self.n, self.tokens))

        def set_postfix(self, tokens, refresh=True):
            self.tokens = tokens
            shown.append((self.n, self.tokens))

        def close(self):
            pass

    monkeypatch.setattr(harness, "tqdm", Bar)
    (gsm8k,) = load_benchmarks(BENCHMARKS_FILE, ["gsm8k"], {"n": 1, "seed": 2, "max_new_tokens": 8, "temperature": 1.0})
    rows = data.load_rows("gsm8k", "test", source=benchmark_data.file("gsm8k"))[:4]
    evaluate_benchmark(early_ending_generator(tiny_model_dir, batch_size=8), gsm8k, tmp_path, rows=rows)
    records = read_jsonl(tmp_path / "gsm8k" / "samples.jsonl")
    total = sum(record["tokens"] for record in records)
    assert shown[-1] == (4, total)
    assert any(0 < tokens < total for _, tokens in shown)  # tokens as they are generated
    assert any(0 < samples < 4 for samples, _ in shown)  # samples as they end


def test_the_base_evaluation_never_replaces_a_row_with_one_over_fewer_problems(tmp_path, capsys):
    """benchmarks/real_model_eval.py with --limit below what its table holds (the committed gsm8k row has 65
    problems): one line naming the table and --tables, exit 2, nothing written, before any model is looked up."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("real_model_eval", REPO / "benchmarks" / "real_model_eval.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    tables, data_dir = tmp_path / "tables", tmp_path / "data" / "gsm8k"
    tables.mkdir()
    data_dir.mkdir(parents=True)
    (data_dir / "test.jsonl").write_text("".join(json.dumps({"question": f"Q{i}", "answer": "#### 1"}) + "\n"
                                                 for i in range(100)))
    recorded = json.dumps({"provenance": {}, "rows": {"gsm8k": {"problems": 65}}})
    (tables / "base_eval.json").write_text(recorded)
    with pytest.raises(SystemExit) as stopped:
        script.main(["--data", str(tmp_path / "data"), "--benchmarks", "gsm8k", "--limit", "1", "--tables", str(tables),
                     "--work", str(tmp_path / "work")])
    assert stopped.value.code == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert "over 65 problems and this run would have 1: nothing written; pass --tables" in message
    assert (tables / "base_eval.json").read_text() == recorded and not (tmp_path / "work").exists()


def base_evaluation_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("real_model_eval", REPO / "benchmarks" / "real_model_eval.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


@pytest.mark.parametrize(("arguments", "message"), [
    (["--data", "{tmp}/none"], "benchmark 'gsm8k': {tmp}/none/gsm8k/test.jsonl does not exist"),
    (["--data", "{tmp}/damaged"], "source {tmp}/damaged/gsm8k/test.jsonl, line 2: not a JSON object"),
    (["--benchmarks", "nope"], "unknown benchmark(s) ['nope']"),
    (["--work", "{tmp}/a_file"], "--work {tmp}/a_file: {tmp}/a_file is a file, not a folder"),
], ids=["missing-data", "damaged-line", "unknown-benchmark", "work-a-file"])
def test_the_base_evaluation_answers_bad_input_in_one_line_before_looking_up_the_model(tmp_path, monkeypatch, capsys,
                                                                                     arguments, message):
    """Each once a traceback (an empty cache first fetched the model): the evaluation's own rules, checked before the
    model is looked up or anything is written."""
    script = base_evaluation_script()
    monkeypatch.setattr(script, "packaged_model", lambda name: pytest.fail("the model was looked up"))
    line = '{"question": "Q", "answer": "#### 1"}\n'
    for folder, text in (("data", line), ("damaged", line + '{"question": \n')):
        (tmp_path / folder / "gsm8k").mkdir(parents=True)
        (tmp_path / folder / "gsm8k" / "test.jsonl").write_text(text)
    (tmp_path / "a_file").write_text("")
    given = {"--data": str(tmp_path / "data"), "--benchmarks": "gsm8k", "--work": str(tmp_path / "work"),
             "--tables": str(tmp_path / "tables"),
             **dict(zip(arguments[::2], [a.format(tmp=tmp_path) for a in arguments[1::2]], strict=True))}
    with pytest.raises(SystemExit) as stopped:
        script.main([item for pair in given.items() for item in pair])
    said = capsys.readouterr().err
    assert stopped.value.code == 2 and "Traceback" not in said and message.format(tmp=tmp_path) in said.splitlines()[-1]
    assert not (tmp_path / "work").exists() and not (tmp_path / "tables").exists()


def test_the_base_evaluation_ends_in_one_line_when_its_evaluation_fails_and_reads_a_killed_drivers_end(tmp_path,
                                                                                                  monkeypatch):
    """The evaluation's own exit is named (it printed its message), not raised as CalledProcessError; a driver killed
    after its evaluation's summary but before it recorded the end leaves that summary's time as the end."""
    import subprocess

    script = base_evaluation_script()
    (tmp_path / "data" / "gsm8k").mkdir(parents=True)
    (tmp_path / "data" / "gsm8k" / "test.jsonl").write_text('{"question": "Q", "answer": "#### 1"}\n')
    monkeypatch.setattr(script, "packaged_model", lambda name: tmp_path / "model")
    monkeypatch.setattr(script.subprocess, "run", lambda command, **kwargs: subprocess.CompletedProcess(command, 3))
    argv = ["--data", str(tmp_path / "data"), "--benchmarks", "gsm8k", "--work", str(tmp_path / "work"),
            "--tables", str(tmp_path / "tables")]
    with pytest.raises(SystemExit, match=r"^error: gsm8k: python -m vcpo.evaluation ended with exit 3 \(its message "
                                         r"above\); the same command resumes it$"):
        script.main(argv)
    assert not (tmp_path / "tables" / "base_eval.json").exists()
    summary = tmp_path / "summary.json"
    summary.write_text("{}")
    os.utime(summary, (0, 0))
    assert script.finished({"start": "s"}, summary) == {"end": "1970-01-01T00:00:00+00:00", "start": "s"}
    assert script.finished({"start": "s", "end": "e"}, summary)["end"] == "e"


def test_a_verl_run_folder_is_evaluated_at_its_last_checkpoints_hugging_face_weights(tmp_path, monkeypatch):
    """--model takes a model folder, or a verl run folder, its checkpoints folder or one global_step_N folder: the
    weights of checkpoints/global_step_<latest>/actor/huggingface (verl's latest_checkpointed_iteration.txt); a folder
    with neither is refused naming both."""
    monkeypatch.syspath_prepend(str(REPO))
    from vcpo.evaluation.__main__ import parse_args
    from vcpo.runs import verl_hf_checkpoint

    run = tmp_path / "run"
    for step in (1, 2):
        weights = run / "checkpoints" / f"global_step_{step}" / "actor" / "huggingface"
        weights.mkdir(parents=True)
        (weights / "config.json").write_text("{}")
    (run / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("2\n")
    last = run / "checkpoints" / "global_step_2" / "actor" / "huggingface"
    assert verl_hf_checkpoint(run) == verl_hf_checkpoint(run / "checkpoints") == last
    assert verl_hf_checkpoint(run / "checkpoints" / "global_step_1") == last.parents[2] / "global_step_1" / "actor" / "huggingface"
    assert verl_hf_checkpoint(tmp_path) is None
    megatron = tmp_path / "megatron" / "checkpoints" / "global_step_3" / "actor" / "model" / "huggingface"
    megatron.mkdir(parents=True)  # Megatron's engine exports its Hugging Face weights under model/
    (megatron / "config.json").write_text("{}")
    (megatron.parents[3] / "latest_checkpointed_iteration.txt").write_text("3")
    assert verl_hf_checkpoint(tmp_path / "megatron") == megatron
    args = parse_args(["--model", str(run), "--benchmarks", "gsm8k", "--out", str(tmp_path / "out")])
    assert args.model == str(last)
    with pytest.raises(SystemExit):
        parse_args(["--model", str(tmp_path / "run" / "checkpoints" / "global_step_1" / "actor"), "--benchmarks", "gsm8k",
                    "--out", str(tmp_path / "out2")])
