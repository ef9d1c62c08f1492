"""A paper run as task × method × lag × seed, composed into verl 0.9.1 Hydra overrides.

``recipes/tasks/<task>.yaml`` holds one experiment's model, data and the values of its paper table
(VCPO Tables 3-5; Table 2 in ``recipes/optimizer.yaml``); ``recipes/methods/<method>.yaml`` holds the
loss, baseline, step-size rule, learning rate and precision. `overrides` turns the pair into the exact
command-line overrides of ``python -m verl.trainer.main_ppo``, each value written once in a recipe;
`compose` resolves them with verl's own Hydra config and `check` validates the result before any GPU
is touched. ``python -m vcpo.launch`` is the command line.

verl seams used (no verl file is patched):
- losses: ``vcpo.verl_plugin`` registers every ``vcpo.core`` loss; a preset is selected by
  ``policy_loss.method``.
- behaviour log-probs: verl 0.9.1's V1 trainer in bypass mode (``algorithm.rollout_correction.
  bypass_mode=true``) sets ``old_log_probs`` = the rollout's per-token log-probs and keeps the
  configured ``loss_mode``, so our losses receive l^μ as ``old_log_prob``. Losses that also need the
  proximal policy (``needs_prox``: P3O two-anchor) run in decoupled mode instead (see the plugin).
- asynchrony, the ESS step size and OPOB: `asynchrony_overrides` and `vcpo.verl_plugin.engine`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shlex
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vcpo.core.registry import POLICY_LOSSES
from vcpo.launch.memory import check_memory, gpu_memory_gb, megatron_sequence_parallel, model_shape, projection
from vcpo.locks import cache_dir, write_atomic
from vcpo.methods import PRECISION_DTYPES, VERL_POLICY_LOSSES, Method, get_method, run_lag, run_rho_on, step_rule
from vcpo.recipes import (
    TaskRecipe,
    hydra_value,
    load_tasks,
    megatron_local_layer_overrides,
    optimizer_table,
    read_yaml,
    recipes_dir,
    run_path,
)
from vcpo.runs import METRICS_FILE
from vcpo.verl_shared import (
    ENGINE_MODEL_TYPE,
    ENGINE_MODULE,
    EXTERNAL_MODULES,
    MegatronSetup,
    last_override,
    megatron_opob_refusals,
)

VERL_ENTRY = ("-m", "verl.trainer.main_ppo")
STRATEGIES = ("fsdp2", "fsdp", "megatron")  # the actor strategies vcpo.launch composes (verl also has others)
# verl's FSDP optimizer offers constant and cosine schedules: a WSD schedule without decay is
# "constant with linear warm-up".
SUPPORTED_DECAY_STEPS = 0
# Above e^20: only verl's ±20 log-ratio safety clamp applies to the untruncated decoupled-mode weights.
UNTRUNCATED_IS_THRESHOLD = 1.0e9


class LaunchError(ValueError):
    """A run that cannot launch; the message names the recipe key or verl key at fault."""


def get_task_recipe(name: str) -> TaskRecipe:
    """The task recipe of ``--task`` (a LaunchError naming the flag if there is none)."""
    tasks = load_tasks()
    if name not in tasks:
        raise LaunchError(f"unknown task {name!r} (--task); known: {sorted(tasks)}")
    return tasks[name]


@dataclass(frozen=True)
class Run:
    """One training run: what `overrides` composes."""

    task: TaskRecipe
    method: Method
    lag: int
    seed: int = 0
    data_dir: Path = Path("data")
    output_dir: Path = Path("results/verl")
    strategy: str | None = None  # the actor's verl strategy; None: the method's (StepRule.strategies[0]), else fsdp2

    @property
    def name(self) -> str:
        return f"{self.task.name}-{self.method.name}-lag{self.lag}-seed{self.seed}"

    @property
    def run_dir(self) -> Path:
        return self.output_dir / run_path(self.task.name, self.method.name, self.lag, self.seed)

    def data_files(self, which: str) -> list[Path]:
        return [self.data_dir / f"{split}.parquet" for split in self.task.spec["data"][which]]

    @property
    def gpus(self) -> int:
        """GPUs of the recipe's layout: the sync trainer colocates on, and separate_async splits, the
        task's sampler + trainer GPUs (what ``gpus_needed`` finds in the composed config)."""
        return self.task.paper["sampler_gpus"] + self.task.paper["trainer_gpus"]


