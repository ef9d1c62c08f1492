"""Checks of a composed run before any GPU is touched: the engine, Megatron's layout, the loss and optimizer,
the lag, the GPUs and their memory."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from pathlib import Path

from vcpo.launch.memory import check_memory, gpu_memory_gb, megatron_sequence_parallel, model_shape
from vcpo.launch.run import LaunchError, Run
from vcpo.methods import step_rule
from vcpo.verl_contract import (
    ENGINE_MODEL_TYPE,
    MegatronSetup,
    megatron_opob_refusals,
)


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


def check_lag(config, run_lag: int) -> None:
    """The lag that runs is the run's (its folder says lag<k>): the trainer mode and every key the asynchrony mapping
    sets for it (``verl_overrides.async_overrides``) as the mapping set them, whatever the user's overrides; and a lag
    the run can honour: no more warm-up batches (the lag k) than training steps, so that the pipeline fills and the
    lag is reached within the run."""
    v1 = config.trainer.v1
    expected = {"trainer.v1.trainer_mode": "sync"} if run_lag == 0 else {
        "trainer.v1.trainer_mode": "separate_async", "trainer.v1.separate_async.num_warmup_batches": run_lag,
        "trainer.v1.sampler.max_off_policy_threshold": run_lag + 1}
    for key, value in expected.items():
        if _select(config, key) != value:
            raise LaunchError(f"{key}={_select(config, key)!r}, but the run's lag is {run_lag} (which sets it to "
                              f"{value!r}): give the lag with --lag, not by this key")
    if v1.trainer_mode != "separate_async":
        return
    lag = v1.separate_async.num_warmup_batches
    steps = config.trainer.total_training_steps
    if steps is not None and lag > steps:
        raise LaunchError(
            f"trainer.v1.separate_async.num_warmup_batches={lag} (the lag k) exceeds trainer.total_training_steps="
            f"{steps}: a lag of {lag} cannot be reached in the run (the bound: lag <= steps)"
        )


# Every integer of a run's layout and batch, and its least value where set (None: verl's default or not used); a
# colocated rollout (sync) has no GPUs of its own
LAYOUT_KEYS = {
    **dict.fromkeys((
        "data.train_batch_size", "trainer.n_gpus_per_node", "trainer.nnodes",
        "actor_rollout_ref.actor.ppo_mini_batch_size", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        "actor_rollout_ref.rollout.n", "actor_rollout_ref.rollout.tensor_model_parallel_size",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
        *(f"actor_rollout_ref.actor.megatron.{key}" for key in (
            "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
            "expert_model_parallel_size", "virtual_pipeline_model_parallel_size"))), 1),
    "actor_rollout_ref.rollout.n_gpus_per_node": 0, "actor_rollout_ref.rollout.nnodes": 0,
}


def check_layout(config) -> None:
    """Each key of LAYOUT_KEYS that is set is an integer of at least its least value: refused in one line naming the
    key before anything is computed from it (a negative TP once projected negative memory and launched)."""
    for key, least in LAYOUT_KEYS.items():
        value = _select(config, key)  # None where unset, or absent (another strategy's section)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise LaunchError(f"{key}={value!r}: must be {'a positive' if least else 'a non-negative'} integer")


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
    check_layout(config)
    check_engine(config)
    check_megatron(config)
    check_lag(config, run.lag)
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
        check_memory(config, capacity)
    except KeyError as error:  # no architecture for the model: the projection cannot be made, nothing to refuse
        warnings.warn(f"no memory projection: {error.args[0]}", stacklevel=2)
    except ValueError as error:
        raise LaunchError(str(error)) from None
    if check_paths:
        check_files(config)


def check_files(config) -> None:
    """Raise `LaunchError` naming each data file and local model folder ``config`` reads that does not exist."""
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
