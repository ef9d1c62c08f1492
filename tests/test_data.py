"""Dataset builders: verl schema, field layouts, splits, Countdown generation, offline errors, the CLI."""

import errno
import functools
import hashlib
import json
import os
import re
import socket
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
from scaling import LINEAR_GROWTH, growth_at_8n

from vcpo.data import DATASETS, HubUnavailableError, build, countdown, load_rows
from vcpo.data.__main__ import main as cli_main
from vcpo.data.countdown import countdown_split, puzzle_key
from vcpo.rewards import REWARD_BY_DATA_SOURCE
from vcpo.rewards.extract import last_boxed

BENCHMARKS = ["gsm8k", "math500", "math", "aime24", "aime25", "amc23"]
FULL_ROW_COUNTS = {"gsm8k": 1319, "math500": 500, "math": 5000, "aime24": 30, "aime25": 30, "amc23": 40}
FIXTURE_ROWS = 20


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


@pytest.mark.parametrize("benchmark", BENCHMARKS)
def test_benchmark_rows_have_verl_schema_and_exact_counts(benchmark, benchmark_data):
    rows = load_rows(benchmark, "test", source=benchmark_data.file(benchmark))
    assert len(rows) == (FULL_ROW_COUNTS[benchmark] if benchmark_data.real else FIXTURE_ROWS)
    task = DATASETS[benchmark]
    for index, row in enumerate(rows):
        assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
        assert row["data_source"] == benchmark and row["ability"] == "math"
        assert row["reward_model"]["style"] == "rule"
        gold = row["reward_model"]["ground_truth"]
        assert isinstance(gold, str) and gold.strip() == gold and gold
        info = row["extra_info"]
        assert (info["split"], info["index"]) == ("test", index)
        assert row["prompt"] == [{"role": "user", "content": task.template.format(question=info["question"])}]
        assert info["question"] and info["answer"]


def test_prompt_templates_follow_verl_conventions(benchmark_data):
    (gsm8k,) = load_rows("gsm8k", "test", source=benchmark_data.file("gsm8k"), size=1)
    assert gsm8k["prompt"][0]["content"].endswith(
        ' Let\'s think step by step and output the final answer after "####".'
    )
    (math,) = load_rows("math500", "test", source=benchmark_data.file("math500"), size=1)
    assert math["prompt"][0]["content"].endswith(
        " Let's think step by step and output the final answer within \\boxed{}."
    )


def test_field_layouts_of_the_shared_files_are_normalised(benchmark_data):
    def golds(benchmark):
        return [
            row["reward_model"]["ground_truth"]
            for row in load_rows(benchmark, "test", source=benchmark_data.file(benchmark))
        ]

    aime25 = golds("aime25")  # answers stored as floats: 70.0
    assert aime25[:3] == ["70", "588", "16"]
    aime24 = golds("aime24")  # answers stored as zero-padded strings: "025"
    assert aime24[:3] == ["204", "113", "371"] and aime24[7] == "25"
    assert golds("amc23")[:3] == ["27", "36", "45"]  # floats, with problem and question both present
    assert golds("math")[:2] == ["2", "10"]  # no answer field: the last \boxed{} of the solution
    assert golds("math500")[0] == r"\left( 3, \frac{\pi}{2} \right)"
    gsm8k = golds("gsm8k")
    assert gsm8k[:2] == ["18", "3"]
    assert all(gold.lstrip("-").isdigit() for gold in gsm8k)  # "#### 2,125" -> "2125"
    assert "2125" in gsm8k


def test_hub_layouts_are_normalised(tmp_path):
    aime_hub = write_jsonl(  # Maxwell-Jia/AIME_2024 capitalises its columns; answers are integers
        tmp_path / "aime.jsonl", [{"ID": "2024-I-1", "Problem": "Find x.", "Solution": "...", "Answer": 204}]
    )
    (row,) = load_rows("aime24", "test", source=aime_hub)
    assert (row["extra_info"]["question"], row["reward_model"]["ground_truth"]) == ("Find x.", "204")

    lighteval = write_jsonl(  # DigitalLearningGmbH/MATH-lighteval: problem, level, type, solution
        tmp_path / "train.jsonl",
        [{"problem": "P", "level": "Level 1", "type": "Algebra", "solution": r"So $\boxed{\frac{1}{\sqrt{2}}}$."}],
    )
    (row,) = load_rows("math", "train", source=lighteval)
    assert row["reward_model"]["ground_truth"] == r"\frac{1}{\sqrt{2}}"
    assert row["extra_info"]["split"] == "train"

    amc_hub = write_jsonl(tmp_path / "amc.jsonl", [{"id": 0, "question": "Q", "answer": -1.0, "url": "u"}])
    (row,) = load_rows("amc23", "test", source=amc_hub)
    assert row["reward_model"]["ground_truth"] == "-1"


