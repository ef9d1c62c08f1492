"""Sample n completions per chat prompt with vLLM (GPU machines) or Hugging Face transformers.

Both backends render prompts the way verl's RL dataset does (chat template with the generation prompt,
then tokenised without extra special tokens), so evaluation sees the prompts training saw. The
transformers backend also runs on a model already in memory (the simulator's held-out evaluation).
"""

from __future__ import annotations

import importlib.util
import logging
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from tqdm.auto import tqdm
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedTokenizerBase,
    StoppingCriteria,
    StoppingCriteriaList,
)

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


@dataclass(frozen=True)
class Completion:
    text: str  # decoded without special tokens, up to the first end-of-sequence token
    tokens: int  # generated tokens, the end-of-sequence token included
    truncated: bool  # stopped by max_new_tokens before an end-of-sequence token
    tool_calls: int = 0  # multi-turn generation (ToolAgentGenerator): tool calls made


class Generator(Protocol):
    def generate(
        self, conversations: list[Conversation], sampling: SamplingParams, desc: str
    ) -> list[list[Completion]]:
        """``sampling.n`` completions for each conversation, in order."""


def encode_prompts(tokenizer: PreTrainedTokenizerBase, conversations: list[Conversation]) -> list[list[int]]:
    if not tokenizer.chat_template:
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no chat template; evaluation prompts are chats")
    texts = [
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        for messages in conversations
    ]
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


def end_token_ids(generation_config) -> tuple[int, ...]:
    """The end-of-sequence ids of a ``GenerationConfig`` (one id or a list)."""
    eos = generation_config.eos_token_id
    return tuple(eos) if isinstance(eos, list | tuple) else (eos,)


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None and torch.cuda.is_available()


def is_hub_id(name: str) -> bool:
    """``org/name``: a model on the Hugging Face hub (the base models a paper run starts from), not a
    local path (absolute, relative with ``.``, home, deeper than one folder, or below a local folder:
    ``results/x`` with a ``results`` folder here is a missing local model, not the hub's)."""
    if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", name) is None or name.startswith("."):
        return False
    return not Path(name.split("/")[0]).is_dir()