def make_run(
    task: str,
    method: str,
    lag: int | None = None,
    seed: int = 0,
    data_dir: Path | str = "data",
    output_dir: Path | str = "results/verl",
    default_lag: int | None = None,
    strategy: str | None = None,
) -> Run:
    """The run for ``--task --method [--lag] [--seed]``; the lag defaults to ``default_lag``, else the task's
    (paper) value (``vcpo.methods.run_lag``: a method that fixes its lag refuses another ``--lag``)."""
    task_recipe = get_task_recipe(task)
    try:
        method_preset = get_method(method)
    except ValueError as error:
        raise LaunchError(f"{error} (--method)") from None
    try:
        default = task_recipe.paper_lag if default_lag is None else default_lag
        resolved_lag = run_lag(method, lag, default, task_recipe.paper["training_steps"])
    except ValueError as error:
        raise LaunchError(f"--lag: {error} (task {task!r})") from None
    if strategy is not None and strategy not in STRATEGIES:
        raise LaunchError(f"actor_rollout_ref.actor.strategy={strategy}: vcpo.launch composes {'|'.join(STRATEGIES)}")
    return Run(task_recipe, method_preset, resolved_lag, seed, Path(data_dir), Path(output_dir), strategy)


def strategy_of(extra: list[str] | tuple[str, ...]) -> str | None:
    """The actor strategy the user's overrides set (the last wins, as in Hydra), or None."""
    return last_override(extra, "actor_rollout_ref.actor.strategy")


def actor_strategy(run: Run) -> str:
    return run.strategy or step_rule(run.method).strategies[0]


def config_name(run: Run) -> str:
    """verl's top-level config: its Megatron trainer's for the Megatron strategy."""
    return "ppo_megatron_trainer" if actor_strategy(run) == "megatron" else "ppo_trainer"


def _set(key: str, value: Any) -> str:
    return f"{key}={hydra_value(value)}"


def model_and_data_overrides(run: Run) -> list[str]:
    paper, actor = run.task.paper, "actor_rollout_ref"
    return [
        _set(f"{actor}.model.path", paper["model"]),
        _set("data.train_files", [str(path) for path in run.data_files("train")]),
        _set("data.val_files", [str(path) for path in run.data_files("val")]),
        _set("data.train_batch_size", paper["prompts_per_batch"]),
        _set("data.max_prompt_length", paper["max_prompt_length"]),
        _set("data.max_response_length", paper["max_response_length"]),
        _set("data.seed", run.seed),
        _set("reward.custom_reward_function.path", "pkg://vcpo.rewards"),
        _set("reward.custom_reward_function.name", "compute_score"),
    ]


def rollout_overrides(run: Run) -> list[str]:
    paper, rollout = run.task.paper, "actor_rollout_ref.rollout"
    settings = [
        _set(f"{rollout}.n", paper["completions_per_prompt"]),
        _set(f"{rollout}.temperature", paper["temperature"]),
        _set(f"{rollout}.calculate_log_probs", True),
        _set(f"{rollout}.seed", run.seed),
    ]
    if run.task.multi_turn:
        settings += [
            _set(f"{rollout}.multi_turn.enable", True),
            _set(f"{rollout}.multi_turn.max_assistant_turns", paper["max_turns"]),
            _set(f"{rollout}.multi_turn.tool_config_path", recipes_dir() / run.task.spec["tool_config"]),
            _set(f"{rollout}.agent.default_agent_loop", "tool_agent"),
        ]
    return settings


