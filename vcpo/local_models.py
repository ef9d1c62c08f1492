"""Small, randomly initialised Qwen2-family models with a locally trained tokenizer (no hub needed).

For tests, CI smoke runs and the CPU simulator, on machines that cannot reach the Hugging Face hub.
The tokenizer is a byte-level BPE trained on a few KB of generated arithmetic text, so it encodes any
string; it carries Qwen's chat markup (``<|im_start|>role ... <|im_end|>``) as special tokens and a
matching chat template. The model is a ``Qwen2ForCausalLM`` with a few thousand parameters per layer;
its outputs are random text, which is all a pipeline test needs.

    python -m vcpo.local_models OUT_DIR      # writes a directory loadable with from_pretrained(OUT_DIR)
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from vcpo.cli import output_folder_problem

END_OF_TEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END)
# Qwen2's pre-tokenization: words with an optional leading non-letter, single digits, punctuation runs,
# newlines and other whitespace.
QWEN2_PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def training_corpus(seed: int = 0, problems: int = 120) -> list[str]:
    """A few KB of chat-formatted arithmetic problems and answers, in the styles the rewards parse."""
    rng = random.Random(seed)
    lines = []
    for _ in range(problems):
        a, b = rng.randint(0, 999), rng.randint(1, 99)
        lines.append(
            f"{IM_START}user\nWhat is {a} + {b}? Let's think step by step.{IM_END}\n"
            f"{IM_START}assistant\n{a} + {b} = {a + b}. The answer is \\boxed{{{a + b}}}.\n#### {a + b}{IM_END}"
        )
    lines.append("Using the numbers [3, 7, 25], create an equation that equals 46: <answer>25 + 3 * 7</answer>")
    return lines


def build_tokenizer(
    vocab_size: int = 512, seed: int = 0, corpus: Iterable[str] | None = None, *, split_digits: bool = False
) -> PreTrainedTokenizerFast:
    """Byte-level BPE tokenizer with Qwen-style chat special tokens, trained in memory.

    ``corpus``: the texts to learn merges from (e.g. a task's prompts and solutions, so that its
    prompts take few tokens); default :func:`training_corpus`. Any corpus gives a tokenizer that
    encodes every string (the 256 bytes are always in the vocabulary).

    ``split_digits``: pre-tokenize with Qwen2's pattern, which makes every digit a token of its own and
    never merges a space into a number, so that a number is the same tokens wherever it stands (the
    default keeps GPT-2's pattern, which merges digit runs and a leading space).
    """
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"build_tokenizer: vocab_size must cover the 256 bytes and special tokens, got {vocab_size}"
        )
    tokenizer = Tokenizer(models.BPE())
    if split_digits:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_PATTERN), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_corpus(seed) if corpus is None else corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=END_OF_TEXT,
        pad_token=END_OF_TEXT,  # as Qwen2 does
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        padding_side="left",  # decoder-only generation pads on the left
    )


def random_qwen2(
    vocab_size: int,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_positions: int = 4096,
    seed: int = 0,
    intermediate_size: int | None = None,
    tie_word_embeddings: bool = True,
    **token_ids: int | None,
) -> Qwen2ForCausalLM:
    """Randomly initialised ``Qwen2ForCausalLM`` (grouped-query attention, tied embeddings by default);
    same arguments and seed, same weights. ``intermediate_size`` (the MLP width) defaults to twice
    ``hidden_size``; ``token_ids``: bos/eos/pad_token_id."""
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie_word_embeddings,
        **token_ids,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).eval()


def build_random_model(tokenizer: PreTrainedTokenizerFast, *, seed: int = 0, **shape) -> Qwen2ForCausalLM:
    """``random_qwen2`` sized for ``tokenizer``, stopping at the end of an assistant turn as well as at
    end-of-text, as Qwen chat models do."""
    model = random_qwen2(
        len(tokenizer), seed=seed, bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, **shape,
    )
    model.generation_config = GenerationConfig(
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END)],
        pad_token_id=tokenizer.pad_token_id,
    )
    return model


def save_random_model(output_dir: str | Path, *, vocab_size: int = 512, seed: int = 0, **model_kwargs) -> Path:
    """Build a tokenizer and a random model and save both to ``output_dir`` (loadable by path)."""
    output_dir = Path(output_dir)
    tokenizer = build_tokenizer(vocab_size, seed=seed)
    model = build_random_model(tokenizer, seed=seed, **model_kwargs)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    return output_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vcpo.local_models", description=__doc__.split("\n\n")[0])
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if problem := output_folder_problem(args.output_dir):
        parser.error(f"{args.output_dir}: {problem}")
    path = save_random_model(
        args.output_dir,
        vocab_size=args.vocab_size,
        seed=args.seed,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
    )
    print(path)


if __name__ == "__main__":
    main()