def make_generator(backend: str, model_path: str | Path, *, batch_size: int = 8, seed: int = 0) -> Generator:
    """``backend`` "auto" picks vLLM where it is installed and a GPU is present, else transformers."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not Path(model_path).exists() and not is_hub_id(str(model_path)):
        raise FileNotFoundError(f"model path {str(model_path)!r} does not exist (and is not a hub id, org/name)")
    if backend == "vllm" or (backend == "auto" and vllm_available()):
        return VLLMGenerator(model_path, seed=seed)
    return HFGenerator.load(model_path, batch_size=batch_size)


DecodeReport = Callable[[int, int], None]  # (tokens a decode step generated, sequences it ended)


class DecodeSteps(StoppingCriteria):
    """A stopping criterion that stops nothing: after each decode step of ``model.generate`` it tells ``report`` how many
    tokens the step generated (one per sequence not yet ended) and how many sequences it ended (their first
    end-of-sequence token), so that progress moves while a batch decodes. It draws no random number and changes no
    token: the samples are those of a generate call without it."""

    def __init__(self, report: DecodeReport, end_ids: set[int]):
        self.report, self.end_ids, self.running = report, sorted(end_ids), None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        last = input_ids[:, -1]
        if self.running is None:
            self.running = torch.ones_like(last, dtype=torch.bool)
        ended = self.running & torch.isin(last, torch.tensor(self.end_ids, device=last.device))
        tokens = int(self.running.sum())
        self.running &= ~ended
        self.report(tokens, int(ended.sum()))
        return torch.zeros_like(last, dtype=torch.bool)


class HFGenerator:
    """Batched ``model.generate`` with left padding, prompts in the order given (so the random numbers
    a prompt's samples draw depend only on the seed and the batches before it, not on prompt lengths).

    The global random state and the model's training mode are left as they were. ``on_progress``, when set, is told
    after each decode step of `generate` the tokens generated and the samples ended (`DecodeSteps`).
    """

    def __init__(self, model, tokenizer: PreTrainedTokenizerBase, *, batch_size: int = 8, progress: bool = True):
        if batch_size < 1:
            raise ValueError(f"HFGenerator: batch_size must be >= 1, got {batch_size}")
        if tokenizer.pad_token_id is None:
            raise ValueError(f"HFGenerator: tokenizer {tokenizer.name_or_path!r} has no pad token")
        self.model, self.tokenizer = model, tokenizer
        self.batch_size, self.progress = batch_size, progress
        self.end_ids = set(end_token_ids(model.generation_config))
        self.on_progress: DecodeReport | None = None

    @classmethod
    def load(cls, model_path: str | Path, *, batch_size: int = 8) -> HFGenerator:
        """A checkpoint folder on the GPU in bf16 where there is one, else on the CPU in fp32."""
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device)
        return cls(model, tokenizer, batch_size=batch_size)

    def generate(
        self, conversations: list[Conversation], sampling: SamplingParams, desc: str
    ) -> list[list[Completion]]:
        prompts = encode_prompts(self.tokenizer, conversations)
        batches = [prompts[start : start + self.batch_size] for start in range(0, len(prompts), self.batch_size)]
        completions: list[Completion] = []
        with self._sampling_state(sampling.seed):
            for batch in tqdm(batches, desc=f"{desc} (hf generate)", unit="batch", disable=not self.progress):
                for ids in self._sample(batch, sampling, sampling.n, sampling.max_new_tokens, self.on_progress):
                    kept = self._cut_at_end(ids)
                    text = self.tokenizer.decode(kept, skip_special_tokens=True)
                    completions.append(Completion(text, len(kept), kept[-1] not in self.end_ids))
        n = sampling.n
        return [completions[start : start + n] for start in range(0, len(completions), n)]

    def continue_tokens(
        self, contexts: list[list[int]], budgets: list[int], sampling: SamplingParams, seeds: list[int]
    ) -> list[list[int]]:
        """One sample per token context (``sampling.n`` is ignored), at most ``budgets[i]`` new tokens, up to
        and including the first end-of-sequence token: a turn of ``ToolAgentGenerator``. A batch of
        ``batch_size`` contexts samples from one random stream, seeded with its first context's seed."""
        continuations: list[list[int]] = []
        for start in range(0, len(contexts), self.batch_size):
            batch_budgets = budgets[start : start + self.batch_size]
            with self._sampling_state(seeds[start]):
                sampled = self._sample(contexts[start : start + self.batch_size], sampling, 1, max(batch_budgets))
            continuations += [
                self._cut_at_end(ids[:budget]) for ids, budget in zip(sampled, batch_budgets, strict=True)
            ]
        return continuations

    @contextmanager
    def _sampling_state(self, seed: int) -> Iterator[None]:
        """Eval mode, left padding and a random state seeded with ``seed``; all restored afterwards."""
        was_training, padding_side = self.model.training, self.tokenizer.padding_side
        self.model.eval()
        self.tokenizer.padding_side = "left"
        try:
            with torch.random.fork_rng(devices=[self.model.device] if self.model.device.type == "cuda" else []):
                torch.manual_seed(seed)
                yield
        finally:
            self.tokenizer.padding_side = padding_side
            self.model.train(was_training)

    def _cut_at_end(self, ids: list[int]) -> list[int]:
        """``ids`` up to and including the first end-of-sequence token (all of them if there is none)."""
        end = next((i for i, token in enumerate(ids) if token in self.end_ids), None)
        return ids if end is None else ids[: end + 1]

    def _sample(
        self, prompts: list[list[int]], sampling: SamplingParams, n: int, max_new_tokens: int,
        on_step: DecodeReport | None = None,
    ) -> list[list[int]]:
        """``n`` sampled continuations of each (left-padded) prompt, prompt-major, with the padding after
        the end of sequence left in; ``on_step`` told each decode step's tokens and ended samples."""
        inputs = self.tokenizer.pad({"input_ids": prompts}, return_tensors="pt").to(self.model.device)
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
                max_new_tokens=max_new_tokens,
                num_return_sequences=n,
                pad_token_id=self.tokenizer.pad_token_id,
                **({"stopping_criteria": StoppingCriteriaList([DecodeSteps(on_step, self.end_ids)])} if on_step else {}),
            )
        return output[:, inputs["input_ids"].shape[1] :].tolist()


class VLLMGenerator:
    """vLLM offline engine; one request per prompt with ``n`` samples each."""

    def __init__(self, model_path: str | Path, *, seed: int = 0):
        from vllm import LLM

        self.llm = LLM(model=str(model_path), seed=seed)
        self.tokenizer = self.llm.get_tokenizer()
        # What vLLM stops at: the tokenizer's end of sequence and the checkpoint's generation config's.
        self.end_ids = {self.tokenizer.eos_token_id}
        try:
            self.end_ids.update(end_token_ids(GenerationConfig.from_pretrained(model_path)))
        except OSError:  # no generation_config.json
            pass

    def generate(
        self, conversations: list[Conversation], sampling: SamplingParams, desc: str
    ) -> list[list[Completion]]:
        from vllm import SamplingParams as VLLMSamplingParams

        params = VLLMSamplingParams(
            n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p, max_tokens=sampling.max_new_tokens
        )
        requests = [{"prompt_token_ids": ids} for ids in encode_prompts(self.tokenizer, conversations)]
        logger.info("%s: generating with vLLM", desc)
        outputs = self.llm.generate(requests, params, use_tqdm=True)
        return [
            [Completion(c.text, len(c.token_ids), c.finish_reason == "length") for c in output.outputs]
            for output in outputs
        ]

    def continue_tokens(
        self, contexts: list[list[int]], budgets: list[int], sampling: SamplingParams, seeds: list[int]
    ) -> list[list[int]]:
        """One sample per token context, at most ``budgets[i]`` new tokens, each with its own seed."""
        from vllm import SamplingParams as VLLMSamplingParams

        params = [
            VLLMSamplingParams(
                n=1, temperature=sampling.temperature, top_p=sampling.top_p, max_tokens=budget, seed=seed
            )
            for budget, seed in zip(budgets, seeds, strict=True)
        ]
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in contexts], params, use_tqdm=False)
        return [list(output.outputs[0].token_ids) for output in outputs]