def optimizer_overrides(run: Run) -> list[str]:
    """VCPO Table 2 with the method's learning rate and the task's warm-up and step count."""
    table, paper, optim = optimizer_table(), run.task.paper, "actor_rollout_ref.actor.optim"
    if paper["lr_decay_steps"] != SUPPORTED_DECAY_STEPS:
        raise LaunchError(
            f"{run.task.path}: paper.lr_decay_steps={paper['lr_decay_steps']}: verl's FSDP optimizer has constant "
            "and cosine schedules only, so a WSD decay phase cannot be expressed"
        )
    if actor_strategy(run) == "megatron":  # verl hands megatron's OptimizerConfig only these overrides for Adam's constants
        adam = [_set(f"+{optim}.override_optimizer_config.adam_beta1", table["betas"][0]),
                _set(f"+{optim}.override_optimizer_config.adam_beta2", table["betas"][1]),
                _set(f"+{optim}.override_optimizer_config.adam_eps", table["eps"]),
                _set(f"{optim}.lr_decay_style", "constant")]
    else:
        adam = [_set(f"{optim}.betas", table["betas"]), _set(f"{optim}.override_optimizer_config", {"eps": table["eps"]}),
                _set(f"{optim}.lr_scheduler_type", "constant")]
    return [
        _set(f"{optim}.lr", run.method.spec["optimizer"]["lr"]),
        _set(f"{optim}.weight_decay", table["weight_decay"]),
        *adam,
        _set(f"{optim}.clip_grad", table["grad_clip"]),
        _set(f"{optim}.lr_warmup_steps", paper["lr_warmup_steps"]),
        _set(f"{optim}.total_training_steps", paper["training_steps"]),
        _set("actor_rollout_ref.actor.entropy_coeff", table["entropy_coeff"]),
        _set("actor_rollout_ref.actor.use_kl_loss", table["kl_coef"] > 0),
        _set("trainer.total_training_steps", paper["training_steps"]),
    ]


def method_overrides(run: Run) -> list[str]:
    """The method preset: loss, aggregation, baseline, precision, KL-in-reward and how l^μ arrives."""
    spec, actor = run.method.spec, "actor_rollout_ref.actor"
    loss = spec["loss"]
    settings = [_set(f"{actor}.loss_agg_mode", loss["agg"])]
    if loss["name"] in VERL_POLICY_LOSSES:
        settings.append(_set(f"{actor}.policy_loss.loss_mode", loss["name"]))
        settings += [_set(f"{actor}.{key}", value) for key, value in loss["params"].items()]
    else:
        settings += [
            _set(f"{actor}.policy_loss._target_", "vcpo.verl_plugin.VcpoPolicyLossConfig"),
            _set(f"{actor}.policy_loss.loss_mode", loss["name"]),
            _set(f"+{actor}.policy_loss.method", run.method.name),
        ]
    correction = "algorithm.rollout_correction"
    if getattr(POLICY_LOSSES.get(loss["name"]), "needs_prox", False):
        settings += [
            _set(f"{correction}.bypass_mode", False),
            _set(f"{correction}.rollout_is", "token"),
            _set(f"{correction}.rollout_is_threshold", UNTRUNCATED_IS_THRESHOLD),
        ]
    else:
        settings += [_set(f"{correction}.bypass_mode", True), _set(f"{correction}.rollout_is", None)]
    settings += [_set(f"{correction}.rollout_rs", None)]

    advantage, rule = spec["advantage"], step_rule(run.method)
    estimator = "grpo" if rule.opob else advantage["estimator"]
    settings.append(_set("algorithm.adv_estimator", estimator))
    if "norm_by_std" in advantage["params"]:
        settings.append(_set("algorithm.norm_adv_by_std_in_grpo", advantage["params"]["norm_by_std"]))

    dtype = PRECISION_DTYPES[spec["precision"]]
    engine_config = "megatron" if actor_strategy(run) == "megatron" else "fsdp_config"
    settings += [_set(f"{actor}.{engine_config}.dtype", dtype), _set("actor_rollout_ref.rollout.dtype", dtype)]

    beta = spec.get("kl_in_reward_beta")
    settings.append(_set("algorithm.use_kl_in_reward", bool(beta)))
    if beta:
        settings += [_set("algorithm.kl_ctrl.type", "fixed"), _set("algorithm.kl_ctrl.kl_coef", beta)]
    return settings + engine_overrides(run)


