"""The tool-integrated task (``tir``): its demonstrations, its SFT masking, its defaults, the tool's
metrics, multi-turn evaluation, and what a policy's bad programs cost."""

import os
import re
import tempfile
import threading
import time

import pytest
from scripted import END, ScriptedModel

from vcpo.local_models import build_tokenizer
from vcpo.sim.base import solution_tokens, task_tokenizer
from vcpo.sim.config import SimConfig
from vcpo.sim.rollout import (
    TOOL_CALL,
    TOOL_OUTPUT,
    TOOL_TOKEN,
    Rollouts,
    RolloutSampler,
    Sampling,
    ToolLog,
    ToolResult,
    Trajectory,
    sandbox_tool,
)
from vcpo.sim.tasks import UNCLOSED_PARENTHESIS, get_sim_task
from vcpo.sim.train import tool_metrics
from vcpo.sim.validation import validate

TIR = get_sim_task("tir")


@pytest.fixture(scope="module")
def tir_tokenizer():
    return task_tokenizer(TIR, 512)


def styles(problems):
    """One problem of each solution style: tool, forgotten print, syntax error, bare answer."""
    found = {}
    for problem in problems:
        calls = TOOL_CALL.findall(problem.solution)
        style = "bare" if not calls else "forgot_print" if not calls[0].startswith("print(") else (
            "syntax_error" if UNCLOSED_PARENTHESIS in problem.solution else "tool")  # fmt: skip
        found.setdefault(style, problem)
    return found


def test_tir_solutions_show_what_the_sandbox_returns():
    """Each demonstrated program, run by the rollouts' own tool, prints the output its demonstration
    shows, and the final answer is the ground truth; every style is present in the train split."""
    found = styles(TIR.problems("train")[:200])
    assert set(found) == {"tool", "forgot_print", "syntax_error", "bare"}
    tool = sandbox_tool(timeout_s=10.0)
    for style, problem in found.items():
        programs = TOOL_CALL.findall(problem.solution)
        outputs = [match[len("<output>") : -len("</output>")] for match in TOOL_OUTPUT.findall(problem.solution)]
        assert len(programs) == len(outputs) == {"bare": 0, "tool": 1}.get(style, 2)
        for program, shown in zip(programs, outputs, strict=True):
            result = tool(program)
            assert result.text == shown
            assert result.error == (style == "syntax_error" and program == programs[0])
        assert problem.solution.endswith(f"#### {problem.ground_truth}")
        a, b = (int(factor) for factor in re.match(r"(\d+) \* (\d+) =", problem.prompt).groups())
        assert int(problem.ground_truth) == a * b and 10 <= min(a, b) and max(a, b) < 1000


def test_sft_trains_the_policy_tokens_and_not_the_tool_outputs(tir_tokenizer):
    im_end = tir_tokenizer.convert_tokens_to_ids(END)
    problem = styles(TIR.problems("train")[:200])["syntax_error"]
    ids, trained = solution_tokens(tir_tokenizer, problem.solution, im_end)
    assert len(ids) == len(trained) and ids[-1] == im_end and trained[-1]
    policy = tir_tokenizer.decode([token for token, keep in zip(ids, trained, strict=True) if keep], skip_special_tokens=True)
    outputs = tir_tokenizer.decode([token for token, keep in zip(ids, trained, strict=True) if not keep])
    assert policy == TOOL_OUTPUT.sub("", problem.solution)
    assert outputs == "".join(TOOL_OUTPUT.findall(problem.solution))
    # a single-turn solution is one piece, all of it trained (the other tasks' SFT is unchanged)
    plain = tir_tokenizer.encode("#### 12", add_special_tokens=False)
    assert solution_tokens(tir_tokenizer, "#### 12", im_end) == (plain + [im_end], [True] * (len(plain) + 1))


def test_tir_runs_multi_turn_with_simpletirs_budget_and_rho_on_by_default():
    from vcpo.local_models import build_random_model
    from vcpo.methods import get_method
    from vcpo.recipes import load_tasks
    from vcpo.sim.learner import Learner

    paper = load_tasks()["simpletir"].paper
    config = validate(SimConfig(task="tir", method="vcpo"))
    assert (config.max_turns, config.rho_on) == (paper["max_turns"], paper["rho_on"]) == (5, 0.55)
    assert config.recorded()["max_turns"] == 5 and config.recorded()["rho_on"] == 0.55
    assert validate(config) == config  # resolved once: validating again changes nothing
    countdown = validate(SimConfig(task="countdown"))
    assert (countdown.max_turns, countdown.rho_on, countdown.max_response_tokens) == (0, None, 48)
    assert validate(SimConfig(task="tir", max_turns=0, rho_on=1.0)).max_turns == 0
    with pytest.raises(ValueError, match="validate"):
        SimConfig(task="tir").recorded()
    learner = Learner(build_random_model(build_tokenizer(), hidden_size=16, num_layers=1), get_method("vcpo"), config)
    assert learner.rule.rho_on == 0.55


