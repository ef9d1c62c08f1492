"""A run as the Hydra overrides and the command line of ``python -m verl.trainer.main_ppo``: one builder per part
of verl's config, each value read from a recipe."""

from __future__ import annotations

import shlex
import sys
from typing import Any

from vcpo.core.registry import POLICY_LOSSES
from vcpo.launch.run import LaunchError, Run, actor_strategy, config_name
from vcpo.methods import PRECISION_DTYPES, VERL_POLICY_LOSSES, run_rho_on, step_rule
from vcpo.recipes import (
    hydra_value,
    megatron_local_layer_overrides,
    optimizer_table,
    read_yaml,
    recipes_dir,
)
from vcpo.runs import METRICS_FILE
from vcpo.verl_contract import (
    ENGINE_MODEL_TYPE,
    ENGINE_MODULE,
    EXTERNAL_MODULES,
)

VERL_ENTRY = ("-m", "verl.trainer.main_ppo")
# verl's FSDP optimizer offers constant and cosine schedules: a WSD schedule without decay is
# "constant with linear warm-up".
SUPPORTED_DECAY_STEPS = 0
# Above e^20: only verl's ±20 log-ratio safety clamp applies to the untruncated decoupled-mode weights.
UNTRUNCATED_IS_THRESHOLD = 1.0e9


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