def engine_overrides(run: Run) -> list[str]:
    """The engine extension (``vcpo.verl_plugin.engine``) for methods with the ESS step size or OPOB.

    It is an FSDP2 engine selected by model type. The task's ρ_on (0.55 multi-turn, Table 5) reaches the
    ESS rule as ``policy_loss.rho_on``. OPOB trains in verl's default mixed precision like every method.
    """
    rule, actor = step_rule(run.method), "actor_rollout_ref.actor"
    if not rule.active:
        return []
    settings = [
        _set("+actor_rollout_ref.model.model_type", ENGINE_MODEL_TYPE),
        _set(f"{actor}.strategy", actor_strategy(run)),
        # every Ray worker imports the engine module inside `import verl`, on a cluster started by `ray start` too
        _set(f"+ray_kwargs.ray_init.runtime_env.env_vars.{EXTERNAL_MODULES}", ENGINE_MODULE),
    ]
    if rule.ess and (rho_on := run_rho_on(None, run.task.paper)) is not None:
        settings.append(_set(f"+{actor}.policy_loss.rho_on", rho_on))
    return settings


def megatron_overrides(run: Run) -> list[str]:
    """The task's Megatron layout (``recipes/megatron.yaml``, the authors' scripts) for the actor and the
    reference and the authors' micro-batches (one sequence each), under the Megatron strategy only; for a method with
    OPOB, megatron's local layers over it (``local_layers``: the local layer spec, the padded layout)."""
    if actor_strategy(run) != "megatron":
        return []
    recipe = read_yaml(recipes_dir() / "megatron.yaml")
    layout = recipe["tasks"][run.task.name]["layout"]
    settings = [_set(f"actor_rollout_ref.{role}.megatron.{key}", value) for role in ("actor", "ref") for key, value in layout.items()]
    settings.append(_set("actor_rollout_ref.ref.megatron.param_offload", recipe["reference"]["param_offload"]))
    settings += [_set(key, value) for key, value in recipe["micro_batches"]["settings"].items()]
    return settings + (megatron_local_layer_overrides() if step_rule(run.method).opob else [])


def asynchrony_overrides(run: Run) -> list[str]:
    """PipelineRL-k on verl 0.9.1's V1 trainers (docs/verl.md, "Asynchrony: PipelineRL-k on verl").

    k = 0: the synchronous trainer, rollout and training colocated on all the task's GPUs.
    k >= 1: ``separate_async``: the sampler GPUs serve the rollout (vLLM), the trainer GPUs the FSDP
    actor. One mini-batch per step (``parameter_sync_step`` = 1, ``ppo_epochs`` = 1), so a weight sync
    follows every optimizer step and a sync is an optimizer step. Prompts are tagged with the step
    that submitted them; the replay buffer drops a group whose tag is more than
    ``max_off_policy_threshold`` − 1 syncs old (trainer/ppo/v1/replay_buffer.py), so threshold k + 1
    bounds the lag of every consumed token by k. Partial rollouts continue across syncs (in-flight
    updates: a sequence mixes versions, the rollout records each token's log-prob under the weights
    that sampled it). ``num_warmup_batches`` = k fills the pipeline with k batches ahead.
    """
    paper, v1 = run.task.paper, "trainer.v1"
    batch = paper["prompts_per_batch"]
    common = [
        _set("trainer.use_v1", True),
        _set("actor_rollout_ref.actor.ppo_mini_batch_size", batch),
        _set("actor_rollout_ref.actor.ppo_epochs", 1),
        _set("trainer.nnodes", 1),
    ]
    if run.lag == 0:
        return [
            *common,
            _set(f"{v1}.trainer_mode", "sync"),
            _set("actor_rollout_ref.hybrid_engine", True),
            _set("trainer.n_gpus_per_node", paper["sampler_gpus"] + paper["trainer_gpus"]),
        ]
    return [
        *common,
        _set(f"{v1}.trainer_mode", "separate_async"),
        _set(f"{v1}.separate_async.parameter_sync_step", 1),
        _set(f"{v1}.separate_async.num_warmup_batches", run.lag),
        _set(f"{v1}.separate_async.hybrid_rollout.enable_switch", False),
        _set(f"{v1}.sampler.max_off_policy_threshold", run.lag + 1),
        _set(f"{v1}.sampler.max_off_policy_strategy", "drop"),
        _set("actor_rollout_ref.hybrid_engine", False),
        _set("actor_rollout_ref.rollout.checkpoint_engine.backend", "nccl"),
        _set("trainer.n_gpus_per_node", paper["trainer_gpus"]),
        _set("actor_rollout_ref.rollout.nnodes", 1),
        _set("actor_rollout_ref.rollout.n_gpus_per_node", paper["sampler_gpus"]),
    ]


