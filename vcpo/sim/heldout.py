"""Held-out accuracy of a model in memory on a simulator task, through ``vcpo.evaluation``'s harness
(the code that evaluates paper-scale checkpoints): sample, score under both answer formats, measure."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from vcpo.evaluation import Completion, HFGenerator, SamplingParams, evaluate_rows
from vcpo.evaluation.generation import Conversation, encode_prompts, end_token_ids
from vcpo.sim.rollout import TOOL_TOKEN, RolloutSampler, Sampling, ToolResult, Trajectory
from vcpo.sim.tasks import Problem, SimTask, evaluation_rows

# Sequences generated per model.generate call; a batch holds this many // samples problems.
SEQUENCES_PER_BATCH = 64


# Tokens per sampling round of a multi-turn response: a row that calls the tool early in a round keeps
# sampling to the round's end (those tokens are then cut), so long rounds waste work.
ROUND_TOKENS = 16


class ToolUseGenerator:
    """The harness's generator for multi-turn tasks: the rollouts' own sampler (one policy version), which
    stops at every ``</code>``, runs the program with ``tool`` and appends its output, at most
    ``max_turns`` times per response. A completion's text holds the tool outputs; its token count is
    that of the generated tokens (the outputs are not the policy's), while the ``max_new_tokens`` budget
    and truncation count the outputs too, as in training. Prompts in the order given, batches of
    ``batch_size`` sequences, on the CPU, the global random state left as it was."""

    def __init__(self, model, tokenizer, tool: Callable[[str], ToolResult], *, max_turns: int, tool_workers: int = 4,
                 batch_size: int = SEQUENCES_PER_BATCH):
        self.model, self.tokenizer, self.tool, self.batch_size = model, tokenizer, tool, batch_size
        self.max_turns, self.tool_workers = max_turns, tool_workers

    def generate(self, conversations: list[Conversation], sampling: SamplingParams, desc: str) -> list[list[Completion]]:
        sampler = RolloutSampler(
            self.tokenizer,
            Sampling(sampling.max_new_tokens, sampling.temperature, end_token_ids(self.model.generation_config), self.tokenizer.pad_token_id,
                     max_turns=self.max_turns, tool_workers=self.tool_workers),
            self.tool,
        )  # fmt: skip
        prompts = [ids for ids in encode_prompts(self.tokenizer, conversations) for _ in range(sampling.n)]
        trajectories = [Trajectory(i, i, ids, 0) for i, ids in enumerate(prompts)]
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.random.fork_rng(devices=[]):
                for start in range(0, len(trajectories), self.batch_size):
                    batch, rounds = trajectories[start : start + self.batch_size], 0
                    while not all(t.finished for t in batch):
                        seed = sampling.seed * 1_000_003 + start * 1_009 + rounds
                        sampler.extend(self.model, 0, batch, ROUND_TOKENS, seed)
                        rounds += 1
        finally:
            self.model.train(was_training)
        completions = [
            Completion(
                self.tokenizer.decode(t.response_ids, skip_special_tokens=True),
                sum(version != TOOL_TOKEN for version in t.versions),
                t.truncated,
                t.tool_calls,
            )
            for t in trajectories
        ]
        return [completions[start : start + sampling.n] for start in range(0, len(completions), sampling.n)]


def heldout_accuracy(
    model,
    tokenizer,
    task: SimTask,
    problems: Sequence[Problem],
    *,
    temperature: float = 1.0,
    max_new_tokens: int | None = None,
    samples: int = 1,
    seed: int = 0,
    tool: Callable[[str], ToolResult] | None = None,
    max_turns: int = 0,
    tool_workers: int = 4,
) -> dict:
    """The harness's metrics of ``model`` on ``problems``: ``samples`` responses each (temperature 0:
    greedy, one response), plain sampling from the temperature-scaled distribution (no top-k or top-p,
    as the rollouts sample), at most ``max_new_tokens`` tokens each (default: the task's budget). With
    ``tool`` and ``max_turns`` > 0 the responses are multi-turn (``ToolUseGenerator``); without, a
    response that writes a program reads no output.

    Returns ``vcpo.evaluation.evaluate_rows``' metrics (``mean_at_n`` and ``pass_at_k`` in the strict
    answer format, ``by_answer_format``, ``mean_response_tokens``, ``truncated``, ``reasons``, ...).
    Deterministic given ``seed``; the global random state and the model's training mode are left as
    they were.
    """
    if samples < 1:
        raise ValueError(f"heldout_accuracy: samples must be >= 1, got {samples}")
    n = 1 if temperature == 0 else samples  # every greedy sample would be the same
    rows = evaluation_rows(task, list(problems))
    if tool is not None and max_turns > 0:
        generator = ToolUseGenerator(model, tokenizer, tool, max_turns=max_turns, tool_workers=tool_workers)
    else:
        generator = HFGenerator(model, tokenizer, batch_size=max(1, SEQUENCES_PER_BATCH // n), progress=False)
    sampling = SamplingParams(
        n=n, temperature=temperature, top_p=1.0, max_new_tokens=max_new_tokens or task.max_response_tokens, seed=seed
    )
    _, metrics = evaluate_rows(generator, rows, sampling, desc=task.name, progress=False)
    return metrics


def validation_metrics(task_name: str, result: dict, split: str = "validation") -> dict[str, float]:
    """``heldout_accuracy``'s result under verl's validation metric names (``val-core`` the headline,
    ``val-aux`` the rest), and ``val/accuracy``, the accuracy every table and figure reads; the test
    split's under the same names with ``test`` for ``val`` (``test/accuracy``, ``test-core/...``)."""
    n = result["num_samples"] // result["num_problems"]
    prefix = {"validation": "val", "test": "test"}[split]
    return {
        f"{prefix}/accuracy": result["mean_at_n"],
        f"{prefix}-core/{task_name}/acc/mean@{n}": result["mean_at_n"],
        **{f"{prefix}-aux/{task_name}/acc/pass@{k}": value for k, value in result["pass_at_k"].items()},
        **{
            f"{prefix}-aux/{task_name}/acc_{name}/mean@{n}": format_metrics["mean_at_n"]
            for name, format_metrics in result["by_answer_format"].items()
            if name != result["answer_format"]
        },
        f"{prefix}-aux/{task_name}/response_length/mean": result["mean_response_tokens"],
        f"{prefix}-aux/{task_name}/response_length/clip_ratio": result["truncated"],
    }
