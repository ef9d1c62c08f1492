"""Multi-turn evaluation with tools (python -m vcpo.evaluation --tool-config): verl's tool agent loop, turn by turn,
with the real sandboxed Python tool and a scripted policy whose every turn is known."""

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from vcpo.evaluation import SamplingParams, run_evaluation
from vcpo.evaluation.tool_use import (
    EVAL_OPTIONS,
    ToolAgentGenerator,
    ToolUse,
    tool_use_options,
    truncate_tool_response,
    verl_multi_turn_defaults,
)
from vcpo.local_models import IM_END, build_tokenizer

REPO = Path(__file__).resolve().parents[1]
TOOL_CONFIG = REPO / "recipes" / "tools" / "python_sandbox.yaml"


def tool_call(code: str, name: str = "code_interpreter") -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": {"code": code}})}\n</tool_call>{IM_END}'


class ScriptedSampler:
    """Answers each context with the text ``policy(context text, seed)``, cut at its budget; records the
    contexts, budgets and seeds of every call."""

    def __init__(self, tokenizer, policy):
        self.tokenizer, self.policy = tokenizer, policy
        self.end_ids = {tokenizer.convert_tokens_to_ids(IM_END)}
        self.calls, self.seeds = [], []

    def continue_tokens(self, contexts, budgets, sampling, seeds):
        self.calls.append((list(map(list, contexts)), list(budgets)))
        self.seeds.append(list(seeds))
        texts = [self.policy(self.tokenizer.decode(c), seed) for c, seed in zip(contexts, seeds, strict=True)]
        return [self.tokenizer.encode(text)[:budget] for text, budget in zip(texts, budgets, strict=True)]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def tool_use(**changes) -> ToolUse:
    settings = dict(tool_config=TOOL_CONFIG, max_turns=5, max_tool_response_length=1024,
                    tool_response_truncate_side="middle", max_parallel_calls=1, tool_parser="hermes")  # fmt: skip
    return ToolUse(**{**settings, **changes})


def run(tokenizer, policy, *, max_new_tokens=400, n=1, **changes):
    sampler = ScriptedSampler(tokenizer, policy)
    generator = ToolAgentGenerator(sampler, tokenizer, tool_use(**changes), model_type="qwen2", progress=False)
    sampling = SamplingParams(n=n, temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens)
    completions = generator.generate([[{"role": "user", "content": "What is 6 * 7?"}]], sampling, desc="test")
    return sampler, completions[0]


def compute_then_answer(context: str, seed: int = 0) -> str:
    if "<|im_start|>tool" not in context:
        return "Let me compute. " + tool_call("print(6 * 7)")
    return "The tool says 42, so \\boxed{42}." + IM_END