def test_tool_metrics_by_hand():
    def trajectory(calls, errors):
        t = Trajectory(group=0, problem=0, prompt_ids=[1], admitted_at=0)
        t.tool_calls, t.tool_errors = calls, errors
        return t

    log = ToolLog([ToolResult("", False, seconds) for seconds in (0.1, 0.3, 0.2, 0.4)], wall_seconds=0.5)
    metrics = tool_metrics([trajectory(2, 1), trajectory(0, 0), trajectory(1, 0), trajectory(1, 1)], log, step_seconds=2.0)
    assert metrics == pytest.approx({
        "tool/calls_per_response": 1.0, "tool/error_frac": 0.5, "tool/executions": 4, "tool/time_s": 0.5,
        "tool/time_frac": 0.25, "tool/calls_per_s": 8.0, "tool/latency_p50_s": 0.3, "tool/latency_p99_s": 0.4,
    })
    assert tool_metrics([trajectory(0, 0)], ToolLog(), 1.0) == {
        "tool/calls_per_response": 0.0, "tool/error_frac": 0.0, "tool/executions": 0, "tool/time_s": 0.0, "tool/time_frac": 0.0,
    }


def test_the_tool_calls_of_a_round_run_concurrently():
    """Eight distinct programs, four workers: each program returns only once four run at once, so the round ends
    only in two waves of four (one at a time, or a repeated program run again, would leave a wave short)."""
    tokenizer = build_tokenizer()
    sampling = Sampling(max_response_tokens=64, temperature=1.0, eos_token_ids=(0,), pad_token_id=0, max_turns=1, tool_workers=4)
    wave = threading.Barrier(4, timeout=120)  # the timeout guards against a hang only: a short wave breaks it

    def meeting(code):
        wave.wait()
        return ToolResult(code)

    generator = RolloutSampler(tokenizer, sampling, meeting)
    calls = [(Trajectory(group=i, problem=i, prompt_ids=[1], admitted_at=0), f"print({i})") for i in range(8)]
    generator._run_tool_calls(calls + calls[:2])  # two responses repeat a program: it runs once
    assert not wave.broken
    assert len(generator.tool_log.results) == 8 and all(t.tool_calls == 1 for t, _ in calls[2:])


def _leftovers() -> tuple[set[int], set[str], int]:
    """This process's children, the sandbox's temporary folders (in the test's own temporary folder, so
    that other processes' sandboxes do not count), and its open file descriptors."""
    children = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    if int(handle.read().rsplit(")", 1)[1].split()[1]) == os.getpid():
                        children.add(int(entry))
            except (OSError, IndexError):
                continue
    folders = {name for name in os.listdir(tempfile.gettempdir()) if name.startswith("vcpo-sandbox-")}
    return children, folders, len(os.listdir("/proc/self/fd"))


BAD_PROGRAMS = {
    "loops": "while True:\n    pass",
    "allocates without bound": "chunks = []\nwhile True:\n    chunks.append(bytearray(10**7))",
    "prints megabytes": "print('x' * 10**8)",
    "forks": "import os\npid = os.fork()\nprint(pid)",
    "reads outside its folder": "print(open('/etc/hostname').read())",
    "leaves a file": "open('scratch.txt', 'w').write('x')\nopen('scratch.txt').read()\n1/0",
}