def trainer_overrides(run: Run) -> list[str]:
    return [
        _set("trainer.experiment_name", run.name),
        _set("trainer.default_local_dir", run.run_dir / "checkpoints"),
    ]


def chosen_overrides(run: Run) -> list[str]:
    """Values no paper states, each with its reason: ``recipes/verl.yaml``, then the task's own."""
    shared = {key: entry["value"] for key, entry in read_yaml(recipes_dir() / "verl.yaml")["chosen"].items()}
    return [_set(key, value) for key, value in {**shared, **run.task.chosen}.items()]


def overrides(run: Run, extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Every Hydra override of the run, in a stable order; ``extra`` (the user's) come last and win."""
    return [
        *model_and_data_overrides(run),
        *rollout_overrides(run),
        *optimizer_overrides(run),
        *method_overrides(run),
        *asynchrony_overrides(run),
        *trainer_overrides(run),
        *chosen_overrides(run),
        *megatron_overrides(run),  # after the chosen micro-batching, which the authors' Megatron scripts replace
        *extra,
    ]


def run_environment(run: Run) -> dict[str, str]:
    """Environment variables the run needs.

    verl's file logger writes the run's metrics.jsonl. WARN logging: with ``hybrid_engine=false`` verl 0.9.1
    calls ``logger.info(..., flush=True)`` (trainer_separate_async.py:181), which raises ``TypeError:
    Logger._log() got an unexpected keyword argument 'flush'`` whenever INFO is enabled.
    """
    env = {"VERL_FILE_LOGGER_PATH": str(run.run_dir / METRICS_FILE), "VERL_LOGGING_LEVEL": "WARN"}
    if step_rule(run.method).active:
        env[EXTERNAL_MODULES] = ENGINE_MODULE
    return env


def command(run: Run, extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, *VERL_ENTRY, f"--config-name={config_name(run)}", *overrides(run, extra)]


def shell_command(run: Run, extra: list[str] | tuple[str, ...] = ()) -> str:
    """The exact command ``--dry-run`` prints, one override per line."""
    env = " ".join(f"{key}={shlex.quote(value)}" for key, value in run_environment(run).items())
    _, *args = command(run, extra)  # printed as `python`: the interpreter's path differs between machines
    lines = [f"{env} python {' '.join(args[:3])}"]
    lines += [f"  {shlex.quote(arg)}" for arg in args[3:]]
    return " \\\n".join(lines)


def write_launch_record(run: Run, run_dir: Path, config, verl_command: list[str], environment: dict[str, str]) -> None:
    """``run_dir/launch.json``: what started the run, with the GPUs its composed config holds (the tables
    cost runs by them, and read a run with this file as a verl run)."""
    record = {"task": run.task.name, "method": run.method.name, "lag": run.lag, "seed": run.seed}
    record |= {"gpus": gpus_needed(config), "command": verl_command, "env": environment}
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / "launch.json").write_text(json.dumps(record, indent=2))


def verl_config_dir() -> Path:
    import verl

    return Path(verl.__file__).parent / "trainer" / "config"


def compose(run: Run, extra: list[str] | tuple[str, ...] = ()):
    """The fully resolved verl config (an OmegaConf DictConfig, struct mode, as Hydra returns it) of the run,
    from verl's own Hydra config. Hydra reads some 30 YAML files per composition (2-3 s); a workflow's plan
    composes every run, so each composition is kept in the cache under its overrides and verl's config files."""
    from omegaconf import OmegaConf

    requested = overrides(run, extra)
    cached = composed_cache_file([config_name(run), *requested])
    if cached.exists():
        config = OmegaConf.create(json.loads(cached.read_text()))
        OmegaConf.set_struct(config, True)
        return config
    config = _hydra_compose(requested, config_name(run))
    cached.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(cached, json.dumps(OmegaConf.to_container(config, resolve=False)))
    return config


def composed_cache_file(requested: list[str]) -> Path:
    """Where the composition of ``requested`` is kept: named by the overrides and by verl's version and config
    files (path, size, modification time), so that a changed verl composes anew."""
    key = hashlib.sha256(json.dumps([verl_configs_fingerprint(verl_config_dir()), requested]).encode()).hexdigest()[:32]
    return cache_dir() / "verl-configs" / f"{key}.json"


@functools.lru_cache(maxsize=4)
def verl_configs_fingerprint(folder: Path) -> list:
    import verl

    return [verl.__version__, sorted((str(path.relative_to(folder)), path.stat().st_size, path.stat().st_mtime_ns)
                                     for path in folder.rglob("*.yaml"))]


def _hydra_compose(requested: list[str], name: str):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(verl_config_dir()), version_base=None):
            return hydra_compose(config_name=name, overrides=requested)
    except (HydraException, OmegaConfBaseException) as error:
        raise LaunchError(f"verl's Hydra config rejects the overrides: {error}") from None


