"""Multi-turn evaluation with tools, sampled the way verl's tool agent loop samples in training.

A model trained with tool calls (SimpleTIR) is measured with them: the prompt lists the tools through
the chat template, each assistant turn ends at end-of-sequence, a Hermes ``<tool_call>`` in it runs the
tool, and the tool's answer comes back as a ``tool`` message, until the model answers without a call,
makes ``max_turns`` assistant turns or fills the response budget. The pieces are verl's own (its
Continuous Token builder, Hermes parser and tool registry, as ``ToolAgentLoop`` uses them), so a
checkpoint sees in evaluation the token stream it saw in its rollouts; only the turn-by-turn sampling is
the evaluation backend's (``continue_tokens`` of ``HFGenerator`` or ``VLLMGenerator``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tqdm.auto import tqdm

from vcpo.evaluation.generation import Completion, Conversation, SamplingParams
from vcpo.upstream import require

TRUNCATE_SIDES = ("left", "middle", "right")


# ToolUse field <- verl's actor_rollout_ref.rollout.multi_turn key, and the python -m vcpo.evaluation option of each.
MULTI_TURN_KEYS = {
    "tool_config": "tool_config_path",
    "max_turns": "max_assistant_turns",
    "max_tool_response_length": "max_tool_response_length",
    "tool_response_truncate_side": "tool_response_truncate_side",
    "max_parallel_calls": "max_parallel_calls",
    "tool_parser": "format",
}
EVAL_OPTIONS = {field: "--" + field.replace("_", "-") for field in MULTI_TURN_KEYS}
UNSUPPORTED_MULTI_TURN_KEYS = ("max_user_turns", "function_tool_path")


@dataclass(frozen=True)
class ToolUse:
    """The multi-turn settings of a training run (verl's ``rollout.multi_turn``), to evaluate it alike."""

    tool_config: Path  # verl tool config YAML (recipes/tools/python_sandbox.yaml)
    max_turns: int  # assistant turns per response
    max_tool_response_length: int  # characters of a tool answer kept (verl counts characters)
    tool_response_truncate_side: str  # which part of a longer answer is cut
    max_parallel_calls: int  # tool calls of one turn that are run
    tool_parser: str  # verl tool parser of the model's calls ("hermes": <tool_call> JSON)

    def __post_init__(self):
        if min(self.max_turns, self.max_tool_response_length, self.max_parallel_calls) < 1:
            raise ValueError(
                f"ToolUse: max_turns, max_tool_response_length and max_parallel_calls must be >= 1, got {self}"
            )
        if self.tool_response_truncate_side not in TRUNCATE_SIDES:
            raise ValueError(f"ToolUse: tool_response_truncate_side must be one of {TRUNCATE_SIDES}, got {self}")
        if not Path(self.tool_config).is_file():
            raise FileNotFoundError(f"ToolUse: tool config {str(self.tool_config)!r} does not exist")


def verl_multi_turn_defaults() -> dict[str, Any]:
    """verl's own defaults of ``rollout.multi_turn`` (what a run that does not set a key uses)."""
    import verl
    from omegaconf import OmegaConf

    rollout = OmegaConf.load(Path(verl.__file__).parent / "trainer" / "config" / "rollout" / "rollout.yaml")
    return OmegaConf.to_container(rollout.multi_turn)


def tool_use_options(multi_turn: Mapping[str, Any]) -> list[str]:
    """The ``python -m vcpo.evaluation`` options that evaluate the way rollouts with this ``rollout.multi_turn``
    config sample; none where multi-turn rollouts are off. ValueError for the settings the evaluation
    does not reproduce (no turn limit, a user-turn limit, function tools)."""
    if not multi_turn.get("enable"):
        return []
    if multi_turn.get("max_assistant_turns") is None:
        raise ValueError("rollout.multi_turn.max_assistant_turns: the tool evaluation needs a turn limit, got null")
    unsupported = [key for key in UNSUPPORTED_MULTI_TURN_KEYS if multi_turn.get(key) is not None]
    if unsupported:
        raise ValueError(f"rollout.multi_turn: the tool evaluation does not reproduce {unsupported}")
    return [str(item) for field, key in MULTI_TURN_KEYS.items() for item in (EVAL_OPTIONS[field], multi_turn[key])]


class TokenSampler(Protocol):
    end_ids: set[int]  # the tokens that end a turn

    def continue_tokens(
        self, contexts: list[list[int]], budgets: list[int], sampling: SamplingParams, seeds: list[int]
    ) -> list[list[int]]:
        """One continuation per context, at most ``budgets[i]`` tokens, through its end-of-sequence token,
        sampled with ``seeds[i]``."""


def truncate_tool_response(text: str, limit: int, side: str) -> str:
    """verl's cut of a tool answer longer than ``limit`` characters (``ToolAgentLoop._call_tool``)."""
    if len(text) <= limit:
        return text
    if side == "left":
        return "(truncated)..." + text[-limit:]
    if side == "right":
        return text[:limit] + "...(truncated)"
    half = limit // 2
    return text[:half] + "...(truncated)..." + text[-half:]


@dataclass
class _Dialogue:
    index: int  # in the order of the completions
    messages: list[dict[str, Any]]
    ids: list[int]
    prompt_length: int
    generated: int = 0
    turns: int = 0
    tool_calls: int = 0
    truncated: bool = False
    finished: bool = False

    @property
    def response_length(self) -> int:
        return len(self.ids) - self.prompt_length


class ToolAgentGenerator:
    """The harness's generator for tool-using checkpoints (``python -m vcpo.evaluation --tool-config``): ``sampling.n``
    multi-turn dialogues per conversation, a turn of every unfinished dialogue per ``continue_tokens``
    call. A completion's text is the whole response, tool answers included; its token count is that of
    the generated tokens; ``max_new_tokens`` bounds generated and tool tokens together, as verl's
    ``response_length`` does, and a dialogue stopped by it counts as truncated."""

    def __init__(
        self, sampler: TokenSampler, tokenizer, tool_use: ToolUse, *, model_type: str | None, progress: bool = True
    ):
        from verl.experimental.agent_loop.tool_parser import ToolParser
        from verl.tools.tool_registry import initialize_tools_from_config
        from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

        require("tool_use_evaluation")
        self.sampler, self.tokenizer, self.tool_use, self.progress = sampler, tokenizer, tool_use, progress
        self.tools = {tool.name: tool for tool in initialize_tools_from_config(str(tool_use.tool_config))}
        self.schemas = [
            tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True) for tool in self.tools.values()
        ]
        self.parser = ToolParser.get_tool_parser(tool_use.tool_parser, tokenizer)
        self.builder = create_continuous_token_builder(tokenizer, hf_model_type=model_type)

    def generate(
        self, conversations: list[Conversation], sampling: SamplingParams, desc: str
    ) -> list[list[Completion]]:
        dialogues = []
        for conversation in conversations:
            prompt = self.builder.build_initial_tokens(list(conversation), tools=self.schemas)
            dialogues += [
                _Dialogue(len(dialogues) + sample, list(conversation), list(prompt), len(prompt))
                for sample in range(sampling.n)
            ]
        with tqdm(total=self.tool_use.max_turns, desc=f"{desc} (tool turns)", disable=not self.progress) as bar:
            for turn in range(self.tool_use.max_turns):
                active = [dialogue for dialogue in dialogues if not dialogue.finished]
                if not active:
                    break
                turns = self._assistant_turn(active, sampling, turn)
                going = [
                    (dialogue, last) for dialogue, last in zip(active, turns, strict=True) if not dialogue.finished
                ]
                asyncio.run(self._tool_turn(going, sampling.max_new_tokens))
                bar.update()
        completions = [
            Completion(
                self.tokenizer.decode(dialogue.ids[dialogue.prompt_length :], skip_special_tokens=True),
                dialogue.generated,
                dialogue.truncated,
                dialogue.tool_calls,
            )
            for dialogue in dialogues
        ]
        return [completions[start : start + sampling.n] for start in range(0, len(completions), sampling.n)]

    def _assistant_turn(self, dialogues: list[_Dialogue], sampling: SamplingParams, turn: int) -> list[list[int]]:
        """Sample and return a turn of each dialogue; finish those out of response budget or of turns. Each
        dialogue and turn has a seed of its own (the same whichever other dialogues are still going)."""
        budgets = [sampling.max_new_tokens - dialogue.response_length for dialogue in dialogues]
        seeds = [(sampling.seed * 1_000_003 + d.index) * self.tool_use.max_turns + turn for d in dialogues]
        turns = self.sampler.continue_tokens([dialogue.ids for dialogue in dialogues], budgets, sampling, seeds)
        for dialogue, generated, budget in zip(dialogues, turns, budgets, strict=True):
            dialogue.ids += generated
            dialogue.generated += len(generated)
            dialogue.turns += 1
            if len(generated) >= budget:
                dialogue.finished = True
                dialogue.truncated = generated[-1] not in self.sampler.end_ids
            elif dialogue.turns >= self.tool_use.max_turns:
                dialogue.finished = True
        return turns

    async def _tool_turn(self, going: list[tuple[_Dialogue, list[int]]], budget: int) -> None:
        """Parse each dialogue's last turn; finish those without a tool call, run the others' first
        ``max_parallel_calls`` calls, all at once, and append the answers as ``tool`` messages, unless
        they do not fit the ``budget`` of response tokens."""
        schemas = [tool.tool_schema for tool in self.tools.values()]  # what verl's loop gives its parser
        parsed = await asyncio.gather(*(self.parser.extract_tool_calls(last, schemas) for _, last in going))
        calling = []
        for (dialogue, _), (content, calls) in zip(going, parsed, strict=True):
            calls = calls[: self.tool_use.max_parallel_calls]
            dialogue.messages.append(_assistant_message(content, calls))
            if calls:
                calling.append((dialogue, calls))
            else:
                dialogue.finished = True
        answers = await asyncio.gather(*(self._call(call) for _, calls in calling for call in calls))
        for dialogue, calls in calling:
            dialogue.tool_calls += len(calls)
            previous = list(dialogue.messages)
            dialogue.messages += [{"role": "tool", "content": answers.pop(0)} for _ in calls]
            merged = self.builder.merge_context_tokens(previous, dialogue.messages, dialogue.ids, tools=self.schemas)
            if len(merged.token_ids) - dialogue.prompt_length >= budget:  # verl drops the answers
                dialogue.finished = dialogue.truncated = True
            else:
                dialogue.ids = list(merged.token_ids)

    async def _call(self, call) -> str:
        """The tool's answer to one parsed call, as verl's agent loop gives it (errors as text)."""
        tool = self.tools.get(call.name)
        if tool is None:
            return f"Unknown function '{call.name}'. Available tools: {list(self.tools)}"
        try:
            arguments = json.loads(call.arguments)
        except (json.JSONDecodeError, TypeError) as error:
            return f"Invalid JSON in arguments for '{call.name}': {error}"
        instance_id = None
        try:
            instance_id, _ = await tool.create()
            response, _reward, _metrics = await tool.execute(instance_id, arguments)
        except Exception as error:  # noqa: BLE001 - verl returns any tool failure to the model as text
            return f"Error executing tool '{call.name}': {error}"
        finally:
            if instance_id is not None:
                await tool.release(instance_id)
        return truncate_tool_response(
            response.text or "", self.tool_use.max_tool_response_length, self.tool_use.tool_response_truncate_side
        )


def _assistant_message(content: str, calls: list) -> dict[str, Any]:
    """The assistant message verl's loop records for a turn (``ToolAgentLoop._build_assistant_message``):
    arguments as a mapping, or the raw text where they are not a JSON object."""
    from verl.tools.schemas import OpenAIFunctionCallSchema, OpenAIFunctionParsedSchema

    message: dict[str, Any] = {"role": "assistant", "content": content or ""}
    if calls:
        message["tool_calls"] = []
        for call in calls:
            parsed = OpenAIFunctionParsedSchema(name=call.name, arguments=call.arguments)
            function, decode_error = OpenAIFunctionCallSchema.from_openai_function_parsed_schema(parsed)
            raw = {"name": call.name, "arguments": call.arguments}
            message["tool_calls"].append(
                {"type": "function", "function": raw if decode_error else function.model_dump()}
            )
    return message
