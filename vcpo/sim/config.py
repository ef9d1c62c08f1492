"""The simulator's run configuration: one dataclass, checked in full before any work starts.

Every field has a default; ``key=value`` overrides (the CLI's trailing arguments) are parsed with the
field's type, and an unknown key, a bad value or a combination the simulator cannot honour raises a
``ConfigError`` naming the key. Values the paper states are marked with their table.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from vcpo.core.per_sequence_grads import COMBINATIONS
from vcpo.methods import PRECISION_DTYPES, Method, get_method, run_lag, run_rho_on, step_rule
from vcpo.recipes import optimizer_table
from vcpo.runs import LR_SCALE, METRICS_FILE, MetricsProblem, metric_records
from vcpo.sim.base import MODEL_SIZES
from vcpo.sim.rollout import KV_CACHE_MODES, LAG_MODELS, OVERLAPPING_LAG_MODELS, SIM_TOOL_TIMEOUT_S
from vcpo.sim.tasks import SIM_TASKS, get_sim_task

EXECUTIONS = ("serial", "concurrent")
DTYPES = ("float32", "float64", "bfloat16", "float16")
ROLLOUT_DTYPES = (*DTYPES, "preset")
# The learning rate every preset is written relative to (VCPO Table 2): a preset's lr / this is the
# factor applied to the simulator's own reference learning rate (low_lr: 1e-7 -> x0.1).
PAPER_REFERENCE_LR = 1.0e-6


TABLE_2 = optimizer_table()


class ConfigError(ValueError):
    """A configuration the simulator cannot run; the message names the key."""


@dataclass
class SimConfig:
    # what to train
    task: str = "countdown"
    method: str = "seq_tis_c8"
    seed: int = 0
    steps: int = 200
    model_size: str = "tiny"
    base: str | None = None  # an SFT base folder; None: the cached vcpo.sim.base.sft_base(task, model_size, seed=base_seed)
    base_seed: int = 0
    # asynchrony
    lag_model: str = "pipeline"
    lag: int = 0  # max policy lag k in optimizer steps (0: synchronous oracle)
    update_tokens: int = 8  # pipeline: tokens every in-flight sequence generates between two weight updates
    # "concurrent": generation in a process of its own while the learner trains (vcpo.sim.concurrent), the
    # same metrics as "serial"; only for a lag model that overlaps (fixed or pipeline_overlap, lag >= 1)
    execution: str = "serial"
    kv_cache: str = "recompute"  # after a weight update mid-response: "recompute" the cache (exact l^μ of each version) or "keep" it (PipelineRL, vLLM)
    # batch and sampling (shape of VCPO Table 3: 8 prompts x 8 completions)
    prompts_per_step: int = 8
    responses_per_prompt: int = 8
    max_response_tokens: int | None = None  # None: the task's budget (vcpo.sim.tasks.SimTask.max_response_tokens)
    temperature: float = 1.0  # VCPO Tables 3-5
    max_turns: int | None = None  # tool calls per response (>0: multi-turn with the sandboxed Python tool); None: the task's
    tool_timeout_s: float = SIM_TOOL_TIMEOUT_S
    tool_workers: int = 4  # tool calls of one generation round run at once (docs/simulator.md: calls/s and latency)
    # optimizer: AdamW with VCPO Table 2's settings (recipes/optimizer.yaml, as the verl launcher uses them)
    lr: float = 5.0e-5  # stands for the paper's 1e-6 at this scale (sync pilot, docs/simulator.md); presets scale it by lr / 1e-6
    weight_decay: float = TABLE_2["weight_decay"]
    betas: tuple[float, float] = tuple(TABLE_2["betas"])
    eps: float = TABLE_2["eps"]
    grad_clip: float = TABLE_2["grad_clip"]
    warmup_steps: int = 5  # warmup-stable-decay (VCPO Table 3)
    decay_steps: int = 0
    micro_batch_size: int = 64  # sequences per learner forward/backward (whole groups)
    # how OPOB combines per-sequence gradients (vcpo.core.PerSequenceGradients): "deferred", one weight-gradient
    # product per parameter once the baseline is known; "buffers", G_R and G_S^γ during the backward, the
    # floating-point order of the studies' runs (recipes/sim/regime.yaml keeps it); "split", each group's success
    # and failure buffers during the backward (verl's engine's), slower here than deferred (8 groups, T = 50)
    opob_combination: str = "deferred"
    # precision
    learner_dtype: str = "float32"
    rollout_dtype: str = "float32"  # "preset": the preset's precision (bf16/fp16), a training-inference mismatch
    # ESS step size: rho_on overrides the preset's; None: the task's paper value where it has one (tir: SimpleTIR's 0.55, VCPO Table 5)
    rho_on: float | None = None
    # evaluation, outputs
    eval_every: int = 25
    eval_problems: int = 200
    eval_samples: int = 4
    eval_temperature: float = 1.0
    # the final evaluation also scores this many problems of the task's test split (0: none), test_samples
    # responses each: enough that its sampling noise is small (recipes/sim/evidence.md measures it)
    test_problems: int = 0
    test_samples: int = 4
    # a run folder whose per-step ESS step-size scale (metrics' actor/lr_scale) this run replays in place
    # of its own: "smaller" without "adaptive" (recipes/sim/evidence.md); only for a method without the ESS rule
    lr_scale_from: str | None = None
    checkpoint_every: int = 25
    # torch threads; 0: torch's default. It changes the order of floating-point reductions, hence the run:
    # one by default, as the workflow and the studies run, so a run repeats whatever the machine's cores.
    threads: int = 1
    wandb: bool = False  # through verl's Tracking; WANDB_MODE defaults to offline
    progress: bool = True
    out: str | None = None
    config_file: str | None = None  # the YAML file the settings were read from (recorded, not re-read)
    extra: dict[str, Any] = field(default_factory=dict)  # free-form notes copied into config.json

    @property
    def method_preset(self) -> Method:
        return get_method(self.method)

    @property
    def batch_size(self) -> int:
        return self.prompts_per_step * self.responses_per_prompt

    @property
    def base_lr(self) -> float:
        return self.lr * self.method_preset.spec["optimizer"]["lr"] / PAPER_REFERENCE_LR

    @property
    def resolved_rollout_dtype(self) -> str:
        if self.rollout_dtype == "preset":
            return PRECISION_DTYPES[self.method_preset.spec["precision"]]
        return self.rollout_dtype

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def recorded(self) -> dict[str, Any]:
        """The settings as a run's ``config.json`` records them (JSON types); of a ``validate``d config, so
        that the task's defaults are filled in."""
        if self.max_response_tokens is None or self.max_turns is None:
            raise ValueError("SimConfig.recorded() needs a validate()d config (the task's defaults filled in)")
        return json.loads(json.dumps(self.to_dict(), default=str))  # tuples as lists