def test_sources_in_parquet_and_json_list_form_load_like_jsonl(tmp_path, benchmark_data):
    from_jsonl = load_rows("aime25", "test", source=benchmark_data.file("aime25"))
    records = [json.loads(line) for line in benchmark_data.file("aime25").read_text().splitlines()]
    (tmp_path / "list.json").write_text(json.dumps(records))
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(records), tmp_path / "copy.parquet")
    assert load_rows("aime25", "test", source=tmp_path / "list.json") == from_jsonl
    assert load_rows("aime25", "test", source=tmp_path / "copy.parquet") == from_jsonl


def dapo_record(problem, answer):
    wrapped = (
        "Solve the following math problem step by step. The last line of your response should be of the form "
        "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
        f'{problem}\n\nRemember to put your answer on its own line after "Answer:".'
    )
    return {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": wrapped}],
        "ability": "MATH",
        "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": "a-uuid"},
    }


def test_dapo_math_is_deduplicated_by_problem_and_unwrapped(tmp_path):
    problems = [("What is $1+1$?", "2"), ("Find $n$.\n\nIt is a positive integer.", "7"), ("Compute 3!.", "6")]
    records = [dapo_record(problem, answer) for _ in range(4) for problem, answer in problems]
    records.append(dapo_record("What is $1+1$?", "3"))  # a repeat with a conflicting answer: the first wins
    source = write_jsonl(tmp_path / "dapo.jsonl", records)
    rows = load_rows("dapo_math", "train", source=source)
    assert [row["extra_info"]["question"] for row in rows] == [problem for problem, _ in problems]
    assert [row["reward_model"]["ground_truth"] for row in rows] == ["2", "7", "6"]
    assert [row["extra_info"]["index"] for row in rows] == [0, 1, 2]  # first occurrence in the source
    assert rows[1]["prompt"][0]["content"].startswith("Find $n$.\n\nIt is a positive integer. Let's think")


def puzzle_keys(rows):
    return {puzzle_key({"metadata": json.loads(row["reward_model"]["ground_truth"])}) for row in rows}


def test_countdown_split_is_proportional_disjoint_and_seeded():
    train = load_rows("countdown", "train", size=100)
    validation = load_rows("countdown", "validation", size=100)
    assert (len(train), len(validation)) == (90, 10)

    assert len(puzzle_keys(train)) == 90 and len(puzzle_keys(validation)) == 10
    assert not puzzle_keys(train) & puzzle_keys(validation)
    assert not {row["prompt"][0]["content"] for row in train} & {row["prompt"][0]["content"] for row in validation}
    assert load_rows("countdown", "validation", size=100) == validation
    small = load_rows("countdown", "train", size=20, seed=1)
    assert len(small) == 18 and puzzle_keys(small) != puzzle_keys(load_rows("countdown", "train", size=20, seed=2))
    row = train[0]
    assert row["data_source"] == "countdown" and row["ability"] == "arithmetic"
    assert "<answer>" in row["prompt"][0]["content"] and row["extra_info"]["answer"]  # the oracle expression


