"""The simulator's training loop: rollouts under a lag model -> rewards -> one optimizer step, repeated.

Writes into ``out`` (through `vcpo.sim.run_folder`): ``config.json`` (the resolved configuration, method preset
included), ``metrics.jsonl`` (one object per optimizer step, verl metric names plus the paper's diagnostics),
``checkpoint.pt`` (everything needed to continue: weights, optimizer, the rollout server's queue,
the snapshots the lag model still needs) and, at the end, ``final/`` (a save_pretrained model that
``python -m vcpo.evaluation`` reads). A run restarted with the same ``out`` continues from its checkpoint and
writes the same metrics an uninterrupted run would (generation seeds derive from (seed, step)).
"""

from __future__ import annotations

import copy
import functools
import time
from collections import Counter
from pathlib import Path

import torch
from tqdm.auto import tqdm

from vcpo.evaluation.generation import end_token_ids
from vcpo.rewards import score_batch
from vcpo.runs import FINAL_DIR, SEQ_ESS_RATIO
from vcpo.sim.base import sft_base
from vcpo.sim.concurrent import GeneratorDied, GeneratorInterrupt, GeneratorProcess, Produced
from vcpo.sim.config import SimConfig
from vcpo.sim.heldout import heldout_accuracy, validation_metrics
from vcpo.sim.learner import Learner, collate, response_log_probs, token_lags, warmup_stable_decay
from vcpo.sim.rollout import (
    Rollouts,
    RolloutSampler,
    Sampling,
    ToolLog,
    Trajectory,
    sandbox_tool,
    use_grouped_query_sdpa,
)
from vcpo.sim.run_folder import RunFolder
from vcpo.sim.tasks import render_prompt
from vcpo.sim.validation import ResolvedRun, resolve

# Metrics that measure the machine, not the run: they differ between a resumed and an uninterrupted run,
# and between a serial and a concurrent one.
TIMING_PREFIXES = ("timing_s/", "perf/", "tool/time_", "tool/calls_per_s", "tool/latency_")


def tool_metrics(trajectories: list[Trajectory], log: ToolLog, step_seconds: float) -> dict[str, float]:
    """The tool's work in one step: calls and errors of the batch's responses (an error: an exception, a
    timeout or a limit), and the sandbox executions the step's generation ran (identical programs of a
    round run once), their throughput, latency and share of the step."""
    calls = sum(t.tool_calls for t in trajectories)
    latencies = sorted(result.seconds for result in log.results)
    metrics = {
        "tool/calls_per_response": calls / len(trajectories),
        "tool/error_frac": sum(t.tool_errors for t in trajectories) / calls if calls else 0.0,
        "tool/executions": len(latencies),
        "tool/time_s": log.wall_seconds,
        "tool/time_frac": log.wall_seconds / step_seconds,
    }
    if latencies:
        metrics["tool/calls_per_s"] = len(latencies) / log.wall_seconds
        metrics["tool/latency_p50_s"] = latencies[len(latencies) // 2]
        metrics["tool/latency_p99_s"] = latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))]
    return metrics