FIELD_TYPES = {f.name: f.type for f in fields(SimConfig)}
# Keys whose default is not what a run recorded before the key existed did: the arithmetic those runs used.
BEFORE_THE_KEY = {"opob_combination": "buffers"}
# Keys a restart may change: they do not change what the run computes.
RESUMABLE_CHANGES = ("progress", "wandb", "checkpoint_every", "out", "config_file", "extra", "tool_workers", "execution")


def settings_changed(recorded: dict[str, Any], config: SimConfig) -> list[str]:
    """``key: recorded -> now`` for every result-changing key where ``config`` differs from a run's
    recorded ``config.json``."""
    now = config.recorded()
    if config.base is None:  # the cached SFT base of (task, model_size, base_seed), which are compared
        del now["base"]
    defaults = SimConfig()  # a key added after the run was recorded: the run had its default, or what it did before
    was = {key: recorded.get(key, BEFORE_THE_KEY.get(key, getattr(defaults, key, None))) for key in now}
    return [f"{key}: {was[key]!r} -> {value!r}" for key, value in now.items()
            if key not in RESUMABLE_CHANGES and was[key] != value]


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


def _parse_value(key: str, text: str) -> Any:
    kind = FIELD_TYPES[key]
    try:
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
        if kind == "int | None":
            return None if text.lower() in ("none", "null") else int(text)
        if kind == "float | None":
            return None if text.lower() in ("none", "null") else float(text)
        if kind == "str | None":
            return None if text.lower() in ("none", "null") else text
        if kind == "bool":
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(text)
            return text.lower() in ("true", "1", "yes")
        if kind == "tuple[float, float]":
            first, second = text.split(",")
            return (float(first), float(second))
        if kind == "str":
            return text
    except ValueError:
        raise ConfigError(f"config key {key!r}: cannot read {text!r} as {kind}") from None
    raise ConfigError(f"config key {key!r} cannot be set from the command line")