def gpus_needed(config) -> int:
    trainer = config.trainer.nnodes * config.trainer.n_gpus_per_node
    rollout = config.actor_rollout_ref.rollout
    separate = config.trainer.v1.trainer_mode == "separate_async"
    return trainer + (rollout.nnodes * rollout.n_gpus_per_node if separate else 0)


def check_engine(config) -> None:
    """A method whose step needs the vcpo engine (ESS step size, OPOB) gets it in the composed config, the
    user's overrides included: otherwise its loss would run alone and train another method."""
    actor = config.actor_rollout_ref.actor
    method = _select(config, "actor_rollout_ref.actor.policy_loss.method")
    if not method:
        return
    rule = step_rule(method)
    if not rule.active:
        return
    try:  # the simulator's own check of the value (vcpo.methods)
        rule.with_rho_on(_select(config, "actor_rollout_ref.actor.policy_loss.rho_on"))
    except ValueError as error:
        raise LaunchError(f"actor_rollout_ref.actor.policy_loss.rho_on: {error}") from None
    # key -> (its value, the values the engine accepts; the first is what vcpo.launch sets)
    needs = {
        "+actor_rollout_ref.model.model_type": (_select(config, "actor_rollout_ref.model.model_type"), (ENGINE_MODEL_TYPE,)),
        "actor_rollout_ref.actor.strategy": (actor.strategy, rule.strategies),
        "trainer.use_v1": (config.trainer.use_v1, (True,)),
        "actor_rollout_ref.actor.policy_loss.loss_mode": (actor.policy_loss.loss_mode, (rule.loss_name,)),
        "actor_rollout_ref.actor.loss_agg_mode": (actor.loss_agg_mode, (rule.agg,)),
    }
    wrong = [f"{key}={accepted[0]} (got {value})" for key, (value, accepted) in needs.items() if value not in accepted]
    if wrong:
        raise LaunchError(
            f"method {method!r} needs the vcpo engine (for {rule.needs}), which this config would not run: "
            + "; ".join(wrong)
        )


def megatron_setup(config) -> MegatronSetup:
    """The composed config's settings that OPOB on Megatron depends on (`megatron_opob_refusals`)."""
    model, megatron = config.actor_rollout_ref.model, config.actor_rollout_ref.actor.megatron
    transformer = megatron.get("override_transformer_config", None) or {}
    return MegatronSetup(
        packed=bool(model.get("use_remove_padding", True)), fused_kernels=bool(model.get("use_fused_kernels", False)),
        transformer_impl=transformer.get("transformer_impl", None),
        vanilla_mbridge=bool(megatron.get("use_mbridge", False) and megatron.get("vanilla_mbridge", False)),
        sequence_parallel=megatron_sequence_parallel(megatron),
        virtual_pipeline=megatron.get("virtual_pipeline_model_parallel_size", None),
        context_parallel=megatron.get("context_parallel_size", 1) or 1, pipeline_parallel=megatron.pipeline_model_parallel_size,
        per_token_loss=bool(transformer.get("calculate_per_token_loss", False)),
        overlap_grad_reduce=bool((megatron.get("override_ddp_config", None) or {}).get("overlap_grad_reduce", False)),
        dtype=str(megatron.get("dtype", "bfloat16")), recompute_granularity=transformer.get("recompute_granularity", None),
        recompute_modules=None if transformer.get("recompute_modules", None) is None else tuple(transformer.recompute_modules))