class Trainer:
    """Builds every part of a run from its config; ``run()`` trains to ``config.steps``."""

    def __init__(self, config: SimConfig):
        run = resolve(config)
        self.config = run.config
        self.folder = RunFolder(run)  # one writer per run folder, from before any work to the end of run()
        try:
            self._build(run)
        except BaseException:
            self.folder.close()  # a failed setup leaves the folder free at once, not at garbage collection
            raise

    def _build(self, run: ResolvedRun) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        config = run.config
        if config.threads:
            torch.set_num_threads(config.threads)
        self.out = self.folder.out
        self.task = run.task
        # the given SFT base, else the cached one of (task, model_size, base_seed), built on first use
        self.base = Path(config.base) if config.base is not None else sft_base(
            run.task, config.model_size, seed=config.base_seed, progress=config.progress)
        self.tokenizer = AutoTokenizer.from_pretrained(self.base)
        learner_dtype = getattr(torch, config.learner_dtype)
        torch.manual_seed(config.seed)
        self.model = AutoModelForCausalLM.from_pretrained(self.base, dtype=learner_dtype)
        self.model.train()
        self.rollout_model = copy.deepcopy(self.model).to(getattr(torch, run.rollout_dtype)).eval()
        use_grouped_query_sdpa(self.rollout_model)
        ref_model = None
        if run.method.spec.get("kl_in_reward_beta"):
            ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.learner = Learner(self.model, run.method, config, base_lr=run.base_lr, rule=run.rule,
                               ref_model=ref_model)
        self.lag = config.lag

        self.train_problems = self.task.problems("train")
        self.eval_problems = self.task.problems("validation")[: config.eval_problems]
        self.test_problems = self.task.problems("test")[: config.test_problems] if config.test_problems else []
        self.replayed_scales = run.replayed_lr_scales
        sampling = Sampling(
            max_response_tokens=config.max_response_tokens,
            temperature=config.temperature,
            eos_token_ids=end_token_ids(self.model.generation_config),
            pad_token_id=self.tokenizer.pad_token_id,
            max_turns=config.max_turns,
            tool_workers=config.tool_workers,
            kv_cache=config.kv_cache,
        )
        self.tool = sandbox_tool(config.tool_timeout_s) if config.max_turns else None
        self.generator = RolloutSampler(self.tokenizer, sampling, self.tool)
        self.snapshots: dict[int, dict] = {}
        self.rollouts = Rollouts(
            lag_model=config.lag_model,
            lag=self.lag,
            prompts_per_step=config.prompts_per_step,
            responses_per_prompt=config.responses_per_prompt,
            update_tokens=config.update_tokens,
            seed=config.seed,
            prompts=functools.lru_cache(maxsize=None)(
                lambda i: self.tokenizer.encode(render_prompt(self.tokenizer, self.train_problems[i]), add_special_tokens=False)
            ),
            num_problems=len(self.train_problems),
            generator=self.generator,
            model=self.rollout_model,
            weights=self.snapshot,
        )
        self.step = 0
        self._ran = False
        self._prox_model = None
        self.generator_process: GeneratorProcess | None = None  # execution=concurrent, while run() runs
        self._rollout_state: dict | None = None  # the server's state after the last batch trained on, at checkpoint steps

    # -- snapshots of policy versions ---------------------------------------------------------------
    def snapshot(self, version: int) -> dict:
        if version == self.step:
            return self.model.state_dict()
        if version not in self.snapshots:
            raise RuntimeError(f"policy version {version} was asked for at step {self.step} but not kept")
        return self.snapshots[version]

    def _versions_needed(self, step: int) -> set[int]:
        return self.rollouts.versions_needed(step) | self._prox_versions(step)

    def _keep_snapshots(self) -> None:
        """Keep the older versions the coming step asks for; copy the current weights only if a later
        step will ask for them (the current version itself is read live)."""
        needed = self._versions_needed(self.step)
        for version in list(self.snapshots):
            if version not in needed:
                del self.snapshots[version]
        if self.step in self._versions_needed(self.step + 1) and self.step < self.config.steps:
            self.snapshots[self.step] = {name: value.detach().clone() for name, value in self.model.state_dict().items()}

    def _prox_versions(self, step: int) -> set[int]:
        """P3O two-anchor: the proximal snapshot is the policy at the start of the optimizer epoch,
        i.e. of the rollout batch (minibatch lag model); with one step per batch it is θ itself."""
        if not self.learner.needs_prox or self.config.lag_model != "minibatch":
            return set()
        return {step - step % (self.lag + 1)}

    def _prox_log_prob(self, batch) -> torch.Tensor | None:
        versions = self._prox_versions(self.step)
        if not versions or versions == {self.step}:
            return None
        if self._prox_model is None:
            self._prox_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        self._prox_model.load_state_dict(self.snapshot(versions.pop()))
        with torch.no_grad():
            return response_log_probs(self._prox_model, batch, self.config.temperature)

    # -- checkpoints -----------------------------------------------------------------------------
    def checkpoint_due(self, steps_done: int) -> bool:
        return steps_done % self.config.checkpoint_every == 0 or steps_done == self.config.steps

    def _checkpoint_state(self) -> dict:
        return {
            "step": self.step,
            "model": self.model.state_dict(),
            "optimizer": self.learner.optimizer.state_dict(),
            "rollouts": self._rollout_state,
            "snapshots": self.snapshots,
        }

    def _resume(self) -> None:
        """Continue from the folder's newest checkpoint, if it has one."""
        state = self.folder.resume()
        if state is None:
            return
        self.model.load_state_dict(state["model"])
        self.learner.optimizer.load_state_dict(state["optimizer"])
        self.rollouts.load_state_dict(state["rollouts"])
        self.snapshots = state["snapshots"]
        self.step = state["step"]

    # -- evaluation ------------------------------------------------------------------------------
    def evaluate(self, split: str = "validation") -> dict[str, float]:
        """Held-out metrics under verl's validation names; ``split="test"``: the final evaluation's test
        problems, under ``test/...`` names."""
        problems, samples = (self.eval_problems, self.config.eval_samples) if split == "validation" else (
            self.test_problems, self.config.test_samples)
        if not problems:
            return {}
        started = time.perf_counter()
        self.model.eval()
        result = heldout_accuracy(
            self.model,
            self.tokenizer,
            self.task,
            problems,
            temperature=self.config.eval_temperature,
            max_new_tokens=self.config.max_response_tokens,
            samples=samples,
            seed=self.config.seed,  # the same random numbers at every evaluation: checkpoints differ by less noise
            tool=self.tool,
            max_turns=self.config.max_turns,
            tool_workers=self.config.tool_workers,
        )
        self.model.train()
        if split == "test":
            return {**validation_metrics(self.task.name, result, split="test"), "timing_s/final_test": time.perf_counter() - started}
        return {**validation_metrics(self.task.name, result), "timing_s/testing": time.perf_counter() - started}

    # -- the loop --------------------------------------------------------------------------------
    def produce(self, step: int) -> Produced:
        """The generator side of a step: the batch of ``step`` and its rewards (in the generator process
        under execution=concurrent), with the server's state where the learner will checkpoint."""
        started = time.perf_counter()
        trajectories = self.rollouts.batch(step)
        generated = time.perf_counter()
        results = self._score(trajectories)
        return Produced(
            step=step,
            trajectories=trajectories,
            results=results,
            tool_log=self.generator.tool_log.take() if self.tool is not None else None,
            timings={"timing_s/gen": generated - started, "timing_s/reward": time.perf_counter() - generated},
            rollout_state=self.rollouts.state_dict() if self.checkpoint_due(step + 1) else None,
        )

    def _read_weights_through(self, get) -> None:
        self.rollouts.weights = get

    def train_step(self) -> dict:
        config = self.config
        started = time.perf_counter()
        metrics: dict = {"step": self.step, "training/global_step": self.step}
        if config.eval_every and self.step % config.eval_every == 0:
            metrics.update(self.evaluate())
        if self.generator_process is None:
            produced = self.produce(self.step)
        else:
            waiting = time.perf_counter()
            produced = self.generator_process.next_batch(self.step)
            metrics["timing_s/wait_gen"] = time.perf_counter() - waiting
        metrics.update(produced.timings)
        if produced.rollout_state is not None:
            self._rollout_state = produced.rollout_state
        trajectories, results = produced.trajectories, produced.results
        batch = collate(trajectories, [r["score"] for r in results], self.tokenizer.pad_token_id, self.model.dtype)

        update_started = time.perf_counter()
        schedule_factor = warmup_stable_decay(self.step, config.steps, config.warmup_steps, config.decay_steps)
        replayed = None if self.replayed_scales is None else self.replayed_scales[self.step]
        metrics.update(self.learner.update(batch, schedule_factor, self._prox_log_prob(batch), step_scale=replayed))
        metrics["timing_s/update_actor"] = time.perf_counter() - update_started
        metrics.update(self._batch_metrics(batch, trajectories, results))

        self.step += 1
        self._keep_snapshots()
        if self.generator_process is not None:
            self.generator_process.publish(self.step, self.model.state_dict())
        elapsed = time.perf_counter() - started
        metrics["timing_s/step"] = elapsed
        metrics["perf/throughput"] = int(batch.mask.sum()) / elapsed
        if self.tool is not None:  # the share of the step's rollout and update (the evaluation's calls are its own)
            metrics.update(tool_metrics(trajectories, produced.tool_log, elapsed - metrics.get("timing_s/testing", 0.0)))
        return metrics

    def _score(self, trajectories) -> list[dict]:
        texts = [self.tokenizer.decode(t.response_ids, skip_special_tokens=True) for t in trajectories]
        truths = [self.train_problems[t.problem].ground_truth for t in trajectories]
        return score_batch([self.task.data_source] * len(texts), texts, truths)

    def _batch_metrics(self, batch, trajectories, results) -> dict:
        lags = token_lags(batch, self.step)
        histogram = torch.bincount(lags, minlength=self.lag + 1).tolist()
        lengths = batch.mask.sum(-1).float()
        reasons = Counter(r["reason"] for r in results)
        versions_per_sequence = [len({v for v in t.versions if v >= 0}) for t in trajectories]
        return {
            "async/lag_mean": float(lags.float().mean()),
            "async/lag_max": int(lags.max()),
            "async/lag_hist": histogram,
            "async/versions_per_sequence_mean": sum(versions_per_sequence) / len(versions_per_sequence),
            "async/inflight_sequence_frac": sum(n > 1 for n in versions_per_sequence) / len(versions_per_sequence),
            "response_length/mean": float(lengths.mean()),
            "response_length/max": float(lengths.max()),
            "response_length/clip_ratio": sum(t.truncated for t in trajectories) / len(trajectories),
            "reward/no_answer_frac": reasons["no_answer"] / len(results),
        }

    def _start(self) -> None:
        self._resume()
        if self.step == 0:
            self._keep_snapshots()
        self.folder.start(self.step, self.base)

    def run(self) -> Path:
        """Train to ``config.steps`` from where the folder's checkpoint left off, then the final evaluation."""
        if self._ran:
            raise RuntimeError("a Trainer runs once (its folder lock ends with its run): build another to run again")
        self._ran = True
        config = self.config
        with self.folder:
            self._start()
            if config.execution == "concurrent" and self.step < config.steps:
                published = {**self.snapshots, self.step: self.model.state_dict()}
                self.generator_process = GeneratorProcess(self.produce, self._read_weights_through, self.model.state_dict(),
                                               slots=self.lag + 1, published=published, first=self.step, steps=config.steps)
            bar = tqdm(total=config.steps, initial=self.step, desc=f"{config.method} k={self.lag} seed={config.seed}",
                       unit="step", disable=not config.progress, dynamic_ncols=True)
            last_accuracy = None
            try:
                while self.step < config.steps:
                    metrics = self.train_step()
                    self.folder.log(metrics)
                    if self.checkpoint_due(self.step):
                        self.folder.save_checkpoint(self._checkpoint_state())
                    last_accuracy = metrics.get("val/accuracy", last_accuracy)
                    bar.update()
                    bar.set_postfix(reward=f"{metrics['critic/score/mean']:.2f}",
                                    val=f"{last_accuracy:.2f}" if last_accuracy is not None else "-",
                                    ess=f"{metrics[SEQ_ESS_RATIO]:.2f}", lag=f"{metrics['async/lag_mean']:.1f}", refresh=False)
            except GeneratorInterrupt as interrupt:
                raise GeneratorDied(str(interrupt)) from None
            finally:
                bar.close()
                if self.generator_process is not None:
                    self.generator_process.close()
                    self.generator_process = None
            if not self.folder.finished:
                result = {"step": self.step, **(self.evaluate() if config.eval_every else {}), **self.evaluate("test")}
                self.model.save_pretrained(self.out / FINAL_DIR)
                self.tokenizer.save_pretrained(self.out / FINAL_DIR)
                self.folder.finish(result)
            self.folder.stop_tracking()
        return self.out