def test_countdown_set_is_cached_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("VCPO_CACHE_DIR", str(tmp_path))
    countdown._train_and_validation.cache_clear()
    first = countdown_split("validation", size=30, seed=5)
    assert len(list(tmp_path.glob("countdown-30-seed5-rg*.json"))) == 1

    def regenerate(*_args):
        raise AssertionError("the cached set must be read, not generated again")

    with monkeypatch.context() as patch:
        patch.setattr(countdown, "_distinct_puzzles", regenerate)
        countdown._train_and_validation.cache_clear()
        assert countdown_split("validation", size=30, seed=5) == first
    # a damaged cached set (truncated; or parseable but altered) is generated again, the same
    (cached,) = tmp_path.glob("countdown-30-seed5-rg*.json")
    text = cached.read_text()
    for damaged in (text[: len(text) // 2], text.replace("1", "2", 1)):
        cached.write_text(damaged)
        countdown._train_and_validation.cache_clear()
        assert countdown_split("validation", size=30, seed=5) == first and cached.read_text() == text
    countdown._train_and_validation.cache_clear()


def test_a_countdown_set_drawn_here_is_the_one_the_workers_draw(monkeypatch):
    """A set of one chunk is drawn in this process, a larger one by worker processes chunk by chunk: the first
    ``size`` distinct puzzles in index order either way."""
    here = countdown._distinct_puzzles(30, 5)
    monkeypatch.setattr(countdown, "_CHUNK", 12)  # three chunks, drawn by the workers
    assert countdown._distinct_puzzles(30, 5) == here and len({puzzle_key(entry) for entry in here}) == 30


@pytest.mark.slow
def test_countdown_full_set_is_9000_train_1000_validation_without_overlap():
    train = load_rows("countdown", "train")
    validation = load_rows("countdown", "validation")
    assert (len(train), len(validation)) == (9000, 1000)
    assert len(puzzle_keys(train)) == 9000 and len(puzzle_keys(validation)) == 1000
    assert not puzzle_keys(train) & puzzle_keys(validation)


def test_size_keeps_a_seeded_subset_in_source_order(benchmark_data):
    source = benchmark_data.file("gsm8k")
    subset = load_rows("gsm8k", "test", source=source, size=5, seed=3)
    indices = [row["extra_info"]["index"] for row in subset]
    assert len(indices) == 5 and indices == sorted(indices)
    assert load_rows("gsm8k", "test", source=source, size=5, seed=3) == subset
    assert [row["extra_info"]["index"] for row in load_rows("gsm8k", "test", source=source, size=5, seed=4)] != indices


def test_build_writes_parquet_and_manifest(tmp_path, benchmark_data):
    source = benchmark_data.file("aime24")
    (path,) = build("aime24", tmp_path, source=source)  # the split is the only one the task has
    assert path == tmp_path / "aime24" / "test.parquet"
    assert pq.read_table(path).to_pylist() == load_rows("aime24", "test", source=source)
    manifest = json.loads((tmp_path / "aime24" / "test.manifest.json").read_text())
    assert manifest["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert manifest["rows"] == (30 if benchmark_data.real else FIXTURE_ROWS)
    assert manifest["source"] == str(source.resolve())
    assert manifest["source_sha256"] == hashlib.sha256(source.read_bytes()).hexdigest()
    assert manifest["prompt_template"].startswith("{question} Let's think step by step")
    assert (manifest["task"], manifest["split"], manifest["data_source"]) == ("aime24", "test", "aime24")


def test_build_countdown_writes_both_splits(tmp_path):
    paths = build("countdown", tmp_path, size=100)
    assert paths == [tmp_path / "countdown" / "train.parquet", tmp_path / "countdown" / "validation.parquet"]
    manifests = [json.loads(path.with_name(f"{path.stem}.manifest.json").read_text()) for path in paths]
    assert [manifest["rows"] for manifest in manifests] == [90, 10]
    assert "countdown, 100 puzzles, seed 0" in manifests[0]["source"]


def test_build_takes_the_split_from_the_file_name_or_asks_for_it(tmp_path, benchmark_data):
    (path,) = build("gsm8k", tmp_path, source=benchmark_data.file("gsm8k"))  # gsm8k/test.jsonl
    assert path.name == "test.parquet"
    renamed = tmp_path / "gsm8k_copy.jsonl"
    renamed.write_bytes(benchmark_data.file("gsm8k").read_bytes())
    with pytest.raises(ValueError, match="--split"):
        build("gsm8k", tmp_path, source=renamed)
    (path,) = build("gsm8k", tmp_path / "named", split="train", source=renamed)
    assert path.name == "train.parquet"


@pytest.fixture
def connections(monkeypatch):
    """Every address this process tries to connect to from here on, each refused at once (nothing leaves)."""
    tried = []

    def refuse(sock, address):
        tried.append(address)
        raise ConnectionRefusedError(errno.ECONNREFUSED, "refused by the test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    return tried


def test_offline_without_source_names_the_file_to_provide(monkeypatch, connections):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # what HF_HUB_OFFLINE=1 sets at import
    with pytest.raises(HubUnavailableError, match=r"openai/gsm8k.*--source PATH.*shared/data/gsm8k/test\.jsonl"):
        load_rows("gsm8k", "test")
    assert connections == []  # offline, no attempt: nothing to wait for


def test_cli_offline_reports_the_file_to_provide(tmp_path, listener):
    port, accepted = listener  # the hub the command is pointed at: it must never be tried
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": f"http://127.0.0.1:{port}"}
    finished = subprocess.run(
        [sys.executable, "-m", "vcpo.data", "build", "aime25", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=environment,
        timeout=120,  # a guard against a hang only
    )
    assert finished.returncode == 2
    assert "math-ai/aime25" in finished.stderr and "shared/data/aime25/test.jsonl" in finished.stderr
    assert "Traceback" not in finished.stderr
    assert accepted == []  # datasets, left to itself, would have retried the hub for about 25 s


def test_unreachable_hub_fails_fast_without_offline_mode(monkeypatch, connections):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)  # read at import: CI's HF_HUB_OFFLINE=1 set it
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(HubUnavailableError, match="shared/data/math500/test.jsonl"):
        load_rows("math500", "test")
    assert connections == [("127.0.0.1", 9)]  # the one probe, refused: datasets never began its retries


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="unknown dataset 'gsm9k'"):
        load_rows("gsm9k", "test")
    with pytest.raises(ValueError, match="no split 'validation'.*train, test"):
        load_rows("gsm8k", "validation")
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_rows("gsm8k", "test", source=tmp_path / "missing.jsonl")
    (tmp_path / "data.csv").write_text("question,answer\n")
    with pytest.raises(ValueError, match="unsupported file type '.csv'"):
        load_rows("gsm8k", "test", source=tmp_path / "data.csv")
    with pytest.raises(ValueError, match="generated offline"):
        load_rows("countdown", "train", source=tmp_path / "data.csv")
    with pytest.raises(ValueError, match="size must be >= 1"):
        load_rows("countdown", "train", size=0)
    no_answer = write_jsonl(tmp_path / "test.jsonl", [{"problem": "P", "solution": "no box here"}])
    with pytest.raises(ValueError, match=r"record 1: no answer"):  # records count from 1, as lines do
        load_rows("math500", "test", source=no_answer)
    second_lacks_answer = write_jsonl(tmp_path / "gsm.jsonl", [{"question": "Q", "answer": "x #### 1"}, {"question": "Q2"}])
    with pytest.raises(ValueError, match=r"record 2: no 'answer' field \(nor 'reward_model.ground_truth'\) in record with keys \['question'\]"):
        load_rows("gsm8k", "test", source=second_lacks_answer)


def test_every_task_has_a_reward():
    assert set(DATASETS) == {"gsm8k", "math", "math500", "aime24", "aime25", "amc23", "dapo_math", "countdown",
                          "sums", "chain_sums", "word_problems", "sums_2digit", "sums_2to3", "countdown3",
                          "sums_2digit_brief", "sums_2to3_brief", "chain_sums_brief"}
    assert {task.data_source for task in DATASETS.values()} <= set(REWARD_BY_DATA_SOURCE)


def test_cli_builds_and_reports(tmp_path, capsys, benchmark_data):
    code = cli_main(
        ["build", "amc23", "--out", str(tmp_path), "--source", str(benchmark_data.file("amc23")), "--size", "7"]
    )
    output = capsys.readouterr().out
    assert code == 0
    assert "wrote 7 rows" in output and "done: 1 file(s), 7 rows" in output
    assert len(pq.read_table(tmp_path / "amc23" / "test.parquet")) == 7


def test_cli_reports_errors_without_a_traceback(tmp_path, capsys):
    assert cli_main(["build", "gsm8k", "--out", str(tmp_path), "--source", str(tmp_path / "nope.jsonl")]) == 2
    assert "nope.jsonl" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so $\boxed{\frac{1}{2}}$", r"\frac{1}{2}"),
        (r"\boxed{1} then \boxed{\{1, 2\}}", r"\{1, 2\}"),
        (r"\boxed{3} and an unfinished \boxed{\frac{1}{2}", "3"),
        (r"the answer is \boxed 5$.", "5"),
        (r"\fbox{7}", "7"),
        (r"\boxed{a^{b^{c}}}", "a^{b^{c}}"),
        ("no box", None),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


def test_last_boxed_is_linear_on_many_unterminated_boxes():
    assert last_boxed(r"\boxed{" * 1000) is None
    assert growth_at_8n(lambda boxes: functools.partial(last_boxed, r"\boxed{" * boxes), 12_500) < LINEAR_GROWTH


def test_a_broken_json_line_names_the_file_and_line(tmp_path):
    source = tmp_path / "test.jsonl"
    source.write_text('{"question": "1+1?", "answer": "#### 2"}\n\n{"question": "2+2?", "answer": \n')
    with pytest.raises(ValueError, match=rf"source {re.escape(str(source))}, line 3: not a JSON object"):
        load_rows("gsm8k", "test", source=source)


def test_a_source_named_after_another_split_warns_and_is_recorded(tmp_path, benchmark_data, capsys):
    from vcpo.data.build import build

    test_file = tmp_path / "test.jsonl"
    test_file.write_text(benchmark_data.file("gsm8k").read_text())
    (path,) = build("gsm8k", tmp_path / "out", split="train", source=test_file, size=5)
    assert f"warning: {test_file} is named after split 'test' but is written as gsm8k/train" in capsys.readouterr().err
    manifest = json.loads(path.with_name("train.manifest.json").read_text())
    assert str(test_file) in json.dumps(manifest)
    build("gsm8k", tmp_path / "out", split="test", source=test_file, size=5)
    assert "warning" not in capsys.readouterr().err


STARTER_TASKS = [name for name, spec in DATASETS.items() if spec.generator is not None]


@pytest.mark.parametrize("task", STARTER_TASKS)
def test_starter_tasks_are_disjoint_seeded_and_their_gold_answers_score_full_marks(task):
    from vcpo.rewards import compute_score

    train, validation = load_rows(task, "train", size=300), load_rows(task, "validation", size=300)
    questions = [row["extra_info"]["question"] for row in train + validation]
    assert len(set(questions)) == len(questions)  # no repeats, none shared by the splits
    assert len(validation) == round(len(questions) * 0.2) and load_rows(task, "train", size=300) == train
    assert load_rows(task, "train", size=300, seed=1) != train
    for row in train[:20]:
        assert row["data_source"] in REWARD_BY_DATA_SOURCE
        oracle = row["extra_info"]["answer"]  # Reasoning Gym's own answer, written as the prompt asks
        written = f"<answer>{oracle}</answer>" if row["data_source"] == "countdown" else f"#### {oracle}"
        assert compute_score(row["data_source"], written, row["reward_model"]["ground_truth"])["score"] == 1.0


def test_the_easiest_starter_task_is_sums_and_differences_of_two_numbers_up_to_ten():
    rows = load_rows("sums", "train")
    for row in rows:
        a, operator, b = re.fullmatch(r"Calculate (\d+) ([+-]) (\d+)\.", row["extra_info"]["question"]).groups()
        assert max(int(a), int(b)) <= 10  # Reasoning Gym's one-digit range reaches 10
        assert int(row["reward_model"]["ground_truth"]) == (int(a) + int(b) if operator == "+" else int(a) - int(b))
    assert len(rows) + len(load_rows("sums", "validation")) <= 11 * 11 * 2  # every distinct problem at most


def test_a_starter_tasks_test_split_shares_no_question_with_train_or_validation():
    """The held-out test split of a generated task comes from a second draw, minus every question train or validation
    holds; a task whose problems are all used (sums: 200 one-digit sums) has none; the others have 400."""
    from vcpo.data.generated import TEST_PROBLEMS

    for task in ("sums", "sums_2digit", "sums_2to3", "chain_sums"):
        train, validation, test = (load_rows(task, split) for split in ("train", "validation", "test"))
        questions = [row["extra_info"]["question"] for row in test]
        assert len(set(questions)) == len(questions)
        assert not set(questions) & {row["extra_info"]["question"] for row in (*train, *validation)}
        assert len(test) == (0 if task == "sums" else TEST_PROBLEMS), (task, len(test))
    assert load_rows("sums_2digit", "test")[0]["reward_model"]["ground_truth"] == str(
        eval(load_rows("sums_2digit", "test")[0]["extra_info"]["question"].removeprefix("Calculate ").rstrip(".")))


def test_a_short_answer_variant_asks_the_same_problems_for_only_the_number():
    """The lag study's rounds 3-4 (recipes/real_model_lag.md): each *_brief task has its original's splits, problem for
    problem and answer for answer, and only the prompt's instruction differs."""
    for task in ("sums_2digit", "sums_2to3", "chain_sums"):
        for split in ("train", "validation", "test"):
            original, brief = load_rows(task, split), load_rows(f"{task}_brief", split)
            assert [(row["extra_info"]["question"], row["reward_model"]) for row in original] == [
                (row["extra_info"]["question"], row["reward_model"]) for row in brief]
        question = original[0]["extra_info"]["question"]
        assert original[0]["prompt"][0]["content"] == f'{question} Output the final answer after "####".'
        assert brief[0]["prompt"][0]["content"] == f"{question} Reply with only the final number."
