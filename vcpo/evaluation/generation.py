"""Sample n completions per chat prompt with vLLM (GPU machines) or Hugging Face transformers.

Both backends render prompts the way verl's RL dataset does (chat template with the generation prompt,
then tokenised without extra special tokens), so evaluation sees the prompts training saw.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "hf", "vllm")
Conversation = list[dict[str, str]]


@dataclass(frozen=True)
class SamplingParams:
    n: int
    temperature: float
    top_p: float
    max_new_tokens: int
    seed: int = 0

    def __post_init__(self):
        if self.n < 1 or self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams: n and max_new_tokens must be >= 1, got {self}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams: need temperature >= 0 and 0 < top_p <= 1, got {self}")


class Generator(Protocol):
    def generate(self, conversations: list[Conversation], sampling: SamplingParams, desc: str) -> list[list[str]]:
        """``sampling.n`` completions for each conversation, in order."""


def encode_prompts(tokenizer: PreTrainedTokenizerBase, conversations: list[Conversation]) -> list[list[int]]:
    if not tokenizer.chat_template:
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no chat template; evaluation prompts are chats")
    texts = [
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        for messages in conversations
    ]
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None and torch.cuda.is_available()


def make_generator(backend: str, model_path: str | Path, *, batch_size: int = 8, seed: int = 0) -> Generator:
    """``backend`` "auto" picks vLLM where it is installed and a GPU is present, else transformers."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not Path(model_path).exists():
        raise FileNotFoundError(f"model path {str(model_path)!r} does not exist (the hub is not used for evaluation)")
    if backend == "vllm" or (backend == "auto" and vllm_available()):
        return VLLMGenerator(model_path, seed=seed)
    return HFGenerator(model_path, batch_size=batch_size)


class HFGenerator:
    """Batched ``model.generate`` with left padding; prompts are batched by length to limit padding."""

    def __init__(self, model_path: str | Path, *, batch_size: int = 8):
        if batch_size < 1:
            raise ValueError(f"HFGenerator: batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(self.device).eval()

    def generate(self, conversations: list[Conversation], sampling: SamplingParams, desc: str) -> list[list[str]]:
        prompts = encode_prompts(self.tokenizer, conversations)
        order = sorted(range(len(prompts)), key=lambda index: len(prompts[index]))
        completions: list[list[str]] = [[] for _ in prompts]
        torch.manual_seed(sampling.seed)
        batches = [order[start : start + self.batch_size] for start in range(0, len(order), self.batch_size)]
        for batch in tqdm(batches, desc=f"{desc} (hf generate)", unit="batch"):
            texts = self._generate_batch([prompts[index] for index in batch], sampling)
            for position, index in enumerate(batch):
                completions[index] = texts[position * sampling.n : (position + 1) * sampling.n]
        return completions

    def _generate_batch(self, prompts: list[list[int]], sampling: SamplingParams) -> list[str]:
        inputs = self.tokenizer.pad({"input_ids": prompts}, return_tensors="pt").to(self.device)
        if sampling.temperature > 0:
            # top_k 0 and no repetition penalty: plain temperature/top-p sampling as in vLLM, whatever
            # defaults the checkpoint's generation_config.json carries.
            decoding = {"do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": 0}
        else:
            decoding = {"do_sample": False}
        with torch.inference_mode():
            output = self.model.generate(
                **inputs,
                **decoding,
                repetition_penalty=1.0,
                max_new_tokens=sampling.max_new_tokens,
                num_return_sequences=sampling.n,
                pad_token_id=self.tokenizer.pad_token_id,
            )
        new_tokens = output[:, inputs["input_ids"].shape[1] :]
        return self.tokenizer.batch_decode(new_tokens, skip_special_tokens=True)


class VLLMGenerator:
    """vLLM offline engine; one request per prompt with ``n`` samples each."""

    def __init__(self, model_path: str | Path, *, seed: int = 0):
        from vllm import LLM

        self.llm = LLM(model=str(model_path), seed=seed)
        self.tokenizer = self.llm.get_tokenizer()

    def generate(self, conversations: list[Conversation], sampling: SamplingParams, desc: str) -> list[list[str]]:
        from vllm import SamplingParams as VLLMSamplingParams

        params = VLLMSamplingParams(
            n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p, max_tokens=sampling.max_new_tokens
        )
        requests = [{"prompt_token_ids": ids} for ids in encode_prompts(self.tokenizer, conversations)]
        logger.info("%s: generating with vLLM", desc)
        outputs = self.llm.generate(requests, params, use_tqdm=True)
        return [[completion.text for completion in output.outputs] for output in outputs]
