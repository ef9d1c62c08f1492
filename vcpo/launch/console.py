"""What a CPU run's terminal shows while verl's trainer runs in a child process whose own output goes to a log file.

verl prints its whole config, every worker's warnings and one long ``step:N`` line per step; a person wants to know
that start-up is moving, one short line per step, and where the results went. This module follows the two files
verl writes — its log (start-up milestones) and ``metrics.jsonl`` (one record per step) — and prints:

  start-up   12 s  Ray started
  step  1/60  score 0.188  ESS 0.94  staleness 0  41.2 s
  step 10/60  score 0.312  held-out 27.0%  ESS 0.62  lr x0.81  staleness 9  38.0 s
  done: metrics runs/x/metrics.jsonl; verl's output runs/x/main_ppo.log
  last checkpoint: runs/x/checkpoints/global_step_60/actor/huggingface
  evaluate it: python -m vcpo.evaluation --model runs/x --benchmarks sums_2digit_brief --out runs/x/eval
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from vcpo.lifetimes import dies_with_this_thread
from vcpo.runs import (
    LR_SCALE,
    METRICS_FILE,
    SEQ_ESS_RATIO,
    STALENESS,
    STEP_SECONDS,
    VAL_ACCURACY,
    flat_record,
    verl_hf_checkpoint,
)

VERL_LOG = "main_ppo.log"
TRAINING_SCORE = "critic/score/mean"  # the task's score of the step's responses (verl's name)
# substrings of verl's log that mark start-up's stages, in the order they appear, and what each says to a person
START_UP_MILESTONES = (
    ("Started a local Ray instance", "Ray started"),
    ("dataset len:", "prompts loaded"),
    ("M parameters", "trainer's model built"),
    ("LLMServerManager", "rollout server up"),
    ("Creating file logger", "training starts (step 0's validation first, when asked)"),
)
# a line at least this often while nothing else is printed, so a slow start is not a hung one; a step can take minutes
# on a loaded machine, so training says so only after a longer silence
HEARTBEAT_S = {"start-up": 60.0, "training": 600.0}
TAIL_LINES = 30  # of verl's log, shown when it fails


def step_line(record: dict, total_steps: int) -> str | None:
    """One metrics record as a short line: the step, its training score, the held-out accuracy when it was evaluated,
    the sequence ESS ratio and lr scale when the method logs them, the staleness verl recorded and the step's seconds;
    None for a record with none of them."""
    flat = flat_record(record)
    parts = []
    for key, text in ((TRAINING_SCORE, "score {:.3f}"), (VAL_ACCURACY, "held-out {:.1%}"), (SEQ_ESS_RATIO, "ESS {:.2f}"),
                      (LR_SCALE, "lr x{:.2f}"), (f"{STALENESS}/max", "staleness {:.0f}"), (STEP_SECONDS, "{:.1f} s")):
        if isinstance(flat.get(key), int | float):
            parts.append(text.format(flat[key]))
    if not parts:
        return None
    width = len(str(total_steps))
    return f"step {flat['step']:>{width}}/{total_steps}  " + "  ".join(parts)


def metrics_line(line: str, total_steps: int) -> str | None:
    """`step_line` of one complete line of ``metrics.jsonl``; a line that is no record is said to be, since the
    console must not stop (and take verl's trainer with it) over one."""
    try:
        return step_line(json.loads(line), total_steps)
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"metrics.jsonl: a line that is no metrics record: {line[:80]!r}"


class LogFollower:
    """New complete lines of a file another process appends to, read from where the last call stopped; a file
    shorter than what was read (written anew: verl's file logger opens its file with "wb") is read from its start."""

    def __init__(self, path: Path):
        self.path, self.offset, self.partial = path, 0, b""

    def new_lines(self) -> list[str]:
        if not self.path.is_file():
            return []
        if self.path.stat().st_size < self.offset:
            self.offset, self.partial = 0, b""
        with open(self.path, "rb") as handle:
            handle.seek(self.offset)
            data = handle.read()
        self.offset += len(data)
        *complete, self.partial = (self.partial + data).split(b"\n")
        return [line.decode("utf-8", "replace") for line in complete]


def follow(process: subprocess.Popen, out: Path, total_steps: int, say: Callable[[str], None] = print,
           poll_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> int:
    """Print start-up milestones, then one line per metrics record, until ``process`` ends; returns its exit code."""
    log, metrics = LogFollower(out / VERL_LOG), LogFollower(out / METRICS_FILE)
    started = last_said = clock()
    milestones = list(START_UP_MILESTONES)
    stepping = False
    while True:
        code = process.poll()  # before reading, so the lines of a process that just ended are all read
        for line in log.new_lines():
            reached = [index for index, (mark, _) in enumerate(milestones) if mark in line]
            if reached:  # a stage passed unmarked is not announced after a later one
                say(f"start-up {clock() - started:5.0f} s  {milestones[reached[0]][1]}")
                del milestones[: reached[0] + 1]
                last_said = clock()
        for line in metrics.new_lines():
            if line.strip() and (text := metrics_line(line, total_steps)):
                say(text)
                stepping, last_said = True, clock()
        if code is not None:
            return code
        phase = "training" if stepping else "start-up"
        if clock() - last_said >= HEARTBEAT_S[phase]:
            say(f"{phase} {clock() - started:5.0f} s  still running (verl's output: {out / VERL_LOG})")
            last_said = clock()
        time.sleep(poll_s)


def evaluation_command(out: Path, benchmark: str) -> list[str]:
    """The command that evaluates the last checkpoint of the run folder ``out`` on ``benchmark`` (recipes/benchmarks.yaml)
    into ``out/eval``."""
    return ["python", "-m", "vcpo.evaluation", "--model", str(out), "--benchmarks", benchmark, "--out", str(out / "eval")]


def closing_lines(out: Path, code: int, benchmark: str | None = None) -> list[str]:
    """Where the run's results went and the commands that read them: the evaluation's on ``benchmark``, the held-out
    benchmark of the task the run trained (None: its prompts are none, and the line says so); on a failure, the end of
    verl's log."""
    if code:
        lines = (out / VERL_LOG).read_text(errors="replace").splitlines()[-TAIL_LINES:] if (out / VERL_LOG).is_file() else []
        return [*lines, f"verl's trainer exited with {code}; its whole output: {out / VERL_LOG}"]
    checkpoint = verl_hf_checkpoint(out)
    evaluate = (f"evaluate it: {shlex.join(evaluation_command(out, benchmark))}" if benchmark else
                "evaluate it: its prompts (a random model's, or --train / --val) are no held-out benchmark; to evaluate "
                "it on one of recipes/benchmarks.yaml, see python -m vcpo.evaluation --help")
    curves = ["python", "-m", "vcpo.reporting", "curves", str(out), "--out", str(out / "curves.png")]
    return [
        f"done: metrics {out / METRICS_FILE}; verl's output {out / VERL_LOG}",
        f"last checkpoint: {checkpoint}" if checkpoint else "no checkpoint saved (--save-every, or a run of 0 steps)",
        *([evaluate] if checkpoint else []),
        f"draw its curves: {shlex.join(curves)}",
    ]


def run_quietly(command: list[str], env: dict[str, str], out: Path, total_steps: int, benchmark: str | None = None) -> int:
    """Run verl's trainer with its output in ``out/main_ppo.log`` and this module's lines on the terminal (``benchmark``:
    the held-out benchmark the closing lines' evaluation command names, as in `closing_lines`)."""
    print(f"verl's trainer is starting (start-up takes minutes on CPU); its output: {out / VERL_LOG}", flush=True)
    with open(out / VERL_LOG, "wb") as handle:
        # killed without a chance to clean up (SIGKILL), this launcher still takes verl's trainer with it
        process = subprocess.Popen(command, env=env, cwd=out, stdout=handle, stderr=subprocess.STDOUT,
                                   preexec_fn=dies_with_this_thread)
        try:
            code = follow(process, out, total_steps, say=lambda text: print(text, flush=True))
        except BaseException:  # Ctrl-C or a kill of this launcher: verl's trainer must not run on alone
            process.terminate()
            process.wait()
            raise
    for line in closing_lines(out, code, benchmark):
        print(line, file=sys.stderr if code else sys.stdout, flush=True)
    return code