def check_megatron(config) -> None:
    """A Megatron actor's layout fits its trainer GPUs and its model, and (a method with OPOB) the engine can run its
    step: what megatron or the engine would otherwise refuse only after Ray, vLLM and the model have started."""
    actor = config.actor_rollout_ref.actor
    if actor.strategy != "megatron":
        return
    megatron, key = actor.megatron, "actor_rollout_ref.actor.megatron"
    tp, pp = megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size
    cp, ep = megatron.get("context_parallel_size", 1) or 1, megatron.get("expert_model_parallel_size", 1) or 1
    trainer_gpus = config.trainer.nnodes * config.trainer.n_gpus_per_node
    if trainer_gpus % (tp * pp * cp):
        raise LaunchError(f"{key}.tensor_model_parallel_size x pipeline_model_parallel_size x context_parallel_size = {tp} x {pp} x {cp} "
                          f"must divide the {trainer_gpus} trainer GPUs (trainer.nnodes x trainer.n_gpus_per_node)")
    try:
        shape = model_shape(str(config.actor_rollout_ref.model.path))
    except KeyError:
        shape = None
    if shape is not None:
        if shape.heads % tp or shape.kv_heads % tp:
            raise LaunchError(f"{key}.tensor_model_parallel_size={tp} must divide the model's {shape.heads} attention heads and "
                              f"{shape.kv_heads} key/value heads")
        if pp > shape.layers:
            raise LaunchError(f"{key}.pipeline_model_parallel_size={pp} exceeds the model's {shape.layers} layers")
        if ep > 1 and not shape.experts:
            raise LaunchError(f"{key}.expert_model_parallel_size={ep} on a dense model (it has no experts): set it to 1")
    method = _select(config, "actor_rollout_ref.actor.policy_loss.method")
    if method and step_rule(method).opob and (refused := megatron_opob_refusals(megatron_setup(config))):
        raise LaunchError(f"OPOB ({method!r}) on Megatron cannot run with this config; set " + "; ".join(refused))


def check_loss_and_optimizer(config) -> None:
    """The loss the actor will look up exists in verl's registry (with the vcpo plugin's losses), and the
    optimizer's numbers are numbers: what verl would otherwise find only on the GPUs."""
    import math

    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    import vcpo.verl_plugin  # noqa: F401  (registers the vcpo losses, as verl's plugin entry point does)

    actor = config.actor_rollout_ref.actor
    loss_mode = actor.policy_loss.loss_mode
    if loss_mode not in POLICY_LOSS_REGISTRY:
        raise LaunchError(
            f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode!r} is not a registered policy loss; "
            f"known: {sorted(POLICY_LOSS_REGISTRY)}"
        )
    for key in ("lr", "weight_decay"):
        value = actor.optim.get(key)
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = float("nan")
        if not math.isfinite(number) or number < 0 or (key == "lr" and number == 0):
            raise LaunchError(f"actor_rollout_ref.actor.optim.{key}={value!r} must be a finite number{' > 0' if key == 'lr' else ' >= 0'}")


def check_lag(config) -> None:
    """A policy lag the run can honour: no more warm-up batches (the lag k) than training steps, so that
    the pipeline fills and the lag is reached within the run."""
    if config.trainer.v1.trainer_mode != "separate_async":
        return
    lag = config.trainer.v1.separate_async.num_warmup_batches
    steps = config.trainer.total_training_steps
    if steps is not None and lag > steps:
        raise LaunchError(
            f"trainer.v1.separate_async.num_warmup_batches={lag} (the lag k) exceeds trainer.total_training_steps="
            f"{steps}: a lag of {lag} cannot be reached in the run (the bound: lag <= steps)"
        )


