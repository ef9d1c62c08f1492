"""Local random Qwen2 models (vcpo.local_models): built offline, saved, and loadable by path like a hub checkpoint."""

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
