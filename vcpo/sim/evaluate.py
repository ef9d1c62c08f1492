"""Held-out accuracy of a model on a simulator task: sample, decode, score with ``vcpo.rewards``."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from vcpo.rewards import score_batch
from vcpo.sim.tasks import Problem, SimTask, render_prompt


@torch.no_grad()
def heldout_accuracy(
    model,
    tokenizer,
    task: SimTask,
    problems: Sequence[Problem],
    *,
    temperature: float = 1.0,
    max_new_tokens: int | None = None,
    batch_size: int = 64,
    samples: int = 1,
    seed: int = 0,
) -> dict:
    """Accuracy of ``model`` on ``problems``, ``samples`` responses each (temperature 0: greedy), at most
    ``max_new_tokens`` generated tokens each (default: the task's ``max_response_tokens``).

    Returns ``accuracy`` (mean over problems and samples), ``pass_at_k`` (the fraction of problems
    with at least one of its ``samples`` responses correct), ``mean_response_tokens`` (generated
    tokens, the end-of-turn token included), ``truncated`` (the fraction that hit ``max_new_tokens``
    without ending), ``reasons`` (count per ``vcpo.rewards.REASONS`` entry), ``problems`` and
    ``samples``. Deterministic given ``seed`` (and the batch size); the global RNG is left untouched
    and the model's training mode is restored.
    """
    if samples < 1 or batch_size < 1:
        raise ValueError(f"heldout_accuracy: samples and batch_size must be >= 1, got {samples}, {batch_size}")
    if not problems:
        raise ValueError("heldout_accuracy: no problems")
    if max_new_tokens is None:
        max_new_tokens = task.max_response_tokens
    greedy = temperature == 0
    if greedy:
        samples = 1  # every sample would be the same
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos) if isinstance(eos, list | tuple) else {eos}
    pad_id = tokenizer.pad_token_id
    # Plain sampling from the temperature-scaled distribution: top_k=0 and top_p=1 switch off the
    # library defaults (top_k=50), as the RL rollouts sample from the full distribution too.
    sampling = (
        {"do_sample": False} if greedy else {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    )
    prompts = [render_prompt(tokenizer, problem) for problem in problems for _ in range(samples)]
    was_training = model.training
    model.eval()
    padding_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    responses: list[str] = []
    lengths: list[int] = []
    truncated = 0
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for start in range(0, len(prompts), batch_size):
                inputs = tokenizer(
                    prompts[start : start + batch_size], return_tensors="pt", padding=True, add_special_tokens=False
                ).to(model.device)
                output = model.generate(**inputs, max_new_tokens=max_new_tokens, pad_token_id=pad_id, **sampling)
                generated = output[:, inputs["input_ids"].shape[1] :].tolist()
                for ids in generated:
                    ended = next((i for i, token in enumerate(ids) if token in eos_ids), None)
                    kept = ids if ended is None else ids[: ended + 1]
                    truncated += ended is None
                    lengths.append(len(kept))
                    responses.append(tokenizer.decode(kept, skip_special_tokens=True))
    finally:
        tokenizer.padding_side = padding_side
        model.train(was_training)
    ground_truths = [problem.ground_truth for problem in problems for _ in range(samples)]
    results = score_batch([task.data_source] * len(responses), responses, ground_truths)
    correct = [result["score"] for result in results]
    per_problem = [correct[i * samples : (i + 1) * samples] for i in range(len(problems))]
    return {
        "accuracy": sum(correct) / len(correct),
        "pass_at_k": sum(max(scores) for scores in per_problem) / len(problems),
        "mean_response_tokens": sum(lengths) / len(lengths),
        "truncated": truncated / len(responses),
        "reasons": dict(Counter(result["reason"] for result in results)),
        "problems": len(problems),
        "samples": samples,
    }