def check(run: Run, config, available_gpus: int | None = None, check_paths: bool = True,
          gpu_memory: float | None = None) -> None:
    """Validate a composed config before launch; raise `LaunchError` naming the key at fault.

    Checks: the vcpo engine for a method that needs it (``check_engine``), the GPU layout against ``available_gpus`` (when given), rollout tensor parallelism against
    the rollout GPUs, batch divisibility (verl's own ``validate_config``), every config dataclass
    instantiates, the actor's projected step memory against ``gpu_memory`` GB per trainer GPU (default: the task's
    GPU, `vcpo.launch.memory`), and (``check_paths``) that data files and a local model folder exist.
    """
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    if not config.trainer.use_v1 and config.algorithm.rollout_correction.bypass_mode:
        raise LaunchError(
            "trainer.use_v1=false with algorithm.rollout_correction.bypass_mode=true: verl's legacy trainer replaces "
            "actor.policy_loss.loss_mode by its own 'bypass_mode' loss, so the method's loss would not run"
        )
    check_engine(config)
    check_megatron(config)
    check_lag(config)
    check_loss_and_optimizer(config)
    rollout = config.actor_rollout_ref.rollout
    separate = config.trainer.v1.trainer_mode == "separate_async"
    rollout_gpus = rollout.n_gpus_per_node if separate else config.trainer.n_gpus_per_node
    tp = rollout.tensor_model_parallel_size
    if tp < 1 or tp > rollout_gpus or rollout_gpus % tp:
        where = "actor_rollout_ref.rollout.n_gpus_per_node" if separate else "trainer.n_gpus_per_node"
        raise LaunchError(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} must divide the {rollout_gpus} rollout GPUs "
            f"per node ({where})"
        )
    batch, mini_batch = config.data.train_batch_size, config.actor_rollout_ref.actor.ppo_mini_batch_size
    if batch % mini_batch:
        raise LaunchError(f"data.train_batch_size={batch} is not a multiple of actor_rollout_ref.actor.ppo_mini_batch_size={mini_batch}")
    trainer_gpus, n = config.trainer.nnodes * config.trainer.n_gpus_per_node, config.actor_rollout_ref.rollout.n
    if (mini_batch * n) % trainer_gpus:
        raise LaunchError(
            f"a mini-batch of actor_rollout_ref.actor.ppo_mini_batch_size x actor_rollout_ref.rollout.n = {mini_batch} x {n} "
            f"sequences must be divisible by the {trainer_gpus} data-parallel trainer GPUs (trainer.nnodes x trainer.n_gpus_per_node)"
        )
    sync_step = config.trainer.v1.separate_async.parameter_sync_step
    if separate and batch != sync_step * mini_batch:
        raise LaunchError(
            f"separate_async needs data.train_batch_size ({batch}) = trainer.v1.separate_async.parameter_sync_step "
            f"({sync_step}) x actor_rollout_ref.actor.ppo_mini_batch_size ({mini_batch})"
        )
    if available_gpus is not None and gpus_needed(config) > available_gpus:
        raise LaunchError(
            f"the run needs {gpus_needed(config)} GPUs (trainer.nnodes x trainer.n_gpus_per_node"
            f"{' + actor_rollout_ref.rollout.nnodes x n_gpus_per_node' if separate else ''}), {available_gpus} are visible"
        )
    try:
        with contextlib.redirect_stdout(sys.stderr), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Disabled critic")
            validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
        for key in ("actor_rollout_ref.actor", "actor_rollout_ref.rollout", "algorithm"):
            omega_conf_to_dataclass(_select(config, key))
    except (AssertionError, ValueError, TypeError) as error:
        raise LaunchError(f"verl rejects the config: {error}") from None
    except Exception as error:  # hydra's InstantiationException wraps the dataclass's own check
        cause = error.__cause__ or error
        raise LaunchError(f"verl rejects the config: {cause}") from None
    capacity = gpu_memory_gb(run.task.paper, gpu_memory)
    try:
        check_memory(projection(config, capacity), capacity)
    except KeyError as error:  # no architecture for the model: the projection cannot be made, nothing to refuse
        warnings.warn(f"no memory projection: {error.args[0]}", stacklevel=2)
    except ValueError as error:
        raise LaunchError(str(error)) from None
    if check_paths:
        missing = [
            f"{key}: {path}"
            for key in ("data.train_files", "data.val_files")
            for path in _select(config, key)
            if not Path(path).exists()
        ]
        model = Path(os.path.expanduser(config.actor_rollout_ref.model.path))
        if (model.is_absolute() or str(model).startswith(".")) and not model.exists():
            missing.append(f"actor_rollout_ref.model.path: {model}")
        if missing:
            raise LaunchError(
                "missing files (build data with `python -m vcpo.data build <task> --out DATA_DIR`): " + "; ".join(missing)
            )


def _select(config, key: str):
    from omegaconf import OmegaConf

    return OmegaConf.select(config, key)