def apply_overrides(config: SimConfig, overrides: list[str] | dict[str, Any]) -> SimConfig:
    """A copy of ``config`` with ``key=value`` strings (or a mapping) applied; unknown keys raise."""
    items = overrides.items() if isinstance(overrides, dict) else [_split(item) for item in overrides]
    changes = {}
    for key, value in items:
        if key == "extra":
            raise ConfigError("config key 'extra' (free-form notes) is set only as a mapping in a --config file")
        if key not in FIELD_TYPES:
            close = difflib.get_close_matches(key, FIELD_TYPES, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"unknown config key {key!r}{hint}; keys: {', '.join(sorted(FIELD_TYPES))}")
        changes[key] = _parse_value(key, value) if isinstance(value, str) else value
    return dataclasses.replace(config, **changes)


def default_lag(method: str, lag: int) -> int:
    """The lag a run of ``method`` takes when none is asked for explicitly (`vcpo.methods.run_lag`: its preset's
    fixed lag, sync's 0, over ``lag``, a config file's); an unknown method is a configuration error."""
    try:
        return run_lag(method, default=lag)
    except ValueError as error:
        raise ConfigError(f"config key 'method': {error}") from None


def start_config(path: str | Path | None) -> SimConfig:
    """What a run starts from: the ``--config`` file's settings over the defaults, or the defaults."""
    return load_config_file(path) if path else SimConfig()


def load_config_file(path: str | Path) -> SimConfig:
    """The defaults with the keys of a YAML mapping file applied, the file recorded in ``config_file``;
    an unknown key or a value of the wrong type is an error naming the file and key."""
    import yaml

    path = Path(path)
    try:
        settings = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise ConfigError(f"config file {str(path)!r}: cannot read it ({error})") from None
    if not isinstance(settings, dict):
        raise ConfigError(f"config file {str(path)!r}: expected a mapping of configuration keys, got {type(settings).__name__}")
    if "config_file" in settings:
        raise ConfigError(f"config file {str(path)!r}: key 'config_file' cannot be set inside a config file")
    notes = settings.pop("extra", {})
    if not isinstance(notes, dict):
        raise ConfigError(f"config file {str(path)!r}: key 'extra' must be a mapping of notes, got {notes!r}")
    try:
        config = apply_overrides(SimConfig(), {str(key): as_override_text(value) for key, value in settings.items()})
    except ConfigError as error:
        raise ConfigError(f"config file {str(path)!r}: {error}") from None
    return dataclasses.replace(config, config_file=str(path), extra=notes)


def as_override_text(value: Any) -> str:
    """A YAML value as the text a command-line override would give (so both are parsed the same way)."""
    if isinstance(value, list | tuple):
        return ",".join(str(item) for item in value)
    return "null" if value is None else str(value)


def _split(item: str) -> tuple[str, str]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} must be key=value")
    key, value = item.split("=", 1)
    return key.strip().replace("-", "_"), value.strip()