def test_a_tool_call_runs_in_the_sandbox_and_its_answer_is_the_next_turns_context(tokenizer):
    sampler, (completion,) = run(tokenizer, compute_then_answer)
    (first_contexts, first_budgets), (second_contexts, second_budgets) = sampler.calls
    chat = [{"role": "user", "content": "What is 6 * 7?"}]
    prompt = tokenizer.encode(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
    assert first_contexts == [prompt] and first_budgets == [400]
    first_turn = tokenizer.encode("Let me compute. " + tool_call("print(6 * 7)"))
    # the tool's answer as verl's Qwen builder appends it: the newline after <|im_end|>, a tool message
    # with the program's stdout, and the next assistant header
    tool_message = tokenizer.encode(f"\n<|im_start|>tool\n42{IM_END}\n<|im_start|>assistant\n")
    assert second_contexts == [prompt + first_turn + tool_message]
    assert second_budgets == [400 - len(first_turn) - len(tool_message)]
    second_turn = tokenizer.encode("The tool says 42, so \\boxed{42}." + IM_END)
    assert completion.tokens == len(first_turn) + len(second_turn)  # generated tokens; the tool's are not
    assert completion.tool_calls == 1 and not completion.truncated
    assert completion.text == tokenizer.decode(first_turn + tool_message + second_turn, skip_special_tokens=True)
    assert "tool\n42" in completion.text and completion.text.endswith("\\boxed{42}.")


def test_turns_stop_at_max_turns_and_the_last_turn_is_not_parsed(tokenizer):
    """verl ends a dialogue at max_assistant_turns before parsing its last turn: 3 turns, 2 tool calls."""
    sampler, (completion,) = run(tokenizer, lambda context, seed: tool_call("print(1)"), max_turns=3)
    assert len(sampler.calls) == 3 and completion.tool_calls == 2 and not completion.truncated
    assert completion.text.count("<tool_call>") == 3 and completion.text.count("tool\n1") == 2


def test_a_long_tool_answer_is_cut_as_verl_cuts_it(tokenizer):
    sampler, (completion,) = run(
        tokenizer, lambda context, seed: tool_call("print('ab' * 500)") if "tool\n" not in context else "done" + IM_END,
        max_tool_response_length=100,
    )  # fmt: skip
    expected = truncate_tool_response("ab" * 500, 100, "middle")
    assert expected == "ab" * 25 + "...(truncated)..." + "ab" * 25
    assert f"tool\n{expected}{IM_END}" in tokenizer.decode(sampler.calls[1][0][0])
    assert completion.tool_calls == 1 and completion.text.endswith("done")


def test_truncation_sides_are_verls():
    assert truncate_tool_response("abcdefghij", 4, "left") == "(truncated)...ghij"
    assert truncate_tool_response("abcdefghij", 4, "right") == "abcd...(truncated)"
    assert truncate_tool_response("abcdefghij", 4, "middle") == "ab...(truncated)...ij"
    assert truncate_tool_response("abcd", 4, "middle") == "abcd"


def test_the_response_budget_counts_generated_and_tool_tokens(tokenizer):
    first_turn = tokenizer.encode(tool_call("print('x' * 300)"))
    # room for the call but not for its 300-character answer: verl drops the answer and ends the dialogue
    sampler, (completion,) = run(tokenizer, lambda context, seed: tool_call("print('x' * 300)"), max_new_tokens=len(first_turn) + 20)
    assert len(sampler.calls) == 1 and completion.truncated and completion.tool_calls == 1
    assert completion.tokens == len(first_turn) and "xxx" not in completion.text
    # a turn that reaches the budget without its end-of-sequence token is truncated
    sampler, (completion,) = run(tokenizer, lambda context, seed: "1 2 3 4 5 6 7 8 9" + IM_END, max_new_tokens=5)
    assert completion.truncated and completion.tokens == 5 and completion.tool_calls == 0


def test_bad_calls_come_back_as_verls_error_messages(tokenizer):
    def policy(context, seed):
        if "tool\n" in context:
            return "ok" + IM_END
        return '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "raise ValueError(7)"}}\n</tool_call>' + IM_END

    sampler, (completion,) = run(tokenizer, policy)
    assert "ValueError: 7" in tokenizer.decode(sampler.calls[1][0][0])
    sampler, _ = run(tokenizer, lambda context, seed: "ok" + IM_END if "tool\n" in context else tool_call("1", name="calculator"))
    assert "Unknown function 'calculator'. Available tools: ['code_interpreter']" in tokenizer.decode(sampler.calls[1][0][0])


def test_every_sample_is_its_own_dialogue_with_its_own_seeds(tokenizer):
    """Dialogue i samples turn t with seed (seed * 1_000_003 + i) * max_turns + t, whichever dialogues are
    still going (here the first answers at once; the others call the tool, then answer)."""

    def policy(context, seed):
        return "\\boxed{42}" + IM_END if seed == 0 else compute_then_answer(context)

    sampler, completions = run(tokenizer, policy, n=3)
    assert [c.tool_calls for c in completions] == [0, 1, 1]
    assert [len(contexts) for contexts, _ in sampler.calls] == [3, 2]
    assert sampler.seeds == [[0, 5, 10], [6, 11]]  # max_turns 5


def test_the_eval_options_of_a_multi_turn_config_read_back_as_the_same_settings(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    from vcpo.evaluation.__main__ import parse_args

    multi_turn = {**verl_multi_turn_defaults(), "enable": True, "max_assistant_turns": 5,
                  "tool_config_path": str(TOOL_CONFIG), "max_tool_response_length": 1024}  # fmt: skip
    options = tool_use_options(multi_turn)
    args = parse_args(["--model", "org/m", "--benchmarks", "aime25", "--out", "o", *options])
    assert args.tool_use == tool_use(tool_config=TOOL_CONFIG)
    assert tool_use_options({**multi_turn, "enable": False}) == []
    with pytest.raises(ValueError, match="needs a turn limit"):
        tool_use_options({**multi_turn, "max_assistant_turns": None})
    with pytest.raises(ValueError, match=r"does not reproduce \['max_user_turns'\]"):
        tool_use_options({**multi_turn, "max_user_turns": 3})
    required = ["--model", "org/m", "--benchmarks", "aime25", "--out", "o"]
    assert parse_args(required).tool_use is None
    defaults = parse_args([*required, EVAL_OPTIONS["tool_config"], str(TOOL_CONFIG), "--max-turns", "2"]).tool_use
    assert (defaults.max_tool_response_length, defaults.tool_response_truncate_side) == (256, "middle")  # verl's
    for bad in ([EVAL_OPTIONS["tool_config"], str(TOOL_CONFIG)], ["--max-turns", "2"],
                [EVAL_OPTIONS["tool_config"], "nonesuch.yaml", "--max-turns", "2"],
                [EVAL_OPTIONS["tool_config"], str(TOOL_CONFIG), "--max-turns", "2", "--tool-parser", "hermez"]):  # fmt: skip
        with pytest.raises(SystemExit):
            parse_args([*required, *bad])


def test_a_tool_evaluation_of_a_tiny_model_records_its_settings(benchmark_data, tiny_model_dir, tmp_path):
    summary = run_evaluation(
        tiny_model_dir, ["gsm8k"], tmp_path, benchmarks_file=REPO / "recipes" / "benchmarks.yaml",
        sampling_overrides={"n": 2, "max_new_tokens": 12}, backend="hf", limit=2, source_dir=benchmark_data.root,
        tool_use=tool_use(max_turns=2),
    )  # fmt: skip
    result = summary["results"]["gsm8k"]
    assert summary["backend"] == "HFGenerator" and summary["tool_use"]["max_turns"] == 2
    assert summary["tool_use"]["tool_config"] == str(TOOL_CONFIG)
    assert result["num_samples"] == 4 and 0 < result["mean_response_tokens"] <= 12
    assert result["tool_calls_per_response"] == 0.0  # a random tiny model writes no <tool_call>


@pytest.mark.slow
def test_the_paper_workflow_evaluates_simpletir_with_its_rollouts_tool_settings(tmp_path):
    """SimpleTIR's checkpoints (and base) are evaluated multi-turn with the tool config, turns and answer
    length its verl runs use; a single-turn task's evaluation gets no tool options."""

    def eval_arguments(task):
        target = tmp_path / f"runs/{task}/base/eval/summary.json"
        command = [sys.executable, "-m", "snakemake", "-s", "workflows/Snakefile", "-n", "-p", "--configfile",
                   str(REPO / "workflows/config/paper.yaml"), "--config", f"results={tmp_path}", "--", str(target)]  # fmt: skip
        output = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert output.returncode == 0, output.stdout + output.stderr
        (line,) = [line for line in output.stdout.splitlines() if line.startswith(f"Shell command: {shlex.quote(sys.executable)} -m vcpo.evaluation")]
        return shlex.split(line.removeprefix("Shell command: ").split(">")[0])

    arguments = eval_arguments("simpletir")
    option = {name: arguments[arguments.index(name) + 1] for name in EVAL_OPTIONS.values()}
    assert Path(option["--tool-config"]).resolve() == TOOL_CONFIG and option["--max-turns"] == "5"
    assert option["--max-tool-response-length"] == "1024"  # recipes/tasks/simpletir.yaml's choice
    assert (option["--tool-response-truncate-side"], option["--max-parallel-calls"], option["--tool-parser"]) == (
        "middle", "1", "hermes")  # fmt: skip
    assert not set(EVAL_OPTIONS.values()) & set(eval_arguments("math"))


def test_hf_turns_are_greedy_generates_cut_at_their_own_budgets(tiny_model_dir):
    """HFGenerator.continue_tokens (one turn per context) against its generate (whole responses): greedy,
    a context's turn is generate's response cut at the context's budget, whatever the batch holds."""
    from vcpo.evaluation import HFGenerator
    from vcpo.evaluation.generation import encode_prompts

    generator = HFGenerator.load(tiny_model_dir, batch_size=2)
    chats = [[{"role": "user", "content": text}] for text in ("What is 2 + 2?", "Add 17 and 25, please.", "Hi")]
    greedy = SamplingParams(n=1, temperature=0.0, top_p=1.0, max_new_tokens=9)
    whole = [samples[0].text for samples in generator.generate(chats, greedy, "t")]
    budgets = [9, 4, 1]
    turns = generator.continue_tokens(encode_prompts(generator.tokenizer, chats), budgets, greedy, [0, 1, 2])
    for turn, response, budget in zip(turns, whole, budgets, strict=True):
        assert 1 <= len(turn) <= budget
        assert response.startswith(generator.tokenizer.decode(turn, skip_special_tokens=True))
        assert len(turn) == budget or turn[-1] in generator.end_ids
    sampled = SamplingParams(n=1, temperature=1.0, top_p=1.0, max_new_tokens=9)
    prompts = encode_prompts(generator.tokenizer, chats)
    first, again = (generator.continue_tokens(prompts, [9] * 3, sampled, [5, 6, 7]) for _ in range(2))
    assert first == again
