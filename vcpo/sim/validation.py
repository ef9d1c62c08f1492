"""Checks of a simulator run's configuration before any work starts: its settings alone (`check_settings`, which
also fills in the task's defaults), then what they read from the disk (`check_inputs`). `resolve` does both and
returns the run as the trainer takes it (`ResolvedRun`); `validate` keeps only its settings, for who plans runs.
Every problem is a ``ConfigError`` naming the key."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from vcpo.core.per_sequence_grads.reductions import COMBINATIONS
from vcpo.methods import Method, StepRule, get_method, run_lag, run_rho_on, step_rule
from vcpo.runs import LR_SCALE, METRICS_FILE, MetricsProblem, metric_records
from vcpo.sim.base import MODEL_SIZES
from vcpo.sim.config import (
    DTYPES,
    EXECUTIONS,
    KV_CACHE_POLICIES,
    LAG_MODELS,
    OVERLAPPING_LAG_MODELS,
    ROLLOUT_DTYPES,
    ConfigError,
    SimConfig,
    preset_base_lr,
    preset_rollout_dtype,
)
from vcpo.sim.tasks import SIM_TASKS, SimTask, get_sim_task


@dataclass(frozen=True)
class ResolvedRun:
    """A run as the trainer takes it: its checked settings with the task's defaults filled in, the task and method
    preset they name, the rates and rollout dtype those give, and the step-size scales it replays
    (``lr_scale_from``'s, read once; None: it replays none): each resolved once, here, and handed on."""

    config: SimConfig
    task: SimTask
    method: Method
    base_lr: float  # the optimizer's rate before the schedule and the ESS scale (SimConfig.base_lr)
    rollout_dtype: str  # the sampler's dtype (SimConfig.resolved_rollout_dtype)
    rule: StepRule  # the method's step rule at the run's rho_on
    replayed_lr_scales: list[float] | None


def resolve(config: SimConfig) -> ResolvedRun:
    """The run of ``config``: `check_settings`, then `check_inputs`, its task and method found once. Idempotent on
    ``.config``; a copy changed afterwards (``dataclasses.replace``) must be resolved again."""
    checked, task, method, rule = _checked_settings(config)
    return _read_inputs(checked, task, method, rule)


def validate(config: SimConfig) -> SimConfig:
    """The settings of `resolve`'s run: for who checks runs before handing them on (a sweep, the workflow)."""
    return resolve(config).config


def check_inputs(config: SimConfig) -> ResolvedRun:
    """What `check_settings`' settings read from the disk, read once: the SFT base folder is checked, and the
    step-size scales of the run replayed kept; raise ConfigError naming the key. The settings are `resolve`d with
    them (checking them again changes nothing), so that the task, method and step rule are found in one place."""
    return resolve(config)


def _read_inputs(config: SimConfig, task: SimTask, method: Method, rule: StepRule) -> ResolvedRun:
    if config.base is not None and not (Path(config.base) / "config.json").is_file():
        raise ConfigError(f"config key 'base': no SFT base model at {config.base!r} (expected a save_pretrained folder "
                          "with config.json)")
    scales = None if config.lr_scale_from is None else replayed_lr_scales(config.lr_scale_from, config.steps)
    return ResolvedRun(config, task, method, preset_base_lr(config.reference_lr, method),
                       preset_rollout_dtype(config.rollout_dtype, method), rule, scales)


def check_settings(config: SimConfig) -> SimConfig:
    """The settings alone (no file is read): raise ConfigError naming the key of the first problem, else return
    ``config`` with the task's defaults filled in (``max_response_tokens``, ``max_turns``, and ``rho_on`` where
    the task has a paper value), so that nothing downstream consults the task for a setting again."""
    return _checked_settings(config)[0]


def _checked_settings(config: SimConfig) -> tuple[SimConfig, SimTask, Method, StepRule]:
    """`check_settings`' config, with the task and method preset it names and the step rule they give."""
    method = _check_choices(config)
    task = get_sim_task(config.task)
    rho_on, rule = _check_lag_and_step_rule(config, task, method)
    _check_run_shape(config, task, method, rule)
    _check_optimizer(config)
    _check_precision(config, method)
    if config.base is None and config.model_size not in MODEL_SIZES:
        _fail("model_size", f"unknown size {config.model_size!r}; known: {sorted(MODEL_SIZES)}")
    checked = dataclasses.replace(
        config,
        max_response_tokens=task.max_response_tokens if config.max_response_tokens is None else config.max_response_tokens,
        max_turns=task.max_turns if config.max_turns is None else config.max_turns,
        rho_on=rho_on,
    )
    return checked, task, method, rule


def _fail(key: str, message: str) -> NoReturn:
    raise ConfigError(f"config key {key!r}: {message}")


def _check_choices(config: SimConfig) -> Method:
    """The task, the method (returned) and every setting that is one of a list, with how they combine."""
    if config.task not in SIM_TASKS:
        _fail("task", f"unknown task {config.task!r}; known: {sorted(SIM_TASKS)}")
    try:
        method = config.method_preset
    except ValueError as error:
        _fail("method", str(error))
    if config.opob_combination not in COMBINATIONS:
        _fail("opob_combination", f"must be one of {COMBINATIONS}, got {config.opob_combination!r}")
    if config.kv_cache not in KV_CACHE_POLICIES:
        _fail("kv_cache", f"must be one of {KV_CACHE_POLICIES}, got {config.kv_cache!r}")
    if config.lag_model not in LAG_MODELS:
        _fail("lag_model", f"must be one of {LAG_MODELS}, got {config.lag_model!r}")
    if config.execution not in EXECUTIONS:
        _fail("execution", f"must be one of {EXECUTIONS}, got {config.execution!r}")
    if config.execution == "concurrent" and not (config.lag >= 1 and config.lag_model in OVERLAPPING_LAG_MODELS):
        _fail("execution", f"'concurrent' needs a lag model whose generation can overlap the update ({', '.join(OVERLAPPING_LAG_MODELS)} "
              f"at lag >= 1); lag_model={config.lag_model!r} at lag {config.lag} generates every batch with the weights "
              "of the step that trains on it (use execution=serial, or threads=2 to give one run both cores)")
    if config.execution == "concurrent" and config.threads != 1:
        # the generator is forked from the learner, and OpenMP's thread pool does not survive a fork: the generator
        # would wait forever in its first parallel region
        _fail("threads", f"execution=concurrent runs each side on one thread (the generator is a forked process, and "
              f"a fork cannot carry OpenMP's threads), got threads={config.threads}; use threads=1, or execution=serial")
    return method


def _check_run_shape(config: SimConfig, task: SimTask, method: Method, rule: StepRule) -> None:
    """Counts, sizes and the batch's shape: steps, budgets, evaluations, groups and micro-batches."""
    if config.max_response_tokens is not None and config.max_response_tokens < 1:
        _fail("max_response_tokens", f"must be >= 1, got {config.max_response_tokens}")
    for key in ("steps", "prompts_per_step", "responses_per_prompt", "update_tokens"):
        if getattr(config, key) < 1:
            _fail(key, f"must be >= 1, got {getattr(config, key)}")
    for key in ("warmup_steps", "decay_steps", "eval_every", "eval_problems", "test_problems", "threads"):
        if getattr(config, key) < 0:
            _fail(key, f"must be >= 0, got {getattr(config, key)}")
    if config.max_turns is not None and config.max_turns < 0:
        _fail("max_turns", f"must be >= 0, got {config.max_turns}")
    if config.tool_workers < 1:
        _fail("tool_workers", f"must be >= 1, got {config.tool_workers}")
    for key in ("checkpoint_every", "eval_samples", "test_samples"):
        if getattr(config, key) < 1:
            _fail(key, f"must be >= 1, got {getattr(config, key)}")
    if config.test_problems > (available := task.test_size):
        _fail("test_problems", f"task {config.task!r} has {available} test problems, got {config.test_problems}")
    if config.lr_scale_from is not None and rule.ess:
        _fail("lr_scale_from", f"method {method.name!r} sets its own step size by the ESS rule; replaying another "
              "run's scale would make it another method (use a preset without the ESS step size)")
    if config.warmup_steps + config.decay_steps > config.steps:
        _fail("warmup_steps", f"warmup_steps + decay_steps ({config.warmup_steps + config.decay_steps}) exceed steps ({config.steps})")
    if config.responses_per_prompt < 2:
        _fail("responses_per_prompt", "group baselines need at least 2 responses per prompt")
    if config.micro_batch_size < config.responses_per_prompt or config.micro_batch_size % config.responses_per_prompt:
        _fail("micro_batch_size", f"must hold whole groups: a multiple of responses_per_prompt ({config.responses_per_prompt})")


def _check_optimizer(config: SimConfig) -> None:
    """The rates, AdamW's constants and the sampling temperatures: finite and in range."""
    for key in ("reference_lr", "temperature", "eval_temperature", "eps", "grad_clip", "tool_timeout_s"):
        value = getattr(config, key)
        if not (math.isfinite(value) and value > 0):
            _fail(key, f"must be a positive finite number, got {value}")
    if not (math.isfinite(config.weight_decay) and config.weight_decay >= 0):
        _fail("weight_decay", f"must be a finite number >= 0, got {config.weight_decay}")
    if len(config.betas) != 2 or not all(0 <= beta < 1 for beta in config.betas):
        _fail("betas", f"must be two numbers in [0, 1) (AdamW's beta1, beta2), got {list(config.betas)}")


def _check_precision(config: SimConfig, method: Method) -> None:
    """The learner's and the rollouts' dtypes, and a precision preset's own."""
    if config.learner_dtype not in DTYPES:
        _fail("learner_dtype", f"must be one of {DTYPES}")
    if config.rollout_dtype not in ROLLOUT_DTYPES:
        _fail("rollout_dtype", f"must be one of {ROLLOUT_DTYPES}")
    if config.learner_dtype in ("bfloat16", "float16"):
        _fail("learner_dtype", "the learner keeps float32 or float64 master weights; set rollout_dtype for low precision")
    if method.spec["precision"] == "fp16" and preset_rollout_dtype(config.rollout_dtype, method) != "float16":
        _fail(
            "rollout_dtype",
            f"method {method.name!r} differs from its parent only by fp16 precision; run it with rollout_dtype=preset "
            "(fp16 rollouts against the learner), otherwise it would silently be a different method",
        )


def _check_lag_and_step_rule(config: SimConfig, task: SimTask, method: Method) -> tuple[float | None, StepRule]:
    """What the method's preset makes of the run, asked of `vcpo.methods` in one place: the lag it allows, the run's
    rho_on (the task's paper value unless set) and the step rule at it (returned)."""
    rho_on = run_rho_on(config.rho_on, task.paper_settings)
    try:
        run_lag(method.name, config.lag, config.lag, config.steps)
    except ValueError as error:
        _fail("lag", str(error))
    try:
        return rho_on, step_rule(method).with_rho_on(rho_on)
    except ValueError as error:
        _fail("rho_on", str(error))


def default_lag(method: str, lag: int) -> int:
    """The lag a run of ``method`` takes when none is asked for explicitly (`vcpo.methods.run_lag`: its preset's
    fixed lag, sync's 0, over ``lag``, a config file's); an unknown method or a lag below 0 is a configuration error
    naming its key."""
    try:
        get_method(method)
    except ValueError as error:
        raise ConfigError(f"config key 'method': {error}") from None
    try:
        return run_lag(method, default=lag)
    except ValueError as error:
        raise ConfigError(f"config key 'lag': {error}") from None


def replayed_lr_scales(run: str | Path, steps: int) -> list[float]:
    """``actor/lr_scale`` of steps 0 .. steps-1 of the run folder ``run`` (its ``metrics.jsonl``); a
    missing, repeated or unreadable step is an error naming the run, never a guess."""
    if not (Path(run) / METRICS_FILE).is_file():
        raise ConfigError(f"config key 'lr_scale_from': no {Path(run) / METRICS_FILE}")

    def refuse(problem: str) -> None:
        raise ConfigError(f"config key 'lr_scale_from': {problem}")

    try:
        records = metric_records(run, report=refuse)
    except MetricsProblem as error:
        refuse(str(error))
    scales = {int(record["step"]): float(record[LR_SCALE]) for _, record in records if LR_SCALE in record}  # not the final evaluation's line
    missing = [step for step in range(steps) if step not in scales]
    if missing:
        refuse(f"{Path(run) / METRICS_FILE} has no {LR_SCALE} for steps {missing[:5]}{' ...' if len(missing) > 5 else ''} "
               f"of the {steps} this run takes")
    return [scales[step] for step in range(steps)]
