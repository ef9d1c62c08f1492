"""The simulator's run configuration: one dataclass, checked in full before any work starts.

Every field has a default; ``key=value`` overrides (the CLI's trailing arguments) are parsed with the
field's type, and an unknown key, a bad value or a combination the simulator cannot honour raises a
``ConfigError`` naming the key. Values the paper states are marked with their table.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from vcpo.methods import PRECISION_DTYPES, Method, get_method
from vcpo.recipes import optimizer_table
from vcpo.runs import CONFIG_FILE, RunFileProblem, read_json

EXECUTIONS = ("serial", "concurrent")
LAG_MODELS = ("pipeline", "pipeline_overlap", "fixed", "minibatch")  # vcpo.sim.rollout
OVERLAPPING_LAG_MODELS = ("pipeline_overlap", "fixed")  # generation can run while the learner updates
KV_CACHE_POLICIES = ("recompute", "keep")  # vcpo.sim.rollout's module docstring
# The simulator's tool calls are one-line programs of a tiny policy that finish in ~40 ms; 5 s bounds
# what a stuck program costs a step at half the paper-scale tool's 10 s (recipes/tools/python_sandbox.yaml,
# written for a 7B model's longer programs).
SIM_TOOL_TIMEOUT_S = 5.0
DTYPES = ("float32", "float64", "bfloat16", "float16")
ROLLOUT_DTYPES = (*DTYPES, "preset")
# The paper's learning rate (VCPO Table 2). A preset's optimizer.lr is a rate at the paper's scale in both backends:
# verl trains at it; the simulator, whose tiny models want larger steps, trains at reference_lr x (that rate / this),
# so a preset at the paper's rate trains at reference_lr and low_lr's 1e-7 at a tenth of it.
PAPER_REFERENCE_LR = 1.0e-6
# Configuration keys renamed since runs were recorded (old name -> current name): a config file, a command line or
# a recorded config.json that uses an old name is read through this map, so archived runs keep their meaning.
RENAMED_KEYS = {"lr": "reference_lr"}


def preset_base_lr(reference_lr: float, method: Method) -> float:
    """The optimizer's rate before the warm-up/decay schedule and the ESS scale: ``method``'s paper-scale rate carried
    to the simulator's scale (`PAPER_REFERENCE_LR`)."""
    return reference_lr * method.spec["optimizer"]["lr"] / PAPER_REFERENCE_LR


def preset_rollout_dtype(rollout_dtype: str, method: Method) -> str:
    """The sampler's dtype: ``rollout_dtype``, or ``method``'s precision for "preset"."""
    return PRECISION_DTYPES[method.spec["precision"]] if rollout_dtype == "preset" else rollout_dtype


def table_2(key: str):
    """A default of VCPO Table 2 (recipes/optimizer.yaml), read when a config is made, not at import."""
    return lambda: (tuple if key == "betas" else float)(optimizer_table()[key])


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
    # the simulator's rate for a preset at the paper's rate (PAPER_REFERENCE_LR), chosen by the sync pilot
    # (docs/simulator.md); base_lr is the rate the optimizer starts from
    reference_lr: float = 5.0e-5
    weight_decay: float = field(default_factory=table_2("weight_decay"))
    betas: tuple[float, float] = field(default_factory=table_2("betas"))
    eps: float = field(default_factory=table_2("eps"))
    grad_clip: float = field(default_factory=table_2("grad_clip"))
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
        return preset_base_lr(self.reference_lr, self.method_preset)

    @property
    def resolved_rollout_dtype(self) -> str:
        return preset_rollout_dtype(self.rollout_dtype, self.method_preset)

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


def current_keys(settings: dict[str, Any], where: str = "settings") -> dict[str, Any]:
    """``settings`` with each renamed key (RENAMED_KEYS) under its current name; ``where`` names them when a key
    is given under both names."""
    both = [old for old, new in RENAMED_KEYS.items() if old in settings and new in settings]
    if both:
        raise ConfigError(f"{where}: {', '.join(f'{old!r} and {RENAMED_KEYS[old]!r}' for old in both)} are one key "
                          f"(renamed); give it once, as {RENAMED_KEYS[both[0]]!r}")
    return {RENAMED_KEYS.get(key, key): value for key, value in settings.items()}


def read_recorded(run_dir: str | Path, keys: tuple[str, ...] = ()) -> dict[str, Any]:
    """A simulator run's ``config.json`` under the current key names, with ``keys``
    (vcpo.runs.RunFileProblem naming the file when it cannot be read or lacks one)."""
    path = Path(run_dir) / CONFIG_FILE
    recorded = current_keys(read_json(path), str(path))
    if missing := [key for key in keys if key not in recorded]:
        raise RunFileProblem(f"{path} lacks {', '.join(missing)}")
    return recorded


def settings_changed(recorded: dict[str, Any], config: SimConfig) -> list[str]:
    """``key: recorded -> now`` for every result-changing key where ``config`` differs from a run's
    recorded ``config.json`` (recorded under any of its keys' names)."""
    recorded = current_keys(recorded, "the recorded settings")
    now = config.recorded()
    if config.base is None:  # the cached SFT base of (task, model_size, base_seed), which are compared
        del now["base"]
    defaults = SimConfig()  # a key added after the run was recorded: the run had its default, or what it did before
    was = {key: recorded.get(key, BEFORE_THE_KEY.get(key, getattr(defaults, key, None))) for key in now}
    return [f"{key}: {was[key]!r} -> {value!r}" for key, value in now.items()
            if key not in RESUMABLE_CHANGES and was[key] != value]


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
    """A copy of ``config`` with ``key=value`` strings (or a mapping) applied; a renamed key is read under its
    current name (RENAMED_KEYS), an unknown key raises."""
    items = overrides.items() if isinstance(overrides, dict) else [_split(item) for item in overrides]
    changes = {}
    for key, value in items:
        key = RENAMED_KEYS.get(key, key)
        if key == "extra":
            raise ConfigError("config key 'extra' (free-form notes) is set only as a mapping in a --config file")
        if key not in FIELD_TYPES:
            close = difflib.get_close_matches(key, FIELD_TYPES, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"unknown config key {key!r}{hint}; keys: {', '.join(sorted(FIELD_TYPES))}")
        changes[key] = _parse_value(key, value) if isinstance(value, str) else value
    return dataclasses.replace(config, **changes)


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
    settings = current_keys(settings, f"config file {str(path)!r}")
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
