"""Where a verl step of the real model goes on this CPU, beside the machine's limits measured in the same run.

    python benchmarks/real_model_step.py [--lag 12] [--steps 20] [--method vcpo] [--json OUT.json]

SmolLM2-135M-Instruct (``vcpo.local_models``) at the registered training's batch (recipes/real_model.yaml: prompts
x responses x response tokens) on the chosen task, in four parts, each with the threads a training gives it (the
CPU recipe for a pretrained model: one for the rollout server, every core for the trainer):

1. **Limits**: a float32 and a bfloat16 matmul's FLOP rate at the update's shapes (tokens x hidden by hidden x
   MLP width) on the server's thread, float32's on the trainer's threads, and the read bandwidth of a 538 MB tensor (the model's float32 weights, which every decode step
   reads once).
2. **Generation** (the ``hf`` rollout server alone, one batch of the training's prompts): one request at a time
   (a batch of 1, as the server decoded before batching) against batched decoding, in float32 and bfloat16; the
   bfloat16 samples' log-probs against float32's on the same tokens; the bandwidth bound (decode steps x weight
   bytes / bandwidth) and the FLOP bound (2 x parameters per sampled token / matmul rate).
3. **A verl run** (``python -m vcpo.launch.cpu``, the method at the lag): start-up (launch to the first step's
   metrics, less that step), each ``timing_s/*`` phase's median over the steps after the pipeline filled, and verl's
   ``trajectory_staleness`` per step (the lag that ran).
4. **Distances**: the update against its FLOP bound (6 x parameters x trained tokens / the float32 rate; OPOB's
   norms are extra work the bound leaves out), generation against its bandwidth bound, and the projected wall
   time of a 60-step run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from vcpo.cli import shrink_problem
from vcpo.lifetimes import dies_with_this_thread
from vcpo.locks import write_atomic

REPO = Path(__file__).resolve().parents[1]
THREADS = 1  # the rollout server's BLAS threads (the CPU recipe's)
TRAINER_THREADS = os.cpu_count() or 1  # the trainer's, for a pretrained model (vcpo.verl_plugin.cpu.recipe.environment)
STALENESS = "training/off_policy/trajectory_staleness"


def matmul_rate(dtype: torch.dtype, rows: int, hidden: int, width: int, seconds: float = 2.0) -> float:
    """FLOP/s of ``[rows, hidden] @ [hidden, width]`` in ``dtype``: the best of repeated timings."""
    a, b = torch.randn(rows, hidden, dtype=dtype), torch.randn(hidden, width, dtype=dtype)
    for _ in range(3):
        a @ b
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        started = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - started)
    return 2 * rows * hidden * width / best


def read_bandwidth(nbytes: int, repeats: int = 5) -> float:
    """Bytes/s of summing a float32 tensor of ``nbytes`` (every byte read once per pass)."""
    tensor = torch.ones(nbytes // 4)
    tensor.sum()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        tensor.sum()
        best = min(best, time.perf_counter() - started)
    return nbytes / best


def training_prompts(model_dir: Path, task: str, prompts: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from vcpo.data import load_rows

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = load_rows(task, "train")[:prompts]
    return [list(tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
            for row in rows]


def generate_once(model_dir: Path, prompts: list[list[int]], responses: int, max_tokens: int, dtype: str,
                  max_batch: int) -> dict:
    """One batch of requests through a fresh ``hf`` rollout server: seconds, tokens sampled, decode steps."""
    from vcpo.verl_plugin.cpu.rollout import HFRolloutServer, RolloutMode

    os.environ["VCPO_HF_ROLLOUT_MAX_BATCH"] = str(max_batch)
    config = {"prompt_length": max(map(len, prompts)), "response_length": max_tokens, "dtype": dtype, "seed": 0}
    server = HFRolloutServer(config, {"local_path": str(model_dir)}, RolloutMode.HYBRID)
    asyncio.run(server.launch_server())
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True}

    async def batch():
        return await asyncio.gather(*[server.generate(prompt_ids=prompt, sampling_params=dict(params), request_id=f"{i}.{j}")
                                      for i, prompt in enumerate(prompts) for j in range(responses)])

    started = time.perf_counter()
    outputs = asyncio.run(batch())
    seconds = time.perf_counter() - started
    lengths = [len(output.token_ids) for output in outputs]
    # decode steps: batched, the longest row's count; one at a time, every row's
    steps = max(lengths) if max_batch > 1 else sum(lengths)
    return {"seconds": seconds, "tokens": sum(lengths), "decode_steps": steps, "outputs": outputs}


def log_prob_error(model_dir: Path, prompts: list[list[int]], outputs, responses: int) -> dict:
    """The bfloat16 server's log-probs of its own samples against float32's on the same tokens (teacher-forced)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    errors = []
    with torch.inference_mode():
        for index, output in enumerate(outputs):
            prompt = prompts[index // responses]
            ids = torch.tensor([prompt + list(output.token_ids)])
            logits = model(input_ids=ids).logits[0, len(prompt) - 1: -1].float()
            reference = torch.log_softmax(logits, -1).gather(-1, torch.tensor(output.token_ids)[:, None])[:, 0]
            errors.append((torch.tensor(output.log_probs) - reference).abs())
    errors = torch.cat(errors)
    return {"mean_abs": float(errors.mean()), "max_abs": float(errors.max()), "tokens": int(errors.numel())}


# part 2's settings: (name, dtype, requests decoded at once)
GENERATIONS = (("one at a time, float32", "float32", 1), ("batched, float32", "float32", 64),
               ("batched, bfloat16", "bfloat16", 64))


def measured(report: dict) -> dict[str, int]:
    """What a report measured, each with its size: each generation setting, and the verl run over its steps."""
    return dict.fromkeys(report.get("generation", {}), 1) | ({"the verl run": report["run"]["steps"]} if "run" in report else {})


def verl_run(args, work: Path) -> dict:
    """One run through verl's trainer: start-up, the per-step phases after the pipeline filled, the staleness."""
    from vcpo.data import load_rows
    from vcpo.launch import overwriting
    from vcpo.recipes import read_yaml, recipes_dir
    from vcpo.reporting.run_data import read_metrics
    from vcpo.studies.real_model_lag import real_model_run_command

    plan = read_yaml(recipes_dir() / "real_model.yaml")
    choice = json.loads((REPO / "tables" / "real_model" / "task_choice.json").read_text())
    training = {**plan["training"], "steps": args.steps}
    val = load_rows(choice["chosen"], plan["task_choice"]["split"])[: training["validation"]["problems"]]
    command, out = real_model_run_command(args.method, args.lag, args.seed, training, choice["chosen"], choice["answer_format"],
                                          val, work / f"{args.method}_lag{args.lag}", work / "data",
                                          extra=("trainer.test_freq=-1", "trainer.val_before_train=false", *args.override))
    started = time.perf_counter()
    with open(work / f"{out.name}.log", "w") as log:  # every run of the benchmark measures a fresh one
        code = subprocess.run(overwriting(command), stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                              preexec_fn=dies_with_this_thread).returncode
    wall = time.perf_counter() - started
    lines = [line for line in read_metrics(out) if "timing_s/step" in line]
    if code or not lines:
        raise SystemExit(f"the verl run failed (exit {code}): see {work / f'{out.name}.log'}")
    steady = [line for line in lines if line["step"] > args.lag + 1] or lines
    phases = sorted({key for line in steady for key in line if key.startswith("timing_s/")})
    return {
        # the machine's paths left out: the interpreter as `python`, files relative to the repository
        "command": ["python", *(part.replace(f"{REPO}/", "") for part in map(str, command[1:]))], "wall_s": wall,
        "steps": len(lines),
        # start-up: the process's wall time less the steps verl timed (Ray, workers, model loads, the first sync)
        "startup_s": wall - sum(line["timing_s/step"] for line in lines),
        # medians: one step slowed by other work on the machine moves a mean of a few steps far
        "phases_s": {key: statistics.median(line.get(key, 0.0) for line in steady) for key in phases},
        "staleness": [(line["step"], line.get(f"{STALENESS}/mean"), line.get(f"{STALENESS}/max")) for line in lines],
        "response_tokens": statistics.mean(line.get("response_length/mean", 0.0) for line in steady),
        "prompt_tokens": statistics.mean(line.get("prompt_length/mean", 0.0) for line in steady),
    }


def finish_run(args, report: dict, limits: dict, training: dict, parameters: int, batched: dict | None) -> int:
    """Part 3 (the verl run) and 4 (the distances), then the JSON report."""
    from vcpo.provenance import utc_now

    responses = training["responses_per_prompt"]
    if not args.skip_run:
        print(f"3. a verl run: {args.method} at lag {args.lag}, {args.steps} steps (python -m vcpo.launch.cpu"
              f"{''.join(' ' + o for o in args.override)})", flush=True)
        args.work.mkdir(parents=True, exist_ok=True)
        run = verl_run(args, args.work)
        report["run"] = run
        print(f"   start-up {run['startup_s']:.0f} s; per step after step {args.lag + 1} (median):", flush=True)
        for key, value in sorted(run["phases_s"].items(), key=lambda item: -item[1]):
            print(f"     {key:32s} {value:7.2f} s", flush=True)
        print("   staleness per step (mean/max): " + ", ".join(f"{step}: {mean}/{high}" for step, mean, high in run["staleness"]),
              flush=True)
        trained = training["prompts_per_step"] * responses * (run["prompt_tokens"] + run["response_tokens"])
        update_bound = 6 * parameters * trained / limits["fp32_flops_trainer"]
        update = run["phases_s"].get("timing_s/update_actor", float("nan"))
        step = run["phases_s"]["timing_s/step"]
        print("4. distances", flush=True)
        print(f"   update {update:.1f} s against its FLOP bound {update_bound:.1f} s on {limits['trainer_threads']} threads "
              f"({update / update_bound:.2f}x; aim 1.5x)", flush=True)
        if batched:
            print(f"   generation {batched['seconds']:.1f} s against its bandwidth bound {batched['bandwidth_bound_s']:.1f} s "
                  f"({batched['seconds'] / batched['bandwidth_bound_s']:.1f}x; aim 3x)", flush=True)
        print(f"   60 steps: {(run['startup_s'] + 60 * step) / 60:.1f} minutes (start-up + 60 x {step:.1f} s; aim 30)", flush=True)
        report["distances"] = {"update_over_flop_bound": update / update_bound, "update_flop_bound_s": update_bound,
                               "sixty_steps_min": (run["startup_s"] + 60 * step) / 60}
    report["provenance"]["end"] = utc_now()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(args.json, json.dumps(report, indent=1, default=str) + "\n")
    return 0


def main(argv=None) -> int:
    from vcpo.local_models import packaged_model
    from vcpo.provenance import code_state, cpu_name, utc_now
    from vcpo.recipes import read_yaml, recipes_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lag", type=int, default=12)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--method", default="vcpo")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, default=REPO / "results" / "real_model" / "step_benchmark")
    parser.add_argument("--skip-run", action="store_true", help="parts 1 and 2 only (no verl run)")
    parser.add_argument("--skip-generation", action="store_true", help="no part 2 (the server alone)")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="a Hydra override appended to the verl run's (repeatable)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    planned = ({} if args.skip_generation else {name: 1 for name, _, _ in GENERATIONS}) | (
        {} if args.skip_run else {"the verl run": args.steps})
    if args.json and args.json.exists() and (problem := shrink_problem(
            args.json, measured(json.loads(args.json.read_text())), planned, "pass --json for a file of your own",
            rows="parts", unit="steps")):
        sys.exit(f"error: {problem}")
    torch.set_num_threads(THREADS)
    plan = read_yaml(recipes_dir() / "real_model.yaml")
    training = plan["training"]
    task = json.loads((REPO / "tables" / "real_model" / "task_choice.json").read_text())["chosen"]
    model_dir = packaged_model(plan["model"])
    report = {"provenance": {**code_state(), "start": utc_now(), "cpu": cpu_name(), "threads": THREADS}, "task": task,
              "batch": {key: training[key] for key in ("prompts_per_step", "responses_per_prompt", "max_response_length")}}
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    parameters, weight_bytes = 134_515_008, (model_dir / "model.safetensors").stat().st_size

    print(f"1. limits ({THREADS} thread)", flush=True)
    tokens = training["prompts_per_step"] * training["responses_per_prompt"] * (training["max_response_length"] + 48)
    limits = {"fp32_flops": matmul_rate(torch.float32, tokens, config.hidden_size, config.intermediate_size),
              "bf16_flops": matmul_rate(torch.bfloat16, tokens, config.hidden_size, config.intermediate_size),
              "read_bytes_per_s": read_bandwidth(weight_bytes), "trainer_threads": TRAINER_THREADS}
    torch.set_num_threads(TRAINER_THREADS)
    limits["fp32_flops_trainer"] = matmul_rate(torch.float32, tokens, config.hidden_size, config.intermediate_size)
    torch.set_num_threads(THREADS)
    report["limits"] = limits
    print(f"   matmul {tokens}x{config.hidden_size}x{config.intermediate_size}: float32 {limits['fp32_flops'] / 1e9:.1f} "
          f"GFLOP/s, bfloat16 {limits['bf16_flops'] / 1e9:.1f} GFLOP/s; read bandwidth {limits['read_bytes_per_s'] / 1e9:.1f} GB/s; "
          f"float32 on the trainer's {TRAINER_THREADS} threads {limits['fp32_flops_trainer'] / 1e9:.1f} GFLOP/s",
          flush=True)

    if args.skip_generation:
        return finish_run(args, report, limits, training, parameters, None)
    print("2. generation (the hf rollout server, one step's requests)", flush=True)
    prompts = training_prompts(model_dir, task, training["prompts_per_step"])
    responses, max_tokens = training["responses_per_prompt"], training["max_response_length"]
    generation = {}
    for name, dtype, max_batch in GENERATIONS:
        result = generate_once(model_dir, prompts, responses, max_tokens, dtype, max_batch)
        bytes_per_step = weight_bytes / (2 if dtype == "bfloat16" else 1)
        bound = result["decode_steps"] * bytes_per_step / limits["read_bytes_per_s"]
        flops_bound = 2 * parameters * result["tokens"] / limits["bf16_flops" if dtype == "bfloat16" else "fp32_flops"]
        generation[name] = {key: result[key] for key in ("seconds", "tokens", "decode_steps")} | {
            "bandwidth_bound_s": bound, "flop_bound_s": flops_bound}
        if dtype == "bfloat16":
            generation[name]["log_prob_error"] = log_prob_error(model_dir, prompts, result["outputs"], responses)
        row = generation[name]
        print(f"   {name}: {row['seconds']:.1f} s for {row['tokens']} tokens ({row['decode_steps']} decode steps); bandwidth "
              f"bound {bound:.1f} s ({row['seconds'] / bound:.1f}x), FLOP bound {flops_bound:.1f} s "
              f"({row['seconds'] / max(bound, flops_bound):.1f}x the larger)", flush=True)
    one, batched = generation["one at a time, float32"], generation["batched, float32"]
    print(f"   batched decoding: {one['seconds'] / batched['seconds']:.2f}x one at a time (tokens per second "
          f"{batched['tokens'] / batched['seconds']:.0f} vs {one['tokens'] / one['seconds']:.0f})", flush=True)
    error = generation["batched, bfloat16"]["log_prob_error"]
    print(f"   bfloat16 log-probs against float32 on the same {error['tokens']} tokens: mean |error| "
          f"{error['mean_abs']:.4f}, max {error['max_abs']:.3f}", flush=True)
    report["generation"] = generation

    return finish_run(args, report, limits, training, parameters, batched)


if __name__ == "__main__":
    sys.exit(main())
