"""The simulator's training loop: rollouts under a lag model -> rewards -> one optimizer step, repeated.

Writes into ``out``: ``config.json`` (the resolved configuration, method preset included),
``metrics.jsonl`` (one object per optimizer step, verl metric names plus the paper's diagnostics),
``checkpoint.pt`` (everything needed to continue: weights, optimizer, the rollout engine's queue,
the snapshots the lag model still needs) and, at the end, ``final/`` (a save_pretrained model that
``python -m vcpo.evaluation`` reads). A run restarted with the same ``out`` continues from its checkpoint and
writes the same metrics an uninterrupted run would (generation seeds derive from (seed, step)).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from tqdm.auto import tqdm

from vcpo.cli import output_folder_problem
from vcpo.evaluation.generation import end_token_ids
from vcpo.locks import FolderInUse, run_folder_lock, write_atomic
from vcpo.provenance import code_state, library_versions, machine_state, utc_now
from vcpo.rewards import score_batch
from vcpo.runs import (
    CHECKPOINT_FILE,
    CONFIG_FILE,
    FINAL_DIR,
    FINAL_EVAL,
    METRICS_FILE,
    PREVIOUS_CHECKPOINT_FILE,
    SEQ_ESS_RATIO,
    MetricsProblem,
    is_finished,
    metric_records,
)
from vcpo.sim.base import sft_base
from vcpo.sim.concurrent import ConcurrentEngine, GeneratorDied, GeneratorInterrupt, Produced
from vcpo.sim.config import ConfigError, SimConfig, settings_changed
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
from vcpo.sim.tasks import get_sim_task, render_prompt
from vcpo.sim.validation import replayed_lr_scales, validate

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


def load_base(config: SimConfig) -> Path:
    if config.base is not None:
        return Path(config.base)
    return sft_base(config.task, config.model_size, seed=config.base_seed, progress=config.progress)


class Trainer:
    """Builds every part of a run from its config; ``run()`` trains to ``config.steps``."""

    def __init__(self, config: SimConfig):
        self.config = validate(config)
        if config.out is None:
            raise ConfigError("config key 'out': a run needs an output folder (--out DIR)")
        if problem := output_folder_problem(Path(config.out)):
            raise ConfigError(f"config key 'out' ({config.out}): {problem}")
        # one writer per run folder, from before any work to the end of run() (or this object's end)
        self._lock = contextlib.ExitStack()
        try:
            self._lock.enter_context(run_folder_lock(Path(config.out)))
        except FolderInUse as error:
            raise ConfigError(f"config key 'out': {error}") from None
        try:
            self._build(self.config)
        except BaseException:
            self._lock.close()  # a failed setup leaves the folder free at once, not at garbage collection
            raise

    def _build(self, config: SimConfig) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self._check_resumable(Path(config.out))
        if config.threads:
            torch.set_num_threads(config.threads)
        self.out = Path(config.out)
        self.task = get_sim_task(config.task)
        self.base = load_base(config)
        self.tokenizer = AutoTokenizer.from_pretrained(self.base)
        learner_dtype = getattr(torch, config.learner_dtype)
        torch.manual_seed(config.seed)
        self.model = AutoModelForCausalLM.from_pretrained(self.base, dtype=learner_dtype)
        self.model.train()
        self.rollout_model = copy.deepcopy(self.model).to(getattr(torch, config.resolved_rollout_dtype)).eval()
        use_grouped_query_sdpa(self.rollout_model)
        method = config.method_preset
        ref_model = None
        if method.spec.get("kl_in_reward_beta"):
            ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.learner = Learner(self.model, method, config, ref_model=ref_model)
        self.lag = config.lag

        self.train_problems = self.task.problems("train")
        self.eval_problems = self.task.problems("validation")[: config.eval_problems]
        self.test_problems = self.task.problems("test")[: config.test_problems] if config.test_problems else []
        self.replayed_scales = replayed_lr_scales(config.lr_scale_from, config.steps) if config.lr_scale_from else None
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
        self.tracker = None
        self.recorded_config: dict = {}  # config.json as _start wrote it
        self.checkpointed_step = 0  # the step of the newest checkpoint (0: none yet, a restart starts over)
        self._prox_model = None
        self.engine: ConcurrentEngine | None = None  # execution=concurrent: the generator process, while run() runs
        self._rollout_state: dict | None = None  # the engine's state after the last batch trained on, at checkpoint steps

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

    def save_checkpoint(self) -> None:
        """checkpoint.pt, written whole before it replaces the last one, which becomes checkpoint.prev.pt."""
        state = {
            "step": self.step,
            "model": self.model.state_dict(),
            "optimizer": self.learner.optimizer.state_dict(),
            "rollouts": self._rollout_state,
            "snapshots": self.snapshots,
            "settings": self.config.recorded(),  # what a resume is checked against, config.json or not
        }
        partial = self.out / f"{CHECKPOINT_FILE}.{os.getpid()}.tmp"
        try:
            torch.save(state, partial)
        except (OSError, RuntimeError) as error:  # torch reports a full disk as "[enforce fail ...] unexpected pos"
            partial.unlink(missing_ok=True)
            free = shutil.disk_usage(self.out).free / 2**20
            raise ConfigError(f"config key 'out': writing {partial} failed ({str(error).splitlines()[0]}) with {free:.0f} MiB "
                              f"free on its filesystem (no space left on device?); the checkpoint of step "
                              f"{self.checkpointed_step} is intact and the same command resumes from it") from None
        current = self.out / CHECKPOINT_FILE
        if current.exists():
            current.replace(self.out / PREVIOUS_CHECKPOINT_FILE)
        partial.replace(current)
        self.checkpointed_step = self.step

    def _refuse_other_settings(self, recorded: dict, where: Path | str) -> None:
        """A checkpoint is resumed only by a run with the settings ``recorded`` with it (at ``where``)."""
        changed = settings_changed(recorded, self.config)
        if changed:
            raise ConfigError(
                f"{where} holds a checkpoint of a run with other settings ({'; '.join(changed)}): resuming it would "
                "file that run under these settings; use another --out, or delete the folder to start over"
            )

    def _check_resumable(self, out: Path) -> None:
        """Before any work, against config.json; the checkpoint's own settings are checked when it is loaded."""
        recorded = out / CONFIG_FILE
        if recorded.exists() and any((out / name).exists() for name in (CHECKPOINT_FILE, PREVIOUS_CHECKPOINT_FILE)):
            self._refuse_other_settings(json.loads(recorded.read_text()), out)

    def _load_checkpoint(self) -> dict | None:
        """The newest readable checkpoint (None: there is none). A damaged one is named in one line, and the
        one before it is used; if none can be read, the error names them and the remedy."""
        for stale in self.out.glob(f"{CHECKPOINT_FILE}.*.tmp"):  # a killed writer's; this run holds the folder lock
            stale.unlink()
        candidates = [path for path in (self.out / CHECKPOINT_FILE, self.out / PREVIOUS_CHECKPOINT_FILE) if path.exists()]
        damaged = []
        for path in candidates:
            try:
                state = torch.load(path, weights_only=False)
            except Exception as error:  # a truncated zip, an empty file, a broken pickle: the file, not the run
                damaged.append(f"{path} is damaged ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else 'no detail'})")
                continue
            if damaged:
                print(f"{damaged[0]}; resuming from {path.name} (step {state['step']})", file=sys.stderr)
            if "settings" in state:  # (checkpoints written before it was recorded have none)
                self._refuse_other_settings(state["settings"], f"{self.out} ({path.name})")
            return state
        if damaged:
            raise ConfigError(f"config key 'out': {'; '.join(damaged)}: delete {' and '.join(p.name for p in candidates)} "
                              f"in {self.out} to start the run over")
        return None

    def maybe_resume(self) -> None:
        state = self._load_checkpoint()
        if state is None:
            # nothing to resume: metrics of an attempt stopped before its first checkpoint are redone
            (self.out / METRICS_FILE).unlink(missing_ok=True)
            return
        self.model.load_state_dict(state["model"])
        self.learner.optimizer.load_state_dict(state["optimizer"])
        self.rollouts.load_state_dict(state["rollouts"])
        self.snapshots = state["snapshots"]
        self.step = self.checkpointed_step = state["step"]
        metrics = self.out / METRICS_FILE
        # a finished run's lines are all kept, its final one too; otherwise the steps after the checkpoint are redone
        if metrics.exists() and not is_finished(self.out):
            kept = [line for step, line in metric_lines(self.out) if step < self.step]
            write_atomic(metrics, "".join(line + "\n" for line in kept))

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
        under execution=concurrent), with the engine's state where the learner will checkpoint."""
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
        if self.engine is None:
            produced = self.produce(self.step)
        else:
            waiting = time.perf_counter()
            produced = self.engine.next_batch(self.step)
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
        if self.engine is not None:
            self.engine.publish(self.step, self.model.state_dict())
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
        self.out.mkdir(parents=True, exist_ok=True)
        self.maybe_resume()
        if self.step == 0:
            self._keep_snapshots()
        machine = machine_state()
        now, code = utc_now(), code_state()
        earlier = json.loads((self.out / CONFIG_FILE).read_text()) if self.step and (self.out / CONFIG_FILE).exists() else {}
        resolved = {
            **self.config.recorded(),
            "base": str(self.base),
            "effective_lag": self.lag,  # what the study tables read (the same as lag since validation enforces it)
            "base_lr": self.config.base_lr,
            "resolved_rollout_dtype": self.config.resolved_rollout_dtype,
            "method_preset": self.config.method_preset.spec,
            "versions": library_versions(),
            # floating-point kernels differ between CPUs: a fixed-seed run can end elsewhere on another
            **machine,
            # the cores the run holds (threads per process x processes): its wall-clock hours x these are its core-hours
            "cores": min(machine["torch_threads"] * (2 if self.config.execution == "concurrent" else 1), os.cpu_count() or 1),
            **code,
            # a resumed run keeps its first start; every attempt (start step, time, code) is listed; a finished run
            # started again keeps its end (it has nothing left to do)
            "started": earlier.get("started", now),
            **({"finished": earlier["finished"]} if earlier.get("finished") and is_finished(self.out) else {}),
            "attempts": [*earlier.get("attempts", []), {"step": self.step, "started": now, **code, "cpu": machine["cpu"]}],
        }
        self.recorded_config = resolved
        write_atomic(self.out / CONFIG_FILE, json.dumps(resolved, indent=2, default=str) + "\n")
        if self.config.wandb:
            from verl.utils.tracking import Tracking

            os.environ.setdefault("WANDB_MODE", "offline")
            # verl's Tracking reads trainer.* (e.g. trainer.wandb_proxy) from the config it logs
            self.tracker = Tracking("vcpo-sim", self.out.name, default_backend=["wandb"], config={"trainer": {}, **resolved})

    def _train_steps(self) -> None:
        config = self.config
        bar = tqdm(total=config.steps, initial=self.step, desc=f"{config.method} k={self.lag} seed={config.seed}",
                   unit="step", disable=not config.progress, dynamic_ncols=True)
        last_accuracy = None
        while self.step < config.steps:
            metrics = self.train_step()
            last_accuracy = metrics.get("val/accuracy", last_accuracy)
            self._log(metrics)
            if self.checkpoint_due(self.step):
                self.save_checkpoint()
            bar.update()
            bar.set_postfix(
                reward=f"{metrics['critic/score/mean']:.2f}",
                val=f"{last_accuracy:.2f}" if last_accuracy is not None else "-",
                ess=f"{metrics[SEQ_ESS_RATIO]:.2f}",
                lag=f"{metrics['async/lag_mean']:.1f}",
                refresh=False,
            )
        bar.close()

    def _log(self, metrics: dict) -> None:
        with open(self.out / METRICS_FILE, "a") as handle:
            handle.write(json.dumps(metrics) + "\n")
        if self.tracker is not None:
            self.tracker.log({k: v for k, v in metrics.items() if not isinstance(v, list)}, step=metrics["step"])

    def run(self) -> Path:
        if self._ran:
            raise RuntimeError("a Trainer runs once (its folder lock ends with its run): build another to run again")
        self._ran = True
        with self._lock:
            return self._run()

    def _run(self) -> Path:
        self._start()
        config = self.config
        if config.execution == "concurrent" and self.step < config.steps:
            published = {**self.snapshots, self.step: self.model.state_dict()}
            self.engine = ConcurrentEngine(self.produce, self._read_weights_through, self.model.state_dict(),
                                           slots=self.lag + 1, published=published, first=self.step, steps=config.steps)
        try:
            self._train_steps()
        except GeneratorInterrupt as interrupt:
            raise GeneratorDied(str(interrupt)) from None
        finally:
            if self.engine is not None:
                self.engine.close()
                self.engine = None
        final = self.out / FINAL_DIR
        if not is_finished(self.out):
            result = {"step": self.step, **(self.evaluate() if config.eval_every else {}), **self.evaluate("test")}
            self.model.save_pretrained(final)
            self.tokenizer.save_pretrained(final)
            if result.get("val/accuracy") is not None:
                self._log(result)
            write_atomic(self.out / CONFIG_FILE, json.dumps({**self.recorded_config, "finished": utc_now()}, indent=2, default=str) + "\n")
            write_atomic(self.out / FINAL_EVAL, json.dumps(result) + "\n")  # the finished mark, written last
        if self.tracker is not None:
            self.tracker.finish()
        return self.out


def metric_lines(run: Path) -> list[tuple[int, str]]:
    """(step, line) of a run's ``metrics.jsonl`` (``vcpo.runs.metric_records``: a partial last line, a step
    logged twice), what it leaves out said on stderr; a line that cannot be read is an error naming it."""
    try:
        records = metric_records(run, report=lambda problem: print(problem, file=sys.stderr))
    except MetricsProblem as error:
        raise ConfigError(f"config key 'out': {error}; repair or remove that line, or start the run over in another folder") from None
    return [(int(record["step"]), line) for line, record in records]
