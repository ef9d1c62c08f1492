"""Simulator tasks, SFT bases and held-out evaluation (vcpo.sim.tasks, .base, .evaluate)."""

import dataclasses
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from vcpo.local_models import IM_END
from vcpo.rewards import score_batch
from vcpo.rewards.countdown import parse_ground_truth
from vcpo.sim import base, tasks
from vcpo.sim.heldout import heldout_accuracy
from vcpo.sim.tasks import SIM_TASKS, get_sim_task, render_prompt


@pytest.fixture(autouse=True, scope="module")
def private_cache(tmp_path_factory):
    """Generated problem sets go to a fresh cache folder, so every test generates its own."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VCPO_CACHE_DIR", str(tmp_path_factory.mktemp("vcpo-cache")))
        yield


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Models this small gain nothing from more threads, and lose much on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def small(name: str, train_size: int = 200, validation_size: int = 40) -> tasks.SimTask:
    """The task with small splits (Countdown's generator takes about 3 ms a puzzle)."""
    return dataclasses.replace(get_sim_task(name), train_size=train_size, validation_size=validation_size)


@pytest.mark.parametrize("name", sorted(SIM_TASKS))
def test_tasks_are_deterministic_and_disjoint(name, tmp_path, monkeypatch):
    task = small(name)
    train, validation = task.problems("train"), task.problems("validation")
    assert len(train) == 200 and len(validation) == 40
    assert len({p.prompt for p in train + validation}) == 240
    # Generated afresh (no in-process or disk cache): the same problems; a larger train split keeps
    # the validation split and extends the train split.
    tasks._splits.cache_clear()
    monkeypatch.setenv("VCPO_CACHE_DIR", str(tmp_path))
    assert task.problems("train") == train and task.problems("validation") == validation
    larger = small(name, train_size=250)
    assert larger.problems("validation") == validation and larger.problems("train")[:200] == train
    # The test split is the problems after the train split: a larger train split starts with them.
    test = dataclasses.replace(task, test_size=30).problems("test")
    assert len(test) == 30 and test == larger.problems("train")[200:230]
    assert not {p.prompt for p in test} & {p.prompt for p in train + validation}
    with pytest.raises(ValueError, match="dev"):
        task.problems("dev")


def test_countdown_puzzles_differ_as_numbers_and_target():
    """The same numbers in another order with the same target would be the same puzzle."""
    task = small("countdown")
    keys = []
    for problem in task.problems("train") + task.problems("validation"):
        numbers, target = parse_ground_truth(problem.ground_truth)
        keys.append((tuple(sorted(numbers)), target))
    assert len(set(keys)) == len(keys)


@pytest.mark.parametrize("name", sorted(SIM_TASKS))
def test_every_solution_scores_one(name):
    task = small(name)
    problems = task.problems("train") + task.problems("validation")
    results = score_batch(
        [task.data_source] * len(problems), [p.solution for p in problems], [p.ground_truth for p in problems]
    )
    assert [r["reason"] for r in results] == ["correct"] * len(problems)
    # The prompt states the answer format that the solution uses.
    marker = {"countdown": "<answer>", "gsm8k": "####"}[task.data_source]
    assert all(marker in p.prompt and marker in p.solution for p in problems)


@pytest.mark.parametrize("name", sorted(SIM_TASKS))
def test_prompts_fit_the_token_budget(name):
    task = small(name, train_size=300)
    tokenizer = base.task_tokenizer(task, base.MODEL_SIZES["tiny"]["vocab"])
    lengths = [
        len(tokenizer.encode(render_prompt(tokenizer, p), add_special_tokens=False))
        for p in task.problems("validation")
    ]
    assert max(lengths) <= task.max_prompt_tokens
    # every SFT solution, with its closing end-of-turn token, fits the generation budget
    solutions = [len(tokenizer.encode(p.solution, add_special_tokens=False)) + 1 for p in task.problems("validation")]
    assert max(solutions) <= task.max_response_tokens
    prompt = render_prompt(tokenizer, task.problems("train")[0])
    assert prompt.startswith("<|im_start|>user\n") and prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_a_damaged_cached_base_is_found_and_built_again(tmp_path, capsys):
    """A cached base's files are checked against the digests recorded when it was built: a truncated
    weights file, flipped bytes or a lost tokenizer is named in one line and the base rebuilt."""
    task = small("arithmetic", train_size=64, validation_size=8)
    path = base.sft_base(task, "tiny", steps=3, cache_dir=tmp_path, progress=False)
    weights = path / "model.safetensors"
    damages = (lambda: weights.write_bytes(weights.read_bytes()[:100]),
               lambda: weights.write_bytes(bytes(b ^ 0xFF if i == 4000 else b for i, b in enumerate(weights.read_bytes()))),
               lambda: (path / "tokenizer.json").unlink())
    for damage in damages:
        damage()
        assert base.damage(path) is not None
        assert base.sft_base(task, "tiny", steps=3, cache_dir=tmp_path, progress=False) == path
        assert f"SFT base {path} is damaged" in capsys.readouterr().err
        assert base.damage(path) is None and AutoModelForCausalLM.from_pretrained(path).config.model_type == "qwen2"


def test_sft_base_writes_a_loadable_model_once(tmp_path, monkeypatch):
    task = small("arithmetic", train_size=64, validation_size=8)
    calls = []
    train_sft = base.train_sft
    monkeypatch.setattr(base, "train_sft", lambda *args, **kwargs: calls.append(1) or train_sft(*args, **kwargs))
    path = base.sft_base(task, "tiny", steps=5, cache_dir=tmp_path, progress=False)
    assert path.parent == tmp_path and path.name.startswith("sft-arithmetic-tiny-seed0-")
    info = (path / base.INFO_FILE).read_text()
    assert '"steps": 5' in info and '"heldout_accuracy"' in info
    # no temporary folder left behind; the lock file stays (removing it could let two builders in)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([path.name, f".{path.name}.lock"])
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == "qwen2" and model.config.hidden_size == base.MODEL_SIZES["tiny"]["hidden"]
    assert tokenizer.convert_tokens_to_ids(IM_END) in model.generation_config.eos_token_id
    mtime = (path / base.INFO_FILE).stat().st_mtime_ns
    assert base.sft_base(task, "tiny", steps=5, cache_dir=tmp_path, progress=False) == path
    assert len(calls) == 1 and (path / base.INFO_FILE).stat().st_mtime_ns == mtime
    # Another setting is another base.
    assert base.sft_base(task, "tiny", steps=6, cache_dir=tmp_path, progress=False) != path

    # Held-out evaluation: deterministic in its seed; the global RNG and the training mode are left alone.
    problems = task.problems("validation")
    state = torch.random.get_rng_state()
    model.train()
    first = heldout_accuracy(model, tokenizer, task, problems, max_new_tokens=8, samples=2, seed=1)
    assert torch.equal(torch.random.get_rng_state(), state) and model.training
    again = heldout_accuracy(model, tokenizer, task, problems, max_new_tokens=8, samples=2, seed=1)
    timings = ("generation_seconds", "scoring_seconds")
    assert {k: v for k, v in again.items() if k not in timings} == {k: v for k, v in first.items() if k not in timings}
    assert 0 <= first["mean_at_n"] <= first["pass_at_k"]["2"] <= 1 and 0 < first["mean_response_tokens"] <= 8
    assert sum(first["reasons"].values()) == 2 * len(problems) and first["num_samples"] == 2 * len(problems)

    # Greedy, one sample per problem, against a direct reference: each prompt alone (no batch, no
    # padding), cut at the first end-of-turn token, scored by vcpo.rewards.
    greedy = heldout_accuracy(model, tokenizer, task, problems, temperature=0.0, max_new_tokens=8, samples=4)
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    texts, lengths, truncated = [], [], []
    for problem in problems:
        prompt = torch.tensor([tokenizer.encode(render_prompt(tokenizer, problem), add_special_tokens=False)])
        ids = model.generate(prompt, do_sample=False, max_new_tokens=8, pad_token_id=tokenizer.pad_token_id)[0]
        ids = ids[prompt.shape[1] :].tolist()
        kept = ids[: ids.index(im_end) + 1] if im_end in ids else ids
        texts.append(tokenizer.decode(kept, skip_special_tokens=True))
        lengths.append(len(kept))
        truncated.append(im_end not in ids)
    scores = score_batch([task.data_source] * len(texts), texts, [p.ground_truth for p in problems])
    assert greedy["num_samples"] == len(problems)
    assert greedy["mean_at_n"] == pytest.approx(sum(r["score"] for r in scores) / len(problems))
    assert greedy["mean_response_tokens"] == pytest.approx(sum(lengths) / len(lengths))
    assert greedy["truncated"] == pytest.approx(sum(truncated) / len(truncated))


def test_unknown_task_or_size_is_named():
    with pytest.raises(ValueError, match="nonesuch.*known: arithmetic, arithmetic_long, countdown"):
        get_sim_task("nonesuch")
    with pytest.raises(ValueError, match="nonesuch"):
        base.sft_base("nonesuch")
    with pytest.raises(ValueError, match="huge.*known: tiny"):
        base.sft_base("countdown", "huge")


def test_a_base_trains_on_one_thread_whatever_its_builder_has(tmp_path, monkeypatch):
    """The thread count changes the order of floating-point reductions: the SFT runs on SFT_THREADS, and the
    caller's setting comes back afterwards."""
    task = small("arithmetic", train_size=64, validation_size=8)
    seen = []
    train_sft = base.train_sft
    monkeypatch.setattr(base, "train_sft", lambda *a, **k: seen.append(torch.get_num_threads()) or train_sft(*a, **k))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        base.sft_base(task, "tiny", steps=3, cache_dir=tmp_path, progress=False)
        assert seen == [base.SFT_THREADS] == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_machine_without_the_sandbox_is_told_before_the_tool_tasks_fine_tuning(tmp_path):
    """`setpriv` missing (a PATH without it): the tool-use task's SFT base refuses in one line before training."""
    import subprocess
    import sys

    env = {**os.environ, "PATH": str(tmp_path)}  # no setpriv, no unshare
    done = subprocess.run([sys.executable, "-m", "vcpo.sim.base", "--task", "tir", "--cache-dir", str(tmp_path / "cache")],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [done.stderr.strip()] and "setpriv --pdeathsig" in done.stderr
    assert not list((tmp_path / "cache").rglob("config.json"))  # no base was trained
