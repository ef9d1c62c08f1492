"""Wall time and step-time split of simulator runs, several methods and generation variants in one
process, with ratios to the first variant.

    python benchmarks/sim_speed.py --config recipes/sim/regime.yaml --methods seq_tis_c8 \
        --variants generate,recompute,keep --steps 100 [key=value ...]

Trains each method with each variant for ``--steps`` optimizer steps (the ``--config`` file's settings,
or the defaults, plus any ``key=value`` override) into a temporary folder and prints, per run: total
wall time, tokens/s (response tokens trained on per second of step time), the mean seconds per step
spent in generation, reward scoring, learner forward, learner backward, optimizer and held-out
evaluation, and the step time and generation time relative to the first variant. Variants:

- ``generate``: the simulator's generation before the KV-cached sampler, kept here as the baseline:
  transformers' ``generate`` and SDPA attention from a full prefill of the context in every round;
- ``recompute``: the simulator's sampler (a preallocated cache, key/value heads shared inside the
  attention kernel), ``kv_cache=recompute`` (the same samples: the cache is reused only while the
  weights are unchanged);
- ``keep``: ``kv_cache=keep`` (the cache survives weight updates, as in PipelineRL and vLLM).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from vcpo.runs import METRICS_FILE
from vcpo.sim import rollout
from vcpo.sim.config import apply_overrides, start_config
from vcpo.sim.rollout import RolloutSampler, left_padded, sampling_log_probs
from vcpo.sim.train import Trainer

PARTS = (
    ("timing_s/gen", "gen"),
    ("timing_s/reward", "reward"),
    ("timing_s/forward", "fwd"),
    ("timing_s/backward", "bwd"),
    ("timing_s/optimizer", "optim"),
    ("timing_s/testing", "eval"),
)
VARIANTS = ("generate", "recompute", "keep")


@torch.no_grad()
def _generate_sample(self, model, todo, contexts, steps):
    """The baseline: one ``generate`` call from a full prefill; returns what ``RolloutSampler._sample`` returns,
    with an empty cache (every round starts again from the whole context)."""
    s = self.sampling
    for trajectory in todo:
        trajectory.kv = None
    ids, mask = left_padded(contexts, s.pad_token_id)
    out = model.generate(
        input_ids=ids, attention_mask=mask, do_sample=True, temperature=s.temperature, top_k=0, top_p=1.0,
        max_new_tokens=steps, eos_token_id=list(s.eos_token_ids), pad_token_id=s.pad_token_id,
        output_scores=True, return_dict_in_generate=True,
    )
    tokens = out.sequences[:, ids.shape[1] :]
    log_probs, sum_pi_squared = sampling_log_probs(torch.stack(out.scores, dim=1), tokens)
    return tokens, log_probs, sum_pi_squared, None, torch.zeros(len(todo), 0)


@contextmanager
def generation_variant(variant: str):
    """The ``generate`` baseline swaps the sampler in for the run (and keeps no per-row cache)."""
    if variant != "generate":
        yield
        return
    sample, row_cache = RolloutSampler._sample, rollout._row_cache
    RolloutSampler._sample, rollout._row_cache = _generate_sample, lambda *args: None
    try:
        yield
    finally:
        RolloutSampler._sample, rollout._row_cache = sample, row_cache


def run(method: str, variant: str, args, overrides: list[str], folder: Path) -> dict:
    start = start_config(args.config)
    changes = {"method": method, "steps": args.steps, "progress": True}
    if args.lag is not None:
        changes["lag"] = args.lag
    if variant != "generate":
        changes["kv_cache"] = variant
    out = folder / f"{method}-{variant}"
    config = apply_overrides(apply_overrides(start, changes), [*overrides, f"out={out}"])
    trainer = Trainer(config)  # loads (or builds and caches) the SFT base before the clock starts
    if variant == "generate":
        trainer.rollout_model.set_attn_implementation("sdpa")  # transformers' own attention, as before
    started = time.perf_counter()
    with generation_variant(variant):
        trainer.run()
    wall = time.perf_counter() - started
    lines = [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines()]
    steps = [line for line in lines if "timing_s/step" in line]
    tokens = sum(line["perf/throughput"] * line["timing_s/step"] for line in steps)
    result = {"method": method, "variant": variant, "lag": config.lag, "wall_s": wall,
              "tokens_per_s": tokens / sum(line["timing_s/step"] for line in steps)}
    for key, name in PARTS:
        result[name] = float(np.sum([line.get(key, 0.0) for line in lines])) / len(steps)
    result["step"] = float(np.mean([line["timing_s/step"] for line in steps]))
    result["final_accuracy"] = lines[-1].get("val/accuracy")
    result["initial_accuracy"] = lines[0].get("val/accuracy")
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="a vcpo.sim --config file (default: the simulator's defaults)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lag", type=int, help="default: the config's")
    parser.add_argument("--methods", default="seq_tis_c8")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--json", type=Path, help="also write the results here")
    args, overrides = parser.parse_known_args(argv)
    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    with tempfile.TemporaryDirectory() as folder:
        results = [run(m, v, args, overrides, Path(folder)) for m in args.methods.split(",") for v in variants]
    names = [name for _, name in PARTS]
    print(f"\n{args.steps} steps, config {args.config or 'defaults'}, overrides {overrides or 'none'}; seconds per step:")
    print(f"{'method':12s} {'variant':10s} {'lag':>3s} {'wall min':>8s} {'tok/s':>7s} {'step':>6s} "
          + " ".join(f"{n:>6s}" for n in names) + "  step / first  gen / first  acc start->end")
    for r in results:
        first = next(f for f in results if f["method"] == r["method"])
        print(f"{r['method']:12s} {r['variant']:10s} {r['lag']:3d} {r['wall_s'] / 60:8.2f} {r['tokens_per_s']:7.0f} "
              f"{r['step']:6.3f} " + " ".join(f"{r[n]:6.3f}" for n in names)
              + f"  {r['step'] / first['step']:12.2f}  {r['gen'] / first['gen']:11.2f}  {r['initial_accuracy']} -> {r['final_accuracy']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
