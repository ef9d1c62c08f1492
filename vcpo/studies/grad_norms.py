"""Figure 14's measurement: exact per-sequence squared gradient norms against OTB's logit-energy proxy
(and OPO's, the response length) on one batch of held-out prompts, sampled from the final checkpoint of
a finished synchronous simulator run. It needs the model, so it lives with the simulator; ``vcpo.reporting``
draws the JSON it writes.

    python -m vcpo.studies.grad_norms --runs RUNS --task countdown --out JSON [--sequences 32]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from vcpo.core import PerSequenceGradients, logit_energy_proxy
from vcpo.reporting.run_data import run_dirs, seed_of
from vcpo.sim.learner import collate, response_log_probs
from vcpo.sim.rollout import RolloutSampler, Sampling, Trajectory
from vcpo.sim.tasks import get_sim_task, render_prompt


def sample_responses(model, tokenizer, problems, max_response_tokens: int, temperature: float, seed: int):
    """One response per problem, sampled with the simulator's rollout code, as a learner ``Batch``."""
    import torch

    eos = model.generation_config.eos_token_id
    eos = tuple(eos) if isinstance(eos, list | tuple) else (eos,)
    sampling = Sampling(max_response_tokens, temperature, eos, tokenizer.pad_token_id)
    prompts = [tokenizer.encode(render_prompt(tokenizer, p), add_special_tokens=False) for p in problems]
    trajectories = [Trajectory(i, i, prompt, admitted_at=0) for i, prompt in enumerate(prompts)]
    with torch.random.fork_rng(devices=[]):
        RolloutSampler(tokenizer, sampling).extend(model.eval(), 0, trajectories, max_response_tokens, seed)
    dtype = torch.promote_types(model.dtype, torch.float32)
    return collate(trajectories, [0.0] * len(trajectories), tokenizer.pad_token_id, dtype)


def exact_and_proxy(model, batch, temperature: float) -> tuple[np.ndarray, np.ndarray]:
    """Per sequence: ||∇_θ Σ_t log π(y_t)||² over all trainable parameters (`PerSequenceGradients`, one
    backward) and OTB's `logit_energy_proxy` from the same forward's logits, both float64 (B,)."""
    import torch

    logits = []

    def forward(**inputs):
        output = model(**inputs)
        logits.append(output.logits)
        return output

    per_sequence = PerSequenceGradients(model)
    ones = torch.ones(batch.size, dtype=torch.float64)
    with per_sequence.micro_batch(ones, torch.zeros_like(ones)):
        response_log_probs(forward, batch, temperature).sum().backward()
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        scaled = logits[0].detach()[:, batch.prompt_width - 1 : -1] / temperature
        proxy = logit_energy_proxy(scaled, batch.response_ids, batch.mask)
    return per_sequence.sq_norms.numpy(), proxy.numpy()


def correlations(x: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """Pearson (of the values and of their logs) and Spearman (Pearson of average ranks) correlations."""

    def ranks(v: np.ndarray) -> np.ndarray:
        _, inverse = np.unique(v, return_inverse=True)
        order = np.empty(len(v))
        order[np.argsort(v, kind="stable")] = np.arange(len(v))
        return (np.bincount(inverse, order) / np.bincount(inverse))[inverse]

    def pearson(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.corrcoef(a, b)[0, 1])

    return {
        "pearson": pearson(x, y),
        "pearson_log": pearson(np.log(x), np.log(y)),
        "spearman": pearson(ranks(x), ranks(y)),
    }


def finished_sync_run(root: Path, task: str) -> Path | None:
    """The first seed of ``task``'s sync run below ``root`` with a final checkpoint."""
    found = [d for d in run_dirs(root, task, "sync", 0) if (d / "final").is_dir() and (d / "config.json").exists()]
    return found[0] if found else None


def measure(run: Path, sequences: int = 32) -> dict:
    """The measurement on ``sequences`` held-out problems of the run's task, one response each, sampled at
    the run's temperature with the run's seed."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((run / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(run / "final", dtype=getattr(torch, config["learner_dtype"]))
    tokenizer = AutoTokenizer.from_pretrained(run / "final")
    problems = get_sim_task(config["task"]).problems("validation")[:sequences]
    temperature, max_tokens = config["temperature"], config["max_response_tokens"]
    batch = sample_responses(model, tokenizer, problems, max_tokens, temperature, seed_of(run))
    exact, proxy = exact_and_proxy(model, batch, temperature)
    lengths = batch.mask.sum(-1).numpy().astype(float)
    return {
        "run": str(run), "task": config["task"], "sequences": len(exact), "temperature": temperature,
        "max_response_tokens": max_tokens, "score": "sum_t log pi(y_t), gradient over all trainable parameters",
        "otb_proxy": correlations(exact, proxy), "opo_length": correlations(exact, lengths),
        "exact_sq_norms": exact.tolist(), "logit_energy_proxy": proxy.tolist(), "response_tokens": lengths.tolist(),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vcpo.studies.grad_norms", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=Path, required=True, help="RUNS/<task>/sync/lag0/seed<s>/")
    parser.add_argument("--task", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sequences", type=int, default=32)
    args = parser.parse_args(argv)
    run = finished_sync_run(args.runs, args.task)
    # no run: the JSON says so, and the figure drawn from it too (the workflow always gets its file)
    result = measure(run, args.sequences) if run else {"missing": f"no finished run {args.task}/sync/lag0/seed*/final below {args.runs}"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