def validate(config: SimConfig) -> SimConfig:
    """The run's settings resolved once: raise ConfigError naming the key of the first problem, else return
    ``config`` with the task's defaults filled in (``max_response_tokens``, ``max_turns``, and ``rho_on`` where
    the task has a paper value), so that nothing downstream consults the task for a setting again.
    Idempotent; a copy changed afterwards (``dataclasses.replace``) must be validated again."""

    def fail(key: str, message: str) -> None:
        raise ConfigError(f"config key {key!r}: {message}")

    if config.task not in SIM_TASKS:
        fail("task", f"unknown task {config.task!r}; known: {sorted(SIM_TASKS)}")
    try:
        method = config.method_preset
    except ValueError as error:
        fail("method", str(error))
    if config.opob_combination not in COMBINATIONS:
        fail("opob_combination", f"must be one of {COMBINATIONS}, got {config.opob_combination!r}")
    if config.kv_cache not in KV_CACHE_MODES:
        fail("kv_cache", f"must be one of {KV_CACHE_MODES}, got {config.kv_cache!r}")
    if config.lag_model not in LAG_MODELS:
        fail("lag_model", f"must be one of {LAG_MODELS}, got {config.lag_model!r}")
    if config.execution not in EXECUTIONS:
        fail("execution", f"must be one of {EXECUTIONS}, got {config.execution!r}")
    if config.execution == "concurrent" and not (config.lag >= 1 and config.lag_model in OVERLAPPING_LAG_MODELS):
        fail("execution", f"'concurrent' needs a lag model whose generation can overlap the update ({', '.join(OVERLAPPING_LAG_MODELS)} "
             f"at lag >= 1); lag_model={config.lag_model!r} at lag {config.lag} generates every batch with the weights "
             "of the step that trains on it (use execution=serial, or threads=2 to give one run both cores)")
    if config.execution == "concurrent" and config.threads != 1:
        # the generator is forked from the learner, and OpenMP's thread pool does not survive a fork: the generator
        # would wait forever in its first parallel region
        fail("threads", f"execution=concurrent runs each side on one thread (the generator is a forked process, and "
             f"a fork cannot carry OpenMP's threads), got threads={config.threads}; use threads=1, or execution=serial")
    if config.max_response_tokens is not None and config.max_response_tokens < 1:
        fail("max_response_tokens", f"must be >= 1, got {config.max_response_tokens}")
    for key in ("steps", "prompts_per_step", "responses_per_prompt", "update_tokens"):
        if getattr(config, key) < 1:
            fail(key, f"must be >= 1, got {getattr(config, key)}")
    for key in ("warmup_steps", "decay_steps", "eval_every", "eval_problems", "test_problems", "threads"):
        if getattr(config, key) < 0:
            fail(key, f"must be >= 0, got {getattr(config, key)}")
    if config.max_turns is not None and config.max_turns < 0:
        fail("max_turns", f"must be >= 0, got {config.max_turns}")
    if config.tool_workers < 1:
        fail("tool_workers", f"must be >= 1, got {config.tool_workers}")
    for key in ("checkpoint_every", "eval_samples", "test_samples"):
        if getattr(config, key) < 1:
            fail(key, f"must be >= 1, got {getattr(config, key)}")
    task = get_sim_task(config.task)
    if config.test_problems > (available := task.test_size):
        fail("test_problems", f"task {config.task!r} has {available} test problems, got {config.test_problems}")
    if config.lr_scale_from is not None:
        if step_rule(method).ess:
            fail("lr_scale_from", f"method {method.name!r} sets its own step size by the ESS rule; replaying another "
                 "run's scale would make it another method (use a preset without the ESS step size)")
        replayed_lr_scales(config.lr_scale_from, config.steps)
    if config.warmup_steps + config.decay_steps > config.steps:
        fail("warmup_steps", f"warmup_steps + decay_steps ({config.warmup_steps + config.decay_steps}) exceed steps ({config.steps})")
    if config.responses_per_prompt < 2:
        fail("responses_per_prompt", "group baselines need at least 2 responses per prompt")
    if config.micro_batch_size < config.responses_per_prompt or config.micro_batch_size % config.responses_per_prompt:
        fail("micro_batch_size", f"must hold whole groups: a multiple of responses_per_prompt ({config.responses_per_prompt})")
    for key in ("lr", "temperature", "eval_temperature", "eps", "grad_clip", "tool_timeout_s"):
        value = getattr(config, key)
        if not (math.isfinite(value) and value > 0):
            fail(key, f"must be a positive finite number, got {value}")
    if not (math.isfinite(config.weight_decay) and config.weight_decay >= 0):
        fail("weight_decay", f"must be a finite number >= 0, got {config.weight_decay}")
    if len(config.betas) != 2 or not all(0 <= beta < 1 for beta in config.betas):
        fail("betas", f"must be two numbers in [0, 1) (AdamW's beta1, beta2), got {list(config.betas)}")
    if config.learner_dtype not in DTYPES:
        fail("learner_dtype", f"must be one of {DTYPES}")
    if config.rollout_dtype not in ROLLOUT_DTYPES:
        fail("rollout_dtype", f"must be one of {ROLLOUT_DTYPES}")
    if config.learner_dtype in ("bfloat16", "float16"):
        fail("learner_dtype", "the learner keeps float32 or float64 master weights; set rollout_dtype for low precision")
    if method.spec["precision"] == "fp16" and config.resolved_rollout_dtype != "float16":
        fail(
            "rollout_dtype",
            f"method {method.name!r} differs from its parent only by fp16 precision; run it with rollout_dtype=preset "
            "(fp16 rollouts against the learner), otherwise it would silently be a different method",
        )
    try:
        run_lag(method.name, config.lag, config.lag, config.steps)
    except ValueError as error:
        fail("lag", str(error))
    if config.base is not None and not (Path(config.base) / "config.json").is_file():
        fail("base", f"no SFT base model at {config.base!r} (expected a save_pretrained folder with config.json)")
    if config.base is None and config.model_size not in MODEL_SIZES:
        fail("model_size", f"unknown size {config.model_size!r}; known: {sorted(MODEL_SIZES)}")
    try:
        step_rule(method.name).with_rho_on(config.rho_on)
    except ValueError as error:
        fail("rho_on", str(error))
    return dataclasses.replace(
        config,
        max_response_tokens=task.max_response_tokens if config.max_response_tokens is None else config.max_response_tokens,
        max_turns=task.max_turns if config.max_turns is None else config.max_turns,
        rho_on=run_rho_on(config.rho_on, task.paper_settings),
    )