@pytest.mark.parametrize("what", list(BAD_PROGRAMS))
def test_a_policys_bad_program_costs_bounded_time_counts_as_an_error_and_leaves_nothing(what, tmp_path, monkeypatch):
    """A scripted policy writes the program, reads the tool's answer and ends; the rollout step
    completes (the sandbox's limits end the program, however long it would run), the call is an error, and no
    process, sandbox folder or file descriptor is left behind."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    tokenizer = build_tokenizer()
    im_end = tokenizer.convert_tokens_to_ids(END)
    timeout = 2.0
    sampling = Sampling(max_response_tokens=256, temperature=1.0, eos_token_ids=(im_end,), pad_token_id=0, max_turns=2)
    generator = RolloutSampler(tokenizer, sampling, sandbox_tool(timeout))
    rollouts = Rollouts(
        lag_model="fixed", lag=0, prompts_per_step=1, responses_per_prompt=2, update_tokens=8, seed=0,
        prompts=lambda i: tokenizer.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"), num_problems=1,
        generator=generator, model=ScriptedModel(tokenizer, [f"<code>{BAD_PROGRAMS[what]}</code>", f" #### 0{END}"]),
        weights=lambda version: {},
    )  # fmt: skip
    before = _leftovers()
    started = time.perf_counter()
    trajectories = rollouts.batch(0)  # ends although "loops" never would: the sandbox's limits end each program
    log = generator.tool_log.take()
    metrics = tool_metrics(trajectories, log, time.perf_counter() - started)
    assert metrics["tool/error_frac"] == 1.0 and metrics["tool/executions"] == 1
    for t in trajectories:
        assert t.finished and t.tool_calls == 1 and t.tool_errors == 1
        output = tokenizer.decode([token for token, v in zip(t.response_ids, t.versions, strict=True) if v == TOOL_TOKEN])
        assert output.startswith("<output>") and len(output) <= len("<output></output>") + 256
    assert _leftovers() == before


def test_multi_turn_evaluation_runs_the_tool_and_scores_the_answer():
    from vcpo.evaluation import SamplingParams, evaluate_rows
    from vcpo.sim.heldout import ToolUseGenerator

    tokenizer = build_tokenizer()
    calls = []

    def tool(code):
        calls.append(code)
        return ToolResult(f"{6 * 7}\n")

    model = ScriptedModel(tokenizer, ["<code>print(6*7)</code>", f" #### 42{END}"])
    rows = [{"prompt": [{"role": "user", "content": f"6 * 7 = ? ({i})"}], "data_source": "gsm8k",
             "reward_model": {"ground_truth": "42"}, "extra_info": {"index": i}} for i in range(3)]  # fmt: skip
    generator = ToolUseGenerator(model, tokenizer, tool, max_turns=5, batch_size=4)
    records, metrics = evaluate_rows(generator, rows, SamplingParams(n=2, temperature=1.0, top_p=1.0, max_new_tokens=48), progress=False)
    assert metrics["mean_at_n"] == 1.0 and metrics["num_samples"] == 6
    assert all(r["completion"] == "<code>print(6*7)</code><output>42\n</output> #### 42" for r in records)
    policy_tokens = len(tokenizer.encode("<code>print(6*7)</code>")) + len(tokenizer.encode(" #### 42")) + 1
    assert metrics["mean_response_tokens"] == policy_tokens  # the tool's output is not the policy's
    assert calls == ["print(6*7)"] * 2  # one execution per round: batches of 4 and 2 sequences


@pytest.mark.slow
@pytest.mark.parametrize("method, lag", [("sync", 0), ("vcpo", 2)])
def test_tir_trains_with_the_tool_from_its_sft_base(tmp_path, method, lag):
    """`python -m vcpo.sim train --task tir` with no extra keys (here shortened): multi-turn with the
    sandbox from the cached SFT base (built on first use, ~4 minutes), SimpleTIR's budget and rho_on
    recorded, tool metrics logged, the base's tool use visible in the first evaluation."""
    import json
    import subprocess
    import sys

    out = tmp_path / method
    subprocess.run(
        [sys.executable, "-m", "vcpo.sim", "train", "--task", "tir", "--method", method, "--lag", str(lag), "--steps", "4",
         "--out", str(out), "eval_every=4", "eval_problems=20", "warmup_steps=1", "threads=1", "progress=false"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    recorded = json.loads((out / "config.json").read_text())
    assert (recorded["max_turns"], recorded["rho_on"], recorded["task"]) == (5, 0.55, "tir")
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "timing_s/step" in line]
    assert [line["step"] for line in steps] == [0, 1, 2, 3] and "val/accuracy" in lines[-1]  # + the final evaluation
    assert lines[0]["val/accuracy"] > 0.1  # the base solves products only through the tool
    assert all(0 < line["tool/calls_per_response"] <= 5 and line["tool/executions"] > 0 for line in steps)
    assert all(0 <= line["tool/error_frac"] <= 1 and 0 < line["tool/time_frac"] < 1 for line in steps)
    assert max(line["async/lag_max"] for line in steps) <= lag
