"""The contract between the launcher and the verl plugin (the engine's model type, the step-rule check, the Megatron
settings OPOB refuses, the CPU platform), importable without importing verl.

The launcher reads these before any verl import, and the engine imports them while ``import verl`` is
still loading its external modules (where ``vcpo.verl_plugin`` may be half imported), so this module
imports nothing from verl and lives outside ``vcpo.verl_plugin`` (importing it would import verl).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from vcpo.methods import step_rule

# The engine extension (ESS step size, OPOB): its module, and the model type it is registered under.
ENGINE_MODULE = "vcpo.verl_plugin.engine"
ENGINE_MODEL_TYPE = "vcpo_language_model"
# verl imports the modules listed (comma-separated) in this environment variable inside `import verl`.
EXTERNAL_MODULES = "VERL_USE_EXTERNAL_MODULES"
# The CPU platform and rollout of `python -m vcpo.launch.cpu` (verl on a CPU-only torch).
CPU_PLATFORM_MODULE = "vcpo.verl_plugin.cpu"
# What selects it in a process: the platform's name, and `import verl` registering the plugin first.
CPU_PLATFORM_NAME = "cpu"
CPU_PLATFORM_ENV = {"VERL_PLATFORM": CPU_PLATFORM_NAME, EXTERNAL_MODULES: CPU_PLATFORM_MODULE}
# BLAS threads of a CPU trainer process (vcpo.verl_plugin.cpu.platform; unset: OMP_NUM_THREADS)
TRAINER_THREADS_ENV = "VCPO_CPU_TRAINER_THREADS"
# The reward manager that tells the reward whether a response ended or was cut (vcpo.verl_plugin.reward)
END_AWARE_REWARD_MANAGER = (
    "reward.reward_manager.source=importlib",
    "reward.reward_manager.name=EndAwareRewardManager",
    "reward.reward_manager.module.path=pkg://vcpo.verl_plugin.reward",
)
# The actor's FSDP mixed-precision setting and its all-fp32 value (the CPU runner, which trains in fp32),
# as a mapping and in Hydra's override grammar.
MIXED_PRECISION_KEY = "actor_rollout_ref.actor.fsdp_config.mixed_precision"
FP32_MIXED_PRECISION = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
FP32_MIXED_PRECISION_HYDRA = "{" + ",".join(f"{key}:{value}" for key, value in FP32_MIXED_PRECISION.items()) + "}"


def last_override(overrides: list[str] | tuple[str, ...], key: str) -> str | None:
    """The value the Hydra overrides give ``key`` (``key=v``, ``+key=v`` or ``++key=v``; the last wins, as in
    Hydra), or None where none sets it."""
    values = [item.partition("=")[2] for item in overrides if item.partition("=")[0].lstrip("+") == key]
    return values[-1] if values else None


def metrics_to_floats(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    """One device-to-host copy for all metrics instead of one sync per ``.item()``."""
    if not metrics:
        return {}
    values = torch.stack([value.detach().to(torch.float64).reshape(()) for value in metrics.values()]).tolist()
    return dict(zip(metrics, values, strict=True))


_STEP_RULE_APPLIED = contextvars.ContextVar("vcpo_step_rule_applied", default=False)


@contextlib.contextmanager
def step_rule_applied() -> Iterator[None]:
    """Around the policy-loss calls of an optimizer step whose caller applies the preset's step rule
    (ESS step size, OPOB): the vcpo engine on verl, the simulator's learner."""
    token = _STEP_RULE_APPLIED.set(True)
    try:
        yield
    finally:
        _STEP_RULE_APPLIED.reset(token)


def check_step_rule_applied(method_name: str | None) -> None:
    """Raise if ``method_name`` needs the ESS step size or OPOB and no caller applies them: its loss alone
    would silently train another method (plain sequence TIS)."""
    if not method_name or _STEP_RULE_APPLIED.get():
        return
    rule = step_rule(method_name)
    if rule.active:
        raise RuntimeError(
            f"method {method_name!r} needs {rule.needs}, which only the vcpo engine applies, but its loss was called "
            f"outside it: set +actor_rollout_ref.model.model_type={ENGINE_MODEL_TYPE} with "
            "actor_rollout_ref.actor.strategy=fsdp2 and trainer.use_v1=true (python -m vcpo.launch sets them), "
            "or train a method without them (e.g. seq_tis_c8)"
        )


def select_cpu_platform() -> None:
    """Make this process's verl run on the CPU platform (`vcpo.verl_plugin.cpu`), as the launcher's
    workers do. verl resolves its platform once, inside `import verl`: call this before anything imports
    it. Raises RuntimeError if verl is already loaded on another platform."""
    if "verl" in sys.modules and os.environ.get("VERL_PLATFORM") != CPU_PLATFORM_NAME:
        raise RuntimeError("select_cpu_platform: verl is already imported on another platform; call it first")
    os.environ.update(CPU_PLATFORM_ENV)


@dataclass(frozen=True)
class MegatronSetup:
    """What OPOB on verl's Megatron engine depends on, from the composed config (the launcher) or the engine's own
    configs (at its first OPOB step): `megatron_opob_refusals` judges it in both places alike."""

    packed: bool  # actor_rollout_ref.model.use_remove_padding (what verl's workers hand the engine)
    fused_kernels: bool  # actor_rollout_ref.model.use_fused_kernels
    transformer_impl: str | None  # override_transformer_config.transformer_impl
    vanilla_mbridge: bool  # use_mbridge and vanilla_mbridge
    sequence_parallel: bool
    virtual_pipeline: int | None
    context_parallel: int
    pipeline_parallel: int
    per_token_loss: bool  # override_transformer_config.calculate_per_token_loss
    overlap_grad_reduce: bool  # override_ddp_config.overlap_grad_reduce
    dtype: str
    recompute_granularity: str | None
    recompute_modules: tuple[str, ...] | None = None  # selective recompute's modules (None: megatron's default, core_attn)


_MEGATRON = "actor_rollout_ref.actor.megatron"


def _recomputes_watched_layers(setup: MegatronSetup) -> bool:
    """Whether megatron reruns, in the backward, a module whose linears or norms the per-sequence norms watch: full
    recompute, or a selective recompute of anything but core attention (which has no parameters)."""
    modules = ("core_attn",) if setup.recompute_modules is None else setup.recompute_modules
    return setup.recompute_granularity == "full" or (setup.recompute_granularity == "selective" and bool(set(modules) - {"core_attn"}))


def megatron_opob_refusals(setup: MegatronSetup) -> list[str]:
    """Each setting OPOB on Megatron cannot run with, in one line naming the key, what to set and why (empty: it runs).
    ``python -m vcpo.launch`` composes a setup that passes (``recipes/megatron.yaml``, ``local_layers``)."""
    rules = [
        (setup.packed, "actor_rollout_ref.model.use_remove_padding=false",
         "packed (THD) micro-batches need Transformer Engine's attention, and the norms do not split a packed row"),
        (setup.transformer_impl != "local", f"++{_MEGATRON}.override_transformer_config.transformer_impl=local",
         "Transformer Engine's fused norm + linear hides the norm's output gradient the per-sequence norms need"),
        (not setup.vanilla_mbridge, f"{_MEGATRON}.use_mbridge=true {_MEGATRON}.vanilla_mbridge=true",
         "mbridge builds the local layer spec transformer_impl=local asks for; Megatron-Bridge builds its own"),
        (setup.sequence_parallel, f"{_MEGATRON}.sequence_parallel=false ++{_MEGATRON}.override_transformer_config.sequence_parallel=false",
         "megatron's local torch norms refuse sequence parallelism (mbridge turns it on whenever TP > 1)"),
        (setup.fused_kernels, "actor_rollout_ref.model.use_fused_kernels=false",
         "the fused log-prob kernel uses the output layer's weight without its forward, which the norms watch"),
        ((setup.virtual_pipeline or 1) > 1, f"{_MEGATRON}.virtual_pipeline_model_parallel_size=null",
         "the norms bind each layer's gradient to one model chunk's micro-batch"),
        (setup.context_parallel > 1, f"{_MEGATRON}.context_parallel_size=1", "a sequence split over ranks has no per-sequence norm here"),
        (setup.per_token_loss, f"++{_MEGATRON}.override_transformer_config.calculate_per_token_loss=false",
         "OPOB's update is a sum over sequences, not a per-token average"),
        (setup.overlap_grad_reduce, f"++{_MEGATRON}.override_ddp_config.overlap_grad_reduce=false",
         "the reduction would start before the combined gradient is written"),
        (setup.dtype in ("float16", "fp16"), f"{_MEGATRON}.dtype=bfloat16", "fp16 loss scaling would scale every per-sequence norm"),
        (setup.pipeline_parallel > 1 and _recomputes_watched_layers(setup),
         f"++{_MEGATRON}.override_transformer_config.recompute_granularity=selective "
         f"++{_MEGATRON}.override_transformer_config.recompute_modules=[core_attn]",
         "under pipeline parallelism a recomputed linear or norm would be bound to the micro-batch announced last"),
    ]
    return [f"{setting} ({why})" for present, setting, why in rules if present]
